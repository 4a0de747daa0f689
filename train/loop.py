"""The training loop: build (or restore) the state, then step, log, evaluate and checkpoint.

``run`` reads like a training script: the step and the state come from :mod:`train.programs`,
data from :mod:`train.data`, checkpoints from :mod:`train.checkpoint`; what a run leaves
behind is written by :mod:`train.summary`. Checkpoints make a stopped run resume
bit-identically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

import jax_nvfp4 as nv
from train import checkpoint as checkpoint_lib
from train import data as data_lib
from train.accounting import gather_accounting
from train.config import Config
from train.preemption import Preemption, Stopped
from train.programs import build, global_batch
from train.step import validation_loss
from train.summary import json_record


def _resume_metrics(path: str, step: int) -> list:
    """The records of ``metrics.jsonl`` up to ``step`` (a resumed run continues after them);
    the file is rewritten without later records, which a run stopped after its last
    checkpoint had written. A last line that is not JSON (a crash in the middle of writing
    it) is dropped, with a notice; a bad line before it is an error.

    Raises:
      train.checkpoint.CheckpointError: a line before the last is not JSON."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    recs = []
    for i, line in enumerate(lines):
        try:
            recs.append(json.loads(line))
        except ValueError:
            if i + 1 < len(lines):
                raise checkpoint_lib.CheckpointError(
                    f"{path}: line {i + 1} of {len(lines)} is not JSON; cannot continue its records "
                    "(move the file aside to start it anew)") from None
            print(f"{path}: dropped its last line, cut off in the middle (a crash while writing it)",
                  file=sys.stderr, flush=True)
    recs = [r for r in recs if r.get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json_record(r) + "\n" for r in recs)
    os.replace(tmp, path)
    return recs



def fetch_metrics(metrics: list) -> list:
    """The host copies of the steps' metrics: the loop's one read of device values per
    ``train.log_every`` steps (and wherever a step must be looked at)."""
    return jax.device_get(metrics)


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """The one extension point of :func:`run`: what a caller adds to its steps, beyond the
    config (the CLI's fault injection, :mod:`train.faults`; an export at chosen steps; a test
    that stops a run). ``step`` counts from 1 in both.

    Attributes:
      run_step: ``run_step(trainer, step, params, opt_state, batch, key) -> (params,
        opt_state, metrics)``, called in place of ``trainer.step_fn(params, opt_state,
        batch, key)``.
      after_step: ``after_step(step, params, opt_state, data_iterator)`` after each step and
        its checkpoint. With it, the host reads every step's metrics before calling it; an
        exception it raises ends the run there, its pending saves finished.
    """

    run_step: Optional[Callable] = None
    after_step: Optional[Callable] = None


def _step(trainer, step, params, opt_state, batch, key):
    return trainer.step_fn(params, opt_state, batch, key)


