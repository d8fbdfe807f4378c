"""The sweep heatmap and report: axes are the swept variables, every cell's state is distinct and
captioned."""

import sys

import matplotlib.pyplot as plt
import pytest

from twinrun.interventions import sweep_axis
from twinrun.publish import plots
from twinrun.publish.plots import plot_sweep, sweep_caption, sweep_grid
from twinrun.publish.sweep import write_sweep_report
from twinrun.storage.sweepdir import SweepDir


def _effect(sigma, cos, se, estimand="all"):
    return {"sigma": sigma, "estimand": estimand, "cos": cos, "se": se}


def _point(job, overrides, effects=(), valid=True, gates_passed=True, gate_sigmas=(), target="PinSigma"):
    return {"run_dir": f"/sweep/{job}", "overrides": ["+experiment=pin_sigma", *overrides],
            "intervention": {"_target_": f"twinrun.interventions.{target}"}, "status": "measured",
            "checks_passed": valid, "gates_passed": gates_passed, "effects": list(effects),
            "gate_sigmas": list(gate_sigmas)}


def _summary(*points):
    return {"sweep_dir": "/sweep", "n_points": len(points), "points": list(points),
            "all_valid": all(p["checks_passed"] and p["gates_passed"] for p in points)}


@pytest.fixture
def pin_sweep():
    """sigma_pin 1.2 listed before 0.2; one point failed its gate; every kind of cell present."""
    return _summary(
        _point(0, ["intervention.sigma_pin=1.2"], [_effect(0.2, 0.5, 0.01), _effect(1.2, 1.0, 0.0)],
               gate_sigmas=[1.2]),
        _point(1, ["intervention.sigma_pin=0.2"], [_effect(0.2, 1.0, None), _effect(1.2, 0.9, 0.08),
                                                   _effect(1.2, 0.1, 0.01, estimand="cond")],
               gate_sigmas=[0.2]),
        _point(2, ["intervention.sigma_pin=0.5"], valid=True, gates_passed=False),
        _point(3, ["intervention.sigma_pin=0.8"], [_effect(0.2, None, None), _effect(1.2, 0.7, None)]),
    )


def test_rows_are_the_swept_knob_in_numeric_order_and_every_cell_state_is_distinct(pin_sweep):
    g = sweep_grid(pin_sweep)
    assert g["row_axis"] == "intervention.sigma_pin" and g["rows"] == ["0.2", "0.5", "0.8", "1.2"]
    assert g["sigmas"] == [0.2, 1.2]
    assert g["states"] == [["no_se", "within_2se"], ["failed", "failed"], ["below_noise", "no_se"],
                           ["effect", "within_2se"]]
    assert g["effect"][3, 0] == pytest.approx(0.5) and g["effect"][0, 1] == pytest.approx(0.1)
    assert g["gates"] == {(0, 0), (3, 1)}  # the gate bins of the points that reported them


def test_only_an_effect_beyond_two_se_is_resolved():
    cells = [_effect(0.2, 0.8, 0.09), _effect(0.5, 0.8, 0.1001), _effect(0.8, 1.0, 0.0),
             _effect(1.2, 1.3, 0.1)]
    assert (sweep_grid(_summary(_point(0, ["a=1"], cells)))["states"][0]
            == ["effect", "within_2se", "within_2se", "effect"])


def test_sweeping_the_grid_gives_one_row_per_grid_and_marks_bins_a_grid_lacks():
    g = sweep_grid(_summary(
        _point(0, ["sigma_grid=edm8"], [_effect(0.2, 0.5, 0.01), _effect(0.5, 0.6, 0.01)]),
        _point(1, ["sigma_grid=coarse4"], [_effect(0.5, 0.4, 0.01), _effect(3.0, 0.3, 0.01)])))
    assert g["row_axis"] == "sigma_grid" and g["rows"] == ["edm8", "coarse4"]
    assert g["states"] == [["effect", "effect", "not_measured"], ["not_measured", "effect", "effect"]]


def test_two_swept_knobs_label_rows_with_both():
    g = sweep_grid(_summary(_point(0, ["a=1", "b=x"], [_effect(0.2, 0.5, 0.01)]),
                            _point(1, ["a=2", "b=y"], [_effect(0.2, 0.5, 0.01)])))
    assert g["row_axis"] == "sweep point" and g["rows"] == ["a=1, b=x", "a=2, b=y"]
    alone = sweep_grid(_summary(_point(0, ["a=1"], [_effect(0.2, 0.5, 0.01)])))
    assert alone["row_axis"] == "sweep point" and alone["rows"] == ["0"]  # nothing swept: the job's name


