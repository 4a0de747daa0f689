"""``python -m benchmarks``: a smoke run on the tiny model and the HLO accounting it rests on."""

import json
import math
import os

import jax
import numpy as np
import pytest

from benchmarks import __main__ as cli
from benchmarks import report

from conftest import tiny_worker

# The worker of the tiny run's tests (test_train.py runs first): the benchmarks' tiny NVFP4 and
# bf16 points are that run's programs, built once per process.
pytestmark = tiny_worker

# The stack's default block (nvfp4.block: auto -> 1d): a 16x16 tile packs to 128 code bytes and
# 16 scale bytes (one per 16 rows of a column), per 512 bytes of the same tile in bf16.
LIMIT = (0.5 + 16 / 256) / 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest asks for 8 simulated CPU devices)")
    out = tmp_path_factory.mktemp("bench")
    # tiny.yaml on its 8 devices: the NVFP4 and bf16 steps the training tests compile.
    rc = cli.main(["traffic", "memory", "speed", "scaling", "quantize", "--quick", "--sizes", "tiny",
                   "--data-sizes", "8", "--quant-size", "256", "--out", str(out)])
    assert rc == 0
    return out


def _load(out, name):
    return json.loads((out / f"{name}.json").read_text())


def test_files_and_commands(results):
    for name in ("traffic.json", "memory.json", "speed.json", "scaling.json", "quantize.json",
                 "REPORT.md", "HEADLINE.md", "traffic.png", "memory.png", "scaling.png"):
        assert (results / name).exists(), name
    text = (results / "REPORT.md").read_text()
    # Each section records the invocation that wrote it (every section it ran), not its own name.
    invocation = ("python -m benchmarks traffic memory speed scaling quantize --quick --sizes tiny --data-sizes 8 "
                  f"--quant-size 256 --out {results}")
    for section in ("traffic", "memory", "speed", "quantize", "scaling"):
        assert _load(results, section)["meta"]["command"] == invocation, section
    assert text.count(f"`{invocation}`") == 5
    head = (results / "HEADLINE.md").read_text()
    assert "| figure | NVFP4 |" in head
    # It points to the report written with it, not to the committed one.
    assert f"details in [{results / 'REPORT.md'}]" in head
    assert sum("packed gather ratio, measured: " in line for line in head.splitlines()) == 1
    # Each section names the code it measured: the commit, whether jax_nvfp4/ or train/ differed
    # from it (then the report says so), and a hash of those files as they were read.
    from benchmarks.common import source_state

    meta = _load(results, "traffic")["meta"]
    state = source_state()
    assert (meta["git_commit"], meta["dirty"], meta["source_sha256"]) == (state["git_commit"], state["dirty"],
                                                                         state["sha256"])
    assert len(meta["source_sha256"]) == 64
    assert ("with uncommitted changes to jax_nvfp4/ or train/" in text) == bool(meta["dirty"])


def test_traffic_ratios(results):
    p = _load(results, "traffic")["point"]
    assert (p["size"], p["data"]) == ("tiny", 8)
    n, b, r = p["nvfp4"], p["bf16"], p["ratios"]
    # The packed gather of the NVFP4 leaves: at most the 1d-block limit, and nothing else is u8.
    assert 0.275 <= r["leaf_gather"] <= LIMIT * 1.002
    assert n["gather"]["nvfp4_gather_bytes"] <= LIMIT * n["gather"]["nvfp4_bf16_gather_bytes"] + 1
    assert not any(k.endswith(":u8") for k in b["collectives_by_purpose"].get("weight gather", {}))
    # Whole model: embeddings and head stay bf16, so between the leaf ratio and 1.
    assert r["leaf_gather"] < r["model_gather"] < 1
    # Gradients cross devices as bf16 bits, whatever the weights' storage format.
    for w in (n, b):
        grad = w["collectives_by_purpose"]["grad reduce"]
        assert grad and all(k.endswith(":u16") for k in grad), grad


