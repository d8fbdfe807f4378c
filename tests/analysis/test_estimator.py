"""The estimator against synthetic data with a known truth (calibration:
tests/analysis/test_estimator_calibration.py)."""

import itertools
import json

import numpy as np
import pytest
from conftest import run_twinrun

from twinrun.analysis.estimator import SHAPED_SHARE, estimate, estimate_batch, residual_gram
from twinrun.analysis.fold_moments import (
    corrected_variance,
    debiased_inner,
    fold_pair_variance,
    jackknife_se,
    kernel_moments,
    leave_one_out_inner,
    pair_corrected_se,
    signal_threshold,
    t_quantile,
)
from twinrun.analysis.selective import shaped_by_selection

ALPHA = 0.05


def two_arms_with_cosine(rng, cos_true, n_params=200, signal_norm=2.0):
    """Unit-free mean gradients μ_a, μ_b with exactly the requested cosine."""
    u = rng.standard_normal(n_params)
    u /= np.linalg.norm(u)
    v = rng.standard_normal(n_params)
    v -= v @ u * u
    v /= np.linalg.norm(v)
    mu_a = signal_norm * u
    mu_b = signal_norm * (cos_true * u + np.sqrt(1 - cos_true**2) * v)
    return mu_a, mu_b


def fold_sums(rng, mu, sizes, noise_std=1.0, shared_noise=None):
    """Per-fold sums of per-sample vectors μ + noise (optionally the other arm's noise, as in CRN)."""
    noise = (shared_noise if shared_noise is not None
             else rng.standard_normal((sum(sizes), mu.size)) * noise_std)
    samples = mu + noise
    edges = np.cumsum([0, *sizes])
    return np.stack([samples[a:b].sum(0) for a, b in itertools.pairwise(edges)]), noise


def grams(sa, sb):
    return sa @ sb.T, sa @ sa.T, sb @ sb.T


def test_identical_arms_give_cosine_exactly_one():
    rng = np.random.default_rng(0)
    s, _ = fold_sums(rng, np.ones(30), [4] * 10)
    g = s @ s.T
    est = estimate(g, g, g, [4] * 10, [4] * 10, ALPHA)
    assert est.cos == 1.0 and est.norm_ratio == 1.0
    assert est.se == 0.0 and est.norm_ratio_se == 0.0
    assert est.cos_interval == (1.0, 1.0) and est.norm_ratio_interval == (1.0, 1.0)
    assert est.diff_norm2 == 0.0 and est.effect_p == 1.0  # no effect, exactly


def test_debiased_inner_product_is_unbiased_where_the_naive_one_is_not():
    rng = np.random.default_rng(1)
    mu_a, mu_b = two_arms_with_cosine(rng, 0.6)
    sizes = np.array([10] * 8)
    truth = mu_a @ mu_b
    deb, cross, naive = [], [], []
    for _ in range(400):
        sa, _ = fold_sums(rng, mu_a, sizes)
        sb, _ = fold_sums(rng, mu_b, sizes)
        deb.append(debiased_inner(sa @ sa.T, sizes, sizes))
        cross.append(debiased_inner(sa @ sb.T, sizes, sizes))
        naive.append((sa.sum(0) / sizes.sum()) @ (sa.sum(0) / sizes.sum()))
    # ⟨μ_a, μ_a⟩ = 4; noise adds P·σ²/N = 200/80 = 2.5 to the naive squared norm.
    assert np.mean(deb) == pytest.approx(mu_a @ mu_a, rel=0.05)
    assert np.mean(naive) == pytest.approx(mu_a @ mu_a + 200 / 80, rel=0.05)
    assert np.mean(cross) == pytest.approx(truth, rel=0.05) and truth == pytest.approx(0.6 * 4)


