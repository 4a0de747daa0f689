"""benchmarks.scale: the training step compiled for simulated multi-rack meshes matches the
analytic byte counts; the HLO accounting (replica groups, loop trip counts, time model)."""

import json
import subprocess
import sys

import pytest

from benchmarks import scale

from conftest import ROOT


# The three compiled reports of the 1B preset's NVFP4 step, by name: benchmarks.scale's arguments.
ARGS = ("--model", "1b", "--weights", "nvfp4", "--seq-len", "128")
RUNS = {
    "1b": ("--mesh", "data:16"),
    "tensor": ("--mesh", "gb200:2", "--nvl-domain", "8", "--tensor", "2", "--layers", "2"),
    "hsdp": ("--mesh", "gb200:2", "--nvl-domain", "8", "--layers", "2", "--sharding", "hsdp"),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """``python -m benchmarks.scale --model 1b --weights nvfp4`` with each of :data:`RUNS`, in
    one fresh process of 16 simulated devices (the device count is fixed when JAX starts; the
    process also drops the count this test session puts in XLA_FLAGS): ``{name: (report,
    markdown report)}``."""
    base = tmp_path_factory.mktemp("scale")
    calls = "".join(f"scale.main({[*ARGS, '--out', str(base / name), *args]!r})\n" for name, args in RUNS.items())
    proc = subprocess.run([sys.executable, "-c", "from benchmarks import scale\n" + calls], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for name in RUNS:
        (path,) = (base / name).glob("scale_*.json")
        # The markdown report, as printed.
        out[name] = json.loads(path.read_text()), path.with_suffix(".md").read_text()
    return out


compiled = pytest.mark.xdist_group("scale")  # one pytest-xdist worker computes the reports


def assert_matches_formula(run, gathers=True):
    m, a = run["measured"], run["analytic"]
    # The gradient sum moves bf16 gradient bits (all-to-all): a bf16 reduce-scatter's bytes.
    keys = ("params", "master", "opt_state")
    for key in keys + (("gather_packed", "gather_plain", "wire_gather", "wire_reduce") if gathers else ()):
        assert a[key] > 0, key
        assert abs(m[key] / a[key] - 1) < 0.05, (key, m[key], a[key])
    assert not run["unsharded_large_leaves"]
    assert m["xla_argument"] >= m["params"] + m["master"] + m["opt_state"]
    assert m["xla_temp"] > 0


@pytest.mark.slow
@compiled
def test_1b_on_16_devices_matches_the_formulas(reports):
    report, text = reports["1b"]
    (run,) = report["runs"]
    assert report["devices"] == 16 and run["axes"] == {"data": 16, "tensor": 1, "storage": 16, "racks": 1}
    assert report["config"]["layers"] == 16 and report["config"]["vocab"] == 128256
    # The figures the layout must give, by hand from the 1B shapes (MHA: 7 matrices per block;
    # every matrix splits into whole 16x16 tiles, evenly over the 16 devices: no padding).
    n, d, f, v, L = 16, 2048, 8192, 128256, 16
    nvfp4 = L * (4 * d * d + 3 * d * f)  # NVFP4 matrices
    plain = 2 * v * d  # embedding and head: bf16, sharded
    norms = (2 * L + 1) * d  # bf16, replicated
    packed = nvfp4 * (1 / 2 + 1 / 16)  # E2M1 codes, one E4M3 scale per 16 inputs (nvfp4.block: 1d)
    assert run["analytic"]["numel"] == nvfp4 + plain + norms
    m = run["measured"]
    assert m["params"] == packed / n + 4 * 7 * L + 2 * plain / n + 2 * norms  # + a float32 amax per matrix
    assert m["master"] == 4 * (nvfp4 + plain) / n + 4 * norms
    assert 2 * m["master"] < m["opt_state"] <= 2 * m["master"] + 64  # Adam's m and v, and a count
    # Gathered per step: the packed weights in the forward and the rematerialised backward pass
    # (0.28 of a bf16 gather), the embedding and head once each; a ring all-gather puts
    # (n - 1) / n of it on the wire.
    assert m["gather_packed"] == 2 * packed and m["gather_plain"] == 2 * plain
    assert m["wire_gather"] == (n - 1) / n * (2 * packed + 2 * plain)
    # The gradient sum moves bf16 gradient bits: a bf16 reduce-scatter's wire bytes (the
    # norms: an all-reduce), within 1% (the all-to-all form).
    assert m["wire_reduce"] == pytest.approx((n - 1) * 2 * (nvfp4 + plain) / n + 2 * (n - 1) / n * 2 * norms, rel=0.01)
    assert not run["unsharded_large_leaves"]
    assert m["xla_argument"] >= m["params"] + m["master"] + m["opt_state"] and m["xla_temp"] > 0
    # The packed weights are all-gathered one layer at a time inside the scanned loops: 7
    # kernels x (codes + scales) x 16 layers, in the forward and again in the backward pass.
    u8 = [c for c in run["collectives"] if c["op"] == "all-gather" and c["dtype"] == "u8"]
    assert sum(c["instances"] for c in u8) == 2 * 14 * L and all(c["axis"] == "data" for c in u8)
    assert {c["purpose"] for c in run["collectives"] if c["bytes"] > 1e6} == {"weight gather", "grad reduce"}
    assert "| params (stored" in text and "modelled time of all collectives" in text


@pytest.mark.slow
@compiled
def test_two_racks_with_a_tensor_axis(reports):
    # 2 "racks" of 8 devices (mesh rack 2 x data 4 x tensor 2, FSDP over (data, rack)); 2 layers.
    report, _ = reports["tensor"]
    (run,) = report["runs"]
    assert run["axes"] == {"data": 8, "tensor": 2, "storage": 8, "racks": 2} and run["sharding"] == "fsdp"
    assert run["mesh"].startswith("mesh rack=2 x data=4 x tensor=2 on 16 cpu devices, 2 NVLink domain(s) of 8; "
                                  "rack: spans 2 domains; data: within one domain; tensor: within one domain")
    # Each device gathers its own tensor shard of a layer over the data axes (two levels: racks
    # first), the formula's 1/t of the bytes on the wire; the activations cross the tensor
    # axis in the formula's (11 L + 4) gathers and reduce-scatters; the modelled time is the
    # formula's (FSDP + TP + SP).
    assert_matches_formula(run, gathers=False)
    m, a = run["measured"], run["analytic"]
    for key in ("wire_gather", "wire_gather_packed", "wire_reduce", "tp_bytes"):
        assert m[key] == pytest.approx(a[key], rel=0.02), (key, m[key], a[key])
    assert a["tp_bytes"] == (11 * 2 + 4) * 128 * 2048 * 2
    assert m["time_2level_s"] <= 1.15 * a["time_2level_s"]
    assert m["eval_xla_peak"] < m["xla_peak"] and m["flops"] > 0
    by = {}
    for c in run["collectives"]:
        by.setdefault((c["purpose"], c["op"], c["dtype"], c["axis"]), []).append(c)
    # Tensor-parallel sums stay inside a rack; a weight gather crosses racks first (groups of
    # one device per rack), then runs inside the rack; a gradient is summed inside the rack
    # (bf16 bits), then its rack partials cross racks (bf16 bits, 1/4 of the tiles).
    assert all(c["domains"] == 1 and c["group"] == 2 for k, cs in by.items() if k[3] == "tensor" for c in cs)
    assert [(c["group"], c["domains"]) for c in by[("weight gather", "all-gather", "u8", "rack")]] == [(2, 2)]
    assert [(c["group"], c["domains"]) for c in by[("weight gather", "all-gather", "u8", "data")]] == [(4, 1)]
    assert [(c["group"], c["domains"]) for c in by[("grad reduce", "all-to-all", "u16", "data")]] == [(4, 1)]
    across = by[("grad reduce", "all-to-all", "u16", "rack")]
    assert [(c["group"], c["domains"]) for c in across] == [(2, 2)]
    inside = by[("grad reduce", "all-to-all", "u16", "data")][0]
    assert across[0]["bytes"] == pytest.approx(inside["bytes"] / 4, rel=0.02)


@pytest.mark.slow
@compiled
def test_hsdp_keeps_weight_gathers_inside_a_rack(reports):
    # HSDP on 2 racks of 8: the state is sharded over the 8 devices of a rack (twice the
    # per-device state of FSDP over 16) and replicated across racks; no weight gather leaves a
    # rack; the gradient's only cross-rack traffic is the rack's 1/8 shard.
    report, _ = reports["hsdp"]
    (run,) = report["runs"]
    assert run["axes"] == {"data": 16, "tensor": 1, "storage": 8, "racks": 2} and report["mesh_spec"] == "gb200-2-nvl8-hsdp"
    assert_matches_formula(run)
    m, a = run["measured"], run["analytic"]
    assert m["ib_bytes"] == pytest.approx(a["ib_bytes"], rel=0.02)
    assert m["time_2level_s"] <= 1.05 * a["time_2level_s"]
    gathers = [c for c in run["collectives"] if c["purpose"] == "weight gather"]
    assert gathers and all(c["domains"] == 1 and c["axis"] == "data" for c in gathers)
    across = [c for c in run["collectives"] if c["domains"] > 1 and c["bytes"] > 1e6]
    assert {(c["purpose"], c["op"], c["axis"]) for c in across} == {("grad reduce", "all-gather", "rack")}


# ----------------------------------------------------------------------------- no compile
def test_time_model():
    gb = 1e9
    # Inside one domain: NVLink; across: the flat ring runs at the IB speed.
    assert scale.collective_time("all-gather", 9 * gb, 9, 1, 900, 50) == pytest.approx((8 / 900, 8 / 900))
    flat, two = scale.collective_time("all-reduce", 144 * gb, 144, 2, 900, 50)
    assert flat == pytest.approx(2 * 143 / 50)
    assert two == pytest.approx(2 * 144 * 71 / 72 / 900 + 2 * 2 * 1 / 2 / 50)
    flat, two = scale.collective_time("reduce-scatter", 1 * gb, 144, 2, 900, 50)
    assert flat == pytest.approx(143 / 50) and two == pytest.approx(2 * 71 / 900 + 1 / 50)
    assert scale.ring_bytes("all-reduce", 10, 5) == 16 and scale.ring_bytes("reduce-scatter", 10, 5) == 40
    # InfiniBand bytes of the two-level algorithms: none inside a domain; an all-gather over
    # 144 = 2 x 72 receives 1/144 of the result across; a rack-pair all-to-all half of it.
    assert scale.ib_bytes("all-gather", 144, 72, 1) == 0
    assert scale.ib_bytes("all-gather", 144, 144, 2) == 1
    assert scale.ib_bytes("all-to-all", 10, 2, 2) == 5 and scale.ib_bytes("reduce-scatter", 3, 144, 2) == 3


def test_mesh_spec():
    s = scale.MeshSpec.parse("gb200:2", tensor=4)
    assert (s.devices, s.label) == (144, "gb200-2-t4")
    assert scale.MeshSpec.parse("data:16").devices == 16
    assert scale.MeshSpec.parse("gb200:4", sharding="hsdp").label == "gb200-4-hsdp"
    assert scale.MeshSpec.parse("gb200:2", sharding="flat").label == "gb200-2-flat"
    assert scale.MeshSpec.parse("data:16", sharding="hsdp").sharding == "flat"  # no racks to speak of
    cfg = scale.make_config(scale.PRESETS["1b"], scale.MeshSpec.parse("gb200:2", sharding="hsdp"), "nvfp4", 128, 1)
    assert (cfg.mesh.layout, cfg.mesh.sharding) == ("gb200", "hsdp")
    assert scale.make_config(scale.PRESETS["1b"], scale.MeshSpec.parse("gb200:2", sharding="flat"), "nvfp4", 128,
                             1).mesh.layout == "auto"
    with pytest.raises(ValueError, match="--sharding 'x'"):
        scale.MeshSpec.parse("gb200:2", sharding="x")
    with pytest.raises(ValueError, match="gb200:RACKS"):
        scale.MeshSpec.parse("racks:2")


def test_sharding_table_reads_the_rack_results(tmp_path):
    def write(name, peak, ib, t, t_ana, overrides=None):
        run = {"weights": "nvfp4",
               "measured": {"params": 1e9, "master": 2e9, "opt_state": 4e9, "xla_peak": peak, "eval_xla_peak": peak / 2,
                            "ib_bytes": ib, "time_2level_s": t, "compute_s": 0.5},
               "analytic": {"ib_bytes": ib, "time_2level_s": t_ana}}
        (tmp_path / name).write_text(json.dumps({"runs": [run], "overrides": overrides or {}, "seq_len": 8192,
                                                 "micro_batch": 1}))

    write("scale_8b_gb200-2.json", 6e9, 1e9, 0.02, 0.02)
    write("scale_8b_gb200-2-flat.json", 6e9, 5e9, 0.06, 0.02)
    write("scale_8b_gb200-2-hsdp.json", 9e9, 2e9, 0.03, 0.03)
    write("scale_8b_gb200-2-t8.json", 3e9, 1e8, 0.01, 0.01)
    write("scale_70b_l40_gb200-2.json", 1, 1, 1, 1, {"layers": 40})  # not the preset: not a row
    text = scale.sharding_table(str(tmp_path))
    rows = [l for l in text.splitlines() if l.startswith("| 8b")]
    assert [r.split(" | ")[2:4] for r in rows] == [["1", "fsdp"], ["8", "fsdp"], ["1", "hsdp"], ["1", "flat"]]
    assert rows[3].endswith("| 60.00 ms | 20.00 ms | 3.000 | 500.00 ms |") and "| 7.000 GB | 6.000 GB | 3.000 GB |" in rows[0]
    assert "8192 tokens per data shard" in text and not any(l.startswith("| 70b") for l in text.splitlines())