def test_memory_and_speed(results):
    p = _load(results, "memory")["point"]
    n, b = p["nvfp4"]["memory"], p["bf16"]["memory"]
    # The tiny model's weights, by hand: 7 matrices per block, embedding and head, norms.
    m = p["model"]
    d, L = m["d_model"], m["layers"]
    weights = L * (4 * d * d + 3 * d * m["mlp_hidden"]) + 2 * m["vocab"] * d + (2 * L + 1) * d
    assert p["nvfp4"]["n_params"] == weights
    # NVFP4 run: a float32 master of every matrix as 16x16 tiles split over the 8 devices (a
    # matrix's tile count padded up to a multiple of 8: the MLP's 4 x 11 tiles take 6 per
    # device), and the norms replicated.
    tiles = lambda rows, cols: math.ceil(math.ceil(rows / 16) * math.ceil(cols / 16) / 8)
    local = 256 * (L * (4 * tiles(d, d) + 3 * tiles(d, m["mlp_hidden"])) + 2 * tiles(m["vocab"], d)) + (2 * L + 1) * d
    assert n["master"] == 4 * local
    assert 4 * weights / 8 < n["master"] < 1.1 * 4 * weights / 8
    # Adam's two moments are float32 copies of the masters (+ a step count), in both runs.
    for w in (n, b):
        assert 2 * w["master"] < w["optimizer"] <= 2 * w["master"] + 64
    # bf16 params sit in their masters' layout at half the bytes; packed NVFP4 ones are a
    # fraction of those (the embedding, head and norms stay bf16 in both).
    assert b["params"] == b["master"] // 2
    assert n["params"] < 0.5 * b["params"]
    assert n["compiled_temp"] > 0 and b["compiled_temp"] > 0
    s = _load(results, "speed")["point"]
    for w in ("nvfp4", "bf16"):  # --repeats 2 (quick) timed steps, after an untimed one
        times = s[w]["step_times_s"]
        assert len(times) == 2
        # The report's step time is the median of the timed steps it recorded.
        assert s[w]["step_time_s"] == pytest.approx(float(np.median(times)))


def test_scaling_and_quantize(results):
    pts = _load(results, "scaling")["points"]
    assert [(p["size"], p["data"]) for p in pts] == [("tiny", 8)]
    q = _load(results, "quantize")["result"]
    # Each figure is its bytes over its own time, and each ratio the baseline's time over it:
    # the bytes counted are the op's real traffic (codes, a scale byte per block, the amax).
    n = q["size"][0] * q["size"][1]
    traffic = {"quantize_16x16": 4 * n + n // 2 + n // 256 + 4, "quantize_1x16": 4 * n + n // 2 + n // 16 + 4,
               "dequantize_bf16": n // 2 + n // 256 + 4 + 2 * n}
    for k, nbytes in traffic.items():
        assert q[f"{k}_s"] > 0
        assert q[f"{k}_GBps"] == pytest.approx(nbytes / q[f"{k}_s"] / 1e9)
        same = q["same_bytes_dequantize_s" if k.startswith("de") else "same_bytes_quantize_s"]
        assert q[f"{k}_vs_same_bytes"] == pytest.approx(same / q[f"{k}_s"])
        assert q[f"{k}_vs_elementwise"] == pytest.approx(q["baseline_elementwise_s"] / q[f"{k}_s"])
    assert report.target_misses(report.load(str(results))) == []


def _run_pair(code_gathers: int, bf16_replicated_grads: int = 0):
    """A synthetic NVFP4 / bf16 pair of one point: V values of NVFP4 weights (their packed
    bytes 0.5625 V with 1d blocks, gathered ``code_gathers`` times where the bf16 run gathers
    its 2 V bytes once) and an embedding both runs gather in bf16."""
    V, embed = 1 << 20, 4096
    grads = {"all-to-all:u16": 2 * V}
    n = {"collectives_by_purpose": {"weight gather": {"all-gather:u16": embed,
                                                      "all-gather:u8": code_gathers * int(LIMIT * 2 * V)},
                                    "grad reduce": dict(grads, **{"all-gather:u16": 64})}}
    b = {"collectives_by_purpose": {"weight gather": {"all-gather:u16": embed + 2 * V},
                                    "grad reduce": dict(grads, **{"all-gather:u16": 64 + bf16_replicated_grads})}}
    return n, b


def test_target_misses_are_reported():
    n, b = _run_pair(code_gathers=1)
    point = {"size": "tiny", "data": 8, "model": {"d_model": 64, "layers": 2}, "nvfp4": n, "bf16": b,
             "ratios": {"leaf_gather": LIMIT, "state_memory": 1.2}}
    res = {"traffic": {"point": point},
           "convergence": {"gap_nvfp4_minus_bf16": 0.2, "gap_nvfp4_compute_minus_bf16": 0.0, "steps": 10}}
    misses = report.target_misses(res)
    assert not any("gather ratio" in m for m in misses)
    assert any("not < 1" in m for m in misses)
    assert any("0.2000 nats" in m for m in misses)


def test_packed_gather_target_fails_when_codes_are_gathered_twice():
    from benchmarks.train_step import packed_gather_measured

    once, twice = _run_pair(code_gathers=1), _run_pair(code_gathers=2)
    assert packed_gather_measured(*once)["ratio"] == pytest.approx(LIMIT)
    assert packed_gather_measured(*twice)["ratio"] == pytest.approx(2 * LIMIT)
    # The per-leaf layout figure (4 x the NVFP4 run's own code bytes) would read LIMIT for both.
    point = {"size": "small", "data": 8, "model": {"d_model": 128, "layers": 4}, "nvfp4": twice[0],
             "bf16": twice[1], "ratios": {"leaf_gather": LIMIT, "state_memory": 0.9}}
    misses = report.target_misses({"traffic": {"point": point}})
    assert len(misses) == 1 and f"measured across the runs {2 * LIMIT:.4f}" in misses[0], misses
    # Where the bf16 run keeps weights replicated that the NVFP4 run gathers, the runs' gathers are
    # not of the same weights: the figure is shown, not held to the target.
    n, b = _run_pair(code_gathers=2, bf16_replicated_grads=1024)
    assert not packed_gather_measured(n, b)["comparable"]
    point = dict(point, nvfp4=n, bf16=b)
    assert report.target_misses({"traffic": {"point": point}}) == []
    assert report.leaf_unchecked({"traffic": {"point": point}}) == [f"small data=8 ({2 * LIMIT:.4f})"]


def test_scale_reports_render_from_their_json():
    """Each committed scale_*.md is its .json rendered (no compile), names the command that
    reproduces it, and states the analytic formula of the block its runs stored."""
    from benchmarks import scale

    names = sorted(f for f in os.listdir(scale.RESULTS) if f.startswith("scale_") and f.endswith(".json"))
    assert names
    for name in names:
        with open(os.path.join(scale.RESULTS, name)) as f:
            rep = json.load(f)
        with open(os.path.join(scale.RESULTS, name[:-5] + ".md")) as f:
            assert scale.markdown(rep) == f.read(), name
        assert rep["command"] == scale.command_of(rep), name
        args = scale.parse_args(rep["command"].split()[4:])
        assert scale.MeshSpec.parse(args.mesh, args.tensor, args.nvl_domain, args.sharding).label == rep["mesh_spec"]
        assert sorted(r["weights"] for r in rep["runs"]) == sorted(
            ("nvfp4", "bf16") if args.weights == "both" else (args.weights,))
    assert scale.block_formula([{"block": [16, 1]}])[0] == "numel/16"
    assert scale.block_formula([{"block": [16, 16]}])[0] == "numel/256"


def test_against_pins_the_block_format():
    from benchmarks import against

    # A commit from before nvfp4.block: its library stores 16x16 tiles only, so this tree runs 2d.
    if subprocess_git_has("fb6f378"):
        old = against.block_overrides("fb6f378", "1d")
        assert (old["rev"], old["here"], old["block"]) == ([], ["nvfp4.block=2d"], "2d")
    now = against.block_overrides("HEAD", "1d")
    assert now["rev"] == now["here"] == ["nvfp4.block=1d"]


def subprocess_git_has(rev: str) -> bool:
    import subprocess

    from conftest import ROOT

    return subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True).returncode == 0


