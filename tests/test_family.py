"""The family-wise reading: Holm over the effect rows' tests of no effect, measured on simulated whole runs
(6 bins × all / cond / residual, one bin a gate, bins sharing the images, arms sharing the draws)."""

import numpy as np
import pytest
from sim import run_effect_rows, run_fold_sums

from twinrun.analysis.family import family_verdict, holm_adjusted

P, COND, BINS, GATE = 200, 40, 6, 2
FEW = np.where(np.arange(P) < 3, 60.0, 0.1)  # 90% of the noise in 3 directions


def test_holm_adjusted_p_values_by_hand():
    # sorted 0.01, 0.02, 0.04, 0.30 (m = 4): 0.04, 0.06, 0.08 (monotone), 0.30
    adj = holm_adjusted(np.array([0.30, 0.01, 0.04, 0.02]))
    np.testing.assert_allclose(adj, [0.30, 0.04, 0.08, 0.06])
    assert holm_adjusted(np.array([0.9, 0.8]))[0] == 1.0  # capped at 1


def _rows(p_all, p_cond, p_residual, gate_p=0.0):
    rows = []
    for k, (a, c, r) in enumerate(zip(p_all, p_cond, p_residual)):
        for name, p in (("all", a), ("cond", c), ("residual", r)):
            rows.append({"sigma": 0.1 * (k + 1), "estimand": name, "gate": k == GATE,
                         "effect_p": gate_p if k == GATE else p})
    return rows


def test_the_family_counts_rows_tests_distinct_hypotheses_and_leaves_gates_out():
    """A gate row's p-value (0 here) never makes an effect; residual rows share all's hypothesis."""
    v = family_verdict(_rows([0.5] * BINS, [0.5] * BINS, [0.0] * BINS), 0.05)
    assert (v.n_rows, v.n_hypotheses, v.effect) == (15, 10, False)
    v = family_verdict(_rows([0.5, 0.5, 0.5, 0.001, 0.5, 0.5], [0.5] * BINS, [0.9] * BINS), 0.05)
    assert v.effect and set(v.rejected) == {(0.4, "all"), (0.4, "residual")}
    assert v.adjusted_p[0.4, "all"] == pytest.approx(0.01)  # 10 hypotheses
    assert "15 effect rows, 10 distinct hypotheses" in v.detail()


def test_a_residual_row_is_its_own_hypothesis_where_all_is_not_read():
    rows = [{"sigma": 0.2, "estimand": "residual", "gate": False, "effect_p": 0.01}]
    assert family_verdict(rows, 0.05).n_hypotheses == 1 and family_verdict(rows, 0.05).effect


def family_error_rate(folds, rho, spectrum, runs, seed, snr=0.0, effect=0.0):
    """(runs reading an effect, runs printing at least one number) out of `runs` simulated runs."""
    rng = np.random.default_rng(seed)
    sizes = [10] * folds
    mu_twin = np.zeros((BINS, P))
    if snr:
        u = rng.standard_normal((BINS, P))
        mu_twin = u / np.linalg.norm(u, axis=1, keepdims=True) * np.sqrt(snr * P / np.sum(sizes))
    mu_arm = mu_twin.copy()
    mu_arm[4] *= 1 + effect
    effects = printed = 0
    for start in range(0, runs, 100):
        sums = run_fold_sums(rng, sizes, mu_arm, mu_twin, rho, min(100, runs - start), spectrum=spectrum)
        for rows in run_effect_rows(sums, sizes, COND, 0.05, GATE):
            effects += family_verdict(rows, 0.05).effect
            printed += any(not r["below_noise"] for r in rows if not r["gate"])
    return effects, printed


def test_pure_noise_with_shared_draws_reads_no_effect_family_wise():
    """At ρ = 0.99 about 7% of pure-noise runs print some number (the test of signal is per row); the
    family-wise verdict reads an effect in far fewer than 5% of them."""
    effects, printed = family_error_rate(10, 0.99, None, 500, seed=1)
    assert effects / 500 <= 0.02
    assert printed > effects  # the per-row test of signal alone would have said more


def test_a_real_effect_is_read_family_wise():
    """Power: the arm's mean gradient 10% larger at one bin of six is found in every run at SNR 3 per bin
    (measured: 100 of 100; at SNR 1 in 23 of 100, and a 20% change in 100 of 100)."""
    effects, _ = family_error_rate(10, 0.99, None, 100, seed=2, snr=3.0, effect=0.1)
    assert effects / 100 >= 0.8


@pytest.mark.slow
@pytest.mark.parametrize("folds", [5, 10, 20])
@pytest.mark.parametrize("rho", [0.0, 0.9, 0.99])
@pytest.mark.parametrize("noise", ["isotropic", "few"])
def test_family_wise_error_on_the_grid(folds, rho, noise):
    """≤ 5% of runs read an effect where there is none, pure noise or signal without effect (2000 runs
    each: a binomial SE of 0.5% at 5%)."""
    spectrum = None if noise == "isotropic" else FEW
    for snr in (0.0, 1.0):
        effects, printed = family_error_rate(folds, rho, spectrum, 2000, seed=folds + int(100 * rho), snr=snr)
        print(f"family-wise: {noise} F={folds} rho={rho} snr={snr}: effect {effects}/2000, "
              f"printed {printed}/2000")
        assert effects / 2000 <= 0.05, (snr, effects)
