"""``python -m benchmarks serving``: every row gets the same budget, the fine-tune continues
the bf16 run, and the report's gap arithmetic (no training here: ``test_hf_import`` covers
the import the rows go through)."""

import json

import pytest

from benchmarks import convergence_text as ct
from benchmarks import serving


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return ct.build_corpus(str(tmp_path_factory.mktemp("serving")), max_bytes=100_000)


def test_every_row_has_the_same_budget(corpus, tmp_path):
    specs = serving.specs("default", 2000, [0, 1], str(tmp_path), corpus)
    assert [s["row"] for s in specs] == ["bf16", "native", "qat", "ptq"] * 2
    for seed in (0, 1):
        bf16, native, qat, ptq = (s for s in specs if s["seed"] == seed)
        assert bf16["steps"] == native["steps"] == 2000 and qat["steps"] == 200
        # The fine-tune starts from the bf16 run's export after the other 1800 steps; the PTQ
        # row quantizes its final export.
        assert sorted(bf16["export_hf"]) == [1800, 2000]
        assert f"train.init_from={bf16['export_hf'][1800]}" in qat["extra"]
        assert ptq["source"] == bf16["export_hf"][2000]
        cfg, _ = ct.run_config(qat["size"], qat["steps"], seed, qat["variant"], corpus, qat["extra"])
        assert (cfg.nvfp4.weights, cfg.train.steps, cfg.optim.schedule, cfg.data.seed) == ("nvfp4", 200, "constant",
                                                                                            seed + 1000)
        # Same batches for the bf16 and native runs of a seed.
        a, _ = ct.run_config("default", 2000, seed, "bf16", corpus)
        b, _ = ct.run_config("default", 2000, seed, "nvfp4", corpus)
        assert a.data == b.data and a.train.seed == b.train.seed
    # The fine-tune's learning rate is the bf16 schedule's over its last 200 steps: between the
    # cosine's final value (0.1 x lr) and its value at step 1800.
    lr = serving.tail_lr("default", 2000, 200, corpus)
    assert 0.1 * 3e-3 < lr < 0.13 * 3e-3


def test_gaps_report_and_plot(tmp_path):
    seeds = [0, 1, 2]
    specs = [{"row": r, "seed": s, "steps": 200 if r == "qat" else 2000, "name": f"{r}-{s}"}
             for s in seeds for r in serving.ROWS]
    vals = {"bf16": [2.0, 2.1, 2.2], "ptq": [2.1, 2.2, 2.3], "native": [2.02, 2.1, 2.24], "qat": [2.04, 2.12, 2.2]}
    results = {f"{r}-{s}": {"final_val_loss": vals[r][s], "val_history": [[200, vals[r][s] + 0.5], [2000, vals[r][s]]]}
               for r in serving.ROWS for s in seeds}
    agg = serving.aggregate(results, specs, seeds)
    assert agg["rows"]["bf16"]["gap_pct"]["mean"] == 0
    assert agg["rows"]["ptq"]["per_seed"][0]["gap_pct"] == pytest.approx(5.0)
    assert agg["rows"]["native"]["gap_pct"]["min"] == pytest.approx(0.0)
    # native - ptq, paired: (1 - 5), (0 - 4.76), (1.82 - 4.55) percentage points.
    assert agg["pairs"]["native-ptq"]["max"] < 0
    meta = {"command": "python -m benchmarks serving", "where": "here", "git_commit": None, "wall_min": 1.0,
            "runs_done": 12, "runs_total": 12, "size": "default", "model": "m", "steps": 2000, "tail_steps": 200,
            "tokens_per_step": "16 x 64", "seeds": seeds}
    path = serving.report({"meta": meta, "aggregate": agg}, str(tmp_path))
    text = open(path).read()
    assert "| bf16 training, then round-to-nearest NVFP4" in text and "+5.00" in text
    serving.plot(agg, str(tmp_path / "serving.png"), 2000)
    assert (tmp_path / "serving.png").stat().st_size > 10_000
    json.dumps(agg)
