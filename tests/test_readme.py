"""The README's "What a user writes" section runs as written, on Explicit and Auto meshes, and
its step moves what the README says: packed bytes for the weights and no float collective."""

import os
import re

import jax
import pytest

import jax_nvfp4 as nv
from conftest import ROOT

MESH_LINE = 'mesh = jax.make_mesh((4,), ("data",))'
LOOP = "for i in range(20):"


def readme_section(title: str) -> str:
    """The python code blocks of the README section ``## title``, joined in order."""
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else None]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2, "expected a set-up block and the library's block"
    return "\n".join(blocks)


def run_section(axis_type: str, n: int = 4, train: bool = True) -> dict:
    """Run the section with its mesh line changed to ``n`` devices with ``axis_type`` axes
    (the line as written when ``explicit`` on 4); without ``train``, up to the training loop.
    Returns the section's namespace."""
    code = readme_section("What a user writes")
    assert MESH_LINE in code and LOOP in code
    if (axis_type, n) != ("explicit", 4):
        types = f"jax.sharding.AxisType.{axis_type.capitalize()}"
        code = code.replace(MESH_LINE, f'mesh = jax.make_mesh(({n},), ("data",), axis_types=({types},), '
                                       f"devices=jax.devices()[:{n}])")
    if not train:
        code = code[:code.index(LOOP)]
    ns = {}
    with jax.set_mesh(None):  # the snippet sets a global mesh; put back the previous one after
        exec(compile(code, "README.md", "exec"), ns)
    return ns


def assert_moves_packed_bytes_only(ns: dict) -> None:
    """The compiled step's collectives: all-gathers of u8 (the packed codes and scale bytes of
    every NVFP4 weight, once each) and scalar all-reduces of the shared amax (u32 bits) and the
    finiteness flag (pred). No float all-gather, all-reduce or collective-permute: of weights,
    gradients or masters."""
    with jax.set_mesh(ns["mesh"]):
        text = ns["step"].lower(ns["params"], ns["opt_state"], ns["batch"]).compile().as_text()
    program = nv.comm.parse(text)
    moved = program.by("op", "dtype")
    assert set(moved) <= {("all-gather", "u8"), ("all-reduce", "u32"), ("all-reduce", "pred")}, moved
    packed = sum(p.data.size + p.scale_bits.size for p in jax.tree.leaves(ns["params"], is_leaf=nv.is_tiled)
                 if isinstance(p, nv.TiledNVFP4))
    assert moved[("all-gather", "u8")] == packed
    assert all(c.bytes <= 8 for c in program.select(op="all-reduce")), moved


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_what_a_user_writes_runs_verbatim(axis_type, capsys):
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 simulated CPU devices)")
    ns = run_section(axis_type)
    mesh = ns["mesh"]
    want = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
    assert tuple(mesh.axis_types) == (want,)
    # The weights really are NVFP4 and sharded over the 4 devices, and training moved the loss.
    stored = ns["params"]
    assert all(isinstance(stored[k], nv.TiledNVFP4) for k in ("up", "down"))
    assert stored["up"].data.sharding.mesh.shape["data"] == 4
    printed = capsys.readouterr().out
    final = float(re.search(r"loss after 20 steps: ([0-9.]+)", printed).group(1))
    assert final < 0.9 * float(ns["loss_fn"](ns["fp32_params"], ns["batch"]))  # 1.44 -> 1.12 when written
    assert_moves_packed_bytes_only(ns)


@pytest.mark.parametrize("n", [3, 6])
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_what_a_user_writes_moves_packed_bytes_only(axis_type, n):
    """Data-axis sizes that pad the tile lists (32 tiles per weight: 33 on 3 devices, 36 on 6).
    On Auto axes the step used to all-gather float32 gradient tiles the size of the weights and
    collective-permute the padding's tiles."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices (conftest asks for 8 simulated CPU devices)")
    assert_moves_packed_bytes_only(run_section(axis_type, n, train=False))
