"""Checkpoints of the whole training state, on orbax-checkpoint's standard handlers.

``<dir>/<step>/`` holds ``state`` (params and optimizer state in their tile-major layout, each process
writing its shards), ``meta`` (step, data position, base key, :func:`describe` of every leaf and
``run``, what :func:`check_resume` compares) and each process's content hashes (:mod:`train.integrity`,
verified before a restore). A checkpoint restores onto any data axis and any tensor split
(:mod:`jax_nvfp4.checkpoint`); saves are atomic. See docs/TRAINING.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np

from jax_nvfp4 import checkpoint as nvck
from train import integrity
from train.config import ConfigError

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "Restored", "check_resume", "describe",
           "host_arrays", "run_identity", "FORMAT", "FORMAT_VERSION", "HASHES"]

FORMAT = "jax_nvfp4.train.checkpoint"
# 1: logical masters; 2: tile layout, hashes, meta["run"]; 3: orbax standard handlers, hashes per process.
FORMAT_VERSION = 3
HASHES = integrity.RECORD  # process 0's hash record


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (incompatible, corrupt, non-finite); one line."""


class CheckpointWriteError(Exception):
    """A checkpoint that could not be written mid-run (the storage failed, not the config: the CLI's
    exit 5, not 2); the ones before it are intact. One line."""


@dataclasses.dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any
    base_key: Optional[jax.Array]
    data_state: Dict[str, int]


def describe(params, opt_state) -> Dict[str, Dict[str, Any]]:
    """:func:`jax_nvfp4.checkpoint.describe` of ``{"params": params, "opt_state": opt_state}``."""
    return nvck.describe({"params": params, "opt_state": opt_state})


def host_arrays(params, opt_state) -> Dict[str, np.ndarray]:
    """:func:`jax_nvfp4.checkpoint.host_arrays` of ``{"params": params, "opt_state": opt_state}``."""
    return nvck.host_arrays({"params": params, "opt_state": opt_state})


