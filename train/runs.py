"""Compare the per-step training losses of two runs, bit for bit.

  python -m train.runs --against DIR -- [python -m train arguments]

compares the ``metrics.jsonl`` of the run those arguments describe with ``DIR/metrics.jsonl``
(``scripts/launch_local.sh N --check-against DIR`` runs it). Exit 0 when every step's loss has the
same bits, 1 otherwise (the first step that differs is printed), 2 when a file is missing. No JAX.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from typing import List, Optional, Tuple


def read_losses(path: str) -> List[Tuple[int, Optional[float]]]:
    """``[(step, loss)]`` from a ``metrics.jsonl`` (a non-finite loss is stored as null: None)."""
    with open(path) as f:
        return [(int(r["step"]), r.get("loss")) for r in (json.loads(line) for line in f if line.strip())]


def compare_losses(this: str, other: str) -> Tuple[bool, str]:
    """``(same, message)``: the same steps and the same bits for every loss; the message names the
    first step that differs."""
    a, b = read_losses(this), read_losses(other)
    if [s for s, _ in a] != [s for s, _ in b]:
        span = lambda r: f"{len(r)} steps ({r[0][0]}..{r[-1][0]})" if r else "no steps"
        return False, f"losses not comparable: this run has {span(a)}, {other} has {span(b)}"
    bits = lambda x: None if x is None else struct.pack("<d", float(x))
    for (step, x), (_, y) in zip(a, b):
        if bits(x) != bits(y):
            diff = f" (difference {x - y:+.3e})" if x is not None and y is not None and math.isfinite(x - y) else ""
            return False, f"losses differ first at step {step}: {x!r} here, {y!r} in {other}{diff}"
    return True, f"losses match bit for bit ({len(a)} steps)"


def metrics_path(train_args) -> str:
    """Where ``python -m train train_args`` writes its metrics.jsonl (no JAX, nothing run)."""
    from train.__main__ import parse_args
    from train.config import load_section

    args = parse_args(list(train_args))
    return os.path.join(args.out or load_section(args.config, args.overrides, "train").out_dir, "metrics.jsonl")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.runs", description=__doc__.strip().splitlines()[0])
    p.add_argument("--against", required=True, metavar="DIR", help="a run's output folder (holds metrics.jsonl)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the python -m train arguments of this run")
    args = p.parse_args(argv)
    from train.config import ConfigError
    try:
        this = metrics_path(args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args)
    except ConfigError as e:
        print(f"check: config error: {e}", file=sys.stderr)
        return 2
    other = os.path.join(args.against, "metrics.jsonl")
    for path in (this, other):
        if not os.path.isfile(path):
            print(f"check: {path}: no such file", file=sys.stderr)
            return 2
    same, message = compare_losses(this, other)
    print(f"check against {args.against}: {message}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
