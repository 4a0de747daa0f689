"""The tile-major layout: round trips, bit-identity with the logical format, padding, decisions."""

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4.layout import quantize_tiles

CASES = [  # (shape, n_data, n_tensor, tensor_dim)
    ((37, 50), 3, 1, None),
    ((16, 16), 7, 1, None),
    ((3, 33, 17), 2, 1, None),
    ((2, 64, 96), 5, 2, -1),
    ((2, 64, 96), 4, 2, -2),
    ((1, 48, 160), 6, 2, -1),
]


def layout_of(shape, nd, nt, td):
    return nv.Layout(shape[-2:], nd, nt, td, "data", "tensor" if nt > 1 else None)


@functools.partial(jax.jit, static_argnums=(1, 2))
def round_trips(x, lay, block):
    """Every device-side value the round-trip test compares, computed by one program (as in a
    training step; op by op, every new shape would dispatch and compile each op on its own)."""
    t = lay.to_tiles(x)
    q = nv.quantize(x, block=block)
    tq = nv.TiledNVFP4.from_array(q, lay)
    key = jax.random.key(3)
    return {"t": t, "back": lay.from_tiles(t), "q": q, "tq": tq, "tq_of_tiles": quantize_tiles(t, lay, block=block),
            "array": tq.to_array(), "dequantized_tiles": tq.dequantize(jnp.float32),
            "dequantized": nv.dequantize(q, jnp.float32),
            "stochastic": nv.quantize(x, block=block, rounding="stochastic", key=key).data,
            "stochastic_of_tiles": quantize_tiles(t, lay, block=block, key=key).to_array().data}


@pytest.mark.parametrize("shape,nd,nt,td,block", [(*c, nv.BLOCK_2D) for c in CASES] + [
    # (16, 1) blocks: odd sizes with data padding, and tensor splits of columns and of rows.
    (*CASES[2], nv.array.BLOCK_COLUMN), (*CASES[3], nv.array.BLOCK_COLUMN), (*CASES[4], nv.array.BLOCK_COLUMN)])