def test_gpu_check_without_a_gpu_is_one_line():
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "benchmarks", "gpu"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("no GPU: ")


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(results, tmp_path, capsys):
    """The whole command on the CPU (``--cpu``, the tiny model: the smoke run's programs), so
    that its first run on a GPU is not its first run."""
    out = tmp_path / "gpu.json"
    rc = cli.main(["gpu", "--cpu", "--models", "tiny", "--steps", "1", "--repeats", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"], printed
    table = printed[printed.index("| check |"):].splitlines()
    assert all(line.count("|") == 4 for line in table if line.startswith("|"))  # one well-formed table
    assert report["quantize"]["ok"] and len(report["quantize"]["cases"]) == 4
    assert report["gemm"]["auto"] == "emulate" and report["gemm"]["native_gemm_calls"] == 0
    step = report["steps"]["tiny"]
    assert step["devices"] == len(jax.devices()) and step["nvfp4"]["weight_gather_dtypes"] == ["u16", "u8"]
    assert 0 < step["ratios"]["peak"] < 1  # NVFP4 weights: less memory than bf16 weights
    assert step["nvfp4"]["cudnn_attention_calls"] == 0  # XLA's attention on a CPU


# Bad arguments of every subcommand, each with the flag its error names. Each is refused by the
# parser, before anything is compiled, trained or written: one line, exit 2, no traceback.
BAD_ARGUMENTS = [
    # python -m benchmarks [SECTION...]
    (["--host-devices", "0"], "--host-devices"), (["--host-devices", "1000"], "--host-devices"),
    (["--data-sizes", "0"], "--data-sizes"), (["--data-sizes", ","], "--data-sizes"),
    (["--data-sizes", "3"], "--data-sizes"), (["--data-sizes", "1,1"], "--data-sizes"),
    (["--repeats", "-1"], "--repeats"), (["--repeats", "1.5"], "--repeats"), (["--conv-steps", "0"], "--conv-steps"),
    (["--quant-size", "x"], "--quant-size"), (["--sizes", "tiny,huge"], "--sizes"), (["--ref-size", "huge"], "--ref-size"),
    (["--conv-size", "huge"], "--conv-size"), (["--against", "nosuchrev"], "--against"),
    (["traffic", "--against", "HEAD"], "--against"), (["--repeats"], "--repeats"), (["--quik"], "--quik"),
    (["--quick=1"], "--quick"), (["nosuch"], "nosuch"), (["--out", "a-file"], "--out"),
    (["--out", "a-file/under"], "--out"), (["--out="], "--out"), (["serving", "--out", "a-file/x"], "--out"),
    # gpu
    (["gpu", "--cpu", "--steps", "0"], "--steps"), (["gpu", "--steps", "x"], "--steps"), (["gpu", "--size", "0"], "--size"),
    (["gpu", "--repeats", "0"], "--repeats"), (["gpu", "--models", "default,huge"], "--models"),
    (["gpu", "--json", "."], "--json"),
    # scale
    (["scale", "--mesh", "data:0"], "--mesh"), (["scale", "--mesh", "gb200:x"], "--mesh"), (["scale", "--tensor", "3"], "--tensor"),
    (["scale", "--tensor", "0"], "--tensor"), (["scale", "--tensor", "128"], "--tensor"), (["scale", "--layers", "0"], "--layers"),
    (["scale", "--vocab", "100", "--tensor", "2"], "--tensor"), (["scale", "--vocab", "0"], "--vocab"),
    (["scale", "--nvl-domain", "0"], "--nvl-domain"), (["scale", "--seq-len", "0"], "--seq-len"),
    (["scale", "--micro-batch", "0"], "--micro-batch"), (["scale", "--nvlink-gbps", "0"], "--nvlink-gbps"),
    (["scale", "--ib-gbps", "nan"], "--ib-gbps"), (["scale", "--model", "9b"], "--model"),
    (["scale", "--sharding", "x"], "--sharding"), (["scale", "--out", "a-file"], "--out"),
    # serving
    (["serving", "--steps", "0"], "--steps"), (["serving", "--steps", "1"], "--steps"), (["serving", "--seeds", "a,b"], "--seeds"),
    (["serving", "--seeds", ""], "--seeds"), (["serving", "--seeds", "0,0"], "--seeds"), (["serving", "--seeds", "-1"], "--seeds"),
    (["serving", "--size", "huge"], "--size"), (["serving", "--max-bytes", "0"], "--max-bytes"),
    # convergence --text
    (["convergence", "--text", "--workers", "0"], "--workers"), (["convergence", "--text", "--workers", "x"], "--workers"),
    (["convergence", "--text", "--seeds", "a"], "--seeds"), (["convergence", "--text", "--lr-check", "x"], "--lr-check"),
    (["convergence", "--text", "--lr-check", "1"], "--lr-check"),
    (["convergence", "--text", "--headline-seeds", "-1"], "--headline-seeds"),
    (["convergence", "--text", "--lengths", "tiny=0"], "--lengths"), (["convergence", "--text", "--lengths", "tiny"], "--lengths"),
    (["convergence", "--text", "--lengths", "huge=10"], "--lengths"), (["convergence", "--text", "--sizes", "huge"], "--sizes"),
    (["convergence", "--text", "--recipe", "--sizes", "tiny"], "--sizes"),
    (["convergence", "--text", "--ablation-at", "l4-d64"], "--ablation-at"),
    (["convergence", "--text", "--max-bytes", "0"], "--max-bytes"), (["convergence", "--text", "--shard", "2/2"], "--shard"),
    (["convergence", "--text", "--rerun", "nosuch"], "--rerun"), (["convergence", "--text", "--only", "nosuch"], "--only"),
    (["convergence", "--text", "--cache", "a-file"], "--cache"),
    (["convergence", "--text", "--recipe", "--sizes", "l4-d64", "--ablation-at", "l4-d128"], "--ablation-at"),
    (["convergence", "--text", "--recipe", "--rerun", "l4-d64-2000-s0-bf16"], "--rerun"),  # not finished
]


@pytest.mark.parametrize("argv, flag", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_errors_before_anything_runs(argv, flag, tmp_path, monkeypatch, capsys):
    """``error: FLAG VALUE: why`` on stderr, exit 2, nothing on stdout and nothing written: the
    relative default folders (runs/, benchmarks/results) would land in the empty working folder,
    and scale's absolute one is the committed results folder."""
    from conftest import ROOT

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    results = os.path.join(ROOT, "benchmarks", "results")
    before = sorted(os.listdir(results))
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert e.value.code == 2 and out == "" and len(lines) == 1, (argv, out, err)
    assert lines[0].startswith(f"error: {flag}") and len(lines[0]) > len(f"error: {flag}: "), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert sorted(os.listdir(results)) == before


def test_argument_errors_name_the_value_and_why(capsys):
    for argv, line in (
            (["--host-devices", "0"], "error: --host-devices 0: must be a positive integer"),
            (["--data-sizes", "3"], "error: --data-sizes 3: the medium model's batch of 32 rows does not split over a "
                                    "data axis of 3"),
            (["--against", "nosuchrev"], "error: --against nosuchrev: not a commit of this repository (git rev-parse "
                                         "--verify)"),
            (["--quik"], "error: --quik: unknown option (did you mean --quick?)"),
            (["serving", "--seeds", "a,b"], "error: --seeds a,b: 'a' is not an integer"),
            (["scale", "--mesh", "data:0"], "error: --mesh data:0: expected gb200:RACKS or data:N (RACKS, N >= 1), e.g. "
                                            "gb200:2 or data:16"),
            (["scale", "--tensor", "3"], "error: --tensor 3: model.d_model=4096: must be divisible by 16 x mesh tensor "
                                         "axis (3) = 48"),
            (["scale", "--model", "9b"], "error: --model 9b: must be one of '1b', '405b', '70b', '8b', 'llama31_405b', "
                                         "'llama31_70b', 'llama31_8b', 'llama3_70b', 'llama3_8b'")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert capsys.readouterr().err == line + "\n", argv


def test_good_arguments_parse():
    args = cli.parse_args(["traffic", "speed", "--data-sizes", "2,4", "--against", "HEAD", "--host-devices", "4"])
    assert (args.sections, args.data_sizes, args.against, args.host_devices) == (["traffic", "speed"], [2, 4], "HEAD", 4)
    from benchmarks import gpu_check, scale, serving

    assert gpu_check.parse_args(["--models", "tiny"]).models == ["tiny"]
    assert serving.parse_args(["--seeds", "3,1", "--steps", "2"]).seeds == [3, 1]
    s = scale.parse_args(["--model", "1b", "--mesh", "gb200:2", "--nvl-domain", "8", "--tensor", "2", "--layers", "2"])
    assert (s.mesh, s.tensor, s.layers) == ("gb200:2", 2, 2)


def test_a_bad_argument_exits_2_from_the_shell():
    import subprocess
    import sys

    from conftest import ROOT

    run = subprocess.run([sys.executable, "-m", "benchmarks", "scale", "--mesh", "data:0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr.splitlines() == ["error: --mesh data:0: expected gb200:RACKS or data:N (RACKS, N >= 1), e.g. "
                                       "gb200:2 or data:16"]


def test_each_committed_convergence_report_holds_its_own_grid():
    """Each text grid writes its own report and JSON; a committed one reproduced by another grid's command
    (a partial --recipe run once replaced the real-text grid's) would quote figures it does not hold."""
    from benchmarks.convergence_text import RESULTS_JSON
    here = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    flags = {"text": ("--recipe", "--length-sweep"), "recipe": ("--length-sweep",), "length_sweep": ("--recipe",)}
    for kind, name in RESULTS_JSON.items():
        with open(os.path.join(here, name)) as f:
            meta = json.load(f)["meta"]
        command = meta["command"].split()
        want = {"text": None, "recipe": "--recipe", "length_sweep": "--length-sweep"}[kind]
        assert want is None or want in command, (name, meta["command"])
        assert not set(flags[kind]) & set(command), (name, meta["command"])
        assert meta["runs_done"] == meta["runs_total"] or kind == "recipe", (name, meta["runs_done"], meta["runs_total"])


def test_data_sizes_past_the_devices_measure_nothing_and_say_so(tmp_path, capsys):
    """Every --data-sizes entry above the device count: exit 2, not a report whose every ratio
    is n/a and whose checks pass vacuously."""
    assert cli.main(["--data-sizes", "16", "--out", str(tmp_path / "r"), "traffic"]) == 2
    assert "--data-sizes 16: each is more than the 8 devices; nothing would be measured" in capsys.readouterr().err
