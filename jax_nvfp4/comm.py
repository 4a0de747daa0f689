"""Collective accounting of compiled HLO: the one module that reads XLA's program text.

``parse(compiled.as_text())`` reads a compiled program once into a :class:`Program`: its
computations, how many times each runs per call (the known trip counts of the ``while`` loops
around it: ``scan`` over layers), the Python call stacks XLA keeps for each instruction, and
every collective instruction as a :class:`Collective` row with its bytes, executions, replica
groups, JAX name scope and **purpose** (what the collective is for). Everything that counts
bytes in this project (the training CLI, the benchmarks, the scale report, the GPU check) reads
these rows; nothing else parses HLO.

Bytes are **per device**: each collective counts the size of its result on one device (an
all-gather its gathered array, a reduce-scatter its shard, an all-reduce the whole reduced
array); an asynchronous ``*-start`` op counts its output buffer once and its ``*-done`` half
not at all.

Purpose (:data:`PURPOSES`) is what the library says where it places a collective: a name
scope (``jax.named_scope``; :data:`jax_nvfp4.collectives.SCOPES`), the innermost one in the
instruction's scope path. Renaming a function changes nothing. A collective XLA placed by
itself is ``"other"``, except that, given a mesh, an all-reduce or reduce-scatter over a data
axis is XLA's own gradient sum (a plain ``jit`` of a data-parallel step).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
}
# "%name = <type> <op>(" where <type> is an array type or a (nested) tuple of them.
_LINE = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?)\s+(" + "|".join(_OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALL_KEYS = ("calls=", "to_apply=", "body=", "condition=", "computations=")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")

# What a collective is for. The keys are the values of ``Collective.purpose``.
PURPOSES = {
    "weight gather": "all-gather of stored weights at their point of use",
    "grad reduce": "gradient reduction into the master shards",
    "grad norm": "global gradient norm (clipping)",
    "re-quantize": "re-quantization of the updated masters (shared amax)",
    "optimizer": "inside the optimizer update",
    "loss / metrics": "loss and metric reductions",
    "tensor parallel": "activations across the tensor axis (sequence gathers, row-parallel and vocabulary sums)",
    "other": "placed by XLA, not by the library (e.g. a gradient sum of a plain jit)",
}
@dataclasses.dataclass(frozen=True)
class Collective:
    """One result array of one collective instruction."""

    op: str  # "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", ...
    dtype: str
    shape: Tuple[int, ...]
    bytes: float  # per device, one execution
    times: int  # executions per call of the program (enclosing loop trip counts)
    op_name: str  # the JAX name-scope path from the instruction's metadata
    stack: Tuple[Tuple[str, str], ...]  # (file, function) of its Python call stack, innermost first
    groups: Tuple[Tuple[int, ...], ...]  # replica groups (logical device ids); () = all devices
    computation: str
    instruction: str  # the instruction's name (one instruction may have several result arrays)
    purpose: str
    axes: Tuple[str, ...] = ()  # mesh axes its groups span (when parsed with a mesh)

    @property
    def per_call(self) -> float:
        """Bytes per device per call of the program."""
        return self.bytes * self.times


@dataclasses.dataclass(frozen=True)
class Program:
    """Compiled HLO text, read once."""

    computations: Mapping[str, Sequence[str]]
    entry: str
    multipliers: Mapping[str, int]
    warnings: Tuple[str, ...]
    collectives: Tuple[Collective, ...]

    def select(self, *, op=None, dtype=None, purpose=None) -> List[Collective]:
        """Rows matching each given field (a string or a tuple of accepted values)."""
        ok = lambda want, v: want is None or v == want or (isinstance(want, tuple) and v in want)
        return [c for c in self.collectives if ok(op, c.op) and ok(dtype, c.dtype) and ok(purpose, c.purpose)]

    def total(self, **fields) -> int:
        """Bytes per device per call of the rows :meth:`select` picks."""
        return int(sum(c.per_call for c in self.select(**fields)))

    def by(self, *fields: str) -> Dict[tuple, int]:
        """Bytes per device per call, summed by the given ``Collective`` fields."""
        out: Dict[tuple, float] = collections.defaultdict(float)
        for c in self.collectives:
            out[tuple(getattr(c, f) for f in fields)] += c.per_call
        return {k: int(v) for k, v in sorted(out.items())}

    def by_purpose(self) -> Dict[str, Dict[str, int]]:
        """``{purpose: {"op:dtype": bytes per device per call}}``."""
        out: Dict[str, Dict[str, int]] = {}
        for (purpose, op, dtype), b in self.by("purpose", "op", "dtype").items():
            out.setdefault(purpose, {})[f"{op}:{dtype}"] = b
        return out

    def weight_gathers(self) -> Dict[str, int]:
        """The weight all-gathers of a training step, per device per call.

        ``all_gather_bytes``: every gather of stored weights (forward and rematerialised
        backward, times the scan's trip count); ``nvfp4_gather_bytes``: the packed (u8) share of
        it; ``bf16_gather_bytes``: what the same gathers move with bf16 weights (2 bytes per
        gathered value; an NVFP4 tile's codes ``[..., 16, 8]`` hold two values per byte);
        ``nvfp4_bf16_gather_bytes``: that figure for the NVFP4 leaves alone (the denominator of
        the NVFP4-leaf gather ratio); ``other_gather_bytes``: all-gathers that move no weights
        (ordered loss and norm sums)."""
        weight = self.select(op="all-gather", purpose="weight gather")
        packed = [c for c in weight if c.dtype == "u8"]
        codes = [c for c in packed if tuple(c.shape[-2:]) == (16, 8)]
        nvfp4_bf16 = int(sum(4 * c.per_call for c in codes))
        plain_bf16 = int(sum(c.per_call * 2 / _BYTES[c.dtype] for c in weight if c.dtype != "u8"))
        total = lambda rows: int(sum(c.per_call for c in rows))
        return {
            "all_gather_bytes": total(weight),
            "nvfp4_gather_bytes": total(packed),
            "bf16_gather_bytes": nvfp4_bf16 + plain_bf16,
            "nvfp4_bf16_gather_bytes": nvfp4_bf16,
            "other_gather_bytes": self.total(op="all-gather") - total(weight),
        }


# ----------------------------------------------------------------------------- parsing
def _arrays(type_text: str):
    for dtype, dims in _ARRAY.findall(type_text):
        yield dtype, tuple(int(d) for d in dims.split(",") if d)


def _results(line: str):
    """``(op, dtype, shape)`` of each result array of a collective instruction line."""
    m = _LINE.search(line)
    if not m:
        return
    type_text, op, start = m.group(1), m.group(2), m.group(3)
    arrays = list(_arrays(type_text))
    if start and type_text.startswith("(("):
        # ((operands...), (outputs...)): the second tuple is the result.
        depth, cut = 0, len(type_text)
        for i, ch in enumerate(type_text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 1 and ch == ")":
                cut = i
                break
        arrays = list(_arrays(type_text[cut + 1:]))
    elif start and type_text.startswith("(") and len(arrays) >= 2:
        # (operand, output): the second half is the result.
        arrays = arrays[len(arrays) // 2:]
    for dtype, shape in arrays:
        if dtype in _BYTES:
            yield op, dtype, shape


def computations(hlo: str) -> Tuple[Dict[str, List[str]], str]:
    """``({name: body lines}, entry name)`` of compiled HLO text. Text without an ``ENTRY``
    computation (a few instruction lines) is one computation named ``""``."""
    comps: Dict[str, List[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        # "%name (params) -> type {" in compiled text; "name {" in a lowered program's HLO.
        if line and not line[0].isspace() and line.rstrip().endswith("{") and not line.startswith("HloModule"):
            head = line.split("(", 1)[0].replace("{", " ").split()
            name = head[-1].lstrip("%")
            if head[0] == "ENTRY":
                entry = name
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    if entry is None:
        return {"": [l for l in hlo.splitlines() if l.strip()]}, ""
    return comps, entry


def multipliers(comps: Mapping[str, Sequence[str]], entry: str) -> Tuple[Dict[str, int], List[str]]:
    """How many times each computation runs per call of ``entry``: the product of the known
    trip counts of the ``while`` loops around it, summed over its call sites. A ``while``
    without a known trip count counts once and adds a warning."""
    edges: Dict[str, List[Tuple[str, int]]] = collections.defaultdict(list)
    warnings: List[str] = []
    for comp, lines in comps.items():
        for line in lines:
            if not any(k in line for k in _CALL_KEYS):  # most lines call nothing: skip the regexes
                continue
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
    return dict(mult), sorted(set(warnings))


def stacks(hlo: str) -> Dict[int, List[Tuple[str, str]]]:
    """``{stack_frame_id: [(file, function), ...] innermost first}`` from the module's
    ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables (empty when
    the text has none)."""
    tables: Dict[str, Dict[int, str]] = {t: {} for t in _TABLES}
    current = None
    for line in hlo.splitlines():
        head = line.strip()
        if head in tables:
            current = tables[head]
            continue
        m = re.match(r"(\d+)\s+(.*)$", head) if current is not None else None
        if not m:
            current = None
            continue
        current[int(m.group(1))] = m.group(2)
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locs = {}
    for k, v in tables["FileLocations"].items():
        f, fn = re.search(r"file_name_id=(\d+)", v), re.search(r"function_name_id=(\d+)", v)
        locs[k] = (files.get(int(f.group(1)), "?") if f else "?", funcs.get(int(fn.group(1)), "?") if fn else "?")
    frames = {}
    for k, v in tables["StackFrames"].items():
        loc, par = re.search(r"file_location_id=(\d+)", v), re.search(r"parent_frame_id=(\d+)", v)
        frames[k] = (int(loc.group(1)) if loc else 0, int(par.group(1)) if par else 0)
    # XLA prints parent_frame_id one above the frame it names (a root frame shows its own id,
    # 1): detect that and shift, so the chains follow real callers.
    if any(k == par for k, (_, par) in frames.items()):
        frames = {k: (loc, par - 1) for k, (loc, par) in frames.items()}
    out = {}
    for k in frames:
        chain, seen, f = [], set(), k
        while f in frames and f not in seen:
            seen.add(f)
            loc, par = frames[f]
            if loc in locs:
                chain.append(locs[loc])
            f = par
        out[k] = chain
    return out


def replica_groups(line: str) -> Tuple[Tuple[int, ...], ...]:
    """Replica groups of a collective instruction (logical device ids: positions in the
    compiled program's device assignment, ``mesh.devices.flat``); source-target pairs of a
    collective-permute; ``()`` for "all devices in one group"."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = [(a, int(s)) for a, s in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        names = [a for a, _ in sizes]
        axes = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
        ids = np.arange(math.prod(s for _, s in sizes)).reshape([s for _, s in sizes])
        rest = [i for i in range(len(sizes)) if i not in axes]
        ids = np.transpose(ids, rest + axes).reshape(-1, math.prod(sizes[i][1] for i in axes))
        return tuple(tuple(int(x) for x in g) for g in ids)
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = np.transpose(ids, [int(x) for x in m.group(3).split(",")])
        return tuple(tuple(int(x) for x in g) for g in ids.reshape(shape[0], -1))
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return tuple(g for g in groups if g)
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)))
    return ()