def test_caption_names_below_noise_and_failed_cells_for_what_they_are(pin_sweep):
    caption = sweep_caption(pin_sweep)
    assert "grey 'n': below noise, no cosine defined" in caption  # never passed off as a failed gate
    assert "red ×: the point's checks or gates failed" in caption and "hatched: |1 − cos| ≤ 2 SE" in caption
    assert "blank" not in caption
    assert "PinSigma" in caption and "estimand `all`" in caption and "intervention.sigma_pin" in caption
    clean = sweep_caption(_summary(_point(0, ["a=1"], [_effect(0.2, 0.5, 0.01)])))
    assert "below noise" not in clean and "failed" not in clean  # only states that are present


def test_heatmap_titles_intervention_and_estimand_and_hatches_uncertain_cells(pin_sweep, tmp_path,
                                                                              monkeypatch):
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    assert plot_sweep(pin_sweep, tmp_path / "h.png", estimand="all") == tmp_path / "h.png"
    assert (tmp_path / "h.png").stat().st_size > 5000
    ax = figures[0].axes[0]
    assert "PinSigma" in ax.get_title() and "`all`" in ax.get_title()
    assert ax.get_ylabel() == "intervention.sigma_pin"
    hatched = {(p.get_x() + 0.5, p.get_y() + 0.5) for p in ax.patches if p.get_hatch() == "///"}
    assert hatched == {(1, 0), (1, 3)}  # (column, row) of both cells within 2 SE
    legend = {h.get_label(): h.get_hatch() for h in figures[0].legends[0].legend_handles}
    assert legend["hatched: |1 − cos| ≤ 2 SE, no effect resolved"] == "///" and "no-op gate bin" in legend
    texts = {(t.get_position(), t.get_text()) for t in ax.texts}
    assert ((0, 2), "n") in texts and ((0, 1), "×") in texts and ((1, 1), "×") in texts
    plt.close(figures[0])


def test_sweep_report_words_plurals_and_flags(tmp_path):
    for job in (0, 1):
        (tmp_path / str(job)).mkdir()
    one = _summary(_point(0, ["x=1"], [_effect(0.2, 0.5, 0.01)]))
    one["points"][0]["run_dir"] = str(tmp_path / "0")
    text = write_sweep_report(SweepDir(tmp_path), one).read_text()
    assert "1 point;" in text and "1 points" not in text
    two = _summary(_point(0, ["x=1"], [_effect(0.2, 0.5, 0.01)]),
                   _point(1, ["x=2"], valid=None, gates_passed=None))
    for job, p in enumerate(two["points"]):
        p["run_dir"] = str(tmp_path / str(job))
    text = write_sweep_report(SweepDir(tmp_path), two).read_text()
    assert "2 points;" in text and "Swept: `x`." in text
    assert not any(word in text for word in ("True", "False", "None"))
    assert "| yes | yes |" in text and "| – | – |" in text


def _scale(job, factor, overrides, effects):
    point = _point(job, overrides, effects, target="ScaleModule")
    point["intervention"] = {"_target_": "twinrun.interventions.ScaleModule", "module": "blocks.1.attn",
                             "factor": factor}
    return point


def test_rows_follow_the_interventions_declared_axis_whatever_the_overrides_say():
    # Points named by experiment files, not by the knob: the declared axis (factor) orders and labels
    # the rows.
    points = [_scale(0, 0.5, ["+experiment=half"], [_effect(0.2, 0.9, 0.01)]),
              _scale(1, 0.0, ["+experiment=ablate"], [_effect(0.2, 0.4, 0.01)])]
    for p in points:
        p["axis"] = sweep_axis(p["intervention"])
    g = sweep_grid(_summary(*points))
    assert g["row_axis"] == "intervention.factor" and g["rows"] == ["0.0", "0.5"]
    assert g["effect"][0, 0] == pytest.approx(0.6) and "ScaleModule" in g["intervention"]


def test_the_axis_is_read_from_twinruns_classes_never_imported_from_a_run_directory():
    assert sweep_axis({"_target_": "twinrun.interventions.PinSigma", "sigma_pin": 1.2}) == \
        {"key": "intervention.sigma_pin", "value": 1.2}
    assert sweep_axis({"_target_": "twinrun.interventions.ScaleInput", "factor": 2.0})["key"] == \
        "intervention.factor"
    # a module nobody imported is not imported to find out (it would run code named by a file)
    assert sweep_axis({"_target_": "tw_never_imported_module.Evil", "x": 1}) is None
    assert "tw_never_imported_module" not in sys.modules
