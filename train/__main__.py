"""python -m train: train the configured model with NVFP4 weights.

Examples:
  python -m train                                  the default job: 2 layers, 300 steps, 8 simulated CPU devices
  python -m train --config train/configs/tiny.yaml --set train.steps=20 --no-progress
  python -m train --compare bf16 --out runs/compare   NVFP4 and bf16 weights side by side (loss.png, summary)
  python -m train --out runs/ck --set checkpoint.dir=ck --set checkpoint.every=50   rerun it to resume
  scripts/launch_local.sh 2 --config train/configs/tiny.yaml --out runs/tiny-2p   2 processes x 4 CPU devices

Config: a .yaml/.gin file (--config) plus KEY=VALUE overrides (--set KEY=VALUE, or bare KEY=VALUE),
applied in order; the keys and their defaults are listed below. A run writes to --out (default: the
config's train.out_dir, runs/default or runs/tiny), which a new run refuses if it holds an earlier
run it does not resume (give each run its own). Checkpoints, stopping (SIGTERM, SIGINT), folder
locks, --init-from, the exports, multi-process runs (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID, SLURM) and fault injection (TRAIN_FAULT_*): docs/TRAINING.md.

Exit status (one line on stderr for every failure):
  0 done; 2 bad config, mesh, data file, checkpoint, output or export folder, an --out holding an
    earlier run this one does not resume, or a folder another run holds (nothing written, nothing
    trained); 3 non-finite steps (nvfp4.nonfinite=error, or nvfp4.max_skipped_in_a_row in a row),
    naming the step; 4 a runtime failure such as a lost or frozen peer process; 5 a checkpoint or
    another output could not be written mid-run (the checkpoints before it are intact); 130, 143
    stopped by SIGINT, SIGTERM (the last step trained is saved).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import socket
import sys
import tempfile
import textwrap
import threading

from train import hf_import
from train.config import AFFECTS, ConfigError, config_keys, save_config, to_dict, validate_for_devices
from train.lock import FolderLock, LockError
from train.peers import coordination_client, differences, preemption_sync_available, watch_peers
from train.preemption import Preemption, Stopped, exit_code


class _Once(argparse.Action):
    """An option that may be given once: a second value is an error, not a silent replacement."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}); give it once")
        if not values:
            parser.error(f"{option_string}: an empty path")
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors (no usage first), exit 2."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


# The options that take a value (the next argument, unless given as --opt=value).
_VALUED = ("--config", "--set", "--compare", "--out", "--export", "--export-hf", "--hf-format", "--calibrate",
           "--init-from")


