"""benchmarks.against: the step time against an earlier commit, as the report shows it."""

from benchmarks import against, report
from benchmarks.train_step import size_config
from train.config import load_config


def _speed(ratio):
    rev, here = 1.0, ratio
    return {"speed": {"against": {
        "rev": "fb6f378621ab9c79fddf0cc0613795285be2019f", "rev_subject": "model: one linear() helper",
        "devices": 8, "rounds": 2, "steps_per_round": 5, "step_time_s_rev": rev, "step_time_s_here": here,
        "ratio": here / rev, "step_times_s_here": [here] * 10, "target": against.TARGET}}}


def _misses(res):
    """The report's misses about the comparison (its speed point is left out here)."""
    (a,) = [res["speed"]["against"]]
    return [m for m in report.target_misses({"speed": {"point": _POINT, "against": a}}) if "commit" in m]


_POINT = {"size": "small", "data": 8, "model": {"d_model": 128, "layers": 4},
          "ratios": {"leaf_gather": None, "state_memory": None}}


def test_report_flags_a_step_slower_than_the_target_only():
    assert _misses(_speed(1.10)) == []
    (miss,) = _misses(_speed(1.20))
    assert "1.200x that of commit fb6f378621" in miss
    table = "\n".join(report.against_md(_speed(1.10)["speed"]["against"]))
    assert "| step time | 1000.0 ms | 1100.0 ms | **1.100** (target <= 1.15) |" in table


def test_shape_overrides_rebuild_the_same_model_and_batch():
    """What the older tree receives must give the same shapes from the plain defaults."""
    cfg = size_config("small", "nvfp4")
    again = load_config(None, against.shape_overrides(cfg))
    assert again.model == cfg.model
    assert (again.data.batch_size, again.data.markov_states) == (cfg.data.batch_size, cfg.data.markov_states)
    assert again.nvfp4.weights == "nvfp4"