def purpose(op_name: str) -> str:
    """What a collective is for (a key of :data:`PURPOSES`): the innermost of the library's
    name scopes (:data:`jax_nvfp4.collectives.SCOPES`) in its JAX scope path ``op_name``;
    ``"other"`` for a collective no library code placed (XLA's own)."""
    from jax_nvfp4.collectives import SCOPES

    found = [(m.start(), scope) for scope in SCOPES for m in re.finditer(rf"(?:^|[/(]){scope}(?=$|[/)])", op_name)]
    return SCOPES[max(found)[1]] if found else "other"


def _mesh_axes(groups, mesh) -> Tuple[str, ...]:
    """Mesh axes along which the devices of ``groups`` differ."""
    shape = tuple(mesh.devices.shape)
    if not groups:
        return tuple(a for a, s in zip(mesh.axis_names, shape) if s > 1)
    axes = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g), shape))
        axes |= {a for i, a in enumerate(mesh.axis_names) if len(set(coords[i].tolist())) > 1}
    return tuple(a for a in mesh.axis_names if a in axes)


def parse(hlo_text: str, mesh=None, data_axes: Sequence[str] = ("data",)) -> Program:
    """Read compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``) once.

    With ``mesh`` (the program's mesh), each collective also gets the mesh axes its groups
    span, and an all-reduce or reduce-scatter over a ``data_axes`` axis that no library scope
    names (XLA's own gradient sum) is a gradient reduction."""
    comps, entry = computations(hlo_text)
    mult, warnings = multipliers(comps, entry) if entry else ({"": 1}, [])
    frames = stacks(hlo_text)
    rows: List[Collective] = []
    for comp, lines in comps.items():
        times = mult.get(comp, 0)
        if not times:
            continue
        for line in lines:
            results = list(_results(line))
            if not results:
                continue
            inst = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
            name = _OP_NAME.search(line)
            op_name = name.group(1) if name else ""
            fid = _FRAME.search(line)
            stack = tuple(frames.get(int(fid.group(1)), ())) if fid else ()
            groups = replica_groups(line)
            label = purpose(op_name)
            axes = _mesh_axes(groups, mesh) if mesh is not None else ()
            if (label == "other" and results[0][0] in ("all-reduce", "reduce-scatter")
                    and set(axes) & set(data_axes)):
                label = "grad reduce"
            for op, dtype, shape in results:
                rows.append(Collective(op=op, dtype=dtype, shape=shape, bytes=_BYTES[dtype] * math.prod(shape),
                                       times=times, op_name=op_name, stack=stack, groups=groups,
                                       computation=comp, instruction=inst.group(1) if inst else "", purpose=label, axes=axes))
    return Program(computations=comps, entry=entry, multipliers=mult, warnings=tuple(warnings),
                   collectives=tuple(rows))


