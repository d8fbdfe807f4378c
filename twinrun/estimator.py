"""DESIGN.md's estimator, from fold Gram matrices alone (F x F arithmetic, float64).

S^a ∈ R^{F×P} holds per-fold sums of per-sample gradients for arm a; G^{ab} = S^a (S^b)ᵀ.
Dividing each fold by its sample count gives per-fold means m_f, and the cross-fold average
  ⟨μ^a, μ^b⟩^ = Σ_{f≠g} m^a_f · m^b_g / (F(F−1))
is unbiased for ⟨E m^a, E m^b⟩ because folds are independent (a U-statistic): the same-fold
terms, which carry each fold's own noise, are left out.
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class Estimate:
    cos: float | None  # debiased cosine; None when a norm estimate is ≤ 0 ("below noise")
    se: float | None  # jackknife standard error over folds; None when undefined
    cos_naive: float  # cosine of the plain mean gradients (biased towards 0 by noise)
    norm2_a: float  # debiased squared norms, for the "below noise" diagnosis
    norm2_b: float

    @property
    def below_noise(self) -> bool:
        return self.cos is None


def debiased_inner(g_ab: np.ndarray, n_a: np.ndarray, n_b: np.ndarray) -> float:
    g = g_ab / np.outer(n_a, n_b)
    f = g.shape[0]
    return float((g.sum() - np.trace(g)) / (f * (f - 1)))


def _cos(g_ab, g_aa, g_bb, n_a, n_b):
    ab = debiased_inner(g_ab, n_a, n_b)
    aa = debiased_inner(g_aa, n_a, n_a)
    bb = debiased_inner(g_bb, n_b, n_b)
    if aa <= 0 or bb <= 0:
        return None, aa, bb
    # One sqrt of the product: identical arms give exactly 1.0 (sqrt(x·x) == x in IEEE).
    return ab / np.sqrt(aa * bb), aa, bb


def jackknife_se(g_ab, g_aa, g_bb, n_a, n_b) -> float | None:
    """Leave-one-fold-out standard error of the debiased cosine; None if a replicate is below noise."""
    f = g_ab.shape[0]
    if f < 3:
        return None
    reps = []
    for i in range(f):
        keep = np.arange(f) != i
        sub = np.ix_(keep, keep)
        c, _, _ = _cos(g_ab[sub], g_aa[sub], g_bb[sub], n_a[keep], n_b[keep])
        if c is None:
            return None
        reps.append(c)
    reps = np.asarray(reps)
    return float(np.sqrt((f - 1) / f * np.sum((reps - reps.mean()) ** 2)))


def estimate(g_ab: np.ndarray, g_aa: np.ndarray, g_bb: np.ndarray, n_a, n_b) -> Estimate:
    """Debiased cosine (with jackknife SE) and naive cosine between two arms' fold sums."""
    n_a, n_b = np.asarray(n_a, dtype=np.float64), np.asarray(n_b, dtype=np.float64)
    assert g_ab.shape == g_aa.shape == g_bb.shape == (len(n_a), len(n_a)) and len(n_a) == len(n_b)
    assert len(n_a) >= 2, "the debiased estimator needs at least 2 folds"
    cos, aa, bb = _cos(g_ab, g_aa, g_bb, n_a, n_b)
    se = jackknife_se(g_ab, g_aa, g_bb, n_a, n_b) if cos is not None else None
    denom = np.sqrt(g_aa.sum() * g_bb.sum())
    naive = float(g_ab.sum() / denom) if denom > 0 else float("nan")
    return Estimate(None if cos is None else float(cos), se, naive, aa, bb)
