"""The run's device mesh: :mod:`jax_nvfp4.mesh` on the ``mesh`` section of a config, ``mesh.layout:
gb200`` giving the rack axis, its errors naming the config keys (``mesh.tensor=3: ...``)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from jax_nvfp4 import mesh as nv_mesh
from train.config import MeshConfig, mesh_error

__all__ = ["build_mesh", "configure_host_devices"]


def build_mesh(cfg_mesh: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """:func:`jax_nvfp4.mesh.make_mesh` over ``devices`` (default: all) for ``cfg_mesh``; ConfigError
    when the devices cannot hold it."""
    racks = (cfg_mesh.racks or -1) if cfg_mesh.layout == "gb200" else None
    try:
        return nv_mesh.make_mesh(cfg_mesh.data, cfg_mesh.tensor, racks=racks, nvl_domain=cfg_mesh.nvl_domain,
                                 devices=list(jax.devices() if devices is None else devices))
    except nv_mesh.MeshError as e:
        raise mesh_error(e) from None


def configure_host_devices(cfg_mesh: MeshConfig) -> int | None:
    """:func:`jax_nvfp4.mesh.simulate_cpu_devices` for ``mesh.simulate_devices`` (nothing when it is 0)."""
    n = cfg_mesh.simulate_devices
    return nv_mesh.simulate_cpu_devices(n) if n > 0 else None