def run(
    cfg: Config,
    mesh,
    out_dir: str,
    *,
    progress: bool = True,
    label: str = "",
    on_start=None,
    preemption: Optional[Preemption] = None,
    hooks: Optional[StepHooks] = None,
) -> Dict[str, Any]:
    """Train ``cfg`` on ``mesh``; write ``metrics.jsonl`` into ``out_dir``; return a summary.

    A new run starts from ``train.seed``'s random init, or from the Hugging Face checkpoint
    ``train.init_from`` (:func:`train.hf_import.load`), whose validation loss is evaluated at
    step 0, before any update, when ``train.eval_every`` is set.

    With ``cfg.checkpoint.dir``, the run resumes from the newest checkpoint there once its
    content hashes are verified (``checkpoint.fallback``: the newest intact one) and its config
    matches (:func:`train.checkpoint.check_resume`); metrics.jsonl continues after its step. It
    saves every ``checkpoint.every`` steps and at the end.

    A non-finite step is one whose update was skipped for non-finite gradients or whose loss
    is not finite.

    Raises:
      FloatingPointError: a non-finite step with ``nvfp4.nonfinite="error"``, or
        ``nvfp4.max_skipped_in_a_row`` non-finite steps in a row (or every step of a run
        shorter than that); the message names the step.
      train.checkpoint.CheckpointError: a corrupt or incompatible checkpoint.
      train.checkpoint.CheckpointWriteError: a checkpoint that cannot be written.
      train.preemption.Stopped: ``preemption`` asked to stop; the step it stopped at is saved
        (with ``checkpoint.dir``) and every pending save finished.

    Args:
      on_start: called once the state is built or restored, before anything is written.
      preemption: asked after every step whether to stop there (SIGTERM, SIGINT).
      hooks: what the caller adds to each step (:class:`StepHooks`).
    """
    hooks = hooks or StepHooks()
    run_step = hooks.run_step or _step
    name = label or cfg.nvfp4.weights
    is_main = jax.process_index() == 0
    ckpt = None
    if cfg.checkpoint.dir:
        ckpt = checkpoint_lib.Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                           async_save=cfg.checkpoint.async_save)
    log = None
    try:
        start = _resume_point(ckpt, cfg)
        t_compile = time.perf_counter()
        if is_main:
            # Building the state and compiling the step take a while before the first step.
            print(f"{name}: compiling the train step...", flush=True)
        imported = start is None and bool(cfg.train.init_from)
        trainer, params, opt_state, base_key, it, source = _initial_state(cfg, mesh, ckpt, start, imported, is_main)
        val_batches = _validation_batches(cfg, trainer)
        start = start or 0
        if on_start is not None:
            on_start()

        acct = gather_accounting(trainer)
        if is_main:
            print(f"{name}: compiled in {time.perf_counter() - t_compile:.1f} s", flush=True)
        log = _Log(out_dir, start, is_main)
        if imported and cfg.train.eval_every:
            # The imported model's quality first, before any update.
            rec = log.write({"step": 0, "val_loss": validation_loss(trainer.eval_fn, params, val_batches)})
            if is_main:
                print(f"{name}: step 0 (imported from {cfg.train.init_from}): validation loss {rec['val_loss']:.4f}",
                      flush=True)
        if progress and is_main:
            log.show_progress(name, cfg.train.steps, start)
        run_id = checkpoint_lib.run_identity(cfg)
        host = _Host(cfg, log, acct, start, skipped=int(nv.find_state(opt_state).skipped))
        pending = []  # the steps dispatched and not read yet: [(step, metrics on the device)]
        for n in range(start + 1, cfg.train.steps + 1):  # n: the step taken, counted from 1
            batch = global_batch(trainer, next(it))
            params, opt_state, m = run_step(trainer, n, params, opt_state, batch, jax.random.fold_in(base_key, n - 1))
            pending.append((n, m))
            # Asked at every step, by every process (a multi-process run agrees on the step).
            stop = preemption is not None and preemption.should_stop(n)
            save, evaluate, read = _due(cfg, n, start, stop, ckpt is not None, hooks.after_step is not None)
            if not read:
                continue  # read with a later step, without waiting for this one
            host.read(pending, opt_state, (lambda: validation_loss(trainer.eval_fn, params, val_batches))
                      if evaluate else None)
            if save:
                ckpt.save(n, params, opt_state, mesh=mesh, base_key=base_key, data_state=it.get_state(), run=run_id)
            if hooks.after_step is not None:
                hooks.after_step(n, params, opt_state, it)
            if stop:
                # This step is saved. A second signal now ends the process at once.
                preemption.arm_second()
                if ckpt is not None:
                    ckpt.close()  # every pending save written and its hashes recorded
                    ckpt = None
                raise Stopped(n, preemption.signum, cfg.checkpoint.dir)
    finally:
        if log is not None:
            log.close_progress()
        try:
            if ckpt is not None:
                ckpt.close()  # waits for an asynchronous save of the last good step
        finally:
            if log is not None:
                log.close()
    return _result(cfg, name, start, host, source, params, opt_state, it)


def _due(cfg: Config, n: int, start: int, stop: bool, checkpointing: bool, watched: bool) -> tuple:
    """``(save, evaluate, read)`` after step ``n``: a checkpoint (every ``checkpoint.every``
    steps, at the last step and at a step stopped at), an evaluation (every
    ``train.eval_every`` steps and at the last, not at a step stopped at) and a read of the
    metrics. The host reads them every ``train.log_every`` steps, where a checkpoint or an
    evaluation is due, at the run's first and last step and a step stopped at, and at every
    step with ``nvfp4.nonfinite=error`` (so that the state on disk stays the last good one) or
    an ``after_step`` hook (``watched``); between reads, steps are dispatched without waiting
    for the previous one."""
    last = n == cfg.train.steps
    save = checkpointing and (last or stop or bool(cfg.checkpoint.every and n % cfg.checkpoint.every == 0))
    evaluate = bool(cfg.train.eval_every) and (last or n % cfg.train.eval_every == 0) and not stop
    read = (last or save or evaluate or stop or n == start + 1 or watched or cfg.nvfp4.nonfinite == "error"
            or n % cfg.train.log_every == 0)
    return save, evaluate, read