def parse_args(argv=None):
    def batches(text: str) -> int:
        with contextlib.suppress(ValueError):
            if int(text) >= 1:
                return int(text)
        raise argparse.ArgumentTypeError(f"expected a positive number of validation batches, got {text!r}")
    p = _Parser(prog="python -m train", description=__doc__.strip(), epilog=config_keys_help(),
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", action=_Once, help="a .yaml/.yml or .gin file (default: the built-in default config)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.layers=4 (repeatable; the last one of a key wins)")
    p.add_argument("--compare", choices=["bf16"], help="also train with plain bf16 weights and compare")
    p.add_argument("--out", action=_Once, help="output directory (default: train.out_dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--export", action=_Once, metavar="DIR", help="after training, write the NVFP4 weights to DIR")
    p.add_argument("--export-hf", action=_Once, metavar="DIR", help="after training, write Hugging Face Llama "
                   "checkpoints to DIR/bf16 and DIR/nvfp4 (bf16 weights: DIR/bf16 alone; DIR must be new or empty)")
    p.add_argument("--hf-format", choices=["compressed-tensors", "modelopt"],
                   help="the layout of --export-hf's DIR/nvfp4: compressed-tensors (default) or NVIDIA ModelOpt's")
    p.add_argument("--calibrate", type=batches, metavar="N", help="with --export-hf: export W4A4, each NVFP4 "
                   "layer's input amax recorded over N validation batches (prints bf16, W4A16, W4A4 losses)")
    p.add_argument("--init-from", action=_Once, metavar="DIR", help="start from the Hugging Face Llama checkpoint "
                   "in DIR (train.init_from; its config.json sets the model's shape)")
    p.add_argument("rest", nargs="*", metavar="KEY=VALUE", help="more overrides, in order with --set")
    ordered, value_next, given = [], False, list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(given):  # a bare KEY=VALUE as --set KEY=VALUE, in its place
        if a == "--" and not value_next:  # the rest are KEY=VALUE overrides as they are
            ordered += given[i:]
            break
        ordered += ["--set", a] if not value_next and not a.startswith("-") and "=" in a else [a]
        value_next = not value_next and a in _VALUED
    args = p.parse_args(ordered)
    if args.calibrate and not args.export_hf:
        p.error("--calibrate N calibrates an --export-hf export: give --export-hf DIR too")
    if args.hf_format and not args.export_hf:
        p.error(f"--hf-format {args.hf_format} chooses the layout of an --export-hf export: give --export-hf DIR too")
    args.hf_format_given, args.hf_format = args.hf_format is not None, args.hf_format or "compressed-tensors"
    args.overrides = [*args.sets, *args.rest]  # rest: only arguments that are not KEY=VALUE (refused)
    return args


def config_keys_help(width: int = 100) -> str:
    """Every config key with its default, meaning and what a change of it affects, by section (for --help)."""
    def shown(v):
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(map(str, v)) + "]"
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    legend = "; ".join(f"{name} = {what}" for name, what in AFFECTS.items())
    lines = textwrap.wrap(f"config keys: KEY=DEFAULT, what it means and [what a change of it affects: {legend}]. "
                          "train/configs/default.yaml lists the same.", width)
    column = 32
    for section, keys in itertools.groupby(config_keys(), key=lambda k: k.section):
        lines += ["", f"  {section}"]
        for k in keys:
            head = f"    {k.key}={shown(k.default)}"
            text = textwrap.wrap(f"{k.explained()} [{k.affects}]", width, initial_indent=" " * column,
                                 subsequent_indent=" " * column, break_on_hyphens=False)
            if len(head) < column - 1:
                text[0] = head.ljust(column) + text[0][column:]
            else:
                lines.append(head)
            lines += text
    return "\n".join(lines)


def _fail(code: int, line: str) -> int:
    print(line, file=sys.stderr, flush=True)
    return code


def main(argv=None) -> int:
    args = parse_args(argv)
    # orbax reports a failed save with pages of tracebacks from its threads; the CLI says it in one line.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    try:  # config first: it needs no JAX, so a bad config fails before anything is written
        cfg = hf_import.load_config(args.config, args.overrides, args.init_from)
        hf_import.check_tokens(cfg)
    except ConfigError as e:
        return _fail(2, f"config error: {e}")
    if args.calibrate and not cfg.data.held_out:
        return _fail(2, f"config error: --calibrate {args.calibrate} calibrates on held-out batches: set "
                        "data.val_path or data.val_fraction (data.source markov draws its own)")
    if cfg.nvfp4.weights == "bf16" and (args.calibrate or args.hf_format_given):
        return _fail(2, "config error: --calibrate and --hf-format shape the NVFP4 export of --export-hf, but "
                        "nvfp4.weights=bf16: the run has no NVFP4 weights (DIR/bf16 is written alone)")
    if args.compare == "bf16" and cfg.nvfp4.weights == "bf16":
        return _fail(2, "config error: --compare bf16 trains a bf16 run beside the NVFP4 one, but nvfp4.weights=bf16: "
                        "both would be bf16; set nvfp4.weights=nvfp4 or drop --compare")
    out_dir = args.out or cfg.train.out_dir
    if why := output_refusal(args, cfg, out_dir):
        return _fail(2, f"error: {why}; nothing written")
    fault = None
    if any(name.startswith("TRAIN_FAULT_") for name in os.environ):  # train.faults is loaded only then
        from train import faults
        try:
            fault = faults.from_env(cfg.checkpoint.dir)
        except ValueError as e:
            return _fail(2, f"error: {e}")
    try:
        return _run(args, cfg, out_dir, fault)
    except KeyboardInterrupt:  # before the training loop took SIGINT over (starting up, compiling)
        return _fail(130, "interrupted (SIGINT) before training started; nothing saved")


def distributed_args(env) -> tuple:
    """``(arguments, heartbeat)``: ``jax.distributed.initialize``'s arguments from the launch environment ``env``,
    JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and JAX_PROCESS_ID, or what JAX detects) and the timeouts
    JAX_HEARTBEAT_TIMEOUT, JAX_INIT_TIMEOUT, JAX_SHUTDOWN_TIMEOUT (seconds: a process that dies takes the others
    down within the heartbeat timeout); ``{}`` in a SLURM step of several tasks (JAX detects it); ``(None, 30)`` for
    one process. ValueError: a variable that is not a number, or a process id outside the process count."""
    def number(name, default=None, low=1):
        text = env.get(name, default)
        if text is None:
            raise ValueError(f"{name} is not set (JAX_NUM_PROCESSES and JAX_PROCESS_ID go together)")
        with contextlib.suppress(ValueError):
            if int(text) >= low:
                return int(text)
        raise ValueError(f"{name}={text!r}: expected a whole number >= {low}")
    slurm = not env.get("JAX_COORDINATOR_ADDRESS") and env.get("SLURM_JOB_ID") and number("SLURM_NTASKS", "1") > 1
    if not env.get("JAX_COORDINATOR_ADDRESS") and not slurm:
        return None, 30  # one process: no peers to watch, the variables unread
    heartbeat = number("JAX_HEARTBEAT_TIMEOUT", "30")
    if slurm:
        return {}, heartbeat
    kw = dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"], heartbeat_timeout_seconds=heartbeat,
              initialization_timeout=number("JAX_INIT_TIMEOUT", "300"),
              shutdown_timeout_seconds=number("JAX_SHUTDOWN_TIMEOUT", "60"))
    if env.get("JAX_NUM_PROCESSES"):
        kw.update(num_processes=number("JAX_NUM_PROCESSES"), process_id=number("JAX_PROCESS_ID", low=0))
        if kw["process_id"] >= kw["num_processes"]:
            raise ValueError(f"JAX_PROCESS_ID={kw['process_id']}: must be below JAX_NUM_PROCESSES="
                             f"{kw['num_processes']}")
    return kw, heartbeat


