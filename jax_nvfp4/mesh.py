"""Device meshes for the sharded step: ``(data, tensor)``, or ``(rack, data, tensor)`` on racks
of GPUs joined by NVLink (GB200 NVL72: 72 GPUs per NVLink domain, InfiniBand between domains).

With a rack axis (``racks=`` not None) every tensor group (the devices along ``tensor`` at one
data index) lies inside one NVLink domain, rack ``r`` is the r-th domain, and the mesh is
``[racks, data / racks, tensor]``: ``Rules(data_axis=("data", "rack"))`` shards the state over
both axes, racks minor, and ``Rules(data_axis="data", replica_axis="rack")`` shards it inside a
rack and replicates it across racks. Without one, devices spanning several domains that each
hold whole tensor groups get that order with the rack axis folded into ``data``; otherwise
JAX's topology-aware order, or the given one.

A device's domain is its ``slice_index`` where that tells domains apart; else, with several
processes, ``process_index // (nvl_domain / devices per process)``; else ``id // nvl_domain``
(:func:`device_domains`). Every mesh axis is ``AxisType.Auto``.

A mesh the devices cannot hold raises :class:`MeshError`.
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

__all__ = ["AXES", "MeshError", "NVL72", "RACK_AXES", "axis_sizes", "describe", "device_domains", "device_grid",
           "make_mesh", "simulate_cpu_devices"]

AXES = ("data", "tensor")
RACK_AXES = ("rack", "data", "tensor")
NVL72 = 72  # GPUs per NVLink domain of a GB200 NVL72 rack


class MeshError(ValueError):
    """Devices that cannot hold the mesh asked for. The message is one line naming the offending
    arguments of this module's functions as ``name=value`` (``tensor=3: does not divide the 8
    devices``), so a caller can rename them after its own settings."""


def _has_slice_index(devices: Sequence[Any], nvl_domain: int) -> bool:
    # Multi-process CPU (and GPU without a partition index) give every device slice_index 0:
    # one value over more devices than a domain holds says nothing.
    values = [getattr(d, "slice_index", None) for d in devices]
    return None not in values and (len(set(values)) > 1 or len(values) <= nvl_domain)


def _check_sizes(**sizes: Any) -> None:
    """Each of ``sizes`` an integer (not a bool; None allowed), ``nvl_domain`` a positive one."""
    for name, v in sizes.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise MeshError(f"{name}={v!r}: must be an integer")
    if sizes.get("nvl_domain", 1) < 1:
        raise MeshError(f"nvl_domain={sizes['nvl_domain']}: must be a positive number of devices")


def device_domains(devices: Sequence[Any], nvl_domain: int = NVL72) -> list[int]:
    """The NVLink domain index of each of ``devices`` (module docstring). Raises :class:`MeshError`
    when several processes hold devices and ``nvl_domain`` is not a multiple of the devices per
    process."""
    _check_sizes(nvl_domain=nvl_domain)
    devices = list(devices)
    if _has_slice_index(devices, nvl_domain):
        return [int(d.slice_index) for d in devices]
    per_process = collections.Counter(d.process_index for d in devices)
    if len(per_process) > 1:
        local = max(per_process.values())
        if nvl_domain % local:
            raise MeshError(f"nvl_domain={nvl_domain}: not a multiple of the {local} "
                             "devices per process, cannot place processes in domains")
        return [d.process_index // (nvl_domain // local) for d in devices]
    return [d.id // nvl_domain for d in devices]


def axis_sizes(data: int, tensor: int, n_devices: int, *, nvl_domain: int = NVL72,
               racked: bool = False) -> tuple[int, int]:
    """``(data, tensor)`` with ``data * tensor == n_devices``, a -1 taking the rest; ``racked`` (a rack
    axis): ``tensor`` divides ``nvl_domain`` and devices past one domain fill whole domains. Raises
    :class:`MeshError`."""
    if n_devices < 1:
        raise MeshError(f"need at least one device, got {n_devices}")
    for name, size in (("data", data), ("tensor", tensor)):
        if size == 0 or size < -1:
            raise MeshError(f"{name}={size}: must be a positive size or -1 (the rest)")
    if data == -1 and tensor == -1:
        raise MeshError("data=-1 and tensor=-1: at most one axis may be -1")
    if -1 in (data, tensor):
        known_name, known = ("tensor", tensor) if data == -1 else ("data", data)
        if n_devices % known:
            raise MeshError(f"{known_name}={known}: does not divide the {n_devices} devices")
        data, tensor = (n_devices // known, tensor) if data == -1 else (data, n_devices // known)
    if data * tensor != n_devices:
        raise MeshError(f"data={data} x tensor={tensor} = {data * tensor}: must equal the {n_devices} devices")
    if racked and (tensor > nvl_domain or nvl_domain % tensor):
        raise MeshError(f"tensor={tensor}: must divide nvl_domain={nvl_domain} so each tensor group stays "
                         "inside one NVLink domain")
    if racked and n_devices > nvl_domain and n_devices % nvl_domain:
        raise MeshError(f"nvl_domain={nvl_domain}: {n_devices} devices span several domains but are not a whole "
                         "number of them")
    return data, tensor


def _hybrid_grid(data: int, tensor: int, devices: Sequence[Any], nvl_domain: int,
                 strict: bool) -> Optional[np.ndarray]:
    """``[data, tensor]`` devices, tensor groups inside domains, data across domains first. When the
    domains cannot hold the tensor axis evenly: None, or MeshError if ``strict``."""
    groups: dict[int, list[Any]] = collections.defaultdict(list)
    for dom, dev in zip(device_domains(devices, nvl_domain), devices):
        groups[dom].append(dev)
    sizes = sorted({len(g) for g in groups.values()})
    if len(sizes) != 1 or sizes[0] % tensor:
        if not strict:
            return None
        if len(sizes) != 1:
            raise MeshError(f"nvl_domain={nvl_domain}: devices fall into NVLink domains of unequal sizes {sizes}")
        raise MeshError(f"tensor={tensor}: does not divide the NVLink domain size {sizes[0]}, a tensor group "
                         "would cross domains")
    ici_data = sizes[0] // tensor
    assert len(groups) * ici_data == data
    if _has_slice_index(devices, nvl_domain):  # JAX's own grouping by slice_index
        return mesh_utils.create_hybrid_device_mesh((ici_data, tensor), (len(groups), 1), list(devices),
                                                    allow_split_physical_axes=True)
    # Within a domain, consecutive devices (same tray / process first) form a tensor group.
    blocks = [np.array(sorted(groups[k], key=lambda d: (d.process_index, d.id)),
                       dtype=object).reshape(ici_data, tensor) for k in sorted(groups)]
    return np.concatenate(blocks, axis=0)


def device_grid(data: int = -1, tensor: int = 1, *, racks: Optional[int] = None, nvl_domain: int = NVL72,
                devices: Optional[Sequence[Any]] = None) -> np.ndarray:
    """The device array of :func:`make_mesh`: ``[data, tensor]``, or ``[racks, data / racks, tensor]``.

    ``data * tensor`` must equal the number of ``devices`` (default: ``jax.devices()``, in that
    order where topology says nothing); -1 on one of them takes the rest, and ``data`` counts
    data-parallel devices over all racks. ``racks``: None for no rack axis (tensor groups still
    stay inside domains when the devices span several and each domain holds whole groups); -1
    for a rack axis of one entry per NVLink domain the devices span; ``R > 0`` for the same,
    checked to be ``R``. With a rack axis ``tensor`` must divide ``nvl_domain`` and the devices
    must fill whole domains of equal sizes.
    """
    _check_sizes(data=data, tensor=tensor, racks=racks, nvl_domain=nvl_domain)
    if racks is not None and (racks == 0 or racks < -1):
        raise MeshError(f"racks={racks}: must be a positive count, -1 (what the devices span) or None")
    devices = list(jax.devices() if devices is None else devices)
    data, tensor = axis_sizes(data, tensor, len(devices), nvl_domain=nvl_domain, racked=racks is not None)
    found = len(set(device_domains(devices, nvl_domain)))
    if racks is not None:
        grid = _hybrid_grid(data, tensor, devices, nvl_domain, strict=True)
        if racks != -1 and racks != found:
            raise MeshError(f"racks={racks}: the {len(devices)} devices fall into "
                             f"{found} NVLink domain(s) of nvl_domain={nvl_domain}")
        return grid.reshape(found, grid.shape[0] // found, grid.shape[1])
    if found > 1 and (grid := _hybrid_grid(data, tensor, devices, nvl_domain, strict=False)) is not None:
        return grid
    shape = (data, tensor)
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AttributeError, KeyError):
        # Topology-aware placement is an optimisation; fall back to the given order.
        return np.array(devices, dtype=object).reshape(shape)


def make_mesh(data: int = -1, tensor: int = 1, *, racks: Optional[int] = None, nvl_domain: int = NVL72,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ``Mesh`` over :func:`device_grid` (same arguments), axes :data:`AXES`, or :data:`RACK_AXES`
    when ``racks`` is not None, every one ``AxisType.Auto`` (the tensor axis is left to XLA's
    propagation inside the layers)."""
    names = AXES if racks is None else RACK_AXES
    grid = device_grid(data, tensor, racks=racks, nvl_domain=nvl_domain, devices=devices)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def describe(mesh: Mesh, nvl_domain: int = NVL72) -> str:
    """One line: axis sizes, NVLink domains, and whether each axis stays inside a domain, e.g.
    ``mesh rack=2 x data=2 x tensor=2 on 8 cpu devices, 2 NVLink domain(s) of 4; rack: spans 2
    domains; data: within one domain; tensor: within one domain``."""
    devs = mesh.devices
    domains = np.array(device_domains(list(devs.flat), nvl_domain)).reshape(devs.shape)
    dom_sizes = sorted(collections.Counter(domains.ravel().tolist()).values())
    size_text = f"{dom_sizes[0]}" if dom_sizes[0] == dom_sizes[-1] else f"{dom_sizes[0]}..{dom_sizes[-1]}"
    parts = [f"mesh {' x '.join(f'{n}={s}' for n, s in mesh.shape.items())} on {devs.size} "
             f"{devs.flat[0].platform} devices, {len(dom_sizes)} NVLink domain(s) of {size_text}"]
    for i, name in enumerate(mesh.axis_names):
        rows = np.moveaxis(domains, i, -1).reshape(-1, domains.shape[i])
        spread = max(len(set(row.tolist())) for row in rows)  # the most domains one group along the axis touches
        parts.append(f"{name}: {'within one domain' if spread == 1 else f'spans {spread} domains'}")
    return "; ".join(parts)


def simulate_cpu_devices(n: int, *, override: bool = False) -> Optional[int]:
    """Ask for ``n`` simulated CPU devices (call before any device is touched); a count in XLA_FLAGS wins
    unless ``override`` (then it is dropped, the CPU platform forced). ``n``, or None if nothing changed
    (a count in XLA_FLAGS, or the backend already started)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        if not override:
            return None
        os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags).strip()
    try:
        if override:
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        return None
    return n