def _resume_point(ckpt, cfg: Config) -> Optional[int]:
    """The step of the checkpoint the run resumes from (None: a new run), verified and
    accepted (:func:`train.checkpoint.check_resume`); only then are the corrupt newer ones
    (``checkpoint.fallback``) set aside, so that a refused run leaves the folder as it was."""
    if ckpt is None:
        return None
    start, corrupt = ckpt.restorable_step(cfg.checkpoint.fallback)
    if start is not None:
        checkpoint_lib.check_resume(os.path.join(ckpt.directory, str(start)), ckpt.read_meta(start), cfg)
    if corrupt:
        ckpt.set_aside(corrupt, start)
    return start


def _initial_state(cfg: Config, mesh, ckpt, start: Optional[int], imported: bool, is_main: bool) -> tuple:
    """``(trainer, params, opt_state, base_key, data_iterator, data_source)`` where the run
    starts: for a new run (``start`` None), ``train.seed``'s random init or, ``imported``,
    ``train.init_from``; otherwise checkpoint ``start``, the data iterator at its position."""
    trainer, params, opt_state = build(cfg, mesh, init=start is None and not imported)
    if imported:
        from train import hf_import

        params, opt_state = hf_import.load(cfg.train.init_from, trainer)
    source = data_lib.make_source(cfg.data, cfg.model)
    it = data_lib.make_data_iterator(cfg, process_index=jax.process_index(), process_count=jax.process_count(),
                                     source=source)
    base_key = jax.random.key(cfg.train.seed + 2)
    if start is not None:
        r = ckpt.restore(start, trainer.abstract_params, trainer.abstract_state,
                         trainer.param_shardings, trainer.state_shardings)
        params, opt_state, base_key = r.params, r.opt_state, r.base_key
        it.set_state(r.data_state)
        if is_main and start < cfg.train.steps:
            print(f"resuming from step {start} of {cfg.train.steps} ({ckpt.directory})", flush=True)
        elif is_main:
            print(f"checkpoint {ckpt.directory} is at step {start} = train.steps: the run is already finished, "
                  f"nothing to train (raise train.steps to continue it; see README, Checkpoints)", flush=True)
    return trainer, params, opt_state, base_key, it, source


def _validation_batches(cfg: Config, trainer) -> list:
    """The validation batches (global arrays), the same at every evaluation; none without
    ``train.eval_every``."""
    if not cfg.train.eval_every:
        return []
    val_source = data_lib.make_source(cfg.data, cfg.model, split="val")
    return [global_batch(trainer, b) for b in data_lib.eval_batches(
        cfg, val_source, process_index=jax.process_index(), process_count=jax.process_count())]


