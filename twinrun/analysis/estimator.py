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

import numpy as np

from twinrun.analysis.fold_moments import (
    REPLICATE_MIN_FOLDS,
    corrected_variance,
    cosine,
    fold_means_gram,
    jackknife_se,
    kernel_moments,
    leave_one_out_inner,
    signal_threshold,
    t_quantile,
    u_statistic,
)
from twinrun.analysis.selective import (
    _t_cdf,
    replicates,
    selective_intervals,
    shaped_by_selection,
)

# A printed row is marked near_boundary where the test of signal visibly shaped its interval: an end moved
# from the plain interval's by more than this share of the plain half-width (docs/estimator.md counts how
# often, by the weaker arm's margin over the threshold).
SHAPED_SHARE = 0.1


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
    # Printed, and the test of signal visibly shaped an interval (an end moved by > SHAPED_SHARE of the plain
    # half-width): the weaker arm is near the threshold, and cos and norm_ratio read as selected (the ratio
    # low, the cosine towards the noise correlation: docs/estimator.md); show |μ|² ± SE beside the row.
    near_boundary: bool = False
    # The row's test of "no effect" (μ^a = μ^b over the estimand's columns): the debiased |μ^a − μ^b|² and
    # the one-sided p-value of its t test. Defined for every row, printed or not (twinrun.family).
    diff_norm2: float = 0.0
    diff_norm2_se: float = 0.0
    effect_p: float = 1.0

    @property
    def below_noise(self) -> bool:
        return self.cos is None


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
    """cos, ratio, their SEs, printed and plain intervals where printed (NaN elsewhere), near_boundary."""
    names = ("cos", "se", "norm_ratio", "norm_ratio_se", "cos_lo", "cos_hi", "ratio_lo", "ratio_hi",
             "cos_plain_lo", "cos_plain_hi", "ratio_plain_lo", "ratio_plain_hi")
    out = {k: np.full(printed.shape, np.nan) for k in names}
    out["near_boundary"] = np.zeros(printed.shape, dtype=bool)
    # Rows that did not print keep NaN: an effect below noise has no cos or ratio, never a made-up 0.
    if not printed.any():
        return out
    m = [mm[printed] for mm in means]
    xp, se_p = x[printed], norm_se[printed]
    ab, aa, bb = xp[:, 0], xp[:, 1], xp[:, 2]
    cos, ratio = cosine(ab, aa, bb), np.sqrt(aa / bb)
    # The SEs of cos and ratio come from the same jackknife moments as the norms', through each one's
    # delta-method weights in (ab, aa, bb).
    jack, zeta2 = kernel_moments(m)
    cos_w = np.stack([1 / np.sqrt(aa * bb), -cos / (2 * aa), -cos / (2 * bb)], axis=-1)
    ratio_w = np.stack([np.zeros_like(aa), ratio / (2 * aa), -ratio / (2 * bb)], axis=-1)
    cos_se, ratio_se = (np.sqrt(corrected_variance(jack, zeta2, w, f)) for w in (cos_w, ratio_w))
    # The intervals are conditional on the row having printed (the test of signal selected it); with too few
    # folds there are no replicates to read that selection from.
    reps = replicates(m, signal_threshold(f, alpha)) if f >= REPLICATE_MIN_FOLDS else None
    threshold = signal_threshold(f, alpha)
    ends, plain = selective_intervals(xp, jack, zeta2, se_p, threshold, cos, ratio, cos_se, ratio_se, f, reps)
    exact = (cos_se == 0) | (ratio_se == 0)  # identical arms, or folds that agree exactly: nothing to bound
    ends[:2] = np.where(exact, cos, ends[:2])
    ends[2:] = np.where(exact, ratio, ends[2:])
    values = {"cos": cos, "se": cos_se, "norm_ratio": ratio, "norm_ratio_se": ratio_se, "cos_lo": ends[0],
              "cos_hi": ends[1], "ratio_lo": ends[2], "ratio_hi": ends[3],
              # the plain Fieller interval (no selection), which the printed one is read against
              "cos_plain_lo": plain[0], "cos_plain_hi": plain[1], "ratio_plain_lo": plain[2],
              "ratio_plain_hi": plain[3],
              # an exact row (arms bit-identical: a gate) has nothing the selection could shape
              "near_boundary": shaped_by_selection(ends, plain, SHAPED_SHARE) & ~exact}
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
    # Below noise: the norms and the test of no effect stand, cos and ratio stay None (not 0).
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