@pytest.mark.parametrize("cos_true", [0.3, 0.8, 0.97])
def test_debiased_cosine_recovers_truth_and_jackknife_covers_it(cos_true):
    rng = np.random.default_rng(int(cos_true * 100))
    mu_a, mu_b = two_arms_with_cosine(rng, cos_true)
    sizes = [10] * 20
    n = 300
    cases = []
    for _ in range(n):
        sa, noise = fold_sums(rng, mu_a, sizes)
        # common random numbers: arm b sees the same noise, as twin arms do
        sb, _ = fold_sums(rng, mu_b, sizes, shared_noise=noise)
        cases.append(grams(sa, sb))
    batch = estimate_batch(*(np.stack(g) for g in zip(*cases)), sizes, sizes, ALPHA)  # estimate(), 300 times
    v = batch.fields
    assert batch.printed.all()
    # the naive cosine is biased by the (shared) noise; the debiased one is not
    assert np.mean(v["cos"]) == pytest.approx(cos_true, abs=0.02)
    assert abs(np.mean(v["cos_naive"]) - cos_true) > 2 * abs(np.mean(v["cos"]) - cos_true)
    covered = np.sum(np.abs(v["cos"] - cos_true) <= t_quantile(20) * v["se"])
    assert covered / n >= 0.88, f"jackknife 95% interval covered the truth {covered}/{n} times"
    printed_covered = np.sum((v["cos_lo"] <= cos_true) & (cos_true <= v["cos_hi"]))
    assert printed_covered / n >= 0.88, f"the printed interval covered the truth {printed_covered}/{n} times"


def test_pure_noise_is_reported_below_noise_not_as_a_number():
    """Signal, not sign: pure noise with shared draws, and norm² > 0 that is not significant, give no
    cosine."""
    rng = np.random.default_rng(3)
    sizes = [5] * 10
    below = positive_but_insignificant = 0
    for _ in range(200):
        sa, noise = fold_sums(rng, np.zeros(100), sizes)
        shared = 0.99 * noise + 0.14 * rng.standard_normal(noise.shape)
        sb, _ = fold_sums(rng, np.zeros(100), sizes, shared_noise=shared)
        est = estimate(*grams(sa, sb), sizes, sizes, ALPHA)
        if est.below_noise:
            below += 1
            assert est.cos is None and est.se is None and est.norm_ratio is None and est.norm_ratio_se is None
        # the evidence is always there: each arm's debiased norm² with its SE
        assert np.isfinite([est.norm2_a, est.norm2_a_se, est.norm2_b, est.norm2_b_se]).all()
        if 0 < est.norm2_a < 1.5 * est.norm2_a_se:
            positive_but_insignificant += 1
            assert est.below_noise
    # A positive norm² is not enough (about half of pure-noise norms are > 0): only signal counts.
    assert below >= 190 and positive_but_insignificant >= 20


def test_leave_one_out_and_jackknife_match_a_brute_force_recomputation():
    rng = np.random.default_rng(6)
    sizes = np.array([3.0, 5, 8, 4, 6, 7])
    sa, _ = fold_sums(rng, np.full(20, 0.4), sizes.astype(int))
    g = sa @ sa.T / np.outer(sizes, sizes)
    brute = []
    for i in range(len(sizes)):
        keep = np.arange(len(sizes)) != i
        brute.append(debiased_inner((sa @ sa.T)[np.ix_(keep, keep)], sizes[keep], sizes[keep]))
    np.testing.assert_allclose(leave_one_out_inner(g), brute, rtol=1e-12)
    reps = np.asarray(brute)
    f = len(reps)
    assert jackknife_se(reps) == pytest.approx(np.sqrt((f - 1) / f * ((reps - reps.mean()) ** 2).sum()))


def test_unequal_folds_are_weighted_by_their_size():
    """Each fold sum is divided by its own size: without that, unequal folds bias |μ|² itself (the
    cosine alone would not show it: the bias is a common factor)."""
    rng = np.random.default_rng(4)
    mu_a, mu_b = two_arms_with_cosine(rng, 0.5, signal_norm=3.0)
    sizes = [3, 5, 8, 4, 6, 7, 2, 5]
    cases = []
    for _ in range(300):
        sa, _ = fold_sums(rng, mu_a, sizes, noise_std=0.5)
        sb, _ = fold_sums(rng, 0.5 * mu_b, sizes, noise_std=0.5)
        cases.append(grams(sa, sb))
    v = estimate_batch(*(np.stack(g) for g in zip(*cases)), sizes, sizes, ALPHA).fields
    assert np.mean(v["cos"]) == pytest.approx(0.5, abs=0.03)
    assert np.mean(v["norm2_a"]) == pytest.approx(9.0, rel=0.03)
    assert np.mean(v["norm_ratio"]) == pytest.approx(2.0, rel=0.03)