def test_tiles_round_trip_and_nvfp4_bit_identity(shape, nd, nt, td, block):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    lay = layout_of(shape, nd, nt, td)
    r = round_trips(x, lay, block)
    t, q, tq = r["t"], r["q"], r["tq"]
    assert t.shape == (*shape[:-2], nt, lay.padded_tiles, 16, 16) and lay.padded_tiles % nd == 0
    assert np.asarray(r["back"]).tobytes() == x.tobytes()
    assert not np.any(np.asarray(t)[..., lay.tiles:, :, :])  # padding tiles are zero
    # Host copies (a checkpoint's or an export's) relayout in NumPy: the same bytes, no program.
    host = jax.device_get(tq)
    with jax.transfer_guard("disallow"):  # a jax.numpy op would move them to the device
        t_host, back = lay.to_tiles(x), host.to_array()
    assert isinstance(t_host, np.ndarray) and t_host.tobytes() == np.asarray(t).tobytes()
    assert isinstance(back.data, np.ndarray)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(q)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # One scale per tile (2D), or one per tile column: 16 consecutive rows of one column.
    assert tq.block == block and tq.scale_bits.shape == (*shape[:-2], nt, lay.padded_tiles,
                                                         *(() if block == nv.BLOCK_2D else (16,)))
    for a, b in zip(jax.tree.leaves(tq), jax.tree.leaves(r["tq_of_tiles"])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for a, b in zip(jax.tree.leaves(r["array"]), jax.tree.leaves(q)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.asarray(r["dequantized_tiles"]).tobytes() == np.asarray(r["dequantized"]).tobytes()
    assert np.asarray(r["stochastic_of_tiles"]).tobytes() == np.asarray(r["stochastic"]).tobytes()


def test_padding_for_llama_shapes_on_144_devices():
    # The tile layout pads a matrix by at most N - 1 tiles; rows rounded up to 16 N would pad
    # 8192 rows to 9216 (12.5%).
    assert nv.Layout((8192, 8192), 144).padding() < 0.0004
    assert nv.Layout((28672, 8192), 144).padding() < 0.0001
    assert nv.Layout((4096, 1024), 144).padding() < 0.002
    assert nv.Layout((128256, 8192), 144).padding() < 0.0001


def test_layout_decisions():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    rules = nv.Rules(tensor=((r"up", -1),), stacked=(r"^blocks",))
    lay = nv.rules.layout_for("blocks/up/kernel", (3, 64, 96), True, mesh, rules)
    assert (lay.n_data, lay.n_tensor, lay.tensor_dim, lay.sub) == (4, 2, -1, (64, 48))
    assert nv.rules.layout_for("blocks/norm/scale", (3, 1 << 16), False, mesh, rules) is None  # a vector per layer
    assert nv.rules.layout_for("bias", (100,), False, mesh, rules) is None
    assert nv.rules.layout_for("embed", (1000, 64), False, mesh, rules).n_tensor == 1
    with pytest.raises(ValueError, match="multiple of 16 x 2"):
        nv.rules.layout_for("blocks/up/kernel", (3, 64, 48), True, mesh, rules)


@pytest.mark.parametrize("n,tensor,block", [(1, 1, nv.BLOCK_2D), (2, 1, nv.BLOCK_2D), (3, 1, nv.BLOCK_2D),
                                             (6, 1, nv.BLOCK_2D), (8, 1, nv.BLOCK_2D), (2, 2, nv.BLOCK_2D),
                                             (3, 2, nv.BLOCK_2D), (3, 1, nv.array.BLOCK_COLUMN), (2, 2, nv.array.BLOCK_COLUMN)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_sharded_requantize_is_the_unsharded_quantization(n, tensor, block, stochastic):
    mesh = jax.make_mesh((n, tensor), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: n * tensor])
    rules = nv.Rules(tensor=((r"w", -1),))
    x = np.random.default_rng(n).standard_normal((2, 48, 96)).astype(np.float32)
    x[1] *= np.float32(1e-3)
    lay = nv.rules.layout_for("w", x.shape, True, mesh, rules)
    m = nv.Tiled.from_logical(x, lay)
    m = nv.Tiled(jax.device_put(m.value, NamedSharding(mesh, m.spec())), lay)
    key = jax.random.key(7) if stochastic else None
    got = jax.jit(lambda m: nv.sharding.requantize(m, mesh, block=block, key=key))(m)
    want = nv.quantize(x, block=block, rounding="stochastic" if stochastic else "nearest", key=key)
    for a, b in zip(jax.tree.leaves(got.to_array()), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # The stored shard is where the master's shard is: no relayout.
    assert got.data.sharding.spec == lay.spec(1)
    want_scale = NamedSharding(mesh, lay.spec(1, 0 if block == nv.BLOCK_2D else 1))
    assert got.scale_bits.sharding.is_equivalent_to(want_scale, got.scale_bits.ndim)


@pytest.mark.parametrize("block", [nv.BLOCK_2D, nv.array.BLOCK_COLUMN])
def test_shard_params_logical_and_shardings_round_trip(block):
    mesh = jax.make_mesh((3,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:3])
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((40, 72)).astype(np.float32),
            "emb": rng.standard_normal((300, 64)).astype(np.float32), "b": rng.standard_normal(9).astype(np.float32)}
    q = nv.quantize_params(tree, nv.Policy(include=("w",), block=block))
    assert q["w"].block == block
    stored = nv.shard_params(q, mesh, nv.Rules(min_shard_size=1000))
    assert isinstance(stored["w"], nv.TiledNVFP4) and isinstance(stored["emb"], nv.Tiled)
    assert not nv.layout.is_tiled(stored["b"])
    stored = jax.device_put(stored, nv.shardings(stored, mesh))
    assert stored["w"].data.sharding.spec == P(None, "data", None, None)
    back = nv.sharding.logical(stored)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(q)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    gathered = jax.jit(lambda s: nv.gather(s, mesh))(stored)
    for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(q)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
