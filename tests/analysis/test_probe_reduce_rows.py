"""Summary rows as the reducer builds them: the printed intervals, near_boundary and the test of no effect on
every row, the report's and the printout's reading of them, and the family-wise line."""

import json

import numpy as np
import pytest
from sim import sample_grams, truth_means

from twinrun.analysis.estimator import estimate
from twinrun.analysis.probe_reduce import family_reading
from twinrun.analysis.references import json_interval, pair_row
from twinrun.publish.probe_plots import _bar_ends
from twinrun.publish.probe_report import effect_table, family_line
from twinrun.publish.render import interval_text, render

SIZES = [8] * 5


def row_at(snr: float, cos_true: float = 0.9, seed: int = 0, rho: float = 0.5, **keys):
    """One simulated pair's summary row (σ 0.5, estimand `all` unless keys say otherwise)."""
    mu_a, mu_b = truth_means(snr, SIZES, cos_true, 1.0)
    g = [x[0] for x in sample_grams(np.random.default_rng(seed), SIZES, mu_a, mu_b, rho, 1)]
    est = estimate(*g, SIZES, SIZES, 0.05)
    return est, pair_row(est, **{"sigma": 0.5, "estimand": "all", "gate": False, **keys})


@pytest.mark.parametrize("interval, limits, want", [
    ((0.25, 0.75), (-1.0, 1.0), [0.25, 0.75]),
    ((-1.0, 0.5), (-1.0, 1.0), [None, 0.5]),  # the data bound the cosine on one side only
    ((0.3, np.inf), (0.0, np.inf), [0.3, None]),  # a ratio unbounded above
    ((0.0, 2.0), (0.0, np.inf), [None, 2.0]),
    ((1.0, 1.0), (-1.0, 1.0), [1.0, 1.0]),  # identical arms: exact, not unbounded
    (None, (-1.0, 1.0), None),  # below noise
])
def test_an_unbounded_side_is_null(interval, limits, want):
    assert json_interval(interval, limits) == want


def test_a_printed_row_carries_the_estimators_printed_intervals_as_json():
    est, row = row_at(snr=20.0)
    assert not row["below_noise"]
    assert row["cos_interval"] == list(est.cos_interval) and row["norm_ratio_interval"] == list(
        est.norm_ratio_interval)
    assert row["cos_interval"][0] < row["cos"] < row["cos_interval"][1]
    for key in ("near_boundary", "diff_norm2", "diff_norm2_se", "effect_p"):
        assert row[key] == getattr(est, key)
    json.dumps(row, allow_nan=False)  # no inf or nan reaches summary.json


def test_a_row_below_noise_has_no_interval_but_still_a_test_of_no_effect():
    _, row = row_at(snr=0.0)
    assert row["below_noise"] and row["cos_interval"] is None and row["norm_ratio_interval"] is None
    assert 0 <= row["effect_p"] <= 1 and not row["near_boundary"]
    json.dumps(row, allow_nan=False)


def near_boundary_row():
    for seed in range(400):
        _, row = row_at(snr=1.0, seed=seed)
        if row["near_boundary"]:
            return row
    raise AssertionError("no near-boundary row in 400 draws at SNR 1")


def test_the_report_prints_asymmetric_intervals_a_dash_and_a_near_boundary_note():
    row = {**near_boundary_row(), "norm_ratio_interval": [0.3, None]}
    line = effect_table([row])[-1]
    assert interval_text(row["cos_interval"]) in line and "[0.3000, —]" in line
    assert "near the detection boundary" in line and f"{row['norm2']:.2e} ± {row['norm2_se']:.1e}" in line
    _, clear = row_at(snr=50.0)
    assert "near the detection boundary" not in effect_table([clear])[-1]


def test_the_plot_draws_the_printed_interval_not_a_symmetric_one():
    row = {"cos": 0.8, "se": 0.01, "t_crit": 2.0, "norm_ratio": 1.0, "norm_ratio_se": 0.1,
           "cos_interval": [0.5, 0.85], "norm_ratio_interval": [0.7, None]}
    assert _bar_ends(row, "cos", "se") == pytest.approx((0.15, 0.5))  # 1 − cos: the interval turned over
    lo, hi = _bar_ends(row, "norm_ratio", "norm_ratio_se")
    assert lo == 0.7 and np.isnan(hi)
    old = {k: v for k, v in row.items() if not k.endswith("_interval")}  # a summary written before them
    assert _bar_ends(old, "cos", "se") == pytest.approx((0.18, 0.22))


def test_the_family_line_counts_rows_and_names_the_ones_holm_rejects():
    _, strong = row_at(snr=50.0, cos_true=0.2, sigma=1.0)
    _, null = row_at(snr=50.0, cos_true=1.0, seed=3, rho=0.9, sigma=2.0)
    _, gate = row_at(snr=50.0, cos_true=1.0, seed=4, sigma=0.5, gate=True)
    resid = {**strong, "estimand": "residual"}  # tests what `all` tests at σ 1: one hypothesis
    rows = [gate, strong, resid, null]
    fam = family_reading(rows, 0.05)
    assert fam["n_rows"] == 3 and fam["n_hypotheses"] == 2 and fam["effect"]
    assert {(r["sigma"], r["estimand"]) for r in fam["rejected"]} == {(1.0, "all"), (1.0, "residual")}
    assert strong["family_p"] == resid["family_p"] <= 0.05
    assert gate["family_p"] is None  # a gate row is the gate's business
    line = family_line({"family": fam})[0]
    assert line.startswith("3 effect rows read") and "Holm, α=0.05" in line and "σ=1 all" in line
    summary = {"run_dir": "r", "registered": {}, "checks": [], "used": {"gate_rule": "replicate"},
               "gates": [],
               "passed": True, "effects": rows, "family": fam}
    assert "family-wise: 3 effect rows" in render(summary)
