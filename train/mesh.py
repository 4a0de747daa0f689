"""Device meshes ``(data, tensor)``, or ``(rack, data, tensor)`` with ``mesh.layout: gb200``, every tensor
group inside one NVLink domain (docs/TRAINING.md). A device's domain: its ``slice_index`` where that tells
domains apart, else ``process_index // (nvl_domain / devices per process)``, else ``id // nvl_domain``."""

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

__all__ = ["AXES", "RACK_AXES", "axis_names", "build_mesh", "configure_host_devices", "describe_mesh",
           "device_domains", "device_grid", "simulate_cpu_devices"]

AXES = ("data", "tensor")
RACK_AXES = ("rack", "data", "tensor")


def axis_names(cfg_mesh: MeshConfig) -> tuple[str, ...]:
    return RACK_AXES if cfg_mesh.layout == "gb200" else AXES


def _has_slice_index(devices: Sequence[Any], nvl_domain: int) -> bool:
    # Multi-process CPU (and GPU without a partition index) give every device slice_index 0:
    # one value over more devices than a domain holds says nothing.
    values = [getattr(d, "slice_index", None) for d in devices]
    return None not in values and (len(set(values)) > 1 or len(values) <= nvl_domain)


def device_domains(devices: Sequence[Any], nvl_domain: int) -> list[int]:
    """The NVLink domain index of each device (module docstring)."""
    devices = list(devices)
    if _has_slice_index(devices, nvl_domain):
        return [int(d.slice_index) for d in devices]
    per_process = collections.Counter(d.process_index for d in devices)
    if len(per_process) > 1:
        local = max(per_process.values())
        if nvl_domain % local:
            raise ConfigError(f"mesh.nvl_domain={nvl_domain}: not a multiple of the {local} "
                              "devices per process, cannot place processes in domains")
        return [d.process_index // (nvl_domain // local) for d in devices]
    return [d.id // nvl_domain for d in devices]


def _hybrid_grid(axes: dict[str, int], devices: Sequence[Any], nvl_domain: int, strict: bool) -> np.ndarray | None:
    """``[data, tensor]`` devices, tensor groups inside domains, data across domains first. When the
    domains cannot hold the tensor axis evenly: None, or ConfigError if ``strict``."""
    tensor = axes["tensor"]
    groups: dict[int, list[Any]] = collections.defaultdict(list)
    for dom, dev in zip(device_domains(devices, nvl_domain), devices):
        groups[dom].append(dev)
    sizes = sorted({len(g) for g in groups.values()})
    if len(sizes) != 1 or sizes[0] % tensor:
        if not strict:
            return None
        if len(sizes) != 1:
            raise ConfigError(f"mesh.nvl_domain={nvl_domain}: devices fall into NVLink domains of unequal sizes "
                              f"{sizes}")
        raise ConfigError(f"mesh.tensor={tensor}: does not divide the NVLink domain size {sizes[0]}, a tensor group "
                          "would cross domains")
    ici_data = sizes[0] // tensor
    assert len(groups) * ici_data == axes["data"]
    if _has_slice_index(devices, nvl_domain):  # JAX's own grouping by slice_index
        return mesh_utils.create_hybrid_device_mesh((ici_data, tensor), (len(groups), 1), list(devices),
                                                    allow_split_physical_axes=True)
    # Within a domain, consecutive devices (same tray / process first) form a tensor group.
    blocks = [np.array(sorted(groups[k], key=lambda d: (d.process_index, d.id)),
                       dtype=object).reshape(ici_data, tensor) for k in sorted(groups)]
    return np.concatenate(blocks, axis=0)


def device_grid(cfg_mesh: MeshConfig, devices: Sequence[Any] | None = None) -> np.ndarray:
    """The device array of :func:`build_mesh`: ``[data, tensor]``, or ``[rack, data, tensor]`` (gb200)."""
    devices = list(jax.devices() if devices is None else devices)
    axes = resolve_mesh_axes(cfg_mesh, len(devices))
    racks = len(set(device_domains(devices, cfg_mesh.nvl_domain)))
    if cfg_mesh.layout == "gb200":  # resolve_mesh_axes checked the tensor axis against the domain
        grid = _hybrid_grid(axes, devices, cfg_mesh.nvl_domain, strict=True)
        if cfg_mesh.racks and cfg_mesh.racks != racks:
            raise ConfigError(f"mesh.racks={cfg_mesh.racks}: the {len(devices)} devices fall into "
                              f"{racks} NVLink domain(s) of mesh.nvl_domain={cfg_mesh.nvl_domain}")
        return grid.reshape(racks, grid.shape[0] // racks, grid.shape[1])
    if racks > 1 and (grid := _hybrid_grid(axes, devices, cfg_mesh.nvl_domain, strict=False)) is not None:
        return grid
    shape = (axes["data"], axes["tensor"])
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AttributeError, KeyError):
        # Topology-aware placement is an optimisation; fall back to the given order.
        return np.array(devices, dtype=object).reshape(shape)


def build_mesh(cfg_mesh: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` over ``devices`` (default: all), axes :func:`axis_names`, every one ``AxisType.Auto``
    (the tensor axis is left to XLA's propagation inside the layers)."""
    names = axis_names(cfg_mesh)
    return Mesh(device_grid(cfg_mesh, devices), names, axis_types=(AxisType.Auto,) * len(names))


def describe_mesh(mesh: Mesh, nvl_domain: int) -> str:
    """One line: axis sizes, NVLink domains, and whether each axis stays inside a domain."""
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


def simulate_cpu_devices(n: int, *, override: bool = False) -> int | None:
    """Ask for ``n`` simulated CPU devices (call before any device is touched); a count in XLA_FLAGS wins
    unless ``override`` (then it is dropped, the CPU platform forced). ``n``, or None if nothing changed."""
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
