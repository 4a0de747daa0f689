"""What a run shows at the end: the summary lines, the loss plot, the scaling plot."""

import numpy as np

from benchmarks import report
from train import __main__ as cli
from train import summary as summary_lib


def _run(label, history, **kw):
    r = {"label": label, "steps": len(history), "final_loss": float(np.mean(history[-20:])), "final_loss_steps": 20,
         "last_loss": history[-1], "final_val_loss": None, "val_history": [], "entropy_floor": 1.5,
         "median_step_time_s": 0.1, "skipped_steps": 0, "history": history, "all_gather_bytes": 172_864,
         "bf16_gather_bytes": 491_520, "nvfp4_gather_bytes": 107_328, "nvfp4_bf16_gather_bytes": 425_984}
    r.update(kw)
    return r


def _summary(runs):
    s = {"runs": runs, "gather_vs_bf16": 172_864 / 491_520, "nvfp4_gather_vs_bf16": 107_328 / 425_984}
    if len(runs) == 2:
        s.update(final_loss_gap=runs[0]["final_loss"] - runs[1]["final_loss"],
                 gathered_bytes_ratio=172_864 / 300_000, step_time_ratio=1.1)
    return s


def test_summary_names_its_loss_and_one_gather_ratio(capsys):
    h = list(np.linspace(5, 1.6, 100))
    cli.print_summary(_summary([_run("nvfp4 weights", h), _run("bf16 weights", h, all_gather_bytes=300_000)]), "out")
    out = capsys.readouterr().out
    assert out.count("mean training loss over the last 20 steps") == 2 and "last step 1.6000" in out
    # One line gives "the" gather ratio, naming both sides; every other ratio says what it divides.
    assert sum(l.startswith("packed gather ratio: ") for l in out.splitlines()) == 1
    assert ("packed gather ratio: 0.25195 = the NVFP4 weights' all-gathers, 107,328 B/step/device / a bf16 gather "
            "of the same weights, 425,984 B") in out
    assert "129/512 = 0.25195 of bf16" in out  # the 16x16-tile value, printed as precisely as the ratio
    assert "whole model, weights kept in bf16 included: 172,864 B = 0.3517 x a bf16 gather of the same params" in out
    assert "params all-gathered, NVFP4 run / bf16 run (each run's own HLO" in out
    assert "limit" not in out
    # A compare rerun onto a finished checkpoint trains no NVFP4 step: no gap and no step time to divide.
    s = _summary([_run("nvfp4 weights", h), _run("bf16 weights", h)])
    s.update(final_loss_gap=float("nan"))
    del s["step_time_ratio"]
    cli.print_summary(s, "out")
    out = capsys.readouterr().out
    assert "above): n/a (a run trained no step here)" in out and "nan" not in out


def test_loss_plot_has_a_difference_panel_and_plain_labels(tmp_path):
    a = [5.0, 3.0, 2.0, 1.7, 1.6]
    b = [5.0, 3.1, 2.0, 1.6, 1.7]
    fig = summary_lib.plot_losses([_run("nvfp4 weights", a), _run("bf16 weights", b)], str(tmp_path / "loss.png"), 1.5)
    assert (tmp_path / "loss.png").stat().st_size > 0
    top, diff = fig.axes
    curves = [l for l in top.get_lines() if len(l.get_xdata()) == 5]
    assert len(curves) == 2
    assert curves[0].get_linestyle() != curves[1].get_linestyle() and curves[0].get_color() != curves[1].get_color()
    np.testing.assert_allclose(diff.get_lines()[0].get_ydata(), np.subtract(a, b))
    labels = [t.get_text() for t in top.get_yticklabels(which="both") if t.get_text()]
    assert labels and not any("times" in t or "^" in t or "$" in t for t in labels), labels
    # One run: no difference panel.
    assert len(summary_lib.plot_losses([_run("nvfp4 weights", a)], str(tmp_path / "one.png"), None).axes) == 1


def test_scaling_plot_marks_the_weight_formats_apart(tmp_path):
    def point(size, data):
        fmt = lambda k: {"gather": {"param_gather_bytes": 1000 * k * data}, "memory": {"total": 10_000 * k},
                         "step_time_s": 0.01 * k}
        return {"size": size, "data": data, "nvfp4": fmt(1), "bf16": fmt(3),
                "ratios": {"leaf_gather": 0.2519, "model_gather": 0.33}}

    fig = report.plot_scaling([point("tiny", 2), point("tiny", 4), point("tiny", 8)], str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 0
    gather = fig.axes[0]
    by_label = {l.get_label(): l for l in gather.get_lines()}
    assert by_label["tiny nvfp4"].get_marker() != by_label["tiny bf16"].get_marker()
    xlabels = [t.get_text() for t in gather.get_xticklabels() if t.get_text()]
    assert xlabels == ["2", "4", "8"]
    assert not any("$" in t.get_text() for ax in fig.axes for t in ax.get_yticklabels() if t.get_text())


def test_report_links_point_to_the_report_written(tmp_path):
    assert report.report_path(str(tmp_path)) == str(tmp_path / "REPORT.md")  # outside the repository: as is
    root = report.os.path.dirname(report.os.path.dirname(report.os.path.abspath(report.__file__)))
    assert report.report_path(report.os.path.join(root, "runs", "benchmarks-quick")) == "runs/benchmarks-quick/REPORT.md"
    assert report.report_path(report.os.path.join(root, "benchmarks", "results")) == "benchmarks/results/REPORT.md"
    assert "details in [runs/q/REPORT.md](runs/q/REPORT.md)" in report.headline(
        {"quantize": {"meta": {"platform": "cpu"}, "result": {"size": [8, 8], "quantize_16x16_GBps": 1.0,
                                                              "same_bytes_quantize_GBps": 2.0,
                                                              "quantize_16x16_vs_same_bytes": 0.5}}}, "runs/q/REPORT.md")
