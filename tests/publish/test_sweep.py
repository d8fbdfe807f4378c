"""The sweep heatmap and report: axes are the swept variables, every cell's state distinct and captioned."""

import sys
import warnings

import numpy as np
import pytest
from matplotlib.patches import Rectangle

from twinrun.intervention_nodes import sweep_axis
from twinrun.publish.sweep import write_sweep_report
from twinrun.publish.sweep_plots import (
    CELL_STYLES,
    EFFECT_CMAP,
    EFFECT_GAMMA,
    EFFECT_SCALE,
    SCALE_NOTE,
    SWATCH_VALUES,
    cell_text,
    plot_sweep,
    sweep_caption,
    sweep_figure,
    sweep_grid,
)
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
    # the gate bins (sigma_pin 0.2 at σ 0.2, 1.2 at 1.2) are marked as gates, never an effect of 0
    assert g["states"] == [["gate", "within_2se"], ["failed", "failed"], ["below_noise", "no_se"],
                           ["effect", "gate"]]
    assert np.isnan(g["effect"][0, 0]) and np.isnan(g["effect"][3, 1])
    assert g["effect"][3, 0] == pytest.approx(0.5) and g["effect"][0, 1] == pytest.approx(0.1)
    assert g["gates"] == {(0, 0), (3, 1)}  # the gate bins of the points that reported them


def test_only_an_effect_beyond_two_se_is_resolved():
    cells = [_effect(0.2, 0.8, 0.09), _effect(0.5, 0.8, 0.1001), _effect(0.8, 1.0, 0.0),
             _effect(1.2, 1.3, 0.1)]
    states = sweep_grid(_summary(_point(0, ["a=1"], cells)))["states"][0]
    assert states == ["effect", "within_2se", "within_2se", "effect"]


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
    assert "grey 'n': below noise, no cosine defined (not 'no effect')" in caption  # never a failed gate
    assert "red × on pink: the point's checks or gates failed" in caption
    assert "hatched: |1 − cos| ≤ 2 SE" in caption
    assert "blank" not in caption
    assert "PinSigma" in caption and "intervention.sigma_pin" in caption
    assert "one panel per estimand (`all`, `cond`)" in caption  # the heatmap shows both
    assert "writes it ± its SE" in caption and SCALE_NOTE in caption  # the cells and the fixed scale
    assert "estimand (`cond`)" in sweep_caption(pin_sweep, estimand="cond")
    clean = sweep_caption(_summary(_point(0, ["a=1"], [_effect(0.2, 0.5, 0.01)])))
    assert "below noise" not in clean and "failed" not in clean  # only states that are present


def _figure(summary, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = sweep_figure(summary, **kw)
        fig.canvas.draw()  # layout and text are computed here: their warnings count too
    return fig


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_title().startswith("estimand")]


def test_one_panel_per_estimand_each_titled_and_the_figure_names_intervention_and_protocol(pin_sweep):
    fig = _figure(pin_sweep, protocol={"n_images": 40, "n_draws": 4, "n_folds": 8})
    assert [ax.get_title() for ax in _panels(fig)] == ["estimand `all`", "estimand `cond`"]
    assert "PinSigma" in fig.get_suptitle() and "40 images × 4 draws, 8 folds" in fig.get_suptitle()
    assert all(ax.get_ylabel() == "intervention.sigma_pin" for ax in _panels(fig))
    assert [ax.get_title() for ax in _panels(_figure(pin_sweep, estimands=["cond"]))] == ["estimand `cond`"]


def test_the_setting_every_point_shares_is_in_the_title_and_the_swept_one_is_not():
    points = [_scale(0, f, [f"intervention.factor={f}"], [_effect(0.2, 0.9, 0.01)]) for f in (0.0, 0.5)]
    title = _figure(_summary(*points)).get_suptitle()
    assert "ScaleModule(module=blocks.1.attn)" in title and "factor=" not in title


