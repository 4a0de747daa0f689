"""The training loop: build (or restore) the state, then step, log, evaluate and checkpoint.

``run`` reads like a training script: the step and the state come from :mod:`train.programs`,
data from :mod:`train.data`, checkpoints from :mod:`train.checkpoint`; what a run leaves
behind is written by :mod:`train.summary`. Checkpoints make a stopped run resume
bit-identically.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, Optional

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


def run(
    cfg: Config,
    mesh,
    out_dir: str,
    *,
    progress: bool = True,
    label: str = "",
    on_step=None,
    on_start=None,
    inject_nonfinite: Optional[Dict[int, float]] = None,
    preemption: Optional[Preemption] = None,
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
      train.checkpoint.CheckpointError: a corrupt or incompatible checkpoint
        (``CheckpointWriteError``: one that cannot be written).
      train.preemption.Stopped: ``preemption`` asked to stop; the step it stopped at is saved
        (with ``checkpoint.dir``) and every pending save finished.

    Args:
      on_step: ``on_step(step, params, opt_state, data_iterator)`` after each step (and its
        checkpoint); ``step`` counts from 1.
      on_start: called once the state is built or restored, before anything is written.
      inject_nonfinite: fault-injection hook for tests, not a config key: ``{step: value}``
        multiplies the loss of that step (counted from 1) by ``value`` (NaN or Inf), which
        makes its gradients non-finite.
      preemption: asked after every step whether to stop there (SIGTERM, SIGINT).
    """
    inject = {int(k): float(v) for k, v in (inject_nonfinite or {}).items()}
    is_main = jax.process_index() == 0
    ckpt = None
    if cfg.checkpoint.dir:
        ckpt = checkpoint_lib.Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                           async_save=cfg.checkpoint.async_save)
    fh = bar = None
    try:
        start, corrupt = ckpt.restorable_step(cfg.checkpoint.fallback) if ckpt is not None else (None, [])
        if start is not None:
            checkpoint_lib.check_resume(os.path.join(ckpt.directory, str(start)), ckpt.read_meta(start), cfg)
        if corrupt:
            # Only now that the resume is accepted: a refused run leaves the folder as it was.
            ckpt.set_aside(corrupt, start)
        name = label or cfg.nvfp4.weights
        t_compile = time.perf_counter()
        if is_main:
            # Building the state and compiling the step take a while before the first step.
            print(f"{name}: compiling the train step...", flush=True)
        imported = start is None and bool(cfg.train.init_from)
        trainer, params, opt_state = build(cfg, mesh, init=start is None and not imported)
        if imported:
            from train import hf_import

            params, opt_state = hf_import.load(cfg.train.init_from, trainer)
        source = data_lib.make_source(cfg.data, cfg.model)
        it = data_lib.make_data_iterator(cfg, process_index=jax.process_index(), process_count=jax.process_count(), source=source)
        val_batches, eval_fn = [], None
        if cfg.train.eval_every:
            val_source = data_lib.make_source(cfg.data, cfg.model, split="val")
            val_batches = [global_batch(trainer, b) for b in data_lib.eval_batches(
                cfg, val_source, process_index=jax.process_index(), process_count=jax.process_count())]
            eval_fn = trainer.eval_fn
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
        start = start or 0
        if on_start is not None:
            on_start()

        acct = gather_accounting(trainer)
        if is_main:
            print(f"{name}: compiled in {time.perf_counter() - t_compile:.1f} s", flush=True)
        metrics_path = os.path.join(out_dir, "metrics.jsonl")
        history = []
        if is_main:
            os.makedirs(out_dir, exist_ok=True)
            history = _resume_metrics(metrics_path, start) if start else []
            fh = open(metrics_path, "a" if start else "w")
        if imported and eval_fn is not None:
            # The imported model's quality first, before any update.
            rec = {"step": 0, "val_loss": validation_loss(eval_fn, params, val_batches)}
            history.append(rec)
            if is_main:
                fh.write(json_record(rec) + "\n")
                print(f"{name}: step 0 (imported from {cfg.train.init_from}): validation loss {rec['val_loss']:.4f}",
                      flush=True)
        if progress and is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps),
                       desc=name, dynamic_ncols=True)
        tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        times = []
        skipped_before = int(nv.find_state(opt_state).skipped)
        in_a_row, limit = 0, cfg.nvfp4.max_skipped_in_a_row
        saved_step = start
        run_id = checkpoint_lib.run_identity(cfg)
        # The host reads metrics every train.log_every steps (and at checkpoints, evaluations,
        # the first and last step, every step with nvfp4.nonfinite=error or an on_step hook):
        # between those, steps are dispatched without waiting for the previous one.
        pending = []
        t_mark = time.perf_counter()
        for step in range(start, cfg.train.steps):
            batch = global_batch(trainer, next(it))
            scale = np.float32(inject.get(step + 1, 1.0))
            params, opt_state, m = trainer.step_fn(params, opt_state, batch, jax.random.fold_in(base_key, step), scale)
            pending.append((step, m))
            # Asked at every step, by every process (a multi-process run agrees on the step).
            stop = preemption is not None and preemption.should_stop(step + 1)
            last = step + 1 == cfg.train.steps
            ckpt_due = ckpt is not None and ((cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0)
                                             or last or stop)
            eval_due = eval_fn is not None and ((step + 1) % cfg.train.eval_every == 0 or last) and not stop
            if not (last or ckpt_due or eval_due or on_step is not None or step == start or stop
                    or cfg.nvfp4.nonfinite == "error" or (step + 1) % cfg.train.log_every == 0):
                continue
            fetched = fetch_metrics([pm for _, pm in pending])  # waits for the steps in flight
            now = time.perf_counter()
            dt = (now - t_mark) / len(pending)  # the mean step time since the last read
            t_mark = now
            for (s, _), mm in zip(pending, fetched):
                loss, skipped = float(mm["loss"]), int(mm["skipped"])
                if cfg.nvfp4.nonfinite == "error" and (skipped > skipped_before or not math.isfinite(loss)):
                    # Read every step in this mode, before any checkpoint of this step: the
                    # state on disk stays the last good one.
                    try:
                        nv.optim.raise_if_skipped(opt_state, skipped_before)
                    except FloatingPointError as e:
                        raise FloatingPointError(f"step {s + 1}: {e}") from None
                    raise FloatingPointError(f"step {s + 1}: non-finite loss ({loss}) (nvfp4.nonfinite=error)")
                # A non-finite loss counts as a non-finite step even where the update went through.
                in_a_row = in_a_row + 1 if skipped > skipped_before or not math.isfinite(loss) else 0
                skipped_before = skipped
                if s > start:
                    times.append(dt)
                rec = {"step": s + 1, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                       "gathered_bytes": acct["all_gather_bytes"], "skipped": skipped}
                if s == step and eval_due:
                    rec["val_loss"] = validation_loss(eval_fn, params, val_batches)
                history.append(rec)
                if fh:
                    try:
                        fh.write(json_record(rec) + "\n")
                    except OSError as e:
                        raise OSError(e.errno, e.strerror, metrics_path) from None
                if bar is not None:
                    bar.update(1)
                    shown = [h["val_loss"] for h in history if "val_loss" in h]
                    bar.set_postfix(loss=f"{loss:.3f}", **({"val": f"{shown[-1]:.3f}"} if shown else {}),
                                    tok_s=f"{rec['tokens_per_s']:.0f}",
                                    gather=f"{acct['all_gather_bytes'] / 1e6:.2f}MB", skipped=skipped, refresh=False)
                # Diverged: every step is being thrown away, or every step of a run shorter than
                # the limit was. Stop before checkpointing it.
                if limit and (in_a_row >= limit or (s + 1 == cfg.train.steps and in_a_row == s + 1 - start)):
                    raise FloatingPointError(
                        f"step {s + 1}: {in_a_row} steps in a row non-finite (gradients skipped or loss {loss}); "
                        f"the run has diverged (nvfp4.max_skipped_in_a_row={limit}; 0 = no limit)")
            pending.clear()
            if fh:
                try:
                    fh.flush()
                except OSError as e:  # e.g. a full file system: name the file
                    raise OSError(e.errno, e.strerror, metrics_path) from None
            if ckpt_due and saved_step != step + 1:
                ckpt.save(step + 1, params, opt_state, mesh=mesh, base_key=base_key,
                          data_state=it.get_state(), run=run_id)
                saved_step = step + 1
            if on_step is not None:
                on_step(step + 1, params, opt_state, it)
            if stop:
                # This step is saved (ckpt_due). A second signal now ends the process at once.
                preemption.arm_second()
                if ckpt is not None:
                    ckpt.close()  # every pending save written and its hashes recorded
                    ckpt = None
                raise Stopped(step + 1, preemption.signum, cfg.checkpoint.dir)
    finally:
        if bar is not None:
            bar.close()
        try:
            if ckpt is not None:
                ckpt.close()  # waits for an asynchronous save of the last good step
        finally:
            if fh:
                try:
                    fh.close()
                except OSError as e:  # the rest of a failed write: name the file
                    raise OSError(e.errno, e.strerror, metrics_path) from None
    losses = [h["loss"] for h in history if "loss" in h]
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    tail = losses[-max(1, min(20, len(losses) // 5)):]
    return {
        "label": label or cfg.nvfp4.weights,
        "steps": cfg.train.steps,
        "start_step": start,
        "final_loss": float(np.mean(tail)) if tail else float("nan"),  # mean of the last final_loss_steps
        "final_loss_steps": len(tail),
        "last_loss": losses[-1] if losses else float("nan"),
        "final_val_loss": val[-1][1] if val else None,
        "val_history": val,
        "entropy_floor": source.entropy_rate(),
        "nvfp4_block": cfg.nvfp4.resolved_block(),
        "median_step_time_s": float(np.median(times)) if times else None,
        "skipped_steps": skipped_before,
        "history": losses,
        **acct,
        "params": params,
        "opt_state": opt_state,
        "data_state": it.get_state(),
    }
