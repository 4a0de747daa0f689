"""Device meshes, including GB200 NVL72 (NVLink-domain-aware) layouts with a rack axis.

On GB200 NVL72 one rack is one NVLink domain of 72 GPUs (18 trays x 4); racks talk over
InfiniBand (~18x less bandwidth per GPU). The tensor axis talks every layer, so each tensor
group must sit inside one domain. ``mesh.layout: auto`` builds ``("data", "tensor")``, the data
axis running across domains first (outer) and then within a domain (inner), like
``mesh_utils.create_hybrid_device_mesh`` does for TPU slices. ``mesh.layout: gb200`` says where
the links are: ``("rack", "data", "tensor")``, ``rack`` across NVLink domains (the DCN part) and
``data`` inside one (the ICI part), so the step can gather and reduce one level at a time
(``mesh.sharding``: FSDP over both axes, or HSDP sharded in the rack and replicated across).

The domain of a device, in order of preference:

1. ``device.slice_index`` when it tells domains apart (several values, or no more devices than
   one domain); XLA sets it from the partition index of multi-host NVLink domains, and
   ``create_hybrid_device_mesh`` groups by it. A single value over more devices than a domain
   (what multi-process CPU, or GPU without a partition index, reports) is ignored;
2. else, across several processes: ``process_index // (nvl_domain / local devices per
   process)`` (one process per GPU -> 72 processes per rack; one per tray -> 18);
3. else (one process, e.g. simulated CPU devices): ``device.id // nvl_domain``.
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from train.config import ConfigError, MeshConfig, resolve_mesh_axes

__all__ = [
    "AXES",
    "RACK_AXES",
    "axis_names",
    "build_mesh",
    "configure_host_devices",
    "describe_mesh",
    "device_domains",
    "device_grid",
    "simulate_cpu_devices",
]

AXES = ("data", "tensor")
RACK_AXES = ("rack", "data", "tensor")


def axis_names(cfg_mesh: MeshConfig) -> tuple[str, ...]:
    """The mesh axes ``cfg_mesh`` builds: with ``layout: gb200`` a rack axis first."""
    return RACK_AXES if cfg_mesh.layout == "gb200" else AXES


def _has_slice_index(devices: Sequence[Any], nvl_domain: int) -> bool:
    """Whether ``slice_index`` tells domains apart.

    Runtimes that know no domains still report one: multi-process CPU (and GPU without a
    partition index) give every device ``slice_index == 0``. One value over more devices than a
    domain holds says nothing, so it is ignored.
    """
    values = [getattr(d, "slice_index", None) for d in devices]
    if any(v is None for v in values):
        return False
    return len(set(values)) > 1 or len(values) <= nvl_domain


def device_domains(devices: Sequence[Any], nvl_domain: int) -> list[int]:
    """The NVLink domain index of each device (see the module docstring for the rules)."""
    devices = list(devices)
    if _has_slice_index(devices, nvl_domain):
        return [int(d.slice_index) for d in devices]
    per_process = collections.Counter(d.process_index for d in devices)
    if len(per_process) > 1:
        local = max(per_process.values())
        if nvl_domain % local:
            raise ConfigError(f"mesh.nvl_domain={nvl_domain}: not a multiple of the {local} "
                              "devices per process, cannot place processes in domains")
        processes_per_domain = nvl_domain // local
        return [d.process_index // processes_per_domain for d in devices]
    return [d.id // nvl_domain for d in devices]


def _hybrid_grid(axes: dict[str, int], devices: Sequence[Any], nvl_domain: int,
                 strict: bool) -> np.ndarray | None:
    """``[data, tensor]`` device array with tensor groups inside domains, data across first.

    Returns None (auto layout) or raises (gb200 layout, ``strict``) when domains cannot hold
    the tensor axis evenly.
    """
    data, tensor = axes["data"], axes["tensor"]
    domains = device_domains(devices, nvl_domain)
    groups: dict[int, list[Any]] = collections.defaultdict(list)
    for dom, dev in zip(domains, devices):
        groups[dom].append(dev)
    sizes = {len(g) for g in groups.values()}
    n_dom = len(groups)

    def fail(msg: str) -> None:
        if strict:
            raise ConfigError(msg)

    if len(sizes) != 1:
        return fail(f"mesh.nvl_domain={nvl_domain}: devices fall into NVLink domains of unequal "
                    f"sizes {sorted(sizes)}")
    (size,) = sizes
    if size % tensor:
        return fail(f"mesh.tensor={tensor}: does not divide the NVLink domain size {size}, a "
                    "tensor group would cross domains")
    ici_data = size // tensor
    assert n_dom * ici_data == data
    if _has_slice_index(devices, nvl_domain):
        # JAX's own grouping by slice_index; per-slice order is the platform's preferred one.
        return mesh_utils.create_hybrid_device_mesh(
            (ici_data, tensor), (n_dom, 1), list(devices), allow_split_physical_axes=True)
    # Within a domain, consecutive devices (same tray / process first) form a tensor group.
    blocks = [np.array(sorted(groups[k], key=lambda d: (d.process_index, d.id)),
                       dtype=object).reshape(ici_data, tensor) for k in sorted(groups)]
    return np.concatenate(blocks, axis=0)


def device_grid(cfg_mesh: MeshConfig, devices: Sequence[Any] | None = None) -> np.ndarray:
    """The object array of devices that :func:`build_mesh` uses: ``[data, tensor]``, or
    ``[rack, data in the rack, tensor]`` with ``layout: gb200``."""
    devices = list(jax.devices() if devices is None else devices)
    axes = resolve_mesh_axes(cfg_mesh, len(devices))
    if cfg_mesh.layout == "gb200":  # resolve_mesh_axes checked the tensor axis against the domain
        grid = _hybrid_grid(axes, devices, cfg_mesh.nvl_domain, strict=True)
        racks = len(set(device_domains(devices, cfg_mesh.nvl_domain)))
        if cfg_mesh.racks and cfg_mesh.racks != racks:
            raise ConfigError(f"mesh.racks={cfg_mesh.racks}: the {len(devices)} devices fall into "
                              f"{racks} NVLink domain(s) of mesh.nvl_domain={cfg_mesh.nvl_domain}")
        return grid.reshape(racks, grid.shape[0] // racks, grid.shape[1])
    if len(set(device_domains(devices, cfg_mesh.nvl_domain))) > 1:
        grid = _hybrid_grid(axes, devices, cfg_mesh.nvl_domain, strict=False)
        if grid is not None:
            return grid
    shape = (axes["data"], axes["tensor"])
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AttributeError, KeyError):
        # Topology-aware placement is an optimisation; fall back to the given order.
        return np.array(devices, dtype=object).reshape(shape)


def build_mesh(cfg_mesh: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` over ``devices`` (default: all) with axes :func:`axis_names`.

    Every axis is ``AxisType.Auto`` (the tensor axis is left to XLA's propagation inside the
    layers).
    """
    grid = device_grid(cfg_mesh, devices)
    names = axis_names(cfg_mesh)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _axis_domain_spread(domains: np.ndarray, axis: int) -> int:
    """The most domains any single group along ``axis`` touches."""
    moved = np.moveaxis(domains, axis, -1).reshape(-1, domains.shape[axis])
    return max(len(set(row.tolist())) for row in moved)


