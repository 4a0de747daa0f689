"""Checkpoints of the whole training state, on orbax-checkpoint's standard handlers.

``<dir>/<step>/`` holds ``state`` (params and optimizer state in their tile-major layout, each process
writing its shards), ``meta`` (step, data position, base key, :func:`jax_nvfp4.checkpoint.describe` of every leaf and
``run``, what :func:`check_resume` compares) and each process's content hashes (:mod:`jax_nvfp4.integrity`,
verified before a restore). A checkpoint restores onto any data axis and any tensor split
(:mod:`jax_nvfp4.checkpoint`); saves are atomic. See docs/TRAINING.md.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Optional

import jax
import numpy as np

from jax_nvfp4 import checkpoint as nvck, integrity
from jax_nvfp4.checkpoint import CheckpointError, CheckpointWriteError

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "Restored", "check_resume",
           "host_arrays", "run_identity", "FORMAT", "FORMAT_VERSION", "HASHES"]

FORMAT = "jax_nvfp4.train.checkpoint"
# 1: logical masters; 2: tile layout, hashes, meta["run"]; 3: orbax standard handlers, hashes per process.
FORMAT_VERSION = 3
HASHES = integrity.RECORD  # process 0's hash record


@dataclasses.dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any
    base_key: Optional[jax.Array]
    data_state: Dict[str, int]
    nonfinite_in_a_row: int = 0  # the non-finite steps in a row up to this one (0 where not recorded)


def host_arrays(params, opt_state) -> Dict[str, np.ndarray]:
    """:func:`jax_nvfp4.checkpoint.host_arrays` of ``{"params": params, "opt_state": opt_state}``."""
    return nvck.host_arrays({"params": params, "opt_state": opt_state})


class Checkpointer(nvck.Checkpointer):
    """:class:`jax_nvfp4.checkpoint.Checkpointer` of the state ``{"params", "opt_state"}``, its ``meta`` the
    format, step, data position, base key, mesh and ``run`` (:func:`run_identity`)."""

    dir_name = "checkpoint.dir"
    fallback_hint = "--set checkpoint.fallback=true restores the newest intact checkpoint instead"

    def save(self, step: int, params, opt_state, *, mesh, base_key: Optional[jax.Array] = None,
             data_state: Optional[Dict[str, int]] = None, run: Optional[Dict[str, Any]] = None,
             nonfinite_in_a_row: int = 0) -> None:
        super().save(step, {"params": params, "opt_state": opt_state}, {
            "format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "nonfinite_in_a_row": int(nonfinite_in_a_row),
            "data_state": {k: int(v) for k, v in (data_state or {}).items()},
            "base_key": None if base_key is None else {"impl": str(jax.random.key_impl(base_key)),
                                                       "data": np.asarray(jax.random.key_data(base_key)).tolist()},
            "mesh": {str(k): int(v) for k, v in mesh.shape.items()}, "run": run})

    def read_meta(self, step: int) -> Dict[str, Any]:
        meta, where = super().read_meta(step), self._dir(step)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {where}: not a {FORMAT} checkpoint")
        if meta.get("version") == 1:
            raise CheckpointError(
                f"checkpoint {where}: format version 1 (masters stored by logical values, before the tile "
                f"layout); this version reads format {FORMAT_VERSION}: resume it with version 0.1.0 or start anew")
        if meta.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {where}: format version {meta.get('version')}, this code reads "
                                  f"{FORMAT_VERSION}")
        if "saved_step" not in meta and meta.get("step") != step:  # saved before the library recorded saved_step
            raise CheckpointError(f"checkpoint {where}: holds step {meta.get('step')!r}, not {step} (its folder was "
                                  "renamed or copied)")
        return meta

    def restore(self, step: int, abstract_params, abstract_state, param_shardings, state_shardings) -> Restored:
        """Checkpoint ``step`` in the layout of ``abstract_params`` / ``abstract_state`` with those shardings."""
        state, meta = super().restore(step, {"params": abstract_params, "opt_state": abstract_state},
                                      {"params": param_shardings, "opt_state": state_shardings})
        k = meta.get("base_key")
        base_key = jax.random.wrap_key_data(np.asarray(k["data"], np.uint32), impl=k["impl"]) if k else None
        return Restored(int(meta["step"]), state["params"], state["opt_state"], base_key,
                        dict(meta.get("data_state") or {}), int(meta.get("nonfinite_in_a_row") or 0))


# The trajectory keys (train.config.trajectory_keys; not the mesh, nor train.steps, whose schedule length
# stands for it) a run records; these two as the run resolves them.
_RESOLVED = {"nvfp4.block": lambda cfg: cfg.nvfp4.resolved_block(),
             "optim.schedule_steps": lambda cfg: cfg.schedule_steps()}
# Keys that checkpoints written before they existed do not record, with the value those had.
_BEFORE_RECORDED = {"nvfp4.block": "2d", "train.init_from": None, "nvfp4.grad_rounding": "stochastic",
                    "nvfp4.wgrad_hadamard": True, "nvfp4.activations": "nvfp4", "nvfp4.fused_amax": False,
                    "nvfp4.four_over_six": False}
# Keys that older checkpoints do not record and whose value then is unknown: not compared.
_UNKNOWN_BEFORE = ("data.val_path", "data.val_fraction", "data.path:content", "data.val_path:content")


def run_identity(cfg) -> Dict[str, Any]:
    """``{"section.key": value}`` of the config a checkpoint's trajectory depends on (its trajectory
    keys, :data:`_RESOLVED` resolved; the data files' content, :func:`train.data.file_fingerprint`)
    plus ``train.steps``."""
    from train.config import to_dict, trajectory_keys

    d, out = to_dict(cfg), {}
    for key in trajectory_keys(type(cfg)):
        section, name = key.split(".")
        out[key] = _RESOLVED[key](cfg) if key in _RESOLVED else d[section][name]
    out["train.steps"] = cfg.train.steps
    if cfg.data.source in ("file", "tokens"):
        from train.data import file_fingerprint
        for key in ("path", "val_path"):
            path = getattr(cfg.data, key)
            out[f"data.{key}:content"] = file_fingerprint(path) if path else None
    return out


def check_resume(where: str, meta: Dict[str, Any], cfg) -> None:
    """Refuse (CheckpointError, one line naming what differs and the override) to resume checkpoint
    ``meta`` (read from ``where``) with ``cfg`` unless it continues the same run, not past
    ``train.steps``; keys in ``checkpoint.allow_change`` may differ."""
    step = int(meta.get("step", 0))
    if step > cfg.train.steps:
        raise CheckpointError(f"checkpoint {where} is at step {step}, past train.steps={cfg.train.steps}: nothing "
                              f"to train; raise train.steps to continue it, or use another checkpoint.dir")
    saved = meta.get("run")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {where}: it does not record its config; cannot check that this run "
                              "continues it")
    here, allowed, saved = run_identity(cfg), set(cfg.checkpoint.allow_change), {**_BEFORE_RECORDED, **saved}
    # A file's content may change where its name is allowed to ("data.path:content" goes with data.path).
    diffs = [k for k in here if k != "train.steps" and k.split(":")[0] not in allowed
             and not (k in _UNKNOWN_BEFORE and k not in saved)
             and json.dumps(saved.get(k), sort_keys=True) != json.dumps(here[k], sort_keys=True)]
    if not diffs:
        return
    k = diffs[0]
    more = f" (and {len(diffs) - 1} more: {', '.join(diffs[1:4])})" if len(diffs) > 1 else ""
    if k.endswith(":content"):
        key = k.split(":")[0]
        was, now = saved.get(k) or {}, here[k] or {}
        raise CheckpointError(
            f"checkpoint {where} was trained on other data: {key}={getattr(cfg.data, key.split('.')[1])!r} now holds "
            f"{now.get('bytes')} bytes (sha256 {str(now.get('sha256'))[:12]}), the checkpoint's had {was.get('bytes')} "
            f"bytes (sha256 {str(was.get('sha256'))[:12]}){more}; resuming would train on different data. To continue "
            f"on the new content set checkpoint.allow_change=[{key}], or use another checkpoint.dir")
    if k == "optim.schedule_steps":
        hint = (f"to extend the run on its schedule set optim.schedule_steps={saved.get(k)}; to rebuild the "
                f"schedule for the new length set checkpoint.allow_change=[optim.schedule_steps]")
    else:
        hint = f"to continue with the new value set checkpoint.allow_change=[{k}], or use another checkpoint.dir"
    short = lambda v: json.dumps(v) if len(json.dumps(v)) <= 40 else json.dumps(v)[:37] + "..."
    raise CheckpointError(f"checkpoint {where} was trained with {k}={short(saved.get(k))} but this run has "
                          f"{k}={short(here[k])}{more}; {hint}")