def test_fold_pair_variance_recovers_the_known_hoeffding_parts():
    """Fold means m_f = μ + e_f (P dims, per-coordinate noise s²); the kernel h_fg = m_f · m_g has
    ζ1 = |μ|²·s² (one fold's noise against μ) and ζ2 = P·s⁴ (noise against noise). The jackknife
    variance must average 4ζ1/F + 4ζ2/(F(F−2)) (it counts ζ2 about twice), the ζ2 estimate ζ2."""
    rng = np.random.default_rng(8)
    f, p, s = 8, 50, 0.5
    mu = np.full(p, 0.2)
    zeta1, zeta2 = mu @ mu * s**2, p * s**4
    jack, z2 = [], []
    for _ in range(4000):
        m = mu + s * rng.standard_normal((f, p))
        v, z = fold_pair_variance(m @ m.T)
        jack.append(v)
        z2.append(z)
    assert np.mean(jack) == pytest.approx(4 * zeta1 / f + 4 * zeta2 / (f * (f - 2)), rel=0.04)
    assert np.mean(z2) == pytest.approx(zeta2, rel=0.05)


def test_pair_corrected_se_removes_six_tenths_of_the_excess_and_never_more_than_that_of_zeta2():
    rng = np.random.default_rng(9)
    m = 0.3 + rng.standard_normal((6, 40))
    g = m @ m.T
    jack, zeta2 = fold_pair_variance(g)
    f = 6
    excess = (4 / (f * (f - 2)) - 2 / (f * (f - 1))) * zeta2
    most = jack * (1 - (f - 2) / (2 * (f - 1)))
    se = pair_corrected_se([np.zeros_like(g), g, np.zeros_like(g)], np.array([0.0, 1.0, 0.0]))
    assert se**2 == pytest.approx(jack - 0.6 * min(excess, most), rel=1e-12)
    assert jack - 0.6 * most <= se**2 < jack


def test_three_folds_give_the_plain_jackknife_se():
    """probe.n_folds=3 is allowed: ζ2 is not identifiable there (the moment equations are singular),
    so nothing is removed and the SEs are the plain jackknife's (never a LinAlgError)."""
    rng = np.random.default_rng(3)
    m = 0.5 + rng.standard_normal((3, 50))
    g = m @ m.T
    jack, zeta2 = fold_pair_variance(g)
    assert zeta2 == 0.0 and np.isfinite(jack) and jack > 0
    se = pair_corrected_se([np.zeros_like(g), g, np.zeros_like(g)], np.array([0.0, 1.0, 0.0]))
    assert se == pytest.approx(np.sqrt(jack), rel=1e-12)
    sizes = np.array([10.0, 10.0, 10.0])
    est = estimate(g * 100, g * 100, g * 100, sizes, sizes, ALPHA)
    assert est.cos is not None and np.isfinite(est.se)