class Checkpointer:
    """Saves and restores training states under ``directory`` (orbax step directories, the ``keep``
    newest kept). Every process creates it and calls :meth:`save`, :meth:`restorable_step`,
    :meth:`verify` and :meth:`restore` together; the directory is shared."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = False):
        import orbax.checkpoint as ocp

        self._ocp, self.async_save = ocp, async_save
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)  # a file there: FileExistsError
        except OSError as e:
            raise CheckpointError(f"checkpoint.dir={directory!r}: cannot create it: {e.strerror or e}") from None
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise CheckpointError(f"checkpoint.dir={directory!r}: not readable and writable")
        self._unhashed: List[int] = []  # steps saved here whose hash record is not written yet
        self._verified: set = set()
        self._hash_lock = threading.Lock()
        # Asynchronous: hashes recorded once a save has committed; the temporary directory made in
        # save(), so an unwritable one fails there (not in orbax's threads, 5 minutes at exit).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_hashes,
                                           create_directories_asynchronously=False) if async_save else None)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # noqa: BLE001 - an unusable directory is a user error
            raise CheckpointError(f"checkpoint.dir={directory!r}: cannot use it: {_first_line(e)}") from None
        with contextlib.suppress(OSError):  # orbax removes a killed save's temporary directory in the background
            getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    def _dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def all_steps(self) -> List[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, params, opt_state, *, mesh, base_key: Optional[jax.Array] = None,
             data_state: Optional[Dict[str, int]] = None, run: Optional[Dict[str, Any]] = None) -> None:
        """Write checkpoint ``step`` (``async_save``: in the background); ``run``: :func:`run_identity`.
        CheckpointWriteError: this save (or the previous asynchronous one) failed."""
        ocp, key = self._ocp, base_key
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "step": int(step),
                "data_state": {k: int(v) for k, v in (data_state or {}).items()},
                "base_key": None if key is None else {"impl": str(jax.random.key_impl(key)),
                                                      "data": np.asarray(jax.random.key_data(key)).tolist()},
                "leaves": describe(params, opt_state), "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
                "run": run}
        if self.async_save and self._unhashed:
            self.wait()  # orbax waits for the previous save: report its failure under its own step
        with self._hash_lock:
            self._unhashed.append(int(step))
        with self._writing(step):
            self.manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), meta=ocp.args.JsonSave(meta)))
        if not self.async_save:
            self._record_hashes()

    def wait(self) -> None:
        """Wait for an asynchronous save and record its hashes (CheckpointWriteError: it failed)."""
        with self._writing(self._unhashed[-1] if self._unhashed else None):
            self.manager.wait_until_finished()
        self._record_hashes()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()

    @contextlib.contextmanager
    def _writing(self, step: Optional[int]):
        """Any failure of orbax's writing becomes one :class:`CheckpointWriteError`."""
        try:
            yield
        except (CheckpointError, CheckpointWriteError):
            raise
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds (OSError, ValueError...)
            what = f"checkpoint {step}" if step is not None else "a checkpoint"
            raise CheckpointWriteError(f"cannot write {what} to {self.directory}: {_first_line(e)}; "
                                       "the checkpoints before it are intact") from None

    def _record_hashes(self) -> None:
        """Write this process's hash record of each committed step it saved (idempotent; also called
        from orbax's thread)."""
        with self._hash_lock:
            for step in [s for s in self._unhashed if os.path.isdir(self._dir(s))]:
                self._unhashed.remove(step)  # committed
                try:
                    integrity.record(self._dir(step))
                except OSError as e:
                    raise CheckpointWriteError(f"cannot write the content hashes of checkpoint {self._dir(step)}: "
                                               f"{e.strerror or e}") from None

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` (one line naming the file) unless checkpoint ``step`` holds
        what its processes recorded (:func:`train.integrity.verify`, on every process)."""
        try:
            integrity.verify(self._dir(step))
        except integrity.IntegrityError as e:
            if isinstance(e, integrity.Unrecorded):
                self.read_meta(step)  # a checkpoint of an older format is refused as such
            raise CheckpointError(f"checkpoint {self._dir(step)}: {e}") from None

    def restorable_step(self, fallback: bool = False) -> Tuple[Optional[int], List[Tuple[int, str]]]:
        """``(step, corrupt)``: the newest step that verifies (None: there is none) and, with
        ``fallback``, the newer ``(step, why)`` that did not (:meth:`set_aside` moves them).
        CheckpointError: the newest is corrupt and not ``fallback``, or none is intact."""
        bad = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                self.verify(step)
            except CheckpointError as e:
                if not fallback:
                    raise CheckpointError(f"{e}; refusing to restore it (--set checkpoint.fallback=true restores "
                                          "the newest intact checkpoint instead)") from None
                bad.append((step, str(e)))
                continue
            self._verified.add(step)
            return step, bad
        if bad:
            raise CheckpointError(f"no intact checkpoint in {self.directory}: {bad[0][1]}"
                                  + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        return None, bad

    def set_aside(self, corrupt: List[Tuple[int, str]], chosen: int, log=None) -> None:
        """Rename the ``corrupt`` steps of :meth:`restorable_step` ``corrupt-<step>`` and say so
        (``log``; default: process 0's stderr). On every process."""
        if not corrupt:
            return
        say = log or (lambda m: print(m, file=sys.stderr, flush=True))
        if jax.process_index() == 0:
            for step, why in corrupt:
                aside, i = os.path.join(self.directory, f"corrupt-{step}"), 1
                while os.path.exists(aside):
                    i += 1
                    aside = os.path.join(self.directory, f"corrupt-{step}-{i}")
                os.rename(self._dir(step), aside)
                say(f"checkpoint: {why}; moved to {aside}; restoring step {chosen} instead")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("jax_nvfp4_checkpoint_fallback")
        self.manager.reload()

    def read_meta(self, step: int) -> Dict[str, Any]:
        where = self._dir(step)
        try:
            meta = self.manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001 - any read failure is a bad checkpoint
            raise CheckpointError(f"checkpoint {where}: cannot read its metadata: {_first_line(e)}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {where}: not a {FORMAT} checkpoint")
        if meta.get("version") == 1:
            raise CheckpointError(
                f"checkpoint {where}: format version 1 (masters stored by logical values, before the tile "
                f"layout); this version reads format {FORMAT_VERSION}: resume it with version 0.1.0 or start anew")
        if meta.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {where}: format version {meta.get('version')}, this code reads "
                                  f"{FORMAT_VERSION}")
        return meta

    def restore(self, step: int, abstract_params, abstract_state, param_shardings, state_shardings) -> Restored:
        """Restore checkpoint ``step`` (verified first) into the layout of the ``jax.eval_shape`` trees
        ``abstract_params`` / ``abstract_state`` with those shardings. CheckpointError: corrupt or
        unreadable files, another model/optimizer, non-finite values."""
        where = self._dir(step)
        if step not in self._verified:
            self.verify(step)
        meta = self.read_meta(step)
        saved, abstract = meta.get("leaves", {}), {"params": abstract_params, "opt_state": abstract_state}
        why = nvck.mismatch(saved, nvck.describe(abstract))
        if why:
            raise CheckpointError(f"checkpoint {where} does not match this model/optimizer: {why}")
        shardings = {"params": param_shardings, "opt_state": state_shardings}
        try:
            args = self._ocp.args.Composite(state=self._ocp.args.StandardRestore(
                nvck.restore_targets(abstract, shardings, saved), strict=False))
            state = self.manager.restore(step, args=args).state
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {where}: cannot read its arrays: {_first_line(e)}") from None
        bad = nvck.nonfinite(state)
        if bad:
            raise CheckpointError(f"checkpoint {where}: non-finite values (NaN or Inf) in {bad[0]}"
                                  + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else "")
                                  + "; refusing to restore it")
        state = nvck.relayout(state, abstract, shardings, saved)  # leaves saved with another tensor split
        k = meta.get("base_key")
        base_key = jax.random.wrap_key_data(np.asarray(k["data"], np.uint32), impl=k["impl"]) if k else None
        return Restored(int(meta["step"]), state["params"], state["opt_state"], base_key,
                        dict(meta.get("data_state") or {}))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


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
