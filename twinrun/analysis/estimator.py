"""The debiased estimator, from fold Gram matrices alone (F x F arithmetic, float64).

S^a ∈ R^{F×P} holds per-fold sums of per-sample gradients for arm a; G^{ab} = S^a (S^b)ᵀ.
Dividing each fold by its sample count gives per-fold means m_f, and the cross-fold average
  ⟨μ^a, μ^b⟩^ = Σ_{f≠g} m^a_f · m^b_g / (F(F−1))
is unbiased for ⟨E m^a, E m^b⟩ because folds are independent (a U-statistic): the same-fold
terms, which carry each fold's own noise, are left out. Standard errors are the jackknife over
folds (leave one fold out, from the same Gram matrices), with the cosine's and the norm ratio's
freed of most of the fold-pair variance the jackknife counts twice (pair_corrected_se).

A cosine and a norm ratio are printed only where both arms pass the test of signal, so their
intervals are built conditional on that test (selective_intervals): Fieller-type pivots, linear in
the three inner products, inverted through their distribution truncated to the cases that pass.
docs/estimator.md states the rules and their calibration.
"""

from dataclasses import dataclass
from functools import cache

import numpy as np
from scipy import special, stats

INTERVAL_LEVEL = 0.95
# A row whose weaker arm's |μ|² sits less than this many SEs above the signal threshold is marked
# near_boundary: there the test of signal visibly shapes the interval. Measured (42 cells of isotropic
# and few-direction noise, 23 342 printed rows): with a margin of 2.5-3 SEs the test moved an interval end
# by more than a tenth of its half-width in 46% of rows, at 3-4 in 15%, at 4-6 in 1% (docs/estimator.md).
BOUNDARY_MARGIN_SE = 3.0


@cache
def t_quantile(n_folds: int, level: float = INTERVAL_LEVEL) -> float:
    """Two-sided t_{F−1} quantile: half-width of a `level` interval in SE units."""
    return float(stats.t.ppf(0.5 + level / 2, n_folds - 1))


@cache
def signal_threshold(n_folds: int, alpha: float) -> float:
    """norm² must exceed this many of its SEs to count as signal (one-sided t_{F−1} at level alpha)."""
    return float(stats.t.ppf(1 - alpha, n_folds - 1))


@dataclass
class Estimate:
    """One pair of arms (a against b) in one bin and estimand. Numbers are None where below noise."""

    cos: float | None  # debiased cosine
    se: float | None  # its jackknife SE
    norm_ratio: float | None  # |μ^a| / |μ^b|, debiased
    norm_ratio_se: float | None
    cos_naive: float  # cosine of the plain mean gradients (biased towards 0 by noise)
    norm2_a: float  # debiased squared norms with their jackknife SEs: always reported
    norm2_a_se: float
    norm2_b: float
    norm2_b_se: float
    t_crit: float  # t_{F−1} half-width factor of a 95% interval (the symmetric cos ± t·se, for reference)
    # The printed 95% intervals, conditional on the row being printed (selective_intervals); asymmetric.
    # A side the data do not bound reads -1 or 1 for the cosine, 0 or inf for the ratio. None below noise.
    cos_interval: tuple[float, float] | None = None
    norm_ratio_interval: tuple[float, float] | None = None
    # Printed, but the weaker arm's |μ|² is < BOUNDARY_MARGIN_SE SEs above the signal threshold: the test of
    # signal shaped the intervals, and cos and norm_ratio read as selected (the ratio low, the cosine
    # towards the noise correlation: docs/estimator.md); show |μ|² ± SE beside the row.
    near_boundary: bool = False
    # The row's test of "no effect" (μ^a = μ^b over the estimand's columns): the debiased |μ^a − μ^b|² and
    # the one-sided p-value of its t test. Defined for every row, printed or not (twinrun.family).
    diff_norm2: float = 0.0
    diff_norm2_se: float = 0.0
    effect_p: float = 1.0

    @property
    def below_noise(self) -> bool:
        return self.cos is None


