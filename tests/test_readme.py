"""The README's "What a user writes" section runs as written, for its Linen and its NNX model,
and its compiled step does what the README says: u8 weight gathers inside the loop over
layers, one layer's bytes each, no float collective, per-device temporaries that grow with
depth by less than the sharded state."""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from conftest import ROOT

MESH_LINE = 'mesh = jax.make_mesh((4,), ("data",))'
LOOP = "for i in range(20):"
LAYERS = "layers=4"
TOKENS = "(16, 33)"


def readme_blocks(title: str = "What a user writes") -> list:
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end >= 0 else None], re.S)


def snippet(kind: str) -> str:
    """The model's set-up block and the library's block, joined (Linen: the first pair)."""
    blocks = readme_blocks()
    assert len(blocks) == 4, "expected a Linen pair and an NNX pair of code blocks"
    i = {"linen": 0, "nnx": 2}[kind]
    return blocks[i] + "\n" + blocks[i + 1]


def run(kind: str, axis_type: str = "explicit", n: int = 4, layers: int = 4, train: bool = True) -> dict:
    """Run the snippet with its mesh line changed to ``n`` devices with ``axis_type`` axes and
    ``layers`` blocks (as written for explicit, 4, 4); without ``train``, up to the loop."""
    code = snippet(kind)
    assert MESH_LINE in code and LOOP in code and code.count(LAYERS) == 1
    if (axis_type, n) != ("explicit", 4):
        types = f"jax.sharding.AxisType.{axis_type.capitalize()}"
        code = code.replace(MESH_LINE, f'mesh = jax.make_mesh(({n},), ("data",), axis_types=({types},), '
                                       f"devices=jax.devices()[:{n}])")
    code = code.replace(LAYERS, f"layers={layers}")
    if 16 % n:  # the batch's rows split evenly over the data axis
        assert code.count(TOKENS) == 1
        code = code.replace(TOKENS, f"({4 * n}, 33)")
    if not train:
        code = code[:code.index(LOOP)]
    ns = {}
    with jax.set_mesh(None):  # the snippet sets a global mesh; put back the previous one after
        exec(compile(code, "README.md", "exec"), ns)
    return ns


def compiled(ns: dict):
    with jax.set_mesh(ns["mesh"]):
        return ns["step"].lower(ns["params"], ns["opt_state"], ns["tokens"]).compile()


def packed_leaves(ns: dict):
    return [p for p in jax.tree.leaves(ns["params"], is_leaf=nv.layout.is_tiled) if isinstance(p, nv.TiledNVFP4)]