def _port_free(address: str) -> None:
    """ValueError if another socket listens on ``address``'s port here, where process 0 serves the coordination
    service (a free port in TIME_WAIT is not refused: the service reuses it)."""
    port = address.rpartition(":")[2]
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(port)))
        except ValueError:
            return  # not a port number: jax.distributed says so
        except OSError as e:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS={address}: process 0 serves the coordination service on port "
                             f"{port}, which another program holds ({e.strerror}); choose a free port") from None


def _run(args, cfg, out_dir, fault) -> int:
    """:func:`main` once its config and output locations are known good."""
    from jax_nvfp4 import xla_flags

    gpu_flags = xla_flags.configure(cfg.train.gpu_xla_flags)  # before JAX starts: XLA reads its flags once
    import jax

    import jax_nvfp4 as nv
    from train import mesh as mesh_lib

    mesh_lib.configure_host_devices(cfg.mesh)  # simulated CPU devices: before the backend starts too
    try:
        launch, heartbeat = distributed_args(os.environ)
        if launch is not None:
            if launch.get("coordinator_address") and os.environ.get("JAX_PLATFORMS", "") == "cpu":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives between processes
            if launch.get("process_id") == 0:  # the coordinator's port: taken, JAX's service dies in C++
                _port_free(launch["coordinator_address"])
            jax.distributed.initialize(**launch)
    except ValueError as e:  # a malformed launch environment (jax.distributed's own checks included)
        return _fail(2, f"error: cannot start the multi-process run: {e}")
    # A dead or frozen peer ends this process in one line (exit 4) before the runtime's heartbeat
    # check aborts it with a C++ stack dump.
    peers = watch_peers(float(heartbeat))
    if peers is not None:  # registered after jax.distributed's shutdown hook, so it runs before it
        atexit.register(peers.done)
    is_main, multi = jax.process_index() == 0, jax.process_count() > 1
    if multi:  # one command everywhere: else a mixed run trains silently, or hangs at a save
        run = {"--out": out_dir, "--compare": args.compare, "--export": args.export, "--export-hf": args.export_hf,
               "--hf-format": args.hf_format, "--calibrate": args.calibrate}
        run.update({f"{s}.{k}": v for s, keys in to_dict(cfg).items() for k, v in keys.items()})
        if why := differences({k: json.dumps(v) for k, v in run.items()}):
            return _fail(2, f"error: the processes were started with different settings ({why}); start every "
                            "process with the same command")
    from train import data as data_lib

    try:
        validate_for_devices(cfg, jax.device_count())
        mesh = mesh_lib.build_mesh(cfg.mesh)
        for split in ("train", "val"):  # a missing or unreadable data file fails here
            source = data_lib.make_source(cfg.data, cfg.model, split=split)
            read = cfg.data.batch_size * (cfg.train.eval_batches if split == "val" else 1)  # rows a step/evaluation
            if isinstance(source, data_lib.TokenFileSource) and (split == "train" or cfg.train.eval_every) and \
                    (n := source.num_windows(cfg.model.seq_len + 1)) < read and is_main:
                print(f"notice: the {split} tokens hold {n} window(s) of model.seq_len + 1 tokens; "
                      f"{'a step' if split == 'train' else 'an evaluation'} reads {read} rows, so they repeat",
                      file=sys.stderr, flush=True)
        if args.calibrate and isinstance(source, data_lib.TokenFileSource):  # past them, the same windows again
            n, rows = source.num_windows(cfg.model.seq_len + 1), cfg.data.batch_size
            if args.calibrate > (most := max(1, n // rows)):
                raise ConfigError(f"--calibrate {args.calibrate}: the held-out tokens hold {n} window(s) of "
                                  f"model.seq_len + 1 tokens, {most} batch(es) of data.batch_size={rows}; give "
                                  f"--calibrate {most} or less")
        if args.export_hf:
            hf_check(cfg, mesh)
    except ConfigError as e:
        return _fail(2, f"config error: {e}")
    from train import loop, summary as summary_lib
    from train.checkpoint import CheckpointError, CheckpointWriteError

    try:
        locks = lock_folders(out_dir, checkpoint_dirs(cfg, args.compare), is_main, multi)
    except LockError as e:
        return _fail(2, f"error: {e}")

    def start():  # once the state is built or restored: a refused checkpoint writes nothing
        if is_main:  # save_config makes the folder
            save_config(cfg, os.path.join(out_dir, "config.yaml"))

    hooks = fault.hooks() if fault is not None else None
    preemption, progress = None, not args.no_progress
    try:
        if is_main:
            print(nv.mesh.describe(mesh, cfg.mesh.nvl_domain))
            if gpu_flags:
                print(f"XLA flags for overlap on GPU (jax_nvfp4/xla_flags.py; XLA_FLAGS overrides): "
                      f"{', '.join(gpu_flags)}")
        # Signal handlers belong to the main thread; several processes need the runtime's preemption
        # service to agree on a step (without it a signal ends a process as before).
        if threading.current_thread() is threading.main_thread() and (not multi or preemption_sync_available()):
            preemption = Preemption(sync=multi).install()
        runs = [loop.run(cfg, mesh, out_dir, progress=progress, label=f"{cfg.nvfp4.weights} weights", on_start=start,
                         preemption=preemption, hooks=hooks)]
        if args.compare == "bf16":
            base = dataclasses.replace(cfg, nvfp4=dataclasses.replace(cfg.nvfp4, weights="bf16"))
            if cfg.checkpoint.dir:
                base = dataclasses.replace(base, checkpoint=dataclasses.replace(
                    cfg.checkpoint, dir=checkpoint_dirs(cfg, args.compare)[1]))
            runs.append(loop.run(base, mesh, os.path.join(out_dir, "bf16"), progress=progress, label="bf16 weights",
                                 preemption=preemption))
        if args.export:
            nv.export.export_nvfp4(runs[0]["params"], args.export, overwrite=True)  # replaces only an export
        if args.export_hf:
            export_hf(cfg, runs[0]["params"], args.export_hf, layout=args.hf_format, calibrate=args.calibrate or 0,
                      run=runs[0])
            if is_main and cfg.nvfp4.weights == "bf16":
                print(f"exported a Hugging Face Llama checkpoint: {args.export_hf}/bf16 (the run's weights are bf16: "
                      "no nvfp4 one)")
            elif is_main:
                print(f"exported Hugging Face Llama checkpoints: {args.export_hf}/bf16, {args.export_hf}/nvfp4 "
                      f"({args.hf_format}, {'W4A4' if args.calibrate else 'weight-only'})")
        summary = summary_lib.summarize(runs, out_dir)
    except Stopped as e:
        if multi:  # every process has saved: leave together (a launcher may stop the others once one exits)
            with contextlib.suppress(Exception):  # a peer gone meanwhile: its checkpoint is written
                coordination_client().wait_at_barrier(f"train_stopped_{e.step}", 300_000)
        if is_main:
            print(e.line(), file=sys.stderr, flush=True)
        return exit_code(e.signum)
    except CheckpointWriteError as e:
        return _fail(5, f"checkpoint error: {e}")
    except (CheckpointError, ConfigError) as e:
        return _fail(2, f"{'checkpoint' if isinstance(e, CheckpointError) else 'config'} error: {e}")
    except FloatingPointError as e:
        return _fail(3, f"error: {e}")
    except OSError as e:  # an output that could not be written mid-run (a full or read-only file system)
        where = f" {e.filename}" if e.filename else ""
        return _fail(5, f"error: cannot write{where}: {e.strerror or e}; the checkpoints written before are intact")
    except jax.errors.JaxRuntimeError as e:  # e.g. a peer died mid-collective: one line, not an XLA traceback
        text = str(e).strip()
        _fail(4, f"error: process {jax.process_index()}: {text.splitlines()[0] if text else type(e).__name__}")
        if multi:  # a lost peer cannot join the shutdown barrier (an abort after the heartbeat timeout)
            sys.stdout.flush()
            os._exit(4)
        return 4
    finally:
        if preemption is not None:
            preemption.uninstall()
        for lock in locks:
            lock.release()
    if is_main:
        print_summary(summary, out_dir)
    return 0


def checkpoint_dirs(cfg, compare) -> list:
    """``checkpoint.dir`` and, with ``--compare bf16``, the bf16 run's ``<checkpoint.dir>-bf16``."""
    if not cfg.checkpoint.dir:
        return []
    return [cfg.checkpoint.dir] + ([cfg.checkpoint.dir.rstrip("/") + "-bf16"] if compare else [])


def lock_folders(out_dir: str, ckpt_dirs, is_main: bool, multi: bool) -> list:
    """Lock ``--out`` and the checkpoint folders (:mod:`train.lock`) in process 0, the others learning
    the outcome from the coordination service; returns the locks held here. LockError: a folder is
    another run's, or cannot be created or written."""
    locks, why, seen = [], "", set()
    if is_main:
        try:
            for path, what in [(out_dir, "--out"), *((d, "checkpoint.dir") for d in ckpt_dirs)]:
                if os.path.realpath(path) not in seen:
                    seen.add(os.path.realpath(path))
                    locks.append(FolderLock(path, what).acquire())
        except LockError as e:
            for lock in locks:
                lock.release()
            locks, why = [], str(e)
    if multi:
        client = coordination_client()
        if is_main:
            client.key_value_set("train_lock/outcome", why or "ok")
        else:
            outcome = client.blocking_key_value_get("train_lock/outcome", 300_000)
            why = "" if outcome == "ok" else outcome
    if why:
        raise LockError(why)
    return locks


def hf_check(cfg, mesh) -> None:
    """Refuse (ConfigError) an ``--export-hf`` of ``cfg``'s model that either format could not hold,
    from the planned state's shapes (before anything is trained)."""
    import jax

    import jax_nvfp4 as nv
    from train.model import HF_NAMES
    from train.programs import build

    params = jax.eval_shape(nv.sharding.logical, build(cfg, mesh, init=False)[0].abstract_params)
    hf_metadata(cfg)  # the config.json and tokenizer files, resolved now rather than after training
    for fmt in ("bf16", "nvfp4"):
        try:
            nv.export.check_hf(params, HF_NAMES, fmt=fmt)
        except nv.export.ExportError as e:
            raise ConfigError(f"--export-hf ({fmt}): {e}; set model sizes it can hold, or drop --export-hf") from None
    if cfg.nvfp4.weights == "nvfp4" and not cfg.nvfp4.fused_amax and jax.process_index() == 0:
        print("notice: nvfp4.fused_amax=false: the --export-hf NVFP4 checkpoint gives q/k/v and gate/up a global "
              "scale each; serving engines that fuse them (vLLM, SGLang) read each group under its largest scale, "
              "which shrinks the other parts' weights, and TensorRT-LLM refuses it (transformers reads it as "
              "trained)", file=sys.stderr, flush=True)


def hf_metadata(cfg) -> tuple:
    """``(config.json, tokenizer files)`` of ``cfg``'s Hugging Face export. The tokenizer is the
    imported checkpoint's where it has one, else the token file's, and the BOS/EOS ids are that
    tokenizer's: the ones the model was trained with."""
    from train import data as data_lib

    tokenizer = eos = bos = generation = None
    max_positions = cfg.model.seq_len
    if cfg.data.source == "tokens":
        meta = data_lib.read_token_header(cfg.data.path)
        if path := data_lib.tokenizer_file(cfg.data.path, meta):
            tokenizer, eos, bos = path, meta.get("eos_id"), meta.get("bos_id")
    if cfg.train.init_from:
        source = hf_import.read_hf_config(cfg.train.init_from)
        max_positions = max(max_positions, int(source.get("max_position_embeddings") or 0))
        if hf_import.has_tokenizer(cfg.train.init_from):
            tokenizer = cfg.train.init_from
        if tokenizer in (None, cfg.train.init_from):  # the source's tokens: its ids and generation settings
            eos, bos = source.get("eos_token_id"), source.get("bos_token_id")
            generation = os.path.join(cfg.train.init_from, "generation_config.json")
    hf_cfg = hf_import.hf_config(cfg, max_position_embeddings=max_positions, eos_token_id=eos, bos_token_id=bos)
    files = hf_import.tokenizer_files(tokenizer, max_positions, eos_id=eos, bos_id=bos)
    if generation and os.path.isfile(generation):
        files.setdefault("generation_config.json", generation)
    return hf_cfg, files


def export_hf(cfg, params, directory: str, *, layout: str = "compressed-tensors", calibrate: int = 0,
              run=None) -> None:
    """``--export-hf DIR``: Hugging Face Llama checkpoints of ``params`` in DIR/bf16 and DIR/nvfp4
    (``layout``: ``--hf-format``), with the token file's or the imported checkpoint's tokenizer;
    ``calibrate`` N: DIR/nvfp4 is W4A4 (:mod:`train.calibrate`; ``run``, the ``train.loop.run``
    result, gives the float32 masters for the bf16 loss), the three validation losses printed."""
    from jax_nvfp4 import export as export_lib
    from train.model import HF_NAMES

    hf_cfg, files = hf_metadata(cfg)
    input_amax = None
    if calibrate:
        import jax

        from train import calibrate as calibrate_lib

        input_amax, losses = calibrate_lib.for_run(cfg, dict(run or {}, params=params), calibrate)
        if jax.process_index() == 0:
            shown = " / ".join(f"{k} {losses[k.lower()]:.4f}" for k in ("bf16", "W4A16", "W4A4")
                               if losses[k.lower()] is not None)
            print(f"calibrated the NVFP4 layers' input amax on {calibrate} validation batch"
                  f"{'es' if calibrate > 1 else ''}; validation loss on them: {shown}", flush=True)
    # A run with bf16 weights has no NVFP4 kernel for DIR/nvfp4: a checkpoint whose every Linear is ignored.
    for fmt in ("bf16", "nvfp4") if cfg.nvfp4.weights == "nvfp4" else ("bf16",):
        export_lib.export_hf(params, hf_cfg, os.path.join(directory, fmt), names=HF_NAMES, fmt=fmt, files=files,
                             layout=layout, input_amax=input_amax if fmt == "nvfp4" else None)


# What a run writes into --out besides the bf16 run's folder of --compare.
RUN_FILES = ("metrics.jsonl", "loss.png", "summary.json", "config.yaml")


def _within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or inside it (both real paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _uncreatable(path: str) -> str:
    """Why the folder ``path`` could not be created (empty if it exists or could be): its nearest existing
    ancestor must be a folder this process may write."""
    d = os.path.abspath(path)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if os.path.abspath(path) == d:
        return ""
    if not os.path.isdir(d):
        return f"cannot create it: {d} is not a folder"
    try:  # permissions alone do not tell (read-only or special file systems): a folder made and removed
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=d))
    except OSError as e:
        return f"cannot create it in {d}: {e.strerror or e}"
    return ""


def output_refusal(args, cfg, out_dir: str) -> str:
    """Why the outputs of this command cannot all be written (empty if they can), checked before anything runs:
    exports overlap no run, checkpoint or other export and replace only a previous export; --out is new or resumed."""
    from jax_nvfp4.export import is_export

    real = os.path.realpath
    out = real(out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out_dir}: exists and is not a folder"
    if args.export_hf and os.path.exists(args.export_hf):
        if not os.path.isdir(args.export_hf):
            return f"--export-hf {args.export_hf}: exists and is not a folder"
        if os.listdir(args.export_hf):
            return f"--export-hf {args.export_hf}: exists and is not empty"
    # The run's files (RUN_FILES, the lock) are inside --out: an export that would replace one overlaps --out.
    runs = [("the run's output directory (--out)", out)]
    if args.compare:
        runs.append(("the bf16 run's output directory (--out/bf16)", os.path.join(out, "bf16")))
    exports = [(f"{option} {given}", real(given))
               for option, given in (("--export", args.export), ("--export-hf", args.export_hf)) if given]
    for name, target in exports:
        if why := _uncreatable(target):
            return f"{name}: {why}"
    ckpts = [real(d) for d in checkpoint_dirs(cfg, args.compare)]
    for name, target in exports:
        hits = [(what, d) for what, d in runs if _within(d, target) or _within(target, d)]
        if hits:  # name the innermost folder that holds the export, else one it would hold
            what, d = max(hits, key=lambda h: (_within(target, h[1]), len(h[1])))
            return f"{name}: would replace or sit in {what} {d}; choose another directory"
        for d in ckpts:
            if _within(target, d) or _within(d, target):
                return f"{name}: would replace or sit in checkpoint.dir {d}; choose another directory"
    if len(exports) == 2 and (_within(exports[0][1], exports[1][1]) or _within(exports[1][1], exports[0][1])):
        return f"{exports[0][0]} and {exports[1][0]}: one would hold the other; choose separate directories"
    if args.export and os.path.exists(args.export):
        if not os.path.isdir(args.export):
            return f"--export {args.export}: exists and is not a directory"
        if os.listdir(args.export) and not is_export(args.export):
            return f"--export {args.export}: is not empty and is not a previous NVFP4 export; refusing to replace it"
    for (what, d), ck in itertools.zip_longest(runs, ckpts):  # ckpts: none, or one per run
        earlier = [f for f in RUN_FILES if os.path.isfile(os.path.join(d, f))]
        # A run stopped before its first step (a data error) leaves its config and no metrics: nothing to keep.
        metrics = os.path.join(d, "metrics.jsonl")
        if set(earlier) <= {"config.yaml", "metrics.jsonl"} and not (os.path.isfile(metrics)
                                                                     and os.path.getsize(metrics)):
            earlier = []
        # Resuming: the run's checkpoint folder holds a step.
        if earlier and not (ck and os.path.isdir(ck) and any(name.isdigit() for name in os.listdir(ck))):
            return (f"--out {out_dir}: {what} holds an earlier run's files ({', '.join(earlier)}) and this run "
                    "does not resume it (no checkpoint in checkpoint.dir); choose a new folder or remove them")
    return ""


def print_summary(summary, out_dir: str) -> None:
    """The end-of-run lines: per run, the training loss (named), the last step's and the validation loss;
    then ONE gather ratio, named by what it divides, and every other ratio labelled with its denominator."""
    r0 = summary["runs"][0]
    floor = r0["entropy_floor"]
    print(f"\n== summary ({out_dir}) ==")
    if "final_val_loss_gap" in summary:
        a, b = summary["runs"]
        print(f"validation loss: {a['label']} {a['final_val_loss']:.4f}, {b['label']} {b['final_val_loss']:.4f}; "
              f"NVFP4 - bf16 gap {summary['final_val_loss_gap']:+.4f} nats")
    for r in summary["runs"]:
        val = f"; validation loss {r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else ""
        n = r.get("final_loss_steps")
        if not n:  # a finished checkpoint reopened: no step ran here
            print(f"{r['label']:>14}: no step trained here (the checkpoint was at train.steps={r['steps']} already; "
                  f"its losses are in the metrics.jsonl it was trained into){val}")
            continue
        what = f"mean training loss over the last {n} steps" if n > 1 else "training loss of the last step"
        gap = f" ({r['final_loss'] - floor:+.3f} above the entropy floor {floor:.3f})" if floor is not None else ""
        last = f"; last step {r['last_loss']:.4f}" if n > 1 and r.get("last_loss") is not None else ""
        step_ms = f"{r['median_step_time_s'] * 1e3:.1f} ms" if r["median_step_time_s"] else "n/a"
        print(f"{r['label']:>14}: {what} {r['final_loss']:.4f}{gap}{last}{val}; step {step_ms}; "
              f"params all-gathered {r['all_gather_bytes']:,} B/step/device; skipped steps {r['skipped_steps']}")
    if "nvfp4_gather_vs_bf16" in summary:
        print(f"packed gather ratio: {summary['nvfp4_gather_vs_bf16']:.5f} = the NVFP4 weights' all-gathers, "
              f"{r0['nvfp4_gather_bytes']:,} B/step/device / a bf16 gather of the same weights, "
              f"{r0['nvfp4_bf16_gather_bytes']:,} B")
        import jax_nvfp4 as nv
        from train.plan import BLOCKS

        floor_text = nv.layout.packed_gather_text(BLOCKS[r0.get("nvfp4_block", "2d")])
        print(f"  ({floor_text} of bf16; less where a small leaf's scales stay replicated)")
    if "gather_vs_bf16" in summary:
        print(f"  whole model, weights kept in bf16 included: {r0['all_gather_bytes']:,} B = "
              f"{summary['gather_vs_bf16']:.4f} x a bf16 gather of the same params ({r0['bf16_gather_bytes']:,} B)")
    if "final_loss_gap" in summary:
        shown = lambda key, fmt, unit="": (f"{summary[key]:{fmt}}{unit}" if isinstance(summary.get(key), float)
                                           and math.isfinite(summary[key]) else "n/a (a run trained no step here)")
        gap = shown("final_loss_gap", "+.4f", " nats")
        print(f"NVFP4 - bf16 training loss (means over the last steps, above): {gap}")
        print(f"  params all-gathered, NVFP4 run / bf16 run (each run's own HLO; the bf16 run keeps weights below "
              f"the shard size replicated, not gathered): {shown('gathered_bytes_ratio', '.4f')}; "
              f"median step time, NVFP4 run / bf16 run: {shown('step_time_ratio', '.3f')}")
    print(f"files: {out_dir}/metrics.jsonl, {out_dir}/loss.png, {out_dir}/summary.json")


if __name__ == "__main__":
    code = main()
    if code == 5:  # abandon orbax's background work for the failed save instead of waiting for it at exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
