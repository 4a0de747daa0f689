"""The training loop: build (or restore) the state, then step, log, evaluate and checkpoint; a run
resumed from its checkpoint continues bit-identically. See docs/TRAINING.md."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, Optional

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
    """The records of ``metrics.jsonl`` up to ``step``, the file rewritten without the later ones; a
    torn last line (a crash while writing it) is dropped with a notice. CheckpointError: a line
    before the last is not JSON."""
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
    # A non-finite loss is written as null: read back as NaN, as the run that wrote it held it.
    recs = [dict(r, loss=float("nan")) if "loss" in r and r["loss"] is None else r
            for r in recs if r.get("step", 0) <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(json_record(r) + "\n" for r in recs)
    os.replace(path + ".tmp", path)
    return recs


def fetch_metrics(metrics: list) -> list:
    """The host copies of the steps' metrics: the loop's one read of device values."""
    return jax.device_get(metrics)


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """What a caller adds to :func:`run`'s steps (``step`` counts from 1): ``run_step(trainer, step,
    params, opt_state, batch, key) -> (params, opt_state, metrics)`` in place of ``trainer.step_fn``;
    ``after_step(step, params, opt_state, data_iterator)`` after each step and its checkpoint (the
    host then reads every step's metrics first; an exception ends the run, its saves finished)."""

    run_step: Optional[Callable] = None
    after_step: Optional[Callable] = None


def run(cfg: Config, mesh, out_dir: str, *, progress: bool = True, label: str = "", on_start=None,
        preemption: Optional[Preemption] = None, hooks: Optional[StepHooks] = None) -> Dict[str, Any]:
    """Train ``cfg`` on ``mesh``, write ``metrics.jsonl`` into ``out_dir``, return a summary.

    A new run starts from ``train.seed``'s init or ``train.init_from`` (its validation loss at step 0
    with ``train.eval_every``); with ``checkpoint.dir`` it resumes from the newest (``fallback``:
    intact) checkpoint that :func:`train.checkpoint.check_resume` accepts and saves every
    ``checkpoint.every`` steps and at the end. ``on_start()``: once the state is built, before
    anything is written; ``preemption``: asked after every step whether to stop there; ``hooks``:
    :class:`StepHooks`; ``progress``: a progress bar; ``label``: the run's name in its output lines.

    Raises:
      FloatingPointError: a non-finite step (skipped update or non-finite loss) with
        ``nvfp4.nonfinite="error"``, or ``nvfp4.max_skipped_in_a_row`` in a row (or every step of a
        shorter run); the message names the step.
      train.checkpoint.CheckpointError / CheckpointWriteError: a bad checkpoint / one not written.
      train.preemption.Stopped: asked to stop; the step is saved and every pending save finished.
    """
    hooks = hooks or StepHooks()
    run_step = hooks.run_step or (lambda trainer, step, *state: trainer.step_fn(*state))
    name, is_main = label or cfg.nvfp4.weights, jax.process_index() == 0
    say = functools.partial(print, flush=True) if is_main else lambda *args, **kwargs: None  # process 0 speaks
    with contextlib.ExitStack() as cleanup:  # closed last to first: progress bar, metrics.jsonl, checkpointer
        ckpt = start = None  # start: the step resumed from (None: a new run)
        if cfg.checkpoint.dir:
            ckpt = checkpoint_lib.Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                               async_save=cfg.checkpoint.async_save)
            cleanup.callback(ckpt.close)  # waits for an asynchronous save of the last good step
            start, corrupt = ckpt.restorable_step(cfg.checkpoint.fallback)
            if start is not None:
                checkpoint_lib.check_resume(os.path.join(ckpt.directory, str(start)), ckpt.read_meta(start), cfg)
            if corrupt:  # newer corrupt ones (checkpoint.fallback) set aside only once the resume is accepted
                ckpt.set_aside(corrupt, start)
        t_compile = time.perf_counter()
        say(f"{name}: compiling the train step...")
        imported = start is None and bool(cfg.train.init_from)
        trainer, params, opt_state, base_key, it, source, in_a_row = _initial_state(cfg, mesh, ckpt, start, imported,
                                                                                    say)
        stored = jax.tree.leaves(trainer.abstract_params, is_leaf=nv.layout.is_tiled)
        if cfg.nvfp4.weights == "nvfp4" and not any(isinstance(x, nv.TiledNVFP4) for x in stored):
            say(f"notice: {name}: no weight of this run is NVFP4 (nvfp4.keep_bf16, keep_first_blocks and "
                "keep_last_blocks keep the rest in bf16, or a matrix axis is under 16)", file=sys.stderr)
        val_batches = []
        if cfg.train.eval_every:  # the same batches at every evaluation
            val_source = data_lib.make_source(cfg.data, cfg.model, split="val")
            val_batches = [global_batch(trainer, b) for b in data_lib.eval_batches(
                cfg, val_source, process_index=jax.process_index(), process_count=jax.process_count())]
        evaluate = lambda: validation_loss(trainer.eval_fn, params, val_batches)
        start = start or 0
        if on_start is not None:
            on_start()
        acct = gather_accounting(trainer)
        say(f"{name}: compiled in {time.perf_counter() - t_compile:.1f} s")
        host = _Host(cfg, out_dir, start, is_main, acct, skipped=int(nv.find_state(opt_state).skipped),
                     in_a_row=in_a_row)
        cleanup.callback(host.close)
        if imported and cfg.train.eval_every:  # the imported model's quality first, before any update
            rec = host.write({"step": 0, "val_loss": evaluate()})
            say(f"{name}: step 0 (imported from {cfg.train.init_from}): validation loss {rec['val_loss']:.4f}")
        if progress and is_main:
            from tqdm.auto import tqdm
            host.bar = cleanup.enter_context(tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps),
                                                  desc=name, dynamic_ncols=True))
        run_id = checkpoint_lib.run_identity(cfg)
        host.t_mark = time.perf_counter()
        pending = []  # the steps dispatched and not read yet: [(step, metrics on the device)]
        for n in range(start + 1, cfg.train.steps + 1):  # n: the step taken, counted from 1
            batch = global_batch(trainer, next(it))
            params, opt_state, m = run_step(trainer, n, params, opt_state, batch, jax.random.fold_in(base_key, n - 1))
            pending.append((n, m))
            stop = preemption is not None and preemption.should_stop(n)  # every process asks at every step
            save, evaluated, read = _due(cfg, n, start, stop, ckpt is not None, hooks.after_step is not None)
            if not read:
                continue  # read with a later step, without waiting for this one
            host.read(pending, opt_state, evaluate if evaluated else None)
            if save:
                ckpt.save(n, params, opt_state, mesh=mesh, base_key=base_key, data_state=it.get_state(), run=run_id,
                          nonfinite_in_a_row=host.in_a_row)
            if hooks.after_step is not None:
                hooks.after_step(n, params, opt_state, it)
            if stop:
                preemption.arm_second()  # this step is saved: a second signal now ends the process at once
                cleanup.close()  # every pending save written and its hashes recorded
                raise Stopped(n, preemption.signum, cfg.checkpoint.dir)
    losses = [h["loss"] for h in host.history if "loss" in h]
    val = [(h["step"], h["val_loss"]) for h in host.history if "val_loss" in h]
    tail = losses[-max(1, min(20, len(losses) // 5)):]
    return {"label": name, "steps": cfg.train.steps, "start_step": start,
            "final_loss": float(np.mean(tail)) if tail else float("nan"),  # mean of the last final_loss_steps
            "final_loss_steps": len(tail), "last_loss": losses[-1] if losses else float("nan"),
            "final_val_loss": val[-1][1] if val else None, "val_history": val, "entropy_floor": source.entropy_rate(),
            "nvfp4_block": cfg.nvfp4.resolved_block(),
            "median_step_time_s": float(np.median(host.times)) if host.times else None,
            "skipped_steps": host.skipped, "history": losses, **acct, "params": params, "opt_state": opt_state,
            "data_state": it.get_state()}


def _due(cfg: Config, n: int, start: int, stop: bool, checkpointing: bool, watched: bool) -> tuple:
    """``(save, evaluate, read)`` after step ``n``. The host reads the metrics every
    ``train.log_every`` steps, where a save or an evaluation is due, at the run's first and last step
    and a step stopped at, and at every step with ``nvfp4.nonfinite=error`` (so that the state on
    disk stays the last good one) or an ``after_step`` hook (``watched``); between reads, steps are
    dispatched without waiting for the previous one."""
    last = n == cfg.train.steps
    save = checkpointing and (last or stop or bool(cfg.checkpoint.every and n % cfg.checkpoint.every == 0))
    # An evaluation due at a stop is taken before the save: a resumed run would not take it again.
    evaluate = bool(cfg.train.eval_every) and (last or n % cfg.train.eval_every == 0)
    read = (last or save or evaluate or stop or n == start + 1 or watched or cfg.nvfp4.nonfinite == "error"
            or n % cfg.train.log_every == 0)
    return save, evaluate, read


def _initial_state(cfg: Config, mesh, ckpt, start: Optional[int], imported: bool, say: Callable) -> tuple:
    """``(trainer, params, opt_state, base_key, data_iterator, data_source, non-finite steps in a row)`` where the
    run starts: the random init, ``train.init_from`` (``imported``) or checkpoint ``start``; ``say`` prints."""
    trainer, params, opt_state = build(cfg, mesh, init=start is None and not imported)
    if imported:
        from train import hf_import
        params, opt_state = hf_import.load(cfg.train.init_from, trainer)
    source = data_lib.make_source(cfg.data, cfg.model)
    it = data_lib.make_data_iterator(cfg, process_index=jax.process_index(), process_count=jax.process_count(),
                                     source=source)
    base_key, in_a_row = jax.random.key(cfg.train.seed + 2), 0
    if start is not None:
        r = ckpt.restore(start, trainer.abstract_params, trainer.abstract_state, trainer.param_shardings,
                         trainer.state_shardings)
        params, opt_state, base_key, in_a_row = r.params, r.opt_state, r.base_key, r.nonfinite_in_a_row
        # The stream's position; its seed is the config's (a changed data.seed that checkpoint.allow_change names).
        it.set_state(dict(r.data_state, seed=cfg.data.seed))
        if start < cfg.train.steps:
            say(f"resuming from step {start} of {cfg.train.steps} ({ckpt.directory})")
        else:
            say(f"checkpoint {ckpt.directory} is at step {start} = train.steps: the run is already finished, "
                f"nothing to train (raise train.steps to continue it; see docs/TRAINING.md, Checkpoints)")
    return trainer, params, opt_state, base_key, it, source, in_a_row


@contextlib.contextmanager
def _naming(path: str):
    """An OSError inside (e.g. a full file system) names ``path``."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None


class _Host:
    """The host's record of the run: reads the steps' metrics, checks them for non-finite values,
    times them and records them in ``history`` (the records resumed, then this run's), in
    ``metrics.jsonl`` (process 0's, continued after ``start``) and on the progress bar ``bar``."""

    def __init__(self, cfg: Config, out_dir: str, start: int, is_main: bool, acct: Dict[str, Any], skipped: int,
                 in_a_row: int = 0):
        self.cfg, self.start, self.acct = cfg, start, acct
        self.skipped = skipped  # the optimizer's count of skipped updates so far
        # Non-finite steps in a row (a resumed run's from its checkpoint); the step times but this run's first.
        self.in_a_row, self.times = in_a_row, []
        self.tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        self.path, self.history, self.fh, self.bar = os.path.join(out_dir, "metrics.jsonl"), [], None, None
        self.t_mark = time.perf_counter()  # when the host last read (or started)
        if is_main:
            os.makedirs(out_dir, exist_ok=True)
            self.history = _resume_metrics(self.path, start) if start else []
            self.fh = open(self.path, "a" if start else "w", buffering=1)  # each record on disk once written
        self.val_loss = next((h["val_loss"] for h in reversed(self.history) if "val_loss" in h), None)  # the last

    def write(self, rec: dict) -> dict:
        self.history.append(rec)
        self.val_loss = rec.get("val_loss", self.val_loss)
        if self.fh:
            with _naming(self.path):
                self.fh.write(json_record(rec) + "\n")
        return rec

    def close(self) -> None:
        if self.fh:
            with _naming(self.path):  # the rest of a failed write
                self.fh.close()

    def read(self, pending: list, opt_state, val_loss: Optional[Callable[[], float]] = None) -> None:
        """Read and record the ``pending`` steps ``[(step, metrics)]`` (emptied), waiting for those in
        flight; ``val_loss()``: the validation loss of the last of them."""
        fetched = fetch_metrics([m for _, m in pending])
        now = time.perf_counter()
        dt = (now - self.t_mark) / len(pending)  # the mean step time since the last read
        self.t_mark = now
        gathered = self.acct["all_gather_bytes"]
        for (n, _), m in zip(pending, fetched):
            loss, skipped = float(m["loss"]), int(m["skipped"])
            # Non-finite: a skipped update, or a non-finite loss even where the update went through.
            nonfinite = skipped > self.skipped or not math.isfinite(loss)
            if nonfinite and self.cfg.nvfp4.nonfinite == "error":
                try:
                    nv.optim.raise_if_skipped(opt_state, self.skipped)
                except FloatingPointError as e:
                    raise FloatingPointError(f"step {n}: {e}") from None
                raise FloatingPointError(f"step {n}: non-finite loss ({loss}) (nvfp4.nonfinite=error)")
            self.in_a_row, self.skipped = self.in_a_row + 1 if nonfinite else 0, skipped
            if n > self.start + 1:
                self.times.append(dt)
            rec = {"step": n, "loss": loss, "step_time_s": dt, "tokens_per_s": self.tokens_per_step / dt,
                   "gathered_bytes": gathered, "skipped": skipped}
            if n == pending[-1][0] and val_loss is not None:
                rec["val_loss"] = val_loss()
            self.write(rec)
            if self.bar is not None:
                self.bar.update(1)
                shown = {} if self.val_loss is None else {"val": f"{self.val_loss:.3f}"}
                self.bar.set_postfix(loss=f"{loss:.3f}", **shown,
                                     tok_s=f"{rec['tokens_per_s']:.0f}", gather=f"{gathered / 1e6:.2f}MB",
                                     skipped=skipped, refresh=False)
            # Diverged (raised before the step is checkpointed): every step thrown away
            # (max_skipped_in_a_row in a row), or every step of a run shorter than the limit.
            limit, steps = self.cfg.nvfp4.max_skipped_in_a_row, self.cfg.train.steps
            if limit and (self.in_a_row >= limit or (n == steps and self.in_a_row == n)):
                raise FloatingPointError(
                    f"step {n}: {self.in_a_row} steps in a row non-finite (gradients skipped or loss {loss}); "
                    f"the run has diverged (nvfp4.max_skipped_in_a_row={limit}; 0 = no limit)")
        pending.clear()
