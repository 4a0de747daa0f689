"""Bytes moved by collectives, read from compiled HLO text."""

from __future__ import annotations

import collections
import math
import re
from typing import Dict, Tuple

_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
}
# "%name = <type> <op>(" where <type> is an array type or a tuple of them.
_LINE = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?)\s+(" + "|".join(_OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def _arrays(type_text: str):
    for dtype, dims in _ARRAY.findall(type_text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        yield dtype, shape


def collective_bytes(hlo_text: str) -> Dict[Tuple[str, str], int]:
    """Bytes per ``(collective op, dtype)`` in compiled HLO text, **per device**.

    Each collective counts the size of its result on one device: an all-gather its gathered
    array, a reduce-scatter its shard, an all-reduce the whole reduced array. Asynchronous
    ``*-start`` ops count their output buffer once (the ``*-done`` halves are not counted).
    Pass ``jax.jit(f).lower(...).compile().as_text()``.
    """
    out: Dict[Tuple[str, str], float] = collections.defaultdict(float)
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        type_text, op, start = m.group(1), m.group(2), m.group(3)
        arrays = list(_arrays(type_text))
        if start and type_text.startswith("(") and len(arrays) >= 2:
            # (operands..., outputs...): the second half is the result.
            arrays = arrays[len(arrays) // 2:]
        for dtype, shape in arrays:
            if dtype not in _BYTES:
                continue
            out[(op, dtype)] += _BYTES[dtype] * math.prod(shape)
    return {k: int(v) for k, v in sorted(out.items())}


def total_bytes(counts: Dict[Tuple[str, str], int], op: str = None) -> int:
    """Sum of :func:`collective_bytes` entries, optionally for one op."""
    return sum(v for (o, _), v in counts.items() if op is None or o == op)