def test_the_colour_scale_is_fixed_whatever_the_data(pin_sweep):
    narrow = _summary(_point(0, ["a=1"], [_effect(0.2, 0.23, 0.01), _effect(0.5, 0.12, 0.01)]),
                      _point(1, ["a=2"], [_effect(0.2, 0.15, 0.01), _effect(0.5, 0.2, 0.01)]))
    for summary in (pin_sweep, narrow):  # effects 0–0.9 and 0.77–0.88: the same scale
        fig = _figure(summary)
        norms = [im.norm for ax in _panels(fig) for im in ax.images]
        assert norms and all((n.vmin, n.vmax, n.gamma) == (*EFFECT_SCALE, EFFECT_GAMMA) for n in norms)
        assert all(im.cmap.name == EFFECT_CMAP for ax in _panels(fig) for im in ax.images)
        cax = next(ax for ax in fig.axes if ax not in _panels(fig))
        bar = cax._colorbar  # private, but matplotlib keeps no public link from a colour bar's axes to it
        assert (bar.norm.vmin, bar.norm.vmax, bar.norm.gamma) == (*EFFECT_SCALE, EFFECT_GAMMA)
        ticks = {t.get_text() for t in cax.get_yticklabels()}
        assert {"0 same direction", "1 orthogonal", "2 opposite"} <= ticks


def _cell_texts(ax) -> dict:
    return {tuple(np.round(t.get_position(), 6)): t.get_text() for t in ax.texts}


def test_every_cell_with_a_number_writes_value_plus_minus_se(pin_sweep):
    fig = _figure(pin_sweep)
    for ax, estimand in zip(_panels(fig), ["all", "cond"]):
        g = sweep_grid(pin_sweep, estimand)
        texts = _cell_texts(ax)
        for r, row in enumerate(g["states"]):
            for c, state in enumerate(row):
                text = texts.get((c, r), "")
                if state in ("effect", "within_2se", "no_se"):
                    value, se = g["effect"][r, c], g["se"][r, c]
                    written = abs(value) if round(value, 2) == 0 else value  # no "-0.00"
                    assert text.startswith(f"{written:.2f}") and "±" in text
                    assert ("no SE" in text) if np.isnan(se) else text.endswith(f"±{se:.2f}")
                else:
                    assert "±" not in text
    assert cell_text(-0.001, 0.02) == "0.00\n±0.02" and cell_text(0.1234, 0.0042) == "0.1234\n±0.0042"


def test_a_below_noise_cell_says_what_each_arm_carried():
    effect = {**_effect(0.2, None, None), "norm2": 104.6, "norm2_se": 5.77, "norm2_base": 0.1356,
              "norm2_base_se": 0.646}
    ax = _panels(_figure(_summary(_point(0, ["a=1"], [effect]))))[0]
    assert sorted(t.get_text() for t in ax.texts) == ["arm 105±5.8\ntwin 0.14±0.65", "n"]


def _legend_swatches(fig) -> dict:
    """Each legend label with the rectangles of its swatch (a value state's swatch is a strip of colours)."""
    legend = fig.legends[0]
    rects = iter(legend.findobj(Rectangle))
    by_label = {style.legend: state for state, style in CELL_STYLES.items()}
    out = {}
    for text in legend.get_texts():
        state = by_label.get(text.get_text())
        n = len(SWATCH_VALUES) if state and CELL_STYLES[state].fill is None else 1
        out[text.get_text()] = [next(rects) for _ in range(n)]
    return out


