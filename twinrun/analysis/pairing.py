"""The pairing receipt: what sharing the draws bought an effect row.

The twin consumes the intervention arm's noise draws and images, so the arms' noise is correlated and
much of it cancels in the comparison. How much depends on where the noise comes from: images, which an
unpaired control would share too (same images, same folds), or draws, which only the twin shares. Fold
sums alone cannot tell the two apart (a fold's image and draw noise add up in its sum), so the probe
also stores, per fold, the difference between the sums over the two halves of its draws,

    H_f = sqrt(k1·k2) · (S_{f,1}/k1 − S_{f,2}/k2)      (k1 = ⌊D/2⌋, k2 = D − k1 draws an image)

in which the images' share cancels (every image is in both halves), with the draw noise's covariance of
the whole sum and uncorrelated with it. Only inner products of H with the sums and with itself are
needed, F×F per parameter tensor (docs/estimator.md, "The pairing receipt", says what the probe stores).

From these blocks (fold-means versions: divided by the folds' sample counts):

- pairing_rho: the arms' noise correlation over the estimand's columns, tr Σ_ab / sqrt(tr Σ_aa tr Σ_bb),
  from the same-fold products less the debiased cross-fold ones; draw_rho the same for the draw noise
  alone, draw_share the draw noise's share of the twin's noise variance;
- pairing_gain (per estimate): Var(estimate had the twin consumed independent draws, same images and
  folds) / Var(estimate as measured). Both from the Hoeffding decomposition Var U = 4ζ1/F + 2ζ2/(F(F−1))
  of the estimate's linearised U-statistic with kernel m_fᵀ K m_g (K = W ⊗ I, W the weights of
  (ab, aa, bb) as a 2×2 form over the arms): unpairing removes the cross-arm draw covariance D from
  the fold noise's covariance Σ, which lowers ζ1 by 2·u_aᵀ D u_b (u = Kμ) and ζ2 by
  2 tr(KΣKJ) − tr(KJKJ) (J: D in the cross blocks). Each term is a U-statistic over folds of the blocks.

Where the draw noise differs across images (so from fold to fold) each term still averages what its folds
carry: the two variances stay unbiased, and the gain is the run's own, given its images. Over runs with other
images the gain pools the runs weighted by their variance and a median receipt reads below it
(docs/estimator.md, "Where draw noise differs across images").
"""

from dataclasses import dataclass, field

import numpy as np

from twinrun.analysis.fold_moments import fold_means_gram, kernel_moments, moment_matrix, u_statistic


@dataclass
class PairingBlocks:
    """One bin and estimand's blocks for a pair of arms (a = intervention, b = twin), F×F each, sums
    (not means) summed over the estimand's parameter tensors. g_xy[f, g] = ⟨S^x_f, S^y_g⟩;
    q_xy[f, g] = ⟨S^x_f, H^y_g⟩; r_xy[f, g] = ⟨H^x_f, H^y_g⟩ (r_ba = r_abᵀ is not stored)."""

    g_ab: np.ndarray
    g_aa: np.ndarray
    g_bb: np.ndarray
    q_aa: np.ndarray
    q_ab: np.ndarray
    q_ba: np.ndarray
    q_bb: np.ndarray
    r_aa: np.ndarray
    r_ab: np.ndarray
    r_bb: np.ndarray


@dataclass
class PairingReceipt:
    rho: float  # the arms' noise correlation (image and draw noise together)
    draw_rho: float  # the correlation of their draw noise alone
    draw_share: float  # the draw noise's share of the twin's noise variance
    gain_cos: float | None  # Var(cos | twin unpaired) / Var(cos as measured); None below noise
    gain_ratio: float | None
    gain_effect: float  # the same for the test of no effect, |μ_a − μ_b|²
    # {"cos", "ratio", "effect"}: (Var as measured, Var unpaired) whose ratio is the gain; each unbiased,
    # so over many runs their means pool to the variances over those runs (tests/analysis/test_pairing.py)
    variances: dict[str, tuple[float, float]] = field(default_factory=dict)


def _off_diagonal_mean(x: np.ndarray) -> float:
    f = x.shape[-1]
    return float((x.sum() - np.trace(x)) / (f * (f - 1)))


def noise_trace(m_xy: np.ndarray, n: np.ndarray) -> float:
    """Σ_f n_f (m^x_f·m^y_f − ⟨μ^x, μ^y⟩^) / F: the per-sample noise covariance's trace, tr Σ_xy, from a
    fold-means Gram (the same-fold products carry μ·μ plus the fold's own noise, tr Σ_xy / n_f)."""
    return float(np.mean(n * (np.diag(m_xy) - u_statistic(m_xy))))


