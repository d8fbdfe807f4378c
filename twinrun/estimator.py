"""The debiased estimator, from fold Gram matrices alone (F x F arithmetic, float64).

S^a ∈ R^{F×P} holds per-fold sums of per-sample gradients for arm a; G^{ab} = S^a (S^b)ᵀ.
Dividing each fold by its sample count gives per-fold means m_f, and the cross-fold average
  ⟨μ^a, μ^b⟩^ = Σ_{f≠g} m^a_f · m^b_g / (F(F−1))
is unbiased for ⟨E m^a, E m^b⟩ because folds are independent (a U-statistic): the same-fold
terms, which carry each fold's own noise, are left out. Standard errors are the jackknife over
folds (leave one fold out, from the same Gram matrices); intervals and the test of signal use t
with F − 1 degrees of freedom. docs/estimator.md states the rules and their calibration.
"""

from dataclasses import dataclass
from functools import cache

import numpy as np
from scipy import stats

INTERVAL_LEVEL = 0.95


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
    t_crit: float  # t_{F−1} half-width factor of a 95% interval

    @property
    def below_noise(self) -> bool:
        return self.cos is None


def fold_means_gram(g_ab: np.ndarray, n_a: np.ndarray, n_b: np.ndarray) -> np.ndarray:
    """G^{ab} of fold means: each fold sum divided by its sample count."""
    return g_ab / np.outer(n_a, n_b)


def debiased_inner(g_ab: np.ndarray, n_a: np.ndarray, n_b: np.ndarray) -> float:
    g = fold_means_gram(g_ab, np.asarray(n_a, dtype=np.float64), np.asarray(n_b, dtype=np.float64))
    f = g.shape[0]
    return float((g.sum() - np.trace(g)) / (f * (f - 1)))


def leave_one_out_inner(g: np.ndarray) -> np.ndarray:
    """The debiased inner product with fold i left out, for every i (g: a fold-means Gram)."""
    f = g.shape[0]
    diag = np.diag(g)
    off_total = g.sum() - diag.sum()
    off_touching = g.sum(0) + g.sum(1) - 2 * diag  # cross-fold terms that involve fold i
    return (off_total - off_touching) / ((f - 1) * (f - 2))


def jackknife_se(replicates: np.ndarray) -> float:
    f = len(replicates)
    return float(np.sqrt((f - 1) / f * np.sum((replicates - replicates.mean()) ** 2)))


def _cos(ab, aa, bb):
    # One sqrt of the product: identical arms give exactly 1.0 (sqrt(x·x) == x in IEEE).
    return ab / np.sqrt(aa * bb)


def is_signal(norm2: float, norm2_se: float, n_folds: int, alpha: float) -> bool:
    """A debiased squared norm significantly above 0 (one-sided t test on its jackknife SE).

    With shared draws two pure-noise arms are nearly the same event, so alpha is also about the
    rate at which pure noise would be reported as a number (reduce.signal_alpha)."""
    return norm2 > 0 and (norm2_se == 0 or norm2 / norm2_se > signal_threshold(n_folds, alpha))


def estimate(g_ab: np.ndarray, g_aa: np.ndarray, g_bb: np.ndarray, n_a, n_b, alpha: float) -> Estimate:
    """Debiased cosine and norm ratio (with jackknife SEs) between two arms' fold sums.

    Both are reported only where each arm's debiased norm² is signal and stays positive with any
    one fold left out (so that every number has an SE); otherwise they are None ("below noise").
    """
    n_a, n_b = np.asarray(n_a, dtype=np.float64), np.asarray(n_b, dtype=np.float64)
    f = len(n_a)
    assert g_ab.shape == g_aa.shape == g_bb.shape == (f, f) and f == len(n_b)
    assert f >= 3, "the jackknife needs at least 3 folds"
    means = [fold_means_gram(g, x, y) for g, x, y in ((g_ab, n_a, n_b), (g_aa, n_a, n_a), (g_bb, n_b, n_b))]
    ab, aa, bb = (float((g.sum() - np.trace(g)) / (f * (f - 1))) for g in means)
    loo_ab, loo_aa, loo_bb = (leave_one_out_inner(g) for g in means)
    aa_se, bb_se = jackknife_se(loo_aa), jackknife_se(loo_bb)
    denom = np.sqrt(g_aa.sum() * g_bb.sum())
    naive = float(g_ab.sum() / denom) if denom > 0 else float("nan")
    out = Estimate(None, None, None, None, naive, aa, aa_se, bb, bb_se, t_quantile(f))
    stable = (loo_aa > 0).all() and (loo_bb > 0).all()
    if not (stable and is_signal(aa, aa_se, f, alpha) and is_signal(bb, bb_se, f, alpha)):
        return out
    out.cos, out.se = float(_cos(ab, aa, bb)), jackknife_se(_cos(loo_ab, loo_aa, loo_bb))
    out.norm_ratio, out.norm_ratio_se = float(np.sqrt(aa / bb)), jackknife_se(np.sqrt(loo_aa / loo_bb))
    return out