def describe_mesh(mesh: Mesh, nvl_domain: int) -> str:
    """One line: axis sizes, NVLink domains, and whether each axis stays inside a domain."""
    devs = mesh.devices
    domains = np.array(device_domains(list(devs.flat), nvl_domain)).reshape(devs.shape)
    n_dom = len(set(domains.ravel().tolist()))
    dom_sizes = sorted(collections.Counter(domains.ravel().tolist()).values())
    size_text = (f"{dom_sizes[0]}" if dom_sizes[0] == dom_sizes[-1]
                 else f"{dom_sizes[0]}..{dom_sizes[-1]}")
    parts = [f"mesh {' x '.join(f'{n}={s}' for n, s in mesh.shape.items())} on {devs.size} "
             f"{devs.flat[0].platform} devices, {n_dom} NVLink domain(s) of {size_text}"]
    for i, name in enumerate(mesh.axis_names):
        spread = _axis_domain_spread(domains, i)
        where = "within one domain" if spread == 1 else f"spans {spread} domains"
        parts.append(f"{name}: {where}")
    return "; ".join(parts)


def simulate_cpu_devices(n: int, *, override: bool = False) -> int | None:
    """Asks for ``n`` simulated CPU devices; the one place that sets the count.

    Call right after ``import jax``, before anything touches a device: the count is fixed when
    the CPU backend starts. A count already in XLA_FLAGS wins, unless ``override`` (the scale
    benchmark, whose simulated mesh is its subject): then that count is dropped and the CPU
    platform forced. Returns the count requested, or None when nothing was changed (the
    backend already up, e.g. inside tests or a notebook, keeps its devices).
    """
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


def configure_host_devices(cfg_mesh: MeshConfig) -> int | None:
    """:func:`simulate_cpu_devices` for ``mesh.simulate_devices`` (nothing when it is 0)."""
    n = cfg_mesh.simulate_devices
    return simulate_cpu_devices(n) if n > 0 else None