def assert_per_layer_packed_gathers(ns: dict, layers: int) -> None:
    """Only unsigned-integer (bits) and pred collectives; the u8 weight gathers move each NVFP4
    matrix's packed bytes, a stacked block weight one layer at a time inside the loop."""
    program = nv.comm.parse(compiled(ns).as_text())
    moved = program.by("op", "dtype")
    assert all(dtype[0] in "up" for _, dtype in moved), moved  # u8/u16/u32 bits and pred flags only
    gathers = program.select(op="all-gather", dtype="u8", purpose="weight gather")
    per_matrix = lambda q: math.prod(q.data.shape[-4:]) + math.prod(q.scale_bits.shape[q.data.ndim - 4:])
    largest = max(per_matrix(q) for q in packed_leaves(ns))
    assert max(c.bytes for c in gathers) <= largest  # never a whole stack of layers at once
    in_loop = [c for c in gathers if c.times >= layers]
    stacked = [q for q in packed_leaves(ns) if q.data.ndim == 5]
    assert stacked and in_loop
    # Every stacked weight is gathered once per layer forward and once more in the
    # rematerialised backward; the rest (embedding, head) once each way at most.
    assert sum(c.per_call for c in in_loop) == 2 * sum(layers * per_matrix(q) for q in stacked)
    assert moved[("all-gather", "u8")] >= sum(q.data.size + q.scale_bits.size for q in packed_leaves(ns))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_what_a_user_writes_runs_verbatim(kind, capsys):
    ns = run(kind)
    assert tuple(ns["mesh"].axis_types) == (jax.sharding.AxisType.Explicit,)
    stored = ns["params"]
    kernels = [p for p in jax.tree.leaves(stored, is_leaf=nv.layout.is_tiled) if isinstance(p, nv.TiledNVFP4)]
    assert len(kernels) == 4 and all(k.data.sharding.mesh.shape["data"] == 4 for k in kernels)
    final = float(re.search(r"loss after 20 steps: ([0-9.]+)", capsys.readouterr().out).group(1))
    assert final < 0.75 * math.log(256)  # from ln(256) = 5.55 at init (3.3 for Linen when written)
    assert_per_layer_packed_gathers(ns, 4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_per_device_memory_is_flat_in_depth(kind):
    """Twice the layers on 8 devices: the step's temporaries grow by less than the sharded
    state does (they are state-shaped: this device's gradient and update tiles), and by less
    than the added layers' weights in bf16, which a step holding every layer's gathered
    weights would add whatever the device count. Without remat they grow 19x more here (the
    activations)."""
    sizes = {}
    for layers in (4, 8):
        ns = run(kind, "auto", 8, layers, train=False)
        m = compiled(ns).memory_analysis()
        sizes[layers] = (m.temp_size_in_bytes, m.argument_size_in_bytes)
    d_temp, d_state = sizes[8][0] - sizes[4][0], sizes[8][1] - sizes[4][1]
    added_bf16 = 4 * 2 * (64 * 256 * 2)  # 4 more blocks of two 64x256 kernels in bf16
    assert d_temp < d_state, sizes
    assert d_temp < 0.6 * added_bf16, sizes  # 132096 of 262144 bytes when written


@pytest.mark.slow
@pytest.mark.parametrize("axis_type, n", [("explicit", 3), ("auto", 6)])
def test_tile_padding_meshes_move_packed_bytes_only(axis_type, n):
    """Data-axis sizes that pad the tile lists (16 tiles of a 64x256 kernel: 18 on 3 and 6)."""
    assert_per_layer_packed_gathers(run("linen", axis_type, n, train=False), 4)


@pytest.mark.slow
def test_whole_model_gather_equals_the_per_layer_step():
    """The README's one-line whole-model gather feeds the same weights: the per-layer step's
    loss equals a plain jit of the model on nv.dequantize_params(nv.gather(params)), within
    one bf16 rounding of the loss (the model computes it in bf16; the step averages the
    devices' row means in float32)."""
    ns = run("linen", train=False)
    with jax.set_mesh(ns["mesh"]):
        whole = jax.jit(lambda p, t: ns["loss_fn"](nv.dequantize_params(nv.gather(p)), t, None))(
            ns["params"], ns["tokens"])
        _, _, metrics = ns["step"](ns["params"], ns["opt_state"], ns["tokens"])
    np.testing.assert_allclose(float(metrics["loss"]), float(whole), rtol=2.0 ** -8)


def _decimals(text: str) -> set:
    """Every decimal number in ``text`` (``+1.56%``, ``26.750 GB``, ``[-0.08, ...``) as a float."""
    return {float(x) for x in re.findall(r"[+-]?\d+\.\d+", text.replace(",", ""))}


def test_every_result_figure_is_in_the_file_it_links():
    """Each bullet of the README's Results section links results files; every decimal figure it
    quotes (gaps, intervals, ratios, gigabytes) is in one of them, to the README's precision."""
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("## Results\n")
    bullets = text[start:text.find("\n## ", start + 1)].split("\n- ")[1:]
    assert len(bullets) >= 4
    missing = {}
    for bullet in bullets:
        links = re.findall(r"\]\((benchmarks/results/[^)#]+)", bullet)
        assert links, f"a Results bullet links no results file: {bullet[:80]}"
        held = set().union(*(_decimals(open(os.path.join(ROOT, p)).read()) for p in links))
        for figure in re.findall(r"[+-]?\d+\.\d+", bullet):
            places = len(figure.split(".")[1])
            if not any(round(abs(x), places) == abs(float(figure)) for x in held):  # "5.49% lower": -5.49
                missing.setdefault(links[0], []).append(figure)
    assert not missing, missing


RULES_LINE = 'rules = nv.Rules(stacked=("^blocks/",))'


@pytest.mark.parametrize("kind, change", [("linen", "undeclared"), ("nnx", "undeclared"), ("linen", "axis 1")])
def test_a_scan_over_layers_the_rules_do_not_stack_is_named(kind, change):
    """The snippet with its stack of 16 layers left out of the rules (its [16, 64] norm scales are
    then matrices, quantized as such), or scanned on axis 1: tracing the step says what to
    declare, instead of an IndexError from inside Flax or JAX."""
    code = snippet(kind).replace(LAYERS, "layers=16")
    assert code.count(RULES_LINE) == 1
    if change == "undeclared":
        code = code.replace(RULES_LINE, "rules = nv.Rules()")
    else:
        assert code.count('variable_axes={"params": 0}') == 1
        code = code.replace('variable_axes={"params": 0}', 'variable_axes={"params": 1}')
    code = code[:code.index(LOOP)] + "step(params, opt_state, tokens)\n"
    with jax.set_mesh(None), pytest.raises((IndexError, ValueError)) as e:
        exec(compile(code, "README.md", "exec"), {})
    said = "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
    if change == "undeclared":
        assert "nv.Rules(stacked=" in said and "'^blocks/'" in said, said
    else:
        assert "sliced by nn.scan or nn.vmap along its axis 1" in said and "{'params': 0}" in said, said


def test_nested_transforms_stack_the_axes_their_rule_says():
    """Sixteen experts under nn.vmap inside an nn.scan: their biases [L, E, d] are vectors per
    layer and expert with ("/experts/", 2) stacked, and the step trains the model the whole-model
    gather computes; with the scan alone declared they would be [E, d] matrices per layer,
    quantized, and the inner vmap could not slice them (named). Overlapping regexes for one stack
    stack one axis (a bare regex is one), so a scanned kernel stays a matrix per layer."""
    import flax.linen as nn
    import optax

    class Expert(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32)(x)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            experts = nn.vmap(Expert, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                              out_axes=0, axis_size=16)
            return x + experts(name="experts")(x).mean(0), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
            return blocks(name="blocks")(x, None)[0]

    x = jax.random.normal(jax.random.key(1), (8, 32))
    fp32 = Model().init(jax.random.key(0), x)["params"]
    loss = lambda p, rows, key=None: jnp.mean((Model().apply({"params": p}, rows) - 1.0) ** 2)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        for stacked in (("^blocks/",), ("^blocks/", ("/experts/", 2))):
            rules = nv.Rules(stacked=stacked)
            tx = nv.master_weights(optax.adam(1e-3), rules=rules)
            params, state = nv.sharded_state(fp32, tx, mesh, rules, nv.Policy())
            bias = params["blocks"]["experts"]["Dense_0"]["bias"]
            step = jax.jit(nv.make_step(loss, tx, mesh, rules))
            if len(stacked) == 1:
                assert isinstance(bias, nv.TiledNVFP4)
                with pytest.raises(ValueError, match=r"the number of axes nested transforms stack"):
                    step(params, state, x)
                continue
            assert not nv.layout.is_tiled(bias) and bias.shape == (2, 16, 32)
            kernel = params["blocks"]["experts"]["Dense_0"]["kernel"]
            assert isinstance(kernel, nv.TiledNVFP4) and kernel.data.ndim == 6  # [L, E] x the 32x32 tiles
            overlapping = nv.Rules(stacked=("^blocks/", "blocks/experts", ("/experts/", 2)))
            assert [overlapping.stacked_axes(f"blocks/experts/Dense_0/{k}") for k in ("kernel", "bias")] == [2, 2]
            assert nv.Rules(stacked=("^blocks/", "blocks/experts")).stacked_axes("blocks/experts/Dense_0/kernel") == 1
            with pytest.raises(ValueError, match=r"stacked entry \('/experts/', 0\): a regex, or \(regex, n\)"):
                nv.Rules(stacked=(("/experts/", 0),))
            whole = float(jax.jit(lambda p: loss(nv.dequantize_params(nv.gather(p)), x))(params))
            _, _, metrics = step(params, state, x)
            np.testing.assert_allclose(float(metrics["loss"]), whole, rtol=1e-5)
