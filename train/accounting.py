"""What the run's compiled step is and moves, read once per plan from its HLO: the abstract
arguments to lower it with, its text, parsed collectives and memory, and the bytes of its
weight gathers (the CLI's accounting, the benchmarks, the scale report)."""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv


def abstract_step_args(trainer) -> tuple:
    """``(params, opt_state, batch, key)`` of ``trainer.step_fn`` as sharded ShapeDtypeStructs:
    enough to lower and compile the run's step ahead of time without allocating anything."""
    sds = lambda t, s: jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), t, s)
    cfg = trainer.cfg
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=trainer.batch_sharding)
    return (sds(trainer.abstract_params, trainer.param_shardings), sds(trainer.abstract_state, trainer.state_shardings),
            batch, jax.eval_shape(lambda: jax.random.key(0)))


def compiled_step(trainer) -> Dict[str, Any]:
    """What the compiled step is, read once per plan and shared by every run of it (the CLI's
    accounting, the benchmarks): ``text`` (its HLO), ``program`` (that text parsed by
    :func:`jax_nvfp4.comm.parse` with the trainer's mesh: each collective's mesh axes) and
    ``memory`` (``compiled.memory_analysis()`` per device: ``temp``, ``argument``, ``output``
    and ``alias`` bytes, None where the backend does not say). The step is lowered from
    :func:`abstract_step_args`: the program the loop runs."""
    if "step" not in trainer.derived:
        compiled = trainer.step_fn.lower(*abstract_step_args(trainer)).compile()
        text = compiled.as_text()
        mem = compiled.memory_analysis()
        trainer.derived["step"] = {
            "text": text,
            "program": nv.comm.parse(text, trainer.mesh, data_axes=trainer.rules.batch_axes),
            "memory": {k: (getattr(mem, f"{k}_size_in_bytes", None) if mem is not None else None)
                       for k in ("temp", "argument", "output", "alias")},
        }
    return trainer.derived["step"]


def gather_accounting(trainer) -> Dict[str, Any]:
    """Bytes per step read from the compiled step's HLO, per device: the weight gathers
    (``jax_nvfp4.comm.Program.weight_gathers``), every collective by ``op:dtype``, and XLA's
    temporary buffer size; ``step_program``: the compiled step read by
    :func:`jax_nvfp4.comm.parse` with the mesh (each collective's mesh axes, groups, scopes)."""
    step = compiled_step(trainer)
    program = step["program"]
    return {
        **program.weight_gathers(),
        "collectives": {f"{op}:{dt}": b for (op, dt), b in program.by("op", "dtype").items()},
        "temp_bytes": step["memory"]["temp"],
        "step_program": program,
    }