def _excluding_pairs(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over distinct g, k, both ≠ f, of a[g, f] · b[k, f] (a, b: F×F, the diagonal ignored)."""
    f = a.shape[-1]
    a, b = a - np.diag(np.diag(a)), b - np.diag(np.diag(b))
    per_fold = a.sum(0) * b.sum(0) - (a * b).sum(0)
    return float(per_fold.sum() / (f * (f - 1) * (f - 2)))


def variance_change(weights: np.ndarray, q: dict, r: dict, n_folds: int) -> tuple[float, float]:
    """(δζ1, δζ2): how much unpairing the draws lowers the Hoeffding parts of the U-statistic Σ w_k X_k
    (X = ab, aa, bb). q, r: fold-means blocks keyed "aa", "ab", "ba", "bb"."""
    w_ab, w_aa, w_bb = weights[0] / 2, weights[1], weights[2]
    # A[f, g] = (K m_f)_a · h^a_g, B[f, g] = (K m_f)_b · h^b_g
    a = w_aa * q["aa"] + w_ab * q["ba"]
    b = w_ab * q["ab"] + w_bb * q["bb"]
    ua_d_ub = _excluding_pairs(a, b)  # u_aᵀ D u_b: m_g and m_k of two other folds stand in for μ
    same = _off_diagonal_mean(a * b)  # E[A_fg B_fg] = tr(Σ_qp D) + u_aᵀ D u_b
    tr_sigma_d = same - ua_d_ub
    frob_d = _off_diagonal_mean(r["aa"] * r["bb"])  # ‖D‖_F²
    tr_d2 = _off_diagonal_mean(r["ab"] * r["ab"].T)  # tr(D²)
    kjkj = 2 * w_ab**2 * tr_d2 + 2 * w_aa * w_bb * frob_d
    return 2 * ua_d_ub, 4 * tr_sigma_d - kjkj


def hoeffding_parts(means: list[np.ndarray], weights: np.ndarray) -> tuple[float, float]:
    """(ζ1, ζ2) of the U-statistic Σ w_k X_k, unbiased (before any clipping), from its two sums of squares."""
    f = means[0].shape[-1]
    kernel = sum(w * m for w, m in zip(weights, means))
    jack, zeta2 = kernel_moments([kernel])
    r_ss = jack[0, 0] * f * (f - 2) ** 2 / (4 * (f - 1))
    if f == 3:
        return float(r_ss * (f - 1) / (f - 2) ** 2), 0.0
    m = moment_matrix(f)
    zeta1 = (r_ss - m[0, 1] * zeta2[0, 0]) / m[0, 0]
    return float(zeta1), float(zeta2[0, 0])


def variances(means: list[np.ndarray], weights: np.ndarray, q: dict, r: dict) -> tuple[float, float]:
    """(Var as measured, Var had the twin's draws been independent) of the U-statistic Σ w_k X_k. Each is
    unbiased before clipping, also where the draw noise differs from fold to fold: every term is an
    average over folds or fold pairs of what those folds carry."""
    f = means[0].shape[-1]
    zeta1, zeta2 = hoeffding_parts(means, weights)
    d1, d2 = variance_change(weights, q, r, f)
    paired = max(4 * zeta1 / f, 0.0) + max(2 * zeta2 / (f * (f - 1)), 0.0)
    unpaired = max(4 * (zeta1 - d1) / f, 0.0) + max(2 * (zeta2 - d2) / (f * (f - 1)), 0.0)
    return paired, unpaired


def _correlation(xy: float, xx: float, yy: float) -> float:
    return xy / np.sqrt(xx * yy) if xx > 0 and yy > 0 else float("nan")


def pairing_receipt(blocks: PairingBlocks, n, printed: bool) -> PairingReceipt:
    """The receipt of one effect row. n: the folds' sample counts (images × draws), equal for both arms;
    printed: whether the row prints a cosine and a ratio (their gains are None otherwise)."""
    n = np.asarray(n, dtype=np.float64)
    means = [fold_means_gram(g, n, n) for g in (blocks.g_ab, blocks.g_aa, blocks.g_bb)]
    q = {k: fold_means_gram(getattr(blocks, f"q_{k}"), n, n) for k in ("aa", "ab", "ba", "bb")}
    r = {k: fold_means_gram(getattr(blocks, f"r_{k}"), n, n) for k in ("aa", "ab", "bb")}
    traces = [noise_trace(m, n) for m in means]
    draws = [float(np.mean(n * np.diag(r[k]))) for k in ("ab", "aa", "bb")]
    rho = _correlation(traces[0], traces[1], traces[2])
    ab, aa, bb = (u_statistic(m) for m in means)
    var = {"effect": variances(means, np.array([-2.0, 1.0, 1.0]), q, r)}
    if printed and aa > 0 and bb > 0:
        cos, ratio = ab / np.sqrt(aa * bb), np.sqrt(aa / bb)
        cos_w = np.array([1 / np.sqrt(aa * bb), -cos / (2 * aa), -cos / (2 * bb)])
        ratio_w = np.array([0.0, ratio / (2 * aa), -ratio / (2 * bb)])
        var["cos"], var["ratio"] = variances(means, cos_w, q, r), variances(means, ratio_w, q, r)
    gains = {k: unpaired / paired if paired > 0 else float("nan") for k, (paired, unpaired) in var.items()}
    return PairingReceipt(rho, _correlation(*draws), draws[2] / traces[2] if traces[2] > 0 else float("nan"),
                          gains.get("cos"), gains.get("ratio"), gains["effect"], var)
