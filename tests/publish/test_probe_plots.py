"""effect.png reads honestly: inspected through its Axes artists, not its pixels.

A below-noise bin has no number and must never sit on the no-effect value; σ ticks are the run's
bins; the ratio is on a log axis with a line at 1; titles name intervention, setting, protocol and
estimand; every state (all below noise, withheld, one bin, nothing given) renders without a warning.
"""

import warnings

import numpy as np
import pytest
from matplotlib.collections import LineCollection

from twinrun.publish.probe_plots import effect_caption, effect_figure, plot_effect

BINS = [0.1, 0.2, 0.5, 1.2, 3.0]
ABLATION = {"_target_": "twinrun.interventions.ScaleModule", "module": "blocks.1.attn", "factor": 0.0}
PROBE = {"n_images": 40, "n_draws": 4, "n_folds": 8, "params": ["*"]}


def _row(sigma, estimand, cos=None, ratio=None, norm2=50.0, norm2_base=0.2):
    """One effect row as the reducer writes it; cos None means below noise (no cos, no ratio)."""
    below = cos is None
    return {"sigma": sigma, "estimand": estimand, "gate": False, "cos": cos, "se": None if below else 0.02,
            "norm_ratio": None if below else ratio, "norm_ratio_se": None if below else 0.3, "cos_naive": 0.5,
            "below_noise": below, "norm2": norm2, "norm2_se": 2.0, "norm2_base": norm2_base,
            "norm2_base_se": 0.6, "t_crit": 2.36}


def _summary(effects, passed=True, gates=(0.5,)):
    return {"arms": ["scale_module", "native"], "passed": passed, "effects": effects,
            "gates": [{"sigma": s, "estimand": "all", "passed": passed} for s in gates]}


@pytest.fixture
def mixed():
    """`all`: numbers at 0.2, 0.5 (the gate: exactly no effect) and 3.0, below noise at 0.1 and 1.2;
    `cond`: below noise everywhere, yet the arm's |μ|² is far above the twin's."""
    all_ = [_row(0.1, "all"), _row(0.2, "all", 0.6, 4.0), _row(0.5, "all", 1.0, 1.0), _row(1.2, "all"),
            _row(3.0, "all", 0.8, 2.5)]
    return _summary(all_ + [_row(s, "cond", norm2=900.0) for s in BINS])


