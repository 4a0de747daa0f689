"""Step time of this tree against an earlier commit, measured back to back in one run.

``python -m benchmarks speed --against REV`` checks ``REV`` out into a temporary git worktree
and times the same train step (same model, same mesh, NVFP4 weights) in both trees, each in
a fresh process that imports only its own tree. The rounds alternate (REV, this tree, REV,
this tree, ...) so a change in the host's load falls on both sides; each side's figure is the
median of all its timed steps: what a change costs or saves in step time, with the host's load
falling on both sides.

Both trees must have ``train.config.load_config``, ``train.mesh.build_mesh`` and
``train.loop.build`` or ``train.programs.build`` (every commit since the training stack landed has one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 1.15  # this tree's step time / REV's: the FSDP step may cost at most 15% on CPU

# Runs in a fresh interpreter with only one tree on sys.path. Prints one JSON line.
_SCRIPT = r"""
import json, sys, time
# Only this tree: an editable install's finder would fill in modules this tree lacks from the
# installed one (e.g. a module that a later commit added).
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import numpy as np
import jax
from train.config import load_config
from train import mesh as mesh_lib
try:
    from train.programs import build  # this tree
except ImportError:
    from train.loop import build  # older trees
import train
assert train.__file__.startswith(sys.argv[3]), (train.__file__, sys.argv[3])

overrides, steps = json.loads(sys.argv[1]), int(sys.argv[2])
cfg = load_config(None, overrides)
mesh = mesh_lib.build_mesh(cfg.mesh, jax.devices())
trainer, params, opt_state = build(cfg, mesh)
rows = np.random.default_rng(0).integers(0, cfg.data.markov_states, (cfg.data.batch_size, cfg.model.seq_len + 1))
batch = jax.device_put(rows.astype(np.int32), trainer.batch_sharding)
# The step is step(params, opt_state, batch, key); trees before the fault module took a fifth
# argument, a float32 loss scale (1.0 in training).
t0 = time.perf_counter()
try:
    extra = ()
    compiled = trainer.step_fn.lower(params, opt_state, batch, jax.random.key(0)).compile()
except (TypeError, ValueError):
    extra = (np.float32(1),)
    compiled = trainer.step_fn.lower(params, opt_state, batch, jax.random.key(0), *extra).compile()
compile_s = time.perf_counter() - t0
times = []
for i in range(steps + 1):  # the first call after compilation is not timed
    t = time.perf_counter()
    params, opt_state, m = compiled(params, opt_state, batch, jax.random.key(i), *extra)
    jax.block_until_ready(m["loss"])
    if i:
        times.append(time.perf_counter() - t)
print(json.dumps({"times": times, "compile_s": compile_s, "loss": float(m["loss"])}))
"""


def _git(*args: str, cwd: str = ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


def _time_tree(tree: str, overrides: Sequence[str], steps: int, devices: int) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(list(overrides)), str(steps), tree],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"timing the step in {tree} failed:\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def has_block_key(rev: str) -> bool:
    """Whether ``rev``'s training config has ``nvfp4.block`` (the NVFP4 block format setting)."""
    try:
        text = _git("show", f"{rev}:train/config.py")
    except RuntimeError:
        return False
    return re.search(r"^\s+block\s*:", text, re.M) is not None


def block_overrides(rev: str, block: str) -> Dict[str, Any]:
    """The block format both sides store, pinned: ``block`` ("1d"/"2d", this tree's) on both
    sides where ``rev`` knows ``nvfp4.block``; else ``rev``'s library has only 16x16-tile blocks,
    so this tree runs ``nvfp4.block=2d``."""
    if has_block_key(rev):
        return {"rev": [f"nvfp4.block={block}"], "here": [f"nvfp4.block={block}"], "block": block,
                "why": f"nvfp4.block={block} on both sides"}
    return {"rev": [], "here": ["nvfp4.block=2d"], "block": "2d",
            "why": "that commit has no nvfp4.block and only 16x16-tile blocks, so this tree runs nvfp4.block=2d"}


def compare(rev: str, overrides: Sequence[str], *, block: str = "1d", devices: int = 8, steps: int = 5,
            rounds: int = 2, log=print) -> Dict[str, Any]:
    """Median step time of ``REV`` and of this tree on the same config ``overrides`` (keys both
    trees know) and the same NVFP4 block format (:func:`block_overrides`), ``rounds``
    alternating rounds of ``steps`` timed steps each."""
    full = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    subject = _git("log", "-1", "--format=%s", full)
    pinned = block_overrides(full, block)
    tmp = tempfile.mkdtemp(prefix="against-")
    tree = os.path.join(tmp, "tree")
    _git("worktree", "add", "--detach", tree, full)
    times: Dict[str, List[float]] = {"rev": [], "here": []}
    compile_s: Dict[str, List[float]] = {"rev": [], "here": []}
    try:
        for r in range(rounds):
            for side, path in (("rev", tree), ("here", ROOT)):
                res = _time_tree(path, [*overrides, *pinned[side]], steps, devices)
                times[side] += res["times"]
                compile_s[side].append(res["compile_s"])
                log(f"  round {r + 1}/{rounds} {'REV ' + full[:10] if side == 'rev' else 'this tree'}: "
                    f"median {statistics.median(res['times']) * 1e3:.1f} ms over {steps} steps "
                    f"(compile {res['compile_s']:.1f} s)")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rev_s, here_s = statistics.median(times["rev"]), statistics.median(times["here"])
    return {
        "rev": full, "rev_subject": subject, "overrides": list(overrides), "devices": devices,
        "overrides_rev": pinned["rev"], "overrides_here": pinned["here"], "block_here": pinned["block"],
        "block_why": pinned["why"],
        "steps_per_round": steps, "rounds": rounds,
        "step_time_s_rev": rev_s, "step_time_s_here": here_s, "ratio": here_s / rev_s,
        "step_times_s_rev": times["rev"], "step_times_s_here": times["here"],
        "compile_s_rev": compile_s["rev"], "compile_s_here": compile_s["here"], "target": TARGET,
    }


def shape_overrides(cfg) -> List[str]:
    """``cfg``'s model and batch as overrides an older tree also reads, NVFP4 weights on every
    device of a data-parallel mesh (the keys of the step time's shape, nothing newer)."""
    m, d = cfg.model, cfg.data
    return [f"model.vocab={m.vocab}", f"model.d_model={m.d_model}", f"model.layers={m.layers}",
            f"model.heads={m.heads}", f"model.mlp_hidden={m.mlp_hidden}", f"model.seq_len={m.seq_len}",
            f"data.batch_size={d.batch_size}", f"data.markov_states={d.markov_states}",
            "mesh.data=-1", "mesh.tensor=1", "nvfp4.weights=nvfp4"]