@contextlib.contextmanager
def _naming(path: str):
    """An OSError inside (e.g. a full file system) names ``path``."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None


class _Log:
    """The host's record of the run: ``history`` (the records resumed, then this run's),
    ``metrics.jsonl`` in ``out_dir`` (written by process 0, continued after ``start``) and the
    progress bar."""

    def __init__(self, out_dir: str, start: int, is_main: bool):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.history, self.fh, self.bar = [], None, None
        if is_main:
            os.makedirs(out_dir, exist_ok=True)
            self.history = _resume_metrics(self.path, start) if start else []
            self.fh = open(self.path, "a" if start else "w")

    def write(self, rec: dict) -> dict:
        self.history.append(rec)
        if self.fh:
            with _naming(self.path):
                self.fh.write(json_record(rec) + "\n")
        return rec

    def flush(self) -> None:
        if self.fh:
            with _naming(self.path):
                self.fh.flush()

    def close(self) -> None:
        if self.fh:
            with _naming(self.path):  # the rest of a failed write
                self.fh.close()

    def show_progress(self, name: str, steps: int, start: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=steps, initial=min(start, steps), desc=name, dynamic_ncols=True)

    def advance(self, rec: dict, gathered_bytes: int) -> None:
        """One step more on the progress bar, with its loss and the latest validation loss."""
        if self.bar is None:
            return
        self.bar.update(1)
        shown = [h["val_loss"] for h in self.history if "val_loss" in h]
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", **({"val": f"{shown[-1]:.3f}"} if shown else {}),
                             tok_s=f"{rec['tokens_per_s']:.0f}", gather=f"{gathered_bytes / 1e6:.2f}MB",
                             skipped=rec["skipped"], refresh=False)

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Host:
    """What the host does with the steps' metrics when it reads them: check each step for
    non-finite values (:meth:`_check_skipped`, :meth:`_check_diverged`), time it and record it
    (:class:`_Log`)."""

    def __init__(self, cfg: Config, log: _Log, acct: Dict[str, Any], start: int, skipped: int):
        self.cfg, self.log, self.acct, self.start = cfg, log, acct, start
        self.skipped = skipped  # the optimizer's count of skipped updates so far
        self.in_a_row = 0  # non-finite steps in a row
        self.times: List[float] = []  # the step times, the first step of this run's excepted
        self.t_mark = time.perf_counter()  # when the host last read (or started)
        self.tokens_per_step = cfg.data.batch_size * cfg.model.seq_len

    def read(self, pending: list, opt_state, val_loss: Optional[Callable[[], float]] = None) -> None:
        """Read and record the ``pending`` steps ``[(step, metrics)]`` (emptied), waiting for
        the steps in flight; ``val_loss()``: the validation loss of the last of them."""
        fetched = fetch_metrics([m for _, m in pending])
        now = time.perf_counter()
        dt = (now - self.t_mark) / len(pending)  # the mean step time since the last read
        self.t_mark = now
        for (n, _), m in zip(pending, fetched):
            loss, skipped = float(m["loss"]), int(m["skipped"])
            self._check_skipped(n, loss, skipped, opt_state)
            if n > self.start + 1:
                self.times.append(dt)
            rec = {"step": n, "loss": loss, "step_time_s": dt, "tokens_per_s": self.tokens_per_step / dt,
                   "gathered_bytes": self.acct["all_gather_bytes"], "skipped": skipped}
            if n == pending[-1][0] and val_loss is not None:
                rec["val_loss"] = val_loss()
            self.log.write(rec)
            self.log.advance(rec, self.acct["all_gather_bytes"])
            self._check_diverged(n, loss)
        pending.clear()
        self.log.flush()

    def _check_skipped(self, n: int, loss: float, skipped: int, opt_state) -> None:
        """Count step ``n`` non-finite or not (a non-finite loss counts even where the update
        went through); with ``nvfp4.nonfinite=error`` a non-finite step is an error."""
        nonfinite = skipped > self.skipped or not math.isfinite(loss)
        if nonfinite and self.cfg.nvfp4.nonfinite == "error":
            try:
                nv.optim.raise_if_skipped(opt_state, self.skipped)
            except FloatingPointError as e:
                raise FloatingPointError(f"step {n}: {e}") from None
            raise FloatingPointError(f"step {n}: non-finite loss ({loss}) (nvfp4.nonfinite=error)")
        self.in_a_row = self.in_a_row + 1 if nonfinite else 0
        self.skipped = skipped

    def _check_diverged(self, n: int, loss: float) -> None:
        """Diverged: every step is being thrown away (``nvfp4.max_skipped_in_a_row`` in a row),
        or every step of a run shorter than the limit was. Raised before the step is
        checkpointed."""
        limit, steps = self.cfg.nvfp4.max_skipped_in_a_row, self.cfg.train.steps
        if limit and (self.in_a_row >= limit or (n == steps and self.in_a_row == n - self.start)):
            raise FloatingPointError(
                f"step {n}: {self.in_a_row} steps in a row non-finite (gradients skipped or loss {loss}); "
                f"the run has diverged (nvfp4.max_skipped_in_a_row={limit}; 0 = no limit)")


def _result(cfg: Config, name: str, start: int, host: _Host, source, params, opt_state, it) -> Dict[str, Any]:
    """What :func:`run` returns: the run's losses, times and accounting, and its final state."""
    history = host.log.history
    losses = [h["loss"] for h in history if "loss" in h]
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    tail = losses[-max(1, min(20, len(losses) // 5)):]
    return {
        "label": name,
        "steps": cfg.train.steps,
        "start_step": start,
        "final_loss": float(np.mean(tail)) if tail else float("nan"),  # mean of the last final_loss_steps
        "final_loss_steps": len(tail),
        "last_loss": losses[-1] if losses else float("nan"),
        "final_val_loss": val[-1][1] if val else None,
        "val_history": val,
        "entropy_floor": source.entropy_rate(),
        "nvfp4_block": cfg.nvfp4.resolved_block(),
        "median_step_time_s": float(np.median(host.times)) if host.times else None,
        "skipped_steps": host.skipped,
        "history": losses,
        **host.acct,
        "params": params,
        "opt_state": opt_state,
        "data_state": it.get_state(),
    }
