"""Collective bytes per executed step, by purpose: ``jax_nvfp4.collective_bytes`` weighted by
loop trip counts and attributed to the code that asked for them.

``jax_nvfp4.collective_bytes`` counts every collective instruction of compiled HLO once. XLA can
move part of the gradient reduction into the scanned backward pass (a ``while`` loop over
layers), where one instruction runs once per layer; counting it once would under-report the
bytes of a step. Here each computation's collectives are counted with the product of the known
trip counts of the ``while`` loops that call it (1 for the entry computation).

Purpose: compiled HLO keeps, for each instruction, the Python call stack of the JAX operation it
came from (``metadata={... stack_frame_id=N}`` and the module's ``StackFrames`` table). A
collective in the ``weight_gather`` name scope (or whose stack passes through ``jax_nvfp4``'s
``gather``) is a parameter gather; through ``requantize``, the re-quantization; in the
``ordered_reduce`` scope, the gradient (and loss) reduction; through the global norm of gradient
clipping, that norm. See :data:`PURPOSES`.
"""

from __future__ import annotations

import collections
import re
from typing import Dict, List, Tuple

import jax_nvfp4 as nv

from jax_nvfp4.comm import computations, multipliers, stack_functions  # noqa: E402,F401


# (purpose, function names whose presence in the call stack decides it), checked in order.
PURPOSES = (
    ("requantize", ("requantize",)),
    ("grad_norm", ("global_norm", "clip_by_global_norm")),
    ("grad_reduce", ("ordered_mean", "ordered_reduce_scatter")),
    ("param_gather", ("gather", "gather_dequantized", "_gather_forward")),
)
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|collective-broadcast)(-start)?\(")


def purpose(op: str, names: List[str], op_name: str = "") -> str:
    """What a collective is for, from its op, its call stack and its JAX op name (the
    library's name scopes decide first: the per-layer gathers and gradient reductions run in
    custom-VJP code whose Python frames XLA does not keep)."""
    if nv.collectives.GATHER_SCOPE in op_name:
        return "param_gather"
    base = {n.split(".<locals>.")[0] for n in names} | set(names)
    if nv.collectives.REDUCE_SCOPE in op_name and not base & {"global_norm", "clip_by_global_norm"}:
        return "grad_reduce"
    for label, funcs in PURPOSES:
        if base & set(funcs):
            return label
    if op in ("all-reduce", "reduce-scatter") and "transpose(" in op_name:
        return "grad_reduce"  # XLA's own gradient sum in the backward pass
    return "other"


def collective_bytes_by_purpose(hlo: str) -> Dict[str, Dict[str, int]]:
    """``{purpose: {"op:dtype": bytes per device per step}}``, loop trip counts applied."""
    mult, _, comps = multipliers(hlo)
    stacks = stack_functions(hlo)
    out: Dict[str, Dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for comp, lines in comps.items():
        m = mult.get(comp, 0)
        if not m:
            continue
        for line in lines:
            c = _COLLECTIVE.search(line)
            if not c:
                continue
            counts = nv.collective_bytes(line)
            if not counts:
                continue
            fid = _FRAME_ID.search(line)
            opn = _OP_NAME.search(line)
            label = purpose(c.group(1), stacks.get(int(fid.group(1)), []) if fid else [],
                            opn.group(1) if opn else "")
            for (op, dtype), b in counts.items():
                out[label][f"{op}:{dtype}"] += b * m
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def collective_bytes_per_step(hlo: str) -> Tuple[Dict[str, int], List[str]]:
    """``({"op:dtype": bytes per device per step}, warnings)``, loop trip counts applied."""
    _, warnings, _ = multipliers(hlo)
    return {f"{op}:{dt}": b for (op, dt), b in nv.collective_bytes(hlo).items()}, warnings


def op_total(counts: Dict[str, int], *ops: str) -> int:
    """Sum of ``counts`` entries whose op is one of ``ops`` (all ops when none given)."""
    return sum(v for k, v in counts.items() if not ops or k.split(":", 1)[0] in ops)