@pytest.mark.slow
def test_the_default_run_is_readable(tmp_path):
    """Issue 11 point 7: the default protocol leaves no effect below noise and no cosine SE above 0.1."""
    proc = run_twinrun(["+experiment=pin_sigma"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(next(tmp_path.glob("outputs/runs/*/*/summary.json")).read_text())
    effects = [e for e in summary["effects"] if not e["gate"]]
    assert effects and not [(e["sigma"], e["estimand"]) for e in effects if e["below_noise"]]
    assert max(e["se"] for e in effects) <= 0.1


def test_the_batch_and_the_single_estimate_agree():
    rng = np.random.default_rng(11)
    mu_a, mu_b = two_arms_with_cosine(rng, 0.7, signal_norm=1.0)
    sizes = [3, 5, 8, 4, 6, 7, 2, 5]
    cases = []
    for _ in range(4):
        sa, noise = fold_sums(rng, mu_a, sizes)
        sb, _ = fold_sums(rng, mu_b, sizes, shared_noise=0.9 * noise + 0.4 * rng.standard_normal(noise.shape))
        cases.append(grams(sa, sb))
    batch = estimate_batch(*(np.stack(g) for g in zip(*cases)), sizes, sizes, ALPHA)
    for i, g in enumerate(cases):
        est = estimate(*g, sizes, sizes, ALPHA)
        assert est.below_noise == (not batch.printed[i])
        assert est.effect_p == pytest.approx(batch.fields["effect_p"][i], rel=1e-12)
        if not est.below_noise:
            ends = (batch.fields["cos_lo"][i], batch.fields["cos_hi"][i])
            assert est.cos_interval == pytest.approx(ends, rel=1e-12)
            assert est.norm_ratio_interval[1] == pytest.approx(batch.fields["ratio_hi"][i], rel=1e-12)


def test_kernel_moments_are_bilinear_and_give_the_pair_corrected_se():
    """One pass gives the variance of every linear combination of (ab, aa, bb): for any weights,
    corrected_variance equals pair_corrected_se² of the combined kernel."""
    rng = np.random.default_rng(12)
    means = [m @ m.T for m in (0.2 + rng.standard_normal((7, 30)) for _ in range(3))]
    jack, zeta2 = kernel_moments(means)
    for w in (np.array([1.0, 0, 0]), np.array([0.3, -1.2, 2.0])):
        se = pair_corrected_se(means, w)
        assert corrected_variance(jack, zeta2, w, 7) == pytest.approx(se**2, rel=1e-10)
        v, z = fold_pair_variance(sum(wk * m for wk, m in zip(w, means)))
        assert w @ jack @ w == pytest.approx(v, rel=1e-10)
        assert max(w @ zeta2 @ w, 0) == pytest.approx(z, rel=1e-10, abs=1e-12)


def test_below_noise_rows_print_no_interval_but_keep_their_test_of_no_effect():
    rng = np.random.default_rng(13)
    sa, noise = fold_sums(rng, np.zeros(100), [5] * 10)
    shared = 0.99 * noise + 0.14 * rng.standard_normal(noise.shape)
    sb, _ = fold_sums(rng, np.zeros(100), [5] * 10, shared_noise=shared)
    est = estimate(*grams(sa, sb), [5] * 10, [5] * 10, ALPHA)
    assert est.below_noise and est.cos_interval is None and est.norm_ratio_interval is None
    assert not est.near_boundary and 0 < est.effect_p <= 1 and est.diff_norm2_se > 0


def test_the_test_of_no_effect_holds_its_level_and_finds_an_effect():
    """μ_a = μ_b with shared draws: p ≤ 0.05 in at most 5% of cases (the jackknife is conservative here);
    the arm 20% longer: found nearly always."""
    rng = np.random.default_rng(14)
    mu = two_arms_with_cosine(rng, 1.0, signal_norm=1.0)[0]
    sizes = [10] * 10
    rejected = {}
    for grow in (0.0, 0.2):
        cases = []
        for _ in range(200):
            sa, noise = fold_sums(rng, mu * (1 + grow), sizes)
            shared = 0.99 * noise + 0.14 * rng.standard_normal(noise.shape)
            sb, _ = fold_sums(rng, mu, sizes, shared_noise=shared)
            cases.append(grams(sa, sb))
        p = estimate_batch(*(np.stack(g) for g in zip(*cases)), sizes, sizes, ALPHA).fields["effect_p"]
        rejected[grow] = int(np.sum(p <= 0.05))
    assert rejected[0.0] <= 10 and rejected[0.2] >= 190, rejected


def test_far_above_the_threshold_the_interval_is_the_plain_fieller_one():
    """The test of signal shapes only the intervals of rows it could have withheld: more than 6 SEs above
    it the printed interval is the plain Fieller one to the bit (the hybrid's projection leaves the
    selection nothing to bound there), and near_boundary is False. The purely conditional interval
    (beta_share 0) moved every such row, by up to 3e-5 of its half-width."""
    rng = np.random.default_rng(15)
    sizes, folds = [10] * 10, 10
    cases = []
    for _ in range(60):
        mu_a, mu_b = two_arms_with_cosine(rng, 0.8, signal_norm=3.0)
        sa, noise = fold_sums(rng, mu_a, sizes)
        shared = 0.9 * noise + 0.44 * rng.standard_normal(noise.shape)
        sb, _ = fold_sums(rng, mu_b, sizes, shared_noise=shared)
        cases.append(grams(sa, sb))
    g = [np.stack(x) for x in zip(*cases)]
    v = estimate_batch(*g, sizes, sizes, ALPHA).fields
    margin = np.minimum(v["norm2_a"] / v["norm2_a_se"], v["norm2_b"] / v["norm2_b_se"])
    far = margin - signal_threshold(folds, ALPHA) > 6
    assert far.sum() >= 30
    for name in ("cos_lo", "cos_hi", "ratio_lo", "ratio_hi"):
        plain = v[name.replace("_", "_plain_")]
        assert np.array_equal(v[name][far], plain[far]), name
    assert not v["near_boundary"][far].any()


def test_identical_arms_near_the_threshold_read_exactly_and_are_not_marked():
    """A no-op gate's row: the arm's sums are the twin's bit for bit. Whatever its margin over the test
    of signal, cos and the ratio are exactly 1 with a zero-width interval: nothing to mark as selected."""
    rng = np.random.default_rng(16)
    sizes = [10] * 10
    for _ in range(400):
        mu, _ = two_arms_with_cosine(rng, 0.5, signal_norm=0.25)
        sums, _ = fold_sums(rng, mu, sizes)
        est = estimate(*grams(sums, sums), sizes, sizes, ALPHA)
        margin = est.norm2_a / est.norm2_a_se - signal_threshold(10, ALPHA)
        if not est.below_noise and margin < 3:
            break
    assert not est.below_noise and 0 <= margin < 3
    assert est.cos == 1 and est.cos_interval == (1, 1) and est.norm_ratio_interval == (1, 1)
    assert not est.near_boundary


def test_near_the_threshold_the_row_is_marked_and_its_interval_widened():
    """A twin barely above the test of signal: near_boundary, and the interval accounts for the selection
    (it differs from the plain one)."""
    rng = np.random.default_rng(16)
    sizes = [10] * 10
    for _ in range(400):
        mu_a, mu_b = two_arms_with_cosine(rng, 0.5, signal_norm=0.25)
        sa, noise = fold_sums(rng, mu_a, sizes)
        shared = 0.9 * noise + 0.44 * rng.standard_normal(noise.shape)
        sb, _ = fold_sums(rng, mu_b, sizes, shared_noise=shared)
        est = estimate(*grams(sa, sb), sizes, sizes, ALPHA)
        if est.near_boundary:
            break
    assert est.near_boundary and not est.below_noise
    margin = min(est.norm2_a / est.norm2_a_se, est.norm2_b / est.norm2_b_se) - signal_threshold(10, ALPHA)
    assert 0 <= margin < 3
    lo, hi = est.norm_ratio_interval
    assert 0 <= lo <= hi and -1 <= est.cos_interval[0] <= est.cos_interval[1] <= 1


def test_the_residual_gram_is_the_gram_of_the_documented_view():
    """R_{b,a,f} = S_{b,a,f} − c_b·M_f, c_b the base's plain mean norm, M_f = mean_b' S_{b',base,f}/c_b'."""
    rng = np.random.default_rng(17)
    bins, arms, folds, params, n_samples, base = 4, 3, 5, 30, 50.0, 1
    s = rng.standard_normal((bins, arms, folds, params)) + 2 * rng.standard_normal((bins, 1, 1, params))
    within = np.einsum("bafp,bcgp->bafcg", s, s)
    cross = np.einsum("bafp,cgp->bafcg", s, s[:, base])
    c = np.linalg.norm(s[:, base].sum(1), axis=-1) / n_samples
    r = s - c[:, None, None, None] * (s[:, base] / c[:, None, None]).mean(0)
    want = np.einsum("bafp,bcgp->bafcg", r, r)
    np.testing.assert_allclose(residual_gram(within, cross, base, n_samples), want, rtol=1e-10, atol=1e-9)


def test_the_residual_gives_every_bin_one_vote_in_the_mean_direction():
    """A bin 100× larger than the others no longer drags every residual: scaling one bin's sums (both arms)
    leaves the other bins' residual views as they were."""
    rng = np.random.default_rng(18)
    s = rng.standard_normal((3, 2, 4, 20)) + rng.standard_normal((3, 1, 1, 20))
    views = []
    for big in (1.0, 100.0):
        t = s.copy()
        t[0] *= big
        within, cross = np.einsum("bafp,bcgp->bafcg", t, t), np.einsum("bafp,cgp->bafcg", t, t[:, 1])
        views.append(residual_gram(within, cross, 1, 40.0))
    np.testing.assert_allclose(views[0][1:], views[1][1:], rtol=1e-9)


def test_a_row_is_marked_where_an_end_moved_more_than_a_tenth_of_the_plain_half_width():
    """near_boundary's rule on hand-made ends (rows: cos [lo, hi], then ratio [lo, hi]): a cosine end moved
    by 0.2 of a half-width of 0.5 is marked, by 0.04 not; a ratio end open where the plain one is closed,
    or closed where the plain one is open, is marked; both open on the same side is not."""
    inf = np.inf
    plain = np.array([[-0.5] * 5, [0.5] * 5, [1.0] * 5, [2.0, 2.0, inf, inf, 2.0]])
    printed = np.array([[-0.6, -0.52, -0.5, -0.5, -0.5], [0.5] * 5, [1.0] * 5, [2.0, 2.0, 3.0, inf, inf]])
    marked = shaped_by_selection(printed, plain, SHAPED_SHARE)
    assert marked.tolist() == [True, False, True, False, True]
