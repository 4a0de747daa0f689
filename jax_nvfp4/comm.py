"""Bytes moved by collectives, read from compiled HLO text."""

from __future__ import annotations

import collections
import math
import re
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

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


def _results(line: str):
    """``(op, dtype, shape)`` of each result array of a collective instruction line."""
    m = _LINE.search(line)
    if not m:
        return
    type_text, op, start = m.group(1), m.group(2), m.group(3)
    arrays = list(_arrays(type_text))
    if start and type_text.startswith("(") and len(arrays) >= 2:
        # (operands..., outputs...): the second half is the result.
        arrays = arrays[len(arrays) // 2:]
    for dtype, shape in arrays:
        if dtype in _BYTES:
            yield op, dtype, shape


def _line_bytes(lines: Iterable[str]) -> Dict[Tuple[str, str], float]:
    out: Dict[Tuple[str, str], float] = collections.defaultdict(float)
    for line in lines:
        for op, dtype, shape in _results(line):
            out[(op, dtype)] += _BYTES[dtype] * math.prod(shape)
    return out


def collective_bytes(hlo_text: str) -> Dict[Tuple[str, str], int]:
    """Bytes per ``(collective op, dtype)`` moved by one execution of compiled HLO, **per
    device**.

    Each collective counts the size of its result on one device: an all-gather its gathered
    array, a reduce-scatter its shard, an all-reduce the whole reduced array. Asynchronous
    ``*-start`` ops count their output buffer once (the ``*-done`` halves are not counted).
    A collective inside a ``while`` loop with a known trip count (``scan`` over layers) counts
    once per iteration. Pass ``jax.jit(f).lower(...).compile().as_text()``; text without
    computations (a few instruction lines) counts each line once.
    """
    if "ENTRY" not in hlo_text:
        out = _line_bytes(hlo_text.splitlines())
    else:
        mult, _, comps = multipliers(hlo_text)
        out = collections.defaultdict(float)
        for comp, lines in comps.items():
            for k, v in _line_bytes(lines).items():
                out[k] += v * mult.get(comp, 0)
    return {k: int(v) for k, v in sorted(out.items())}


def collectives(hlo_text: str) -> List[Dict[str, object]]:
    """Every collective instruction of compiled HLO: ``{"op", "dtype", "shape", "bytes"
    (per device, one execution), "times" (executions per call: enclosing loop trip counts),
    "op_name" (the JAX name-scope path from the metadata)}``; one row per result array."""
    mult, _, comps = multipliers(hlo_text)
    rows: List[Dict[str, object]] = []
    for comp, lines in comps.items():
        for line in lines:
            name = re.search(r'op_name="([^"]*)"', line)
            for op, dtype, shape in _results(line):
                rows.append({"op": op, "dtype": dtype, "shape": shape, "bytes": _BYTES[dtype] * math.prod(shape),
                             "times": mult.get(comp, 1), "op_name": name.group(1) if name else ""})
    return rows


def total_bytes(counts: Dict[Tuple[str, str], int], op: str = None) -> int:
    """Sum of :func:`collective_bytes` entries, optionally for one op."""
    return sum(v for (o, _), v in counts.items() if op is None or o == op)


# ---------------------------------------------------------------- HLO structure helpers
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def computations(hlo: str) -> Tuple[Dict[str, List[str]], str]:
    """``({name: body lines}, entry name)`` of compiled HLO text."""
    comps: Dict[str, List[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{") and "(" in line:
            head = line.split("(", 1)[0].split()
            name = head[-1].lstrip("%")
            if head[0] == "ENTRY":
                entry = name
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def multipliers(hlo: str) -> Tuple[Dict[str, int], List[str], Dict[str, List[str]]]:
    """How many times each computation runs per call of the entry computation.

    Returns ``(multipliers, warnings, computations)``; a ``while`` without a known trip count
    counts once and adds a warning.
    """
    comps, entry = computations(hlo)
    edges: Dict[str, List[Tuple[str, int]]] = collections.defaultdict(list)
    warnings: List[str] = []
    for comp, lines in comps.items():
        for line in lines:
            callees = set(_CALLEE.findall(line))
            for group in _CALLEE_LIST.findall(line):
                callees.update(c.strip().lstrip("%") for c in group.split(",") if c.strip())
            if not callees:
                continue
            trip = 1
            if re.search(r"\swhile\(", line):
                t = _TRIP.search(line)
                if t:
                    trip = int(t.group(1))
                else:
                    warnings.append(f"{comp}: a while loop without a known trip count counts once")
            body = _BODY.search(line)
            for callee in callees:
                edges[comp].append((callee, trip if body and callee == body.group(1) else 1))
    mult: Dict[str, int] = collections.defaultdict(int)

    def visit(comp: str, m: int, depth: int = 0) -> None:
        if depth > 64:  # the call graph is a DAG; this only guards against malformed text
            return
        mult[comp] += m
        for callee, trip in edges.get(comp, ()):
            if callee in comps:
                visit(callee, m * trip, depth + 1)

    visit(entry, 1)
    return dict(mult), warnings, comps




def stack_functions(hlo: str) -> Dict[int, List[str]]:
    """``{stack_frame_id: [function names, innermost first]}`` from the HLO module's tables."""
    tables: Dict[str, Dict[int, str]] = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {},
                                         "StackFrames": {}}
    current = None
    for line in hlo.splitlines():
        head = line.strip()
        if head in tables:
            current = head
            continue
        if current is None:
            continue
        m = re.match(r"(\d+)\s+(.*)$", head)
        if not m:
            if head.startswith(("%", "ENTRY", "HloModule")) or (head and not head[0].isdigit()):
                current = None
            continue
        tables[current][int(m.group(1))] = m.group(2)
    func_of_loc = {}
    for i, text in tables["FileLocations"].items():
        f = re.search(r"function_name_id=(\d+)", text)
        if f:
            func_of_loc[i] = tables["FunctionNames"].get(int(f.group(1)), "").strip('"')
    frames = {}
    for i, text in tables["StackFrames"].items():
        loc = re.search(r"file_location_id=(\d+)", text)
        parent = re.search(r"parent_frame_id=(\d+)", text)
        frames[i] = (int(loc.group(1)) if loc else 0, int(parent.group(1)) if parent else 0)
    out = {}
    for i in frames:
        names, j, seen = [], i, set()
        while j in frames and j not in seen:
            seen.add(j)
            loc, parent = frames[j]
            names.append(func_of_loc.get(loc, ""))
            j = parent - 1  # parent ids are written one above the frame they name; 0 = none
        out[i] = names
    return out
