"""``python -m benchmarks``: NVFP4 weights vs bf16 weights, measured side by side.

Sections (default ``all`` = every one but ``scale``)::

    traffic      1. parameter all-gather and gradient-reduction bytes per step (compiled HLO)
    memory       2. per-device training state (params, master, optimizer, grads), temporaries
    speed        3. median step time
    quantize     4. quantize / dequantize throughput vs memory-bound passes
    convergence  5. final loss after a fixed budget: NVFP4, bf16, nvfp4.compute=nvfp4
                 (embedded Markov corpus; ``convergence --text``: the validation gap on
                 held-out Python stdlib modules over sizes, lengths, seeds and levers,
                 ``benchmarks.convergence_text``, its own arguments: ``--text --help``;
                 ``--text --recipe``: the full recipe's gap against width and its ablation;
                 ``--text --length-sweep``: the gap against tokens per parameter)
    scaling      6. figures 1-3 over model sizes x data-axis sizes 1, 2, 4, 8
    scale        compile-only large models on simulated racks (``benchmarks.scale``; takes its
                 own arguments: ``python -m benchmarks scale --help``)
    gpu          validate a GPU machine end to end in one table and a JSON: quantize against
                 the CPU, packed gathers, the recipe GEMM's backend, the default and a 1.1B
                 model's steps with NVFP4 and bf16 weights (``benchmarks.gpu_check``; its own
                 arguments: ``python -m benchmarks gpu --help``); without a GPU, one line, exit 1
    serving      the validation loss of a model served in NVFP4: bf16 + post-training
                 quantization, native NVFP4 training, bf16 + NVFP4 fine-tuning
                 (``benchmarks.serving``; its own arguments: ``serving --help``)

Examples::

    python -m benchmarks                       # everything, into benchmarks/results/ (< 15 min on 2 CPU cores)
    python -m benchmarks traffic memory        # two sections; the report keeps the others' results
    python -m benchmarks --quick               # smoke run into runs/benchmarks-quick/
    python -m benchmarks convergence --text --workers 2   # real-text grid -> CONVERGENCE_TEXT.md
    python -m benchmarks convergence --text --recipe --workers 2   # -> CONVERGENCE_RECIPE.md
    python -m benchmarks convergence --text --length-sweep --workers 2   # -> CONVERGENCE_LENGTH.md

Results: one JSON per section, REPORT.md (with PNG plots) and HEADLINE.md in ``--out``. On CPU the
run asks for 8 simulated devices (unless XLA_FLAGS sets a count); on GPU/TPU it uses
``jax.devices()``.

A bad argument, here or of a subcommand, is one line on stderr naming it (``error: --steps 0:
must be a positive integer``) and exit status 2, before anything is compiled, trained or
written (``benchmarks.arguments``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import sys
import time
from typing import Any, Dict, List, Sequence

from benchmarks import arguments as A
from benchmarks.common import request_cpu_devices, source_state

SECTIONS = ("traffic", "memory", "speed", "quantize", "convergence", "scaling")
DEFAULT_OUT = os.path.join("benchmarks", "results")
QUICK_OUT = os.path.join("runs", "benchmarks-quick")


def parse_args(argv: Sequence[str]):
    """The sections' arguments; a bad one is one line on stderr (``error: --flag VALUE: why``)
    and exit 2, before anything is compiled or written (:mod:`benchmarks.arguments`)."""
    from benchmarks import train_step as ts
    from train.config import MAX_SIMULATED_DEVICES

    sizes = list(ts.SIZES)
    p = A.Parser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("sections", nargs="*", default=["all"], metavar="SECTION",
                   help=f"all (default) or any of: {', '.join(SECTIONS)}; or 'scale ARGS...', 'gpu ARGS...'")
    p.add_argument("--quick", action="store_true", help="a fast smoke run: tiny model, data 1 and 8, short budgets")
    p.add_argument("--out", type=A.output_dir, help=f"results folder (default {DEFAULT_OUT}; with --quick {QUICK_OUT})")
    p.add_argument("--sizes", type=A.name_list(sizes, "model size"), help="model sizes for scaling, e.g. tiny,small,medium")
    p.add_argument("--data-sizes", type=A.int_list(minimum=1), help="data-axis sizes for scaling, e.g. 1,2,4,8")
    p.add_argument("--ref-size", choices=sizes, metavar="SIZE", help="model size of the traffic/memory/speed sections "
                   "(default small; quick: tiny), measured at the largest of --data-sizes")
    p.add_argument("--repeats", type=A.positive_int, help="timed steps per point (default 3; quick: 2)")
    p.add_argument("--conv-size", choices=sizes, metavar="SIZE", help="model size of the convergence runs (default tiny)")
    p.add_argument("--conv-steps", type=A.positive_int, help="convergence budget in steps (default 300; quick: 40)")
    p.add_argument("--quant-size", type=A.positive_int, help="square side for quantize throughput (default 4096; quick: 1024)")
    p.add_argument("--host-devices", type=A.int_at_least(1, maximum=MAX_SIMULATED_DEVICES,
                                                            why_max="the most simulated CPU devices that run a step"),
                   default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--against", metavar="REV", type=A.git_revision,
                   help="speed: also time the same NVFP4 step at git commit REV, back to back with this "
                        "tree (benchmarks.against), e.g. the commit before the FSDP step")
    args = p.parse_args(argv)
    for s in args.sections:
        if s not in ("all", *SECTIONS):
            p.error(f"{A.show(s)}: {A.unknown_name(s, ['all', *SECTIONS], 'section')}; or one of scale, gpu, "
                    "serving, convergence --text, each with its own arguments")
    q = args.quick
    args.out = args.out or (QUICK_OUT if q else DEFAULT_OUT)
    args.sizes = args.sizes or (["tiny"] if q else ["tiny", "small", "medium"])
    args.data_sizes = args.data_sizes or ([1, 8] if q else [1, 2, 4, 8])
    args.ref_size = args.ref_size or ("tiny" if q else "small")
    args.repeats = args.repeats if args.repeats is not None else (2 if q else 3)
    args.conv_size = args.conv_size or "tiny"
    args.conv_steps = args.conv_steps or (40 if q else 300)
    args.quant_size = args.quant_size or (1024 if q else 4096)
    sections = list(dict.fromkeys(SECTIONS if "all" in args.sections else args.sections))
    args.sections = sections
    if args.against and "speed" not in sections:
        p.error(f"--against {A.show(args.against)}: times the speed section, which this run does not include")
    # Every model a section measures must split its batch over each data-axis size asked for.
    models = {*(args.sizes if "scaling" in sections else ()),
              *([args.ref_size] if {"traffic", "memory", "speed"} & set(sections) else ()),
              *([args.conv_size] if "convergence" in sections else ())}
    for size in sorted(models):
        batch = ts.size_config(size, "nvfp4").data.batch_size
        for n in args.data_sizes:
            if batch % n:
                p.error(f"--data-sizes {','.join(map(str, args.data_sizes))}: the {size} model's batch of {batch} "
                        f"rows does not split over a data axis of {n}")
    return args


def run_scale(argv: Sequence[str]) -> int:
    """``python -m benchmarks scale ...`` -> ``benchmarks.scale:main(argv)``."""
    result = importlib.import_module("benchmarks.scale").main(list(argv))
    return result if isinstance(result, int) else 0


def _meta(argv: Sequence[str], devices, wall_s: float) -> Dict[str, Any]:
    """The run's record in each section's JSON: ``command`` is the invocation that wrote it (all
    its sections, as given), not one section's name."""
    import jax

    source = source_state()
    return {
        "command": " ".join(["python -m benchmarks", *map(shlex.quote, argv)]),
        "platform": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "n_devices": len(devices),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        # The library and training code measured: its commit, whether it differed from it, and a
        # hash of the files themselves.
        "git_commit": source["git_commit"],
        "dirty": source["dirty"],
        "source_sha256": source["sha256"],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": round(wall_s, 1),
        # Timings on a shared host move with its load; the 1-minute load average says how busy.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _write(out_dir: str, name: str, obj: Dict[str, Any]) -> None:
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "scale":
        return run_scale(argv[1:])
    if argv and argv[0] == "gpu":
        from benchmarks import gpu_check

        return gpu_check.main(argv[1:])
    if argv and argv[0] == "serving":
        from benchmarks import serving

        return serving.main(argv[1:])
    if argv and argv[0] == "convergence" and "--text" in argv:
        from benchmarks import convergence_text

        return convergence_text.main([a for a in argv[1:] if a != "--text"])
    args = parse_args(argv)
    t_start = time.perf_counter()
    A.make_output_dir(args.out)
    devices = request_cpu_devices(args.host_devices)

    from benchmarks import report
    from benchmarks import train_step as ts

    data_sizes = ts.data_sizes_for(devices, args.data_sizes)
    dropped = sorted(set(args.data_sizes) - set(data_sizes))
    if not data_sizes:
        print(f"error: --data-sizes {','.join(map(str, args.data_sizes))}: each is more than the {len(devices)} "
              "devices; nothing would be measured", file=sys.stderr)
        return 2
    print(f"benchmarks: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); "
          f"sections {', '.join(args.sections)}; results in {args.out}"
          + (f"; data sizes {dropped} skipped (more than the {len(devices)} devices)" if dropped else ""),
          flush=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

    points: Dict[tuple, Dict[str, Any]] = {}
    if "scaling" in args.sections:
        t0 = time.perf_counter()
        log(f"scaling: sizes {args.sizes} x data {data_sizes}")
        for size in args.sizes:
            for n in data_sizes:
                points[(size, n)] = ts.measure_pair(size, n, devices, time_steps=args.repeats, log=log)
        _write(args.out, "scaling", {"meta": _meta(argv, devices, time.perf_counter() - t0),
                                     "points": list(points.values())})

    ref_data = max(data_sizes) if data_sizes else 1  # the largest requested data-axis size
    point_sections = [s for s in ("traffic", "memory", "speed") if s in args.sections]
    if point_sections:
        t0 = time.perf_counter()
        ref = points.get((args.ref_size, ref_data))
        if ref is None:
            log(f"{'/'.join(point_sections)}: {args.ref_size} model, data={ref_data}")
            timed = args.repeats if "speed" in point_sections else 0
            ref = ts.measure_pair(args.ref_size, ref_data, devices, time_steps=timed, log=log)
        extra: Dict[str, Any] = {}
        if args.against and "speed" in point_sections:
            from benchmarks import against

            log(f"speed: this tree against {args.against}, {args.ref_size} model, data={ref_data}")
            shape = against.shape_overrides(ts.size_config(args.ref_size, "nvfp4"))
            block = ts.size_config(args.ref_size, "nvfp4").nvfp4.resolved_block()
            extra["against"] = against.compare(args.against, shape, block=block, devices=ref_data, log=log)
        wall = time.perf_counter() - t0
        for s in point_sections:
            _write(args.out, s, {"meta": _meta(argv, devices, wall), "point": ref,
                                 **(extra if s == "speed" else {})})

    if "quantize" in args.sections:
        from benchmarks import quantize

        t0 = time.perf_counter()
        log(f"quantize: {args.quant_size}x{args.quant_size} float32")
        q = quantize.run(args.quant_size, repeats=5 if args.quick else 10)
        _write(args.out, "quantize", {"meta": _meta(argv, devices, time.perf_counter() - t0), "result": q})
        log(f"  quantize 16x16 {q['quantize_16x16_GBps']:.1f} GB/s = {q['quantize_16x16_vs_same_bytes']:.3f} of a "
            f"same-bytes pass; dequantize {q['dequantize_bf16_GBps']:.1f} GB/s = "
            f"{q['dequantize_bf16_vs_same_bytes']:.3f}")

    if "convergence" in args.sections:
        from benchmarks import convergence

        t0 = time.perf_counter()
        conv_devices = devices[:ref_data]
        log(f"convergence: {args.conv_size} model, {args.conv_steps} steps, data={len(conv_devices)}")
        c = convergence.run(args.conv_size, args.conv_steps, conv_devices, args.out, log=log)
        _write(args.out, "convergence", {"meta": _meta(argv, devices, time.perf_counter() - t0), **c})

    summary = report.write(args.out)
    total = time.perf_counter() - t_start
    print()
    print(report.headline(report.load(args.out), report.report_path(args.out)))
    for m in summary["misses"]:
        print(f"OUTSIDE TARGET: {m}")
    if not summary["misses"]:
        print("all checked figures within target")
    print(f"wrote {args.out}/REPORT.md, HEADLINE.md and {', '.join(s + '.json' for s in summary['sections'])}; "
          f"total {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