def test_legend_swatches_are_coloured_as_the_cells_they_name(pin_sweep):
    fig = _figure(pin_sweep)
    ax = _panels(fig)[0]
    image = ax.images[0]
    swatches = _legend_swatches(fig)
    g = sweep_grid(pin_sweep, "all")
    for r, row in enumerate(g["states"]):
        for c, state in enumerate(row):
            style = CELL_STYLES[state]
            swatch = swatches[style.legend]
            at_cell = [p for p in ax.patches if np.allclose(p.get_xy(), (c - 0.5, r - 0.5))]
            if style.fill is not None:  # a fixed fill: the swatch's is the cell's
                fill = next(p for p in at_cell if p.get_fill())
                assert swatch[0].get_facecolor() == fill.get_facecolor(), state
            else:  # the effect's colour: the swatch is the image's own scale, end to end, hatched as the cell
                scale = [image.cmap(image.norm(v)) for v in SWATCH_VALUES]
                assert [tuple(s.get_facecolor()) for s in swatch] == [tuple(x) for x in scale], state
                assert SWATCH_VALUES[0] == EFFECT_SCALE[0] and SWATCH_VALUES[-1] == EFFECT_SCALE[1]
                hatches = {p.get_hatch() for p in at_cell if not p.get_fill() and p.get_hatch()} or {""}
                assert {s.get_hatch() or "" for s in swatch} == hatches, state
    gate = swatches["orange box: no-op gate bin"][0]
    boxes = [p for p in ax.patches if not p.get_fill() and p.get_linewidth() == 2.5]
    assert boxes and all(b.get_edgecolor() == gate.get_edgecolor() for b in boxes)


def test_heatmap_titles_intervention_and_estimand_and_hatches_uncertain_cells(pin_sweep, tmp_path):
    assert plot_sweep(pin_sweep, tmp_path / "h.png") == tmp_path / "h.png"
    assert (tmp_path / "h.png").stat().st_size > 5000
    ax = _panels(_figure(pin_sweep))[0]
    hatched = {(p.get_x() + 0.5, p.get_y() + 0.5) for p in ax.patches if p.get_hatch() == "///"}
    assert hatched == {(1, 0)}  # (column, row) of the cell within 2 SE; the gate cell is no value
    texts = {(t.get_position(), t.get_text()) for t in ax.texts}
    assert ((0, 0), "gate") in texts and ((1, 3), "gate") in texts
    assert ((0, 2), "n") in texts and ((0, 1), "×") in texts and ((1, 1), "×") in texts


@pytest.mark.parametrize("state", ["fixture", "one_cell", "all_below_noise", "all_failed", "one_estimand"])
def test_every_state_writes_a_png_without_warnings(state, pin_sweep, tmp_path):
    summary = {"fixture": pin_sweep, "one_cell": _summary(_point(0, ["a=1"], [_effect(0.2, 0.5, 0.01)])),
               "all_below_noise": _summary(*(_point(j, [f"a={j}"], [_effect(s, None, None, e)
                                                                      for s in (0.1, 1.0)
                                                                      for e in ("all", "cond")])
                                             for j in (0, 1))),
               "all_failed": _summary(_point(0, ["a=1"], [_effect(0.2, 0.5, 0.01)], gates_passed=False)),
               "one_estimand": pin_sweep}[state]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_sweep(summary, tmp_path / "h.png", estimand="cond" if state == "one_estimand" else None)
    assert path == tmp_path / "h.png" and path.stat().st_size > 5000


def test_nothing_to_show_writes_no_heatmap(tmp_path):
    unfinished = _summary(_point(0, ["a=1"], valid=None, gates_passed=None))
    assert plot_sweep(unfinished, tmp_path / "h.png") is None and not (tmp_path / "h.png").exists()


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
    # Points named by experiment files, not by the knob: the declared axis (factor) orders and labels rows.
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
    axis = sweep_axis({"_target_": "twinrun.interventions.ScaleInput", "factor": 2.0})
    assert axis["key"] == "intervention.factor"
    # a module nobody imported is not imported to find out (it would run code named by a file)
    assert sweep_axis({"_target_": "tw_never_imported_module.Evil", "x": 1}) is None
    assert "tw_never_imported_module" not in sys.modules