_DOT = re.compile(r"=\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s+dot\(([^)]*)\)")
# "%name = dtype[dims]...": an instruction's name, element type and dimensions.
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z0-9]+)\[([0-9,]*)\]")


def _dims(text: str) -> Tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def dot_flops(program: Program) -> Tuple[float, List[str]]:
    """``(flops, warnings)``: floating-point operations of every ``dot`` of a compiled
    program per call, ``2 x prod(result) x prod(contracted dims)`` each, times how often its
    computation runs (known loop trip counts; :attr:`Program.multipliers`). XLA's own
    ``cost_analysis()`` counts a loop body once, whatever its trip count. Both branches of a
    conditional count (e.g. attention blocks skipped above the causal diagonal)."""
    flops, warnings = 0.0, []
    for comp, lines in program.computations.items():
        times = program.multipliers.get(comp, 0)
        if not times:
            continue
        shapes = {}
        for line in lines:
            d = _DEF.match(line)
            if d:
                shapes[d.group(1)] = _dims(d.group(3))
        for line in lines:
            m = _DOT.search(line)
            if not m:
                continue
            operands = [o.strip().split()[-1].lstrip("%") for o in m.group(3).split(",")]
            lhs = shapes.get(operands[0]) if operands else None
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
            if lhs is None or contracting is None:
                warnings.append(f"{comp}: a dot whose operand shape is unknown is not counted")
                continue
            k = math.prod(lhs[i] for i in _dims(contracting.group(1)))
            flops += 2.0 * math.prod(_dims(m.group(2))) * k * times
    return flops, sorted(set(warnings))


