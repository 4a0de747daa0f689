"""What the run's compiled step is and moves, read once per plan from its HLO (the CLI's accounting,
the benchmarks, the scale report)."""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv


def abstract_step_args(trainer) -> tuple:
    """``(params, opt_state, batch, key)`` of ``trainer.step_fn`` as sharded ShapeDtypeStructs (to
    compile the run's step ahead of time, allocating nothing)."""
    sds = lambda t, s: jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), t, s)
    cfg = trainer.cfg
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=trainer.batch_sharding)
    return (sds(trainer.abstract_params, trainer.param_shardings), sds(trainer.abstract_state, trainer.state_shardings),
            batch, jax.eval_shape(lambda: jax.random.key(0)))


def compiled_step(trainer) -> Dict[str, Any]:
    """The compiled step (lowered from :func:`abstract_step_args`), cached in ``trainer.derived``:
    ``text`` (its HLO), ``program`` (:func:`jax_nvfp4.comm.parse` of it on the trainer's mesh) and
    ``memory`` (per device ``temp``/``argument``/``output``/``alias`` bytes, None where unknown)."""
    if "step" not in trainer.derived:
        compiled = trainer.step_fn.lower(*abstract_step_args(trainer)).compile()
        text, mem = compiled.as_text(), compiled.memory_analysis()
        trainer.derived["step"] = {
            "text": text, "program": nv.comm.parse(text, trainer.mesh, data_axes=trainer.rules.batch_axes),
            "memory": {k: (getattr(mem, f"{k}_size_in_bytes", None) if mem is not None else None)
                       for k in ("temp", "argument", "output", "alias")}}
    return trainer.derived["step"]


def gather_accounting(trainer) -> Dict[str, Any]:
    """Per device and step, from the compiled step: the weight gathers' bytes
    (``Program.weight_gathers``), every collective's by ``op:dtype``, XLA's temporary bytes, and
    ``step_program`` (the parsed program)."""
    step = compiled_step(trainer)
    program = step["program"]
    collectives = {f"{op}:{dt}": b for (op, dt), b in program.by("op", "dtype").items()}
    return {**program.weight_gathers(), "collectives": collectives, "temp_bytes": step["memory"]["temp"],
            "step_program": program}