def _figure(summary, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = effect_figure(summary, **{"intervention": ABLATION, "protocol": PROBE, "sigmas": BINS, **kw})
        fig.canvas.draw()  # layout and tick labels are computed here: their warnings count too
    return fig


def _grid(fig):
    """The 3 × n_estimands axes: rows 1 − cos, norm ratio, |μ|²."""
    axes = [ax for ax in fig.axes if ax.get_subplotspec() is not None]
    n_cols = axes[0].get_subplotspec().get_gridspec().ncols
    return np.array(axes).reshape(3, n_cols)


def _data_points(ax) -> np.ndarray:
    """Every (x, y) that an artist places in data coordinates: markers, lines and error bars."""
    pts = [line.get_xydata() for line in ax.lines if line.get_transform() == ax.transData]
    pts += [np.concatenate(c.get_segments()) for c in ax.collections
            if isinstance(c, LineCollection) and c.get_segments()]
    return np.concatenate(pts) if pts else np.empty((0, 2))


def _below_noise_sigmas(summary, estimand):
    """The below-noise bins that are not gate bins (a gate bin is marked as the gate, whatever its row)."""
    gates = {g["sigma"] for g in summary["gates"]}
    return [e["sigma"] for e in summary["effects"] if e["estimand"] == estimand and e["below_noise"]
            and e["sigma"] not in gates]


def test_a_below_noise_bin_is_never_drawn_on_the_no_effect_value(mixed):
    grid = _grid(_figure(mixed))
    for col, estimand in enumerate(["all", "cond"]):
        gaps = _below_noise_sigmas(mixed, estimand)
        for ax in grid[:2, col]:  # 1 − cos and the ratio: no number there, so nothing at all in data space
            pts = _data_points(ax)
            assert not np.isin(pts[:, 0], gaps).any(), f"a value drawn at a below-noise σ of {estimand}"
            labels = {t.get_position()[0] for t in ax.texts if t.get_text() == "below noise"}
            assert labels == set(gaps)
            # the label spans the axis (y in axes coordinates), so it sits on no value of the axis
            assert all(t.get_transform() == ax.get_xaxis_transform() for t in ax.texts)



def test_a_gate_bin_is_a_labelled_band_never_an_effect_at_zero(mixed):
    """The gate's arms are equal by construction: a value of 0 there would draw a V through no effect."""
    grid = _grid(_figure(mixed))
    for ax in grid[:2].flat:  # 1 − cos and the ratio: nothing in data space at the gate's σ
        assert not np.isin(_data_points(ax)[:, 0], [0.5]).any()
        assert {t.get_position()[0] for t in ax.texts if t.get_text() == "no-op gate"} == {0.5}
    assert (_data_points(grid[0, 0])[:, 0] == 0.2).any()  # the bins beside it keep their values
    # each arm's |μ|² is measured at the gate too, and drawn
    assert np.isclose(grid[2, 0].lines[0].get_xdata(), 0.5 * 0.97).any()
    # no line joins the bins either side of the gate across it: 0.2 and 3.0 are separate segments
    for line in (x for x in grid[0, 0].lines if x.get_transform() == grid[0, 0].transData):
        xs = np.asarray(line.get_xdata(), dtype=float)
        assert not ((xs < 0.5).any() and (xs > 0.5).any())


def test_an_ablation_below_noise_everywhere_shows_each_arms_signal_not_no_effect(mixed):
    grid = _grid(_figure(mixed))
    lines = {line.get_gid(): line for line in grid[2, 1].lines}
    arm_line, twin_line = lines["norm2"], lines["norm2_base"]
    assert list(arm_line.get_ydata()) == [900.0] * len(BINS)
    assert list(twin_line.get_ydata()) == [0.2] * len(BINS)
    assert grid[2, 1].get_yscale() == "symlog"  # a debiased |μ|² of noise may be negative


def test_sigma_ticks_are_exactly_the_runs_bins_on_a_log_axis(mixed):
    for ax in _grid(_figure(mixed)).flat:
        assert ax.get_xscale() == "log"
        assert list(ax.get_xticks()) == BINS and len(ax.xaxis.get_minorticklocs()) == 0
    bottom = _grid(_figure(mixed))[2, 0]
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["0.1", "0.2", "0.5", "1.2", "3"]


def test_a_bin_without_any_effect_row_is_still_a_tick():
    one = _summary([_row(0.2, "all", 0.6, 4.0)])
    assert list(_grid(_figure(one))[0, 0].get_xticks()) == BINS


def test_ratio_on_a_log_axis_with_a_line_at_one_and_cos_with_a_line_at_zero(mixed):
    grid = _grid(_figure(mixed))
    for ax_cos, ax_ratio in zip(grid[0], grid[1]):
        assert ax_ratio.get_yscale() == "log"
        refs = {(ax, tuple(line.get_ydata())) for ax in (ax_cos, ax_ratio) for line in ax.lines
                if line.get_transform() == ax.get_yaxis_transform()}
        assert (ax_cos, (0, 0)) in refs and (ax_ratio, (1, 1)) in refs
        lo, hi = ax_ratio.get_ylim()
        assert lo < 1 < hi


def test_titles_name_the_intervention_its_setting_the_protocol_and_each_estimand(mixed):
    fig = _figure(mixed)
    title = fig.get_suptitle()
    assert "ScaleModule(module=blocks.1.attn, factor=0.0)" in title and "native twin" in title
    assert "40 images × 4 draws, 8 folds" in title
    assert [ax.get_title() for ax in _grid(fig)[0]] == ["estimand `all`", "estimand `cond`"]
    bare = _figure(mixed, intervention=None, protocol=None)
    assert "arm `scale_module` (setting not given)" in bare.get_suptitle()
    assert "protocol not given" in bare.get_suptitle()


def _legend_labels(fig):
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_every_bin_below_noise_renders_without_warnings_and_with_a_legend_of_what_is_drawn():
    summary = _summary([_row(s, e) for s in BINS for e in ("all", "cond", "residual")], gates=())
    fig = _figure(summary)
    labels = _legend_labels(fig)
    assert labels and not any(label.startswith("measured") for label in labels)  # nothing measured
    assert any(label.startswith("below noise") for label in labels)
    assert not any("gate" in label for label in labels)
    ax_cos, ax_ratio = _grid(fig)[:2, 0]
    assert ax_cos.get_ylim()[0] < 0 < ax_cos.get_ylim()[1]
    assert ax_ratio.get_ylim()[0] < 1 < ax_ratio.get_ylim()[1]


def test_a_failed_run_draws_no_numbers():
    fig = _figure(_summary([_row(0.2, "all", 0.6, 4.0)], passed=False))
    assert not any(ax.has_data() for ax in fig.axes)
    assert any("effects withheld" in t.get_text() for t in fig.texts)


@pytest.mark.parametrize("state", ["mixed", "all_below", "failed", "one_bin", "bare", "no_gates"])
def test_every_state_writes_a_png_without_warnings(state, mixed, tmp_path):
    summary = {"mixed": mixed, "all_below": _summary([_row(s, "all") for s in BINS]),
               "failed": _summary(mixed["effects"], passed=False),
               "one_bin": _summary([_row(1.2, "all", 0.9, 3.0)]), "bare": mixed,
               "no_gates": _summary(mixed["effects"], gates=())}[state]
    kw = {} if state == "bare" else {"intervention": ABLATION, "protocol": PROBE, "sigmas": BINS}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_effect(summary, tmp_path / "effect.png", **kw) == tmp_path / "effect.png"
    assert (tmp_path / "effect.png").stat().st_size > 5000


def test_the_caption_explains_only_what_is_drawn(mixed):
    caption = effect_caption(mixed)
    assert "below noise" in caption and "not \"no effect\"" in caption and "no-op gate" in caption
    clean = effect_caption(_summary([_row(0.2, "all", 0.6, 4.0)], gates=()))
    assert "below noise" not in clean and "gate" not in clean and "log axis" in clean
    assert "failed" in effect_caption(_summary(mixed["effects"], passed=False))


def _train_effect(step, distance, floor, machinery=0.0, replicate=0.0):
    return {"step": step, "estimand": "all", "distance": distance, "floor": floor, "margin": 2.0,
            "machinery_distance": machinery, "replicate_distance": replicate}


def test_distance_png_draws_bit_identical_arms_as_exact_marks_in_a_labelled_strip_not_at_a_height():
    from twinrun.publish.train_plots import EXACT_BAND, distance_figure

    summary = {"effects": [_train_effect(2, 3e-3, 1e-4), _train_effect(4, 5e-3, 2e-4, replicate=1e-9)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = distance_figure(summary, "all")
        fig.canvas.draw()
    ax = fig.axes[0]
    exact = [line for line in ax.lines if "bit-identical" in str(line.get_label())]
    assert {line.get_label().split(":")[0] for line in exact} == {"machinery", "replicate"}
    for line in exact:  # y in axes fraction, inside the strip: at no value of the log axis
        assert line.get_transform() != ax.transData
        assert all(0 < y < EXACT_BAND for y in line.get_ydata())
    machinery = next(line for line in exact if line.get_label().startswith("machinery"))
    assert list(machinery.get_xdata()) == [2, 4]
    replicate = next(line for line in exact if line.get_label().startswith("replicate"))
    assert list(replicate.get_xdata()) == [2]  # at step 4 it moved (1e-9): a value on the axis
    assert "bit-identical (distance exactly 0) ↓" in [t.get_text() for t in ax.texts]
    lo, _ = ax.get_ylim()  # every positive distance sits above the strip
    frac = (np.log10(1e-9) - np.log10(lo)) / np.subtract(*np.log10(ax.get_ylim())[::-1])
    assert frac > EXACT_BAND
    in_data = np.concatenate([line.get_xydata() for line in ax.lines if line.get_transform() == ax.transData])
    assert np.nanmin(in_data[:, 1]) >= 1e-9  # nothing in data space below the smallest real distance


def _loss(step, arm, role, held, train):
    return {"step": step, "arm": arm, "role": role, "heldout_loss": held, "train_loss_steps": train,
            "heldout_diff": held - 0.5, "heldout_diff_se": 0.01, "t_crit": 2.0}


def test_loss_png_says_which_arms_sit_bit_identical_on_the_twins_line(tmp_path):
    from matplotlib import image

    from twinrun.publish import train_plots

    rows = [_loss(2, a, r, 0.5, [0.7, 0.6]) for a, r in (("native", "twin"), ("machinery", "machinery"))]
    rows += [_loss(2, "scale_lr", "intervention", 0.55, [0.7, 0.62])]
    summary = {"arms": ["scale_lr", "native", "machinery"], "losses": rows}
    shown = {}
    real = train_plots.save_figure
    train_plots.save_figure = lambda fig, path: shown.update(fig=fig) or real(fig, path)
    try:
        train_plots.plot_losses(summary, tmp_path / "loss.png")
    finally:
        train_plots.save_figure = real
    labels = [t.get_text() for ax in shown["fig"].axes for t in ax.get_legend().get_texts()]
    assert "machinery (machinery): bit-identical to the twin, on its line" in labels
    assert not any("scale_lr" in x and "bit-identical" in x for x in labels)
    assert image.imread(tmp_path / "loss.png").shape[0] > 200