# ----------------------------------------------------------------------------- native GEMMs
# Custom-call targets of block-scaled GEMMs -> the ``jax_nvfp4.gemm`` backend that emits them.
GEMM_TARGETS = {"__op$block_scaled_dot": "scaled_matmul", "te_gemm_ffi": "te"}
# Outside shard_map, jax.nn.scaled_matmul lowers to a custom_partitioning call that XLA expands
# into __op$block_scaled_dot once it knows the shardings (at compile time): recognised by its
# operands, the only float4 x float8 call in this library's programs.
PARTITIONED = "CustomSPMDPartitioning"
BLOCK_SCALED_OPERANDS = ("f4e2m1fn", "f4e2m1fn", "f8e4m3fn", "f8e4m3fn")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class NativeGemm:
    """One native block-scaled GEMM of a program: its custom-call ``target``, the ``backend``
    of :mod:`jax_nvfp4.gemm` that emits it, its operands' element types (``"f4e2m1fn"``,
    ``"f8e4m3fn"``, ...) and how many times it runs per call (known loop trip counts)."""

    backend: str
    target: str
    operands: Tuple[str, ...]
    times: int
    computation: str


def _braced(line: str, key: str) -> str:
    """The text inside the braces that follow ``key`` in ``line`` (nested braces kept); ''."""
    start = line.find(key)
    if start < 0:
        return ""
    depth, i = 0, start + len(key)
    for j in range(i, len(line)):
        depth += line[j] == "{"
        depth -= line[j] == "}"
        if depth == 0:
            return line[i + 1:j]
    return line[i + 1:]


