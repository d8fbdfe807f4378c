"""Intervals given printing: a cosine and a norm ratio print only where both arms pass the test of
signal, so their intervals are built conditional on it. Fieller-type pivots, linear in the three inner
products, inverted through their distribution truncated to the cases that pass; the test's pull is read
from leave-one-fold-out replicates. The intervals are hybrid: the pivot's distribution is truncated also
to the plain interval at a small level β, so that a row the test of signal could not have withheld reads
the plain interval exactly. docs/estimator.md states the rule and its calibration.
"""

from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from twinrun.analysis.fold_moments import (
    INTERVAL_LEVEL,
    corrected_variance,
    jackknife_se,
    kernel_moments,
    leave_one_out_inner,
    u_statistic,
)

# The hybrid's share of the miss rate (Andrews, Kitagawa & McCloskey's hybrid confidence sets): the pivot is
# conditioned also on lying inside its plain 1 − β interval, and the rest of the miss rate, (α − β)/(1 − β),
# is spent given both. Far from the threshold the selection bounds nothing inside that interval and the
# hybrid is the plain 1 − α interval exactly; near it the miss given printing is at most about
# α − β + β/P(print). β = α/10 measured (docs/estimator.md): coverage stays in the band at the boundary.
HYBRID_BETA_SHARE = 0.1


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
                  weights: np.ndarray, n_folds: int, reps: Replicates | None = None,
                  projection_t: float = np.inf, selected: np.ndarray | bool = True) -> np.ndarray:
    """Where the observed pivot T = wᵀx falls in its null distribution given that the row printed.

    x: (ab, aa, bb) (..., 3); norm_se: aa's and bb's jackknife SEs (..., 2); the row printed because
    each arm's margin m_k = x_k − threshold·norm_se_k is positive; weights w make E T = 0 at the tested
    value; T is studentised by corrected_variance to t. Write m_k = W_k + κ_k·t with W_k uncorrelated
    with t (κ: selection_slopes): given W, printing bounds t to an interval, and t is a t_{F−1}
    truncated to it (the polyhedral lemma of selective inference, with the moments estimated from the
    folds). projection_t bounds t further to |t| ≤ projection_t (the hybrid's plain interval); a pivot
    outside it reads 0 or 1 (rejected). Where selected is False the selection's bound is left out (the
    plain interval, for comparison)."""
    sd = np.sqrt(np.maximum(corrected_variance(jack, zeta2, weights, n_folds), 1e-300))
    t_obs = np.einsum("...k,...k->...", weights, x) / sd
    slopes = selection_slopes(jack, weights, sd, n_folds, reps)
    lo, hi = np.full_like(t_obs, -np.inf), np.full_like(t_obs, np.inf)
    for k in (0, 1):
        margin = x[..., k + 1] - threshold * norm_se[..., k]  # ≥ 0: the row printed
        with np.errstate(divide="ignore", invalid="ignore"):
            bound = t_obs - margin / slopes[..., k]
        lo = np.where(selected & (slopes[..., k] > 0), np.maximum(lo, bound), lo)
        hi = np.where(selected & (slopes[..., k] < 0), np.minimum(hi, bound), hi)
    lo, hi = np.maximum(lo, -projection_t), np.minimum(hi, projection_t)
    inside = truncated_t_cdf(t_obs, lo, hi, n_folds - 1)
    return np.where(t_obs > projection_t, 1.0, np.where(t_obs < -projection_t, 0.0, inside))


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
                        reps: Replicates | None, level: float = INTERVAL_LEVEL,
                        beta_share: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """((4, n) printed, (4, n) plain): the cosine's lower and upper ends, then the norm ratio's, given that
    each of the n rows printed (hybrid, at level), and the same ends without the selection (the plain
    Fieller interval at level, for comparison). Each end is where selective_cdf of the row's pivot, as the
    tested value moves, crosses its target. The cosine is searched over [−1, 1], the ratio over log r (a
    side that reaches the limit is unbounded: 0 or inf). All eight searches per row share one vectorised
    root finder. beta_share (default HYBRID_BETA_SHARE) = 0 gives the purely conditional interval."""
    alpha = 1 - level
    beta_share = HYBRID_BETA_SHARE if beta_share is None else beta_share
    beta = beta_share * alpha
    # Given |t| ≤ q_β the rest of the miss, (α − β)/(1 − β), is split between the tails; with no selection
    # these targets land exactly on the plain 1 − α interval's t quantiles.
    tail = (alpha - beta) / (1 - beta) / 2
    projection = float(stats.t.ppf(1 - beta / 2, n_folds - 1)) if beta > 0 else np.inf
    n = len(cos)
    is_cos = np.tile(np.repeat([True, True, False, False], n), 2)
    selected = np.repeat([True, False], 4 * n)
    eight = lambda a: None if a is None else np.concatenate([a] * 8)
    target = np.tile(np.repeat([1 - tail, tail, 1 - tail, tail], n), 2)
    # All eight ends of every row in one vector: one vectorised search instead of 8n scalar ones. The ratio is
    # searched on log r, so that its unbounded sides, 0 and inf, are finite limits.
    start = np.tile(np.concatenate([np.clip(cos, -1, 1)] * 2 + [np.log(ratio)] * 2), 2)
    step = np.tile(np.concatenate([cos_se] * 2 + [ratio_se / ratio] * 2), 2)
    lo = np.where(is_cos, -1.0, -LOG_RATIO_LIMIT)
    hi = np.where(is_cos, 1.0, LOG_RATIO_LIMIT)
    xs, js, zs, ses = eight(x), eight(jack), eight(zeta2), eight(norm_se)
    rs = None
    if reps is not None:
        rs = Replicates(eight(reps.x), eight(reps.jack), eight(reps.zeta2), eight(reps.margin))

    def fun(theta):
        w = np.where(is_cos[:, None], _cos_weights(theta, xs), _ratio_weights(theta, xs))
        return selective_cdf(xs, js, zs, ses, threshold, w, n_folds, rs, projection, selected)

    roots = _decreasing_root(fun, start, np.where(step > 0, step, 1.0), lo, hi, target).reshape(8, n)
    # A side that reached the limit is unbounded: reported as 0 or inf, never as the number the search stopped
    # at.
    for r in (roots[2:4], roots[6:8]):
        r[:] = np.exp(np.where(np.abs(r) >= LOG_RATIO_LIMIT, np.sign(r) * np.inf, r))
    return roots[:4], roots[4:]


def shaped_by_selection(printed: np.ndarray, plain: np.ndarray, share: float) -> np.ndarray:
    """(n,): rows where the selection visibly shaped the interval: an end of the printed interval (4, n)
    moved from the plain one's by more than share of the plain half-width, on the cosine's scale and on
    log r (an end open in one and not the other counts as moved)."""
    def scale(ends, k):
        with np.errstate(divide="ignore"):
            return ends[k] if k < 2 else np.log(ends[k])

    moved = np.zeros(printed.shape[1], dtype=bool)
    for pair in ((0, 1), (2, 3)):
        p_lo, p_hi = (scale(plain, k) for k in pair)
        with np.errstate(invalid="ignore", divide="ignore"):
            half = (p_hi - p_lo) / 2
            for k, p_end in zip(pair, (p_lo, p_hi)):
                end = scale(printed, k)
                same = end == p_end  # also both open on the same side (±inf)
                gap = np.abs(end - p_end)
                # an open plain side leaves no half-width to compare a finite move against
                moved |= ~same & (np.isinf(gap) | ~(gap <= share * np.where(np.isfinite(half), half, np.inf)))
    return moved
