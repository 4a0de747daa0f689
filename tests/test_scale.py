"""benchmarks.scale: the training step compiled for simulated multi-rack meshes matches the
analytic byte counts; the HLO accounting (replica groups, loop trip counts, time model)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import scale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_scale(tmp_path, *args):
    # A fresh process: the simulated device count is fixed when JAX starts (the subprocess also
    # drops the device count this test session puts in XLA_FLAGS).
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--model", "1b", "--weights", "nvfp4", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("scale_*.json")
    assert path.with_suffix(".md").exists()
    return json.loads(path.read_text()), proc.stdout


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
def test_1b_on_16_devices_matches_the_formulas(tmp_path):
    report, stdout = run_scale(tmp_path, "--mesh", "data:16")
    (run,) = report["runs"]
    assert report["devices"] == 16 and run["axes"] == {"data": 16, "tensor": 1}
    assert report["config"]["layers"] == 16 and report["config"]["vocab"] == 128256
    assert_matches_formula(run)
    # Packed NVFP4 gather: 0.5 + 1/256 bytes per weight per pass (forward, and the
    # rematerialised backward), ~0.252 of a bf16 gather of the same weights.
    per_pass = run["measured"]["gather_packed"] / 2
    assert per_pass / (2 * run["analytic"]["numel_nvfp4"]) == pytest.approx((0.5 + 1 / 256) / 2, rel=0.01)
    # 1B (MHA): 16 x (4 d^2 + 3 d ffn) + 2 vocab d + norms.
    d, f, v, L = 2048, 8192, 128256, 16
    assert run["analytic"]["numel"] == L * (4 * d * d + 3 * d * f) + 2 * v * d + (2 * L + 1) * d
    # The packed weights are all-gathered one layer at a time inside the scanned loops: 7
    # kernels x (codes + scales) x 16 layers, in the forward and again in the backward pass.
    u8 = [c for c in run["collectives"] if c["op"] == "all-gather" and c["dtype"] == "u8"]
    assert sum(c["instances"] for c in u8) == 2 * 14 * L and all(c["axis"] == "data" for c in u8)
    assert {c["purpose"] for c in run["collectives"] if c["bytes"] > 1e6} == {"weight gather", "grad reduce"}
    assert "| params (stored" in stdout and "modelled time of all collectives" in stdout


@pytest.mark.slow
def test_two_racks_with_a_tensor_axis(tmp_path):
    # 2 "racks" of 8 devices, tensor 2 inside a rack, data 8 across both; 2 layers for speed.
    report, _ = run_scale(tmp_path, "--mesh", "gb200:2", "--nvl-domain", "8", "--tensor", "2", "--layers", "2")
    (run,) = report["runs"]
    assert run["axes"] == {"data": 8, "tensor": 2}
    assert "2 NVLink domain(s) of 8" in run["mesh"] and "tensor: within one domain" in run["mesh"]
    assert run["data_group_domains"] == 2
    # With a tensor axis the per-layer gather also collects the tensor shards (the layers then
    # compute unsplit, and reduce unsplit gradients): more bytes than the formula's 1/t, a
    # known limit of the FSDP step.
    assert_matches_formula(run, gathers=False)
    for key in ("gather_packed", "wire_reduce"):
        assert run["measured"][key] >= 0.95 * run["analytic"][key], key
    by_axis = {}
    for c in run["collectives"]:
        by_axis.setdefault(c["axis"], []).append(c)
    # Tensor-parallel activation sums stay inside a rack; the weight gathers cross racks.
    assert by_axis["tensor"] and all(c["domains"] == 1 and c["group"] == 2 for c in by_axis["tensor"])
    assert any(c["op"] == "all-gather" and c["dtype"] == "u8" and c["domains"] == 2 for c in by_axis["data"])


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


def test_mesh_spec():
    s = scale.MeshSpec.parse("gb200:2", tensor=4)
    assert (s.devices, s.label) == (144, "gb200-2-t4")
    assert scale.MeshSpec.parse("data:16").devices == 16
    with pytest.raises(ValueError, match="gb200:RACKS"):
        scale.MeshSpec.parse("racks:2")