def fold_means_gram(g_ab: np.ndarray, n_a: np.ndarray, n_b: np.ndarray) -> np.ndarray:
    """G^{ab} of fold means: each fold sum divided by its sample count (leading batch axes allowed)."""
    return g_ab / np.multiply.outer(n_a, n_b)


def debiased_inner(g_ab: np.ndarray, n_a: np.ndarray, n_b: np.ndarray) -> float:
    g = fold_means_gram(g_ab, np.asarray(n_a, dtype=np.float64), np.asarray(n_b, dtype=np.float64))
    return float(u_statistic(g))


def u_statistic(g: np.ndarray) -> np.ndarray:
    """The cross-fold average of a fold-means Gram (..., F, F): the debiased inner product."""
    f = g.shape[-1]
    return (g.sum((-2, -1)) - np.trace(g, axis1=-2, axis2=-1)) / (f * (f - 1))


def leave_one_out_inner(g: np.ndarray) -> np.ndarray:
    """The debiased inner product with fold i left out, for every i (g: a fold-means Gram, ..., F, F)."""
    f = g.shape[-1]
    diag = np.diagonal(g, axis1=-2, axis2=-1)
    off_total = g.sum((-2, -1)) - diag.sum(-1)
    off_touching = g.sum(-2) + g.sum(-1) - 2 * diag  # cross-fold terms that involve fold i
    return (off_total[..., None] - off_touching) / ((f - 1) * (f - 2))


def jackknife_se(replicates: np.ndarray) -> np.ndarray:
    f = replicates.shape[-1]
    centred = replicates - replicates.mean(-1, keepdims=True)
    return np.sqrt((f - 1) / f * np.sum(centred**2, axis=-1))


def moment_matrix(f: int) -> np.ndarray:
    """E[(R, T)] = M · (ζ1, ζ2): R the sum of squares over the row means, T over the fold pairs."""
    return np.array([[(f - 2) ** 2 / (f - 1), (f - 2) / (f - 1)], [(f - 2) * (f - 1), f * (f - 1) / 2 - 1]])


def fold_pair_variance(h: np.ndarray) -> tuple[float, float]:
    """(jackknife variance, fold-pair variance ζ2) of the U-statistic whose kernel is h (off-diagonal).

    Write h_fg = θ + a_f + a_g + d_fg (Hoeffding): a_f is fold f's own share (variance ζ1), d_fg
    what only the pair carries (variance ζ2; noise·noise at low signal). Var U = 4ζ1/F + 2ζ2/(F(F−1)),
    but the jackknife's expectation is 4ζ1/F + 4ζ2/(F(F−2)): it counts ζ2 about twice. ζ1 and ζ2
    are solved from two sums of squares with known expectations: R over the row means r_f and T over
    the pairs."""
    jack, zeta2 = kernel_moments([np.asarray(h, dtype=np.float64)])
    return float(jack[0, 0]), max(float(zeta2[0, 0]), 0.0)