def _operand_types(line: str, defs: Mapping[str, str]) -> Tuple[str, ...]:
    """Element types of a custom call's operands: its layout constraints (a lowered program's
    calls have them), else its typed operand list, else each operand's definition."""
    constraints = _braced(line, "operand_layout_constraints=")
    if constraints:
        return tuple(dtype for dtype, _ in _arrays(constraints))
    operands = line.split("custom-call(", 1)[1].split(")", 1)[0]
    typed = tuple(dtype for dtype, _ in _arrays(operands))
    if typed:
        return typed
    return tuple(defs.get(name.strip().lstrip("%"), "?") for name in operands.split(",") if name.strip())


def native_gemms(hlo_text: str) -> List[NativeGemm]:
    """The native GEMMs of HLO text: a lowered program's (``jit(f).trace(*args).lower(
    lowering_platforms=("cuda",)).as_text(dialect="hlo")``, which needs no GPU) or a compiled
    one's. An empty list: every GEMM of the program is an ordinary dot (the emulation)."""
    comps, entry = computations(hlo_text)
    mult, _ = multipliers(comps, entry) if entry else ({"": 1}, [])
    rows = []
    for comp, lines in comps.items():
        defs = None
        for line in lines:
            target = _TARGET.search(line)
            if not target or not mult.get(comp) or target.group(1) not in (*GEMM_TARGETS, PARTITIONED):
                continue
            if defs is None:
                defs = {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}
            operands = _operand_types(line, defs)
            if target.group(1) == PARTITIONED and operands != BLOCK_SCALED_OPERANDS:
                continue
            backend = GEMM_TARGETS.get(target.group(1), "scaled_matmul")
            rows.append(NativeGemm(backend, target.group(1), operands, mult[comp], comp))
    return rows


def custom_calls(hlo_text: str) -> Dict[str, int]:
    """``{custom-call target: calls per call of the program}`` of HLO text (loop trip counts
    applied), e.g. cuDNN's fused attention (``__cudnn$fmha...``) in a compiled GPU program."""
    comps, entry = computations(hlo_text)
    mult, _ = multipliers(comps, entry) if entry else ({"": 1}, [])
    out: Dict[str, int] = collections.defaultdict(int)
    for comp, lines in comps.items():
        for line in lines:
            target = _TARGET.search(line)
            if target and mult.get(comp):
                out[target.group(1)] += mult[comp]
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- shortcuts
def collective_bytes(hlo_text: str) -> Dict[Tuple[str, str], int]:
    """Bytes per ``(collective op, dtype)`` moved by one call of compiled HLO, **per device**,
    loop trip counts applied (see :func:`parse`)."""
    return parse(hlo_text).by("op", "dtype")


def total_bytes(counts: Dict[Tuple[str, str], int], op: str = None) -> int:
    """Sum of :func:`collective_bytes` entries, optionally for one op."""
    return sum(v for (o, _), v in counts.items() if op is None or o == op)