def kernel_moments(kernels: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(jackknife covariance, fold-pair covariance ζ2) of the U-statistics of K kernels (..., F, F).

    fold_pair_variance made bilinear: for weights w, wᵀ·jack·w is the jackknife variance of the
    kernel Σ w_k h_k and wᵀ·ζ2·w its ζ2 (before clipping at 0), so one pass gives the variance of
    every linear combination of the inner products (..., K, K each). With three folds ζ2 cannot be
    told from ζ1 (the moment equations are singular) and is 0: the plain, conservative jackknife."""
    h = np.stack([(k + np.swapaxes(k, -1, -2)) / 2 for k in kernels], axis=-3)
    f = h.shape[-1]
    rows = (h.sum(-1) - np.diagonal(h, axis1=-2, axis2=-1)) / (f - 1)
    rows = rows - rows.mean(-1, keepdims=True)
    upper = np.triu_indices(f, 1)
    pairs = h[..., upper[0], upper[1]]
    pairs = pairs - pairs.mean(-1, keepdims=True)
    r_ss = np.einsum("...kf,...lf->...kl", rows, rows)  # E = (F−2)²/(F−1)·ζ1 + (F−2)/(F−1)·ζ2
    t_ss = np.einsum("...kf,...lf->...kl", pairs, pairs)  # E = (F−2)(F−1)·ζ1 + (F(F−1)/2 − 1)·ζ2
    jack = 4 * (f - 1) / (f * (f - 2) ** 2) * r_ss  # U_(i) − U_(·) = −2 (r_i − r̄) / (F − 2)
    if f == 3:
        return jack, np.zeros_like(jack)
    inverse = np.linalg.inv(moment_matrix(f))
    return jack, inverse[1, 0] * r_ss + inverse[1, 1] * t_ss


# The share of the jackknife's excess fold-pair variance the cosine's and ratio's SEs remove. 0.5 left
# one corner of the grid (F = 5, unequal folds, SNR 0.3, norm ratio) at 0.971 coverage (20 000 cases)
# and 1.0 under-covers at F = 5 (0.92); 0.6 puts every cell of the isotropic grid inside 0.93–0.97
# (docs/estimator.md). Removing ζ2's own share instead, where larger, was tried for noise in a few
# directions (where 0.6 over-covers): it under-covered at F = 5 and at ρ = 0.99 and is not used.
PAIR_EXCESS_REMOVED = 0.6
# Selective intervals read the test of signal's pull from leave-one-fold-out replicates, each with its
# own jackknife: that needs 4 folds (selection_slopes).
REPLICATE_MIN_FOLDS = 4


def corrected_variance(jack: np.ndarray, zeta2: np.ndarray, weights: np.ndarray, n_folds: int) -> np.ndarray:
    """Variance of the U-statistic Σ w_k X_k: its jackknife variance less PAIR_EXCESS_REMOVED of the
    fold-pair variance the jackknife counts twice, never more than that share of what ζ2 can account for.

    jack, zeta2: kernel_moments' (..., K, K); weights (..., K). pair_corrected_se² for one kernel."""
    f = n_folds
    j = np.einsum("...k,...kl,...l->...", weights, jack, weights)
    z = np.maximum(np.einsum("...k,...kl,...l->...", weights, zeta2, weights), 0.0)
    excess = (4 / (f * (f - 2)) - 2 / (f * (f - 1))) * z
    most = j * (1 - (f - 2) / (2 * (f - 1)))  # ζ2's whole share of the jackknife variance
    return np.maximum(j - PAIR_EXCESS_REMOVED * np.minimum(excess, most), 0.0)


def pair_corrected_se(means: list[np.ndarray], grad: np.ndarray) -> float:
    """SE of a smooth function of the three inner products (ab, aa, bb), given its gradient.

    The delta method turns the function into one U-statistic with kernel Σ_k grad_k · means_k. Its
    jackknife variance over-counts the fold-pair variance ζ2 (fold_pair_variance), which makes
    intervals over-cover where the signal is weak (up to 0.987 at SNR 0.3); removing all of the
    excess leaves a variance so noisy at few folds that intervals under-cover (0.92).
    PAIR_EXCESS_REMOVED of it is removed (corrected_variance)."""
    f = means[0].shape[-1]
    jack, zeta2 = kernel_moments([sum(g * m for g, m in zip(grad, means))])
    return float(np.sqrt(corrected_variance(jack, zeta2, np.ones(1), f)))


def _cos(ab, aa, bb):
    # One sqrt of the product: identical arms give exactly 1.0 (sqrt(x·x) == x in IEEE).
    return ab / np.sqrt(aa * bb)


def is_signal(norm2: float, norm2_se: float, n_folds: int, alpha: float) -> bool:
    """A debiased squared norm significantly above 0 (one-sided t test on its jackknife SE).

    With shared draws two pure-noise arms are nearly the same event, so alpha is also about the
    rate at which pure noise would be reported as a number (reduce.signal_alpha)."""
    return norm2 > 0 and (norm2_se == 0 or norm2 / norm2_se > signal_threshold(n_folds, alpha))


# ----------------------------------------------------------------------------- intervals given printing


def _t_cdf(df: int, x: np.ndarray) -> np.ndarray:
    return special.stdtr(df, x)


def truncated_t_cdf(z: np.ndarray, lo: np.ndarray, hi: np.ndarray, df: int) -> np.ndarray:
    """P(t ≤ z | lo ≤ t ≤ hi) for t ~ t_df, computed in the upper tail when lo > 0 (no cancellation)."""
    upper = lo > 0
    num = np.where(upper, _t_cdf(df, -lo) - _t_cdf(df, -z), _t_cdf(df, z) - _t_cdf(df, lo))
    den = np.where(upper, _t_cdf(df, -lo) - _t_cdf(df, -hi), _t_cdf(df, hi) - _t_cdf(df, lo))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(np.where(den > 0, num / den, 0.5), 0.0, 1.0)


@dataclass
class Replicates:
    """Every printed row recomputed with one fold left out (F replicates; leading axes as the rows'):
    the inner products x (..., F, 3), their kernel moments, and each arm's margin over the test of
    signal, |μ|² − threshold·SE(|μ|²) (..., F, 2), with the replicate's own jackknife SE."""

    x: np.ndarray
    jack: np.ndarray
    zeta2: np.ndarray
    margin: np.ndarray


def _without_each_fold(g: np.ndarray) -> np.ndarray:
    """(..., F, F) → (..., F, F−1, F−1): the Gram with fold i's row and column removed, for every i."""
    f = g.shape[-1]
    keep = np.array([[j for j in range(f) if j != i] for i in range(f)])
    return g[..., keep[:, :, None], keep[:, None, :]]


def replicates(means: list[np.ndarray], threshold: float) -> Replicates:
    """Leave-one-fold-out replicates of a printed row (needs F ≥ 4: each replicate's own jackknife)."""
    loo = [_without_each_fold(m) for m in means]
    x = np.stack([u_statistic(m) for m in loo], axis=-1)
    jack, zeta2 = kernel_moments(loo)
    se = [jackknife_se(leave_one_out_inner(loo[k])) for k in (1, 2)]
    margin = np.stack([x[..., k] - threshold * s for k, s in zip((1, 2), se)], axis=-1)
    return Replicates(x, jack, zeta2, margin)


def selection_slopes(jack, weights, sd, n_folds: int, reps: Replicates | None):
    """(..., 2): how much each arm's margin over the test of signal, |μ|² − threshold·SE(|μ|²), moves
    per unit of the studentised pivot t = wᵀx / sd.

    From the leave-one-fold-out replicates: the regression slope of the margin on t. The SE is part of
    the margin: where the noise lies in a few directions a large noise draw inflates |μ|² and its SE
    together, and |μ|² alone (its jackknife covariance with the pivot) overstates how strongly printing
    selects the pivot (coverage fell to 0.82). The margin, not |μ|²/SE: far above the threshold the
    ratio's replicates swing with the SE's noise and would truncate pivots that printing never
    constrained. With three folds a replicate has no SE of its own: the slope of |μ|² alone, from the
    jackknife covariance."""
    if reps is None:
        jw = np.einsum("...kl,...l->...k", jack, weights)
        jvar = np.maximum(np.einsum("...k,...k->...", jw, weights), 1e-300)
        return jw[..., 1:] * (sd / jvar)[..., None]
    w = np.broadcast_to(weights[..., None, :], reps.x.shape)
    t_rep = np.einsum("...k,...k->...", w, reps.x) / np.sqrt(
        np.maximum(corrected_variance(reps.jack, reps.zeta2, w, n_folds - 1), 1e-300))
    t_rep = t_rep - t_rep.mean(-1, keepdims=True)
    m_rep = reps.margin - reps.margin.mean(-2, keepdims=True)
    return np.einsum("...f,...fk->...k", t_rep, m_rep) / np.maximum((t_rep**2).sum(-1), 1e-300)[..., None]


def selective_cdf(x: np.ndarray, jack: np.ndarray, zeta2: np.ndarray, norm_se: np.ndarray, threshold: float,
                  weights: np.ndarray, n_folds: int, reps: Replicates | None = None) -> np.ndarray:
    """Where the observed pivot T = wᵀx falls in its null distribution given that the row printed.

    x: (ab, aa, bb) (..., 3); norm_se: aa's and bb's jackknife SEs (..., 2); the row printed because
    each arm's margin m_k = x_k − threshold·norm_se_k is positive; weights w make E T = 0 at the tested
    value; T is studentised by corrected_variance to t. Write m_k = W_k + κ_k·t with W_k uncorrelated
    with t (κ: selection_slopes): given W, printing bounds t to an interval, and t is a t_{F−1}
    truncated to it (the polyhedral lemma of selective inference, with the moments estimated from the
    folds)."""
    sd = np.sqrt(np.maximum(corrected_variance(jack, zeta2, weights, n_folds), 1e-300))
    t_obs = np.einsum("...k,...k->...", weights, x) / sd
    slopes = selection_slopes(jack, weights, sd, n_folds, reps)
    lo, hi = np.full_like(t_obs, -np.inf), np.full_like(t_obs, np.inf)
    for k in (0, 1):
        margin = x[..., k + 1] - threshold * norm_se[..., k]  # ≥ 0: the row printed
        with np.errstate(divide="ignore", invalid="ignore"):
            bound = t_obs - margin / slopes[..., k]
        lo = np.where(slopes[..., k] > 0, np.maximum(lo, bound), lo)
        hi = np.where(slopes[..., k] < 0, np.minimum(hi, bound), hi)
    return truncated_t_cdf(t_obs, lo, hi, n_folds - 1)


def _ratio_weights(log_ratio: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Fieller's pivot for |μ^a|/|μ^b| = r: T = aa − r²·bb, exactly mean 0 at the true r."""
    r2 = np.exp(2 * log_ratio)
    return np.stack([np.zeros_like(r2), np.ones_like(r2), -r2], axis=-1)


def _cos_weights(cos: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The pivot for the cosine c: T = ab − c·sqrt(aa·bb), linearised at the observed aa, bb (mean 0 to
    second order at the true c)."""
    scale = np.sqrt(x[..., 2] / x[..., 1])
    return np.stack([np.ones_like(cos), -cos * scale / 2, -cos / (2 * scale)], axis=-1)


def _decreasing_root(fun, start, step, lo, hi, target, expansions: int = 14, bisections: int = 36):
    """θ in [lo, hi] with fun(θ) = target for a decreasing fun, searched outwards from start in steps
    step·2^k; lo or hi where fun stays on one side up to that limit (the interval is unbounded there).
    Every argument is an array of one shape: many roots are found at once."""
    right = fun(start) > target
    sign = np.where(right, 1.0, -1.0)
    inner, outer = start.copy(), np.clip(start + sign * step, lo, hi)
    crossed = np.zeros(start.shape, dtype=bool)
    for k in range(expansions):
        value = fun(outer)
        crossed |= np.where(right, value <= target, value >= target)
        inner = np.where(crossed, inner, outer)
        outer = np.where(crossed, outer, np.clip(start + sign * step * 2.0 ** (k + 1), lo, hi))
    a, b = np.where(right, inner, outer), np.where(right, outer, inner)
    for _ in range(bisections):
        mid = (a + b) / 2
        above = fun(mid) > target
        a, b = np.where(above, mid, a), np.where(above, b, mid)
    return np.where(crossed, (a + b) / 2, np.where(right, hi, lo))


LOG_RATIO_LIMIT = 30.0  # |log r| beyond this is "unbounded": the ratio interval's side reads 0 or inf


def selective_intervals(x, jack, zeta2, norm_se, threshold, cos, ratio, cos_se, ratio_se, n_folds: int,
                        reps: Replicates | None, level: float = INTERVAL_LEVEL) -> np.ndarray:
    """(4, n): the cosine's lower and upper ends, then the norm ratio's, given that each of the n rows
    printed. Each end is where selective_cdf of the row's pivot, as the tested value moves, crosses
    (1 ± level)/2. The cosine is searched over [−1, 1], the ratio over log r (a side that reaches the
    limit is unbounded: 0 or inf). All four searches per row share one vectorised root finder."""
    tail = (1 - level) / 2
    n = len(cos)
    is_cos = np.repeat([True, True, False, False], n)
    four = lambda a: None if a is None else np.concatenate([a] * 4)
    target = np.repeat([1 - tail, tail, 1 - tail, tail], n)
    start = np.concatenate([np.clip(cos, -1, 1)] * 2 + [np.log(ratio)] * 2)
    step = np.concatenate([cos_se] * 2 + [ratio_se / ratio] * 2)
    lo = np.where(is_cos, -1.0, -LOG_RATIO_LIMIT)
    hi = np.where(is_cos, 1.0, LOG_RATIO_LIMIT)
    xs, js, zs, ses = four(x), four(jack), four(zeta2), four(norm_se)
    rs = None
    if reps is not None:
        rs = Replicates(four(reps.x), four(reps.jack), four(reps.zeta2), four(reps.margin))

    def fun(theta):
        w = np.where(is_cos[:, None], _cos_weights(theta, xs), _ratio_weights(theta, xs))
        return selective_cdf(xs, js, zs, ses, threshold, w, n_folds, rs)

    roots = _decreasing_root(fun, start, np.where(step > 0, step, 1.0), lo, hi, target).reshape(4, n)
    roots[2:] = np.exp(np.where(np.abs(roots[2:]) >= LOG_RATIO_LIMIT, np.sign(roots[2:]) * np.inf, roots[2:]))
    return roots


@dataclass
class Batch:
    """estimate_batch's output: every field of Estimate as an array over the leading axes, NaN below noise."""

    printed: np.ndarray
    fields: dict


def _signal_and_moments(means: list[np.ndarray], f: int, alpha: float):
    """(x = (ab, aa, bb), aa's and bb's jackknife SEs, printed mask)."""
    x = np.stack([u_statistic(m) for m in means], axis=-1)
    loo_aa, loo_bb = leave_one_out_inner(means[1]), leave_one_out_inner(means[2])
    se = np.stack([jackknife_se(loo_aa), jackknife_se(loo_bb)], axis=-1)
    c = signal_threshold(f, alpha)
    stable = (loo_aa > 0).all(-1) & (loo_bb > 0).all(-1)
    signal = (x[..., 1:] > 0) & ((se == 0) | (x[..., 1:] > c * se))
    return x, se, stable & signal.all(-1)


def effect_test(means: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(|μ^a − μ^b|²^, its jackknife SE, one-sided p-value of "no effect") from fold-means Grams (ab, aa, bb).

    The difference of the arms is a linear view: its Gram is G_aa + G_bb − G_ab − G_abᵀ. Its debiased
    squared norm has mean 0 exactly when μ^a = μ^b; the t test on the plain jackknife SE is conservative
    there (the jackknife counts the fold-pair variance, all there is under no effect, about twice)."""
    f = means[0].shape[-1]
    diff = means[1] + means[2] - means[0] - np.swapaxes(means[0], -1, -2)
    value, se = u_statistic(diff), jackknife_se(leave_one_out_inner(diff))
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(se > 0, _t_cdf(f - 1, -value / se), np.where(value > 0, 0.0, 1.0))
    return value, se, p


def estimate_batch(g_ab: np.ndarray, g_aa: np.ndarray, g_bb: np.ndarray, n_a, n_b, alpha: float) -> Batch:
    """estimate() over leading batch axes of (..., F, F) Grams (the calibration simulations call this)."""
    n_a, n_b = np.asarray(n_a, dtype=np.float64), np.asarray(n_b, dtype=np.float64)
    f = len(n_a)
    assert g_ab.shape == g_aa.shape == g_bb.shape and g_ab.shape[-2:] == (f, f) and f == len(n_b)
    assert f >= 3, "the jackknife needs at least 3 folds"
    means = [fold_means_gram(g, x, y) for g, x, y in ((g_ab, n_a, n_b), (g_aa, n_a, n_a), (g_bb, n_b, n_b))]
    x, norm_se, printed = _signal_and_moments(means, f, alpha)
    denom = np.sqrt(g_aa.sum((-2, -1)) * g_bb.sum((-2, -1)))
    with np.errstate(divide="ignore", invalid="ignore"):
        naive = np.where(denom > 0, g_ab.sum((-2, -1)) / denom, np.nan)
    diff, diff_se, effect_p = effect_test(means)
    fields = {"cos_naive": naive, "norm2_a": x[..., 1], "norm2_a_se": norm_se[..., 0], "norm2_b": x[..., 2],
              "norm2_b_se": norm_se[..., 1], "diff_norm2": diff, "diff_norm2_se": diff_se,
              "effect_p": effect_p}
    fields.update(_printed_fields(means, x, norm_se, printed, f, alpha))
    return Batch(printed, fields)


def _printed_fields(means, x, norm_se, printed, f: int, alpha: float) -> dict:
    """cos, ratio, their SEs and selective intervals where printed (NaN elsewhere), and near_boundary."""
    names = ("cos", "se", "norm_ratio", "norm_ratio_se", "cos_lo", "cos_hi", "ratio_lo", "ratio_hi")
    out = {k: np.full(printed.shape, np.nan) for k in names}
    out["near_boundary"] = np.zeros(printed.shape, dtype=bool)
    if not printed.any():
        return out
    m = [mm[printed] for mm in means]
    xp, se_p = x[printed], norm_se[printed]
    ab, aa, bb = xp[:, 0], xp[:, 1], xp[:, 2]
    cos, ratio = _cos(ab, aa, bb), np.sqrt(aa / bb)
    jack, zeta2 = kernel_moments(m)
    cos_w = np.stack([1 / np.sqrt(aa * bb), -cos / (2 * aa), -cos / (2 * bb)], axis=-1)
    ratio_w = np.stack([np.zeros_like(aa), ratio / (2 * aa), -ratio / (2 * bb)], axis=-1)
    cos_se, ratio_se = (np.sqrt(corrected_variance(jack, zeta2, w, f)) for w in (cos_w, ratio_w))
    reps = replicates(m, signal_threshold(f, alpha)) if f >= REPLICATE_MIN_FOLDS else None
    threshold = signal_threshold(f, alpha)
    ends = selective_intervals(xp, jack, zeta2, se_p, threshold, cos, ratio, cos_se, ratio_se, f, reps)
    exact = (cos_se == 0) | (ratio_se == 0)  # identical arms, or folds that agree exactly: nothing to bound
    ends[:2] = np.where(exact, cos, ends[:2])
    ends[2:] = np.where(exact, ratio, ends[2:])
    margin = (xp[:, 1:] / np.where(se_p > 0, se_p, np.nan)).min(-1) - signal_threshold(f, alpha)
    values = {"cos": cos, "se": cos_se, "norm_ratio": ratio, "norm_ratio_se": ratio_se, "cos_lo": ends[0],
              "cos_hi": ends[1], "ratio_lo": ends[2], "ratio_hi": ends[3],
              "near_boundary": np.nan_to_num(margin, nan=np.inf) < BOUNDARY_MARGIN_SE}
    for k, v in values.items():
        out[k][printed] = v
    return out


def estimate(g_ab: np.ndarray, g_aa: np.ndarray, g_bb: np.ndarray, n_a, n_b, alpha: float) -> Estimate:
    """Debiased cosine and norm ratio (with jackknife SEs and selective 95% intervals) between two arms.

    Both are reported only where each arm's debiased norm² is signal and stays positive with any
    one fold left out; otherwise they are None ("below noise"). Their SEs: pair_corrected_se; their
    intervals: selective_intervals, conditional on that test. The row's test of no effect: effect_test.
    """
    b = estimate_batch(*(np.asarray(g, dtype=np.float64)[None] for g in (g_ab, g_aa, g_bb)), n_a, n_b, alpha)
    v = {k: a[0] for k, a in b.fields.items()}
    f = len(n_a)
    out = Estimate(None, None, None, None, float(v["cos_naive"]), float(v["norm2_a"]), float(v["norm2_a_se"]),
                   float(v["norm2_b"]), float(v["norm2_b_se"]), t_quantile(f),
                   diff_norm2=float(v["diff_norm2"]), diff_norm2_se=float(v["diff_norm2_se"]),
                   effect_p=float(v["effect_p"]))
    if not b.printed[0]:
        return out
    out.cos, out.se = float(v["cos"]), float(v["se"])
    out.norm_ratio, out.norm_ratio_se = float(v["norm_ratio"]), float(v["norm_ratio_se"])
    out.cos_interval = (float(v["cos_lo"]), float(v["cos_hi"]))
    out.norm_ratio_interval = (float(v["ratio_lo"]), float(v["ratio_hi"]))
    out.near_boundary = bool(v["near_boundary"])
    return out


# ----------------------------------------------------------------------------- the residual view


def residual_scales(within: np.ndarray, base: int, n_samples: float) -> np.ndarray:
    """[B]: the plain norm of the base arm's mean gradient at each bin, sqrt(1ᵀ G 1) / N, from the
    within-bin blocks [B, A, F, A, F] of the estimand's columns (N: samples per arm and bin)."""
    return np.sqrt(np.maximum(within[:, base, :, base, :].sum((-2, -1)), 0.0)) / n_samples


def residual_gram(within: np.ndarray, cross: np.ndarray, base: int, n_samples: float) -> np.ndarray:
    """The within-bin Gram blocks [B, A, F, A, F] of the residual view: each bin's mean gradient less the
    base arm's mean direction over the bins, scaled to that bin's base norm.

    With c_b the base arm's plain mean-gradient norm at bin b (residual_scales) and its mean unit
    direction over the B bins ū = (1/B) Σ_b' μ^base_b' / c_b', the view of arm a at bin b is
    μ^a_b − c_b·ū; per fold, R_{b,a,f} = S_{b,a,f} − c_b·M_f with M_f = (1/B) Σ_b' S_{b',base,f} / c_b'.
    Every fold keeps its own noise (M_f is built from fold f alone), so the debiased estimator reads
    R like any other view. Its Gram needs, besides the within-bin blocks, every row against every bin's
    base rows: cross[b, a, f, b', g] = ⟨S_{b,a,f}, S_{b',base,g}⟩ ([B, A, F, B, F]):

        ⟨R_{b,a,f}, R_{b,a',g}⟩ = G_{b,a,f,a',g} − c_b·SM_{b,a,f,g} − c_b·SM_{b,a',g,f} + c_b²·MM_{f,g},
        SM_{b,a,f,g} = (1/B) Σ_b' cross[b,a,f,b',g] / c_b',
        MM_{f,g} = (1/B²) Σ_b',b'' cross[b',base,f,b'',g] / (c_b' c_b'').

    A bin whose base mean is exactly 0 (c_b = 0) adds nothing to ū and keeps its sums as they are."""
    n_bins = within.shape[0]
    scale = residual_scales(within, base, n_samples)
    weight = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0) / n_bins
    s_m = np.einsum("bafcg,c->bafg", cross, weight)  # ⟨S_{b,a,f}, M_g⟩
    m_m = np.einsum("cfdg,c,d->fg", cross[:, base], weight, weight)  # ⟨M_f, M_g⟩
    c = scale[:, None, None, None, None]
    row_term = s_m[:, :, :, None, :]  # [b, a, f, ·, g] = SM_{b,a,f,g}
    column_term = np.einsum("bagf->bfag", s_m)[:, None]  # [b, ·, f, a', g] = SM_{b,a',g,f}
    return within - c * (row_term + column_term) + c**2 * m_m[None, None, :, None, :]
