"""Simulated fold Gram matrices with a known truth, for the calibration tests (numpy only, vectorised).

Two arms' per-fold sums S_f = n_f·μ + noise_f over P coordinates. The per-sample noise has total variance P
(SNR = |μ_twin|² / (P / N) is then the twin's squared mean over the noise the plain mean of N samples carries),
the arms' noise correlated by rho as shared draws make it, and optionally

- concentrated in `k` dominant directions that carry `share` of the variance (real gradient noise is);
- heavy-tailed: a multivariate t with `tail_df` degrees of freedom, one scale per sample shared by both arms
  (an image whose gradients are large is large in every coordinate and in both arms), so a fold's noise
  is Gaussian given the scales of its samples with variance Σ_{i ∈ f} s_i² instead of n_f;
- with the signal in a dominant direction (`aligned`) rather than orthogonal to them.

No P-dimensional noise is drawn: the signal lives in 2 coordinates, the dominant directions in k more, and the
Gram of the remaining isotropic bulk is Wishart (rotation invariance).
"""

from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Noise:
    """The per-sample noise: total variance n_params, `share` of it in `k` dominant directions."""

    n_params: int = 1000
    k: int = 0
    share: float = 0.0
    tail_df: float | None = None  # None: Gaussian
    aligned: bool = False  # the twin's mean gradient lies along the first dominant direction

    @property
    def dominant_var(self) -> float:
        return self.share * self.n_params / self.k if self.k else 0.0

    @property
    def bulk_var(self) -> float:
        return (1 - self.share) * self.n_params / (self.n_params - self.k)


ISOTROPIC = Noise()
FEW = Noise(k=3, share=0.9)  # 90% of the variance in 3 directions
HEAVY = Noise(tail_df=3.0)
FEW_HEAVY = Noise(k=3, share=0.9, tail_df=3.0)
FEW_ALIGNED = Noise(k=3, share=0.9, aligned=True)


def fold_variances(rng, sizes, reps: int, noise: Noise) -> np.ndarray:
    """[reps, F]: each fold's noise variance in units of one sample's (n_f for Gaussian noise)."""
    sizes = np.asarray(sizes, dtype=int)
    if noise.tail_df is None:
        return np.broadcast_to(sizes.astype(np.float64), (reps, len(sizes))).copy()
    nu = noise.tail_df
    scale2 = nu / rng.chisquare(nu, size=(reps, sizes.sum())) * (nu - 2) / nu  # mean 1
    edges = np.concatenate([[0], np.cumsum(sizes)])
    return np.add.reduceat(scale2, edges[:-1], axis=1)


def sample_grams(rng, sizes, mu_a, mu_b, rho: float, reps: int, noise: Noise = ISOTROPIC):
    """(G_ab, G_aa, G_bb), each [reps, F, F], of `reps` simulated pairs of arms.

    mu_a, mu_b: 2-vectors, the arms' mean gradients in the two signal coordinates."""
    n = np.asarray(sizes, dtype=np.float64)
    f = len(n)
    var_f = fold_variances(rng, sizes, reps, noise)  # [reps, F]
    root = np.sqrt(var_f)
    # Explicit coordinates: the k dominant directions, then the bulk coordinates that carry the signal; when
    # aligned, the twin's direction is the first dominant one and only the arm's second coordinate is bulk.
    aligned = noise.aligned and noise.k > 0
    n_explicit = noise.k + (1 if aligned else 2)
    explicit_var = np.concatenate([np.full(noise.k, noise.dominant_var), np.full(n_explicit - noise.k, noise.bulk_var)])
    signal_at = [0, noise.k] if aligned else [noise.k, noise.k + 1]
    za = rng.standard_normal((reps, f, n_explicit))
    zb = rho * za + np.sqrt(1 - rho**2) * rng.standard_normal((reps, f, n_explicit))
    scale = root[:, :, None] * np.sqrt(explicit_var)[None, None, :]
    sa, sb = za * scale, zb * scale
    sa[:, :, signal_at] += n[None, :, None] * np.asarray(mu_a, dtype=np.float64)
    sb[:, :, signal_at] += n[None, :, None] * np.asarray(mu_b, dtype=np.float64)
    g = lambda x, y: np.einsum("kfp,kgp->kfg", x, y)
    bulk_df = noise.n_params - n_explicit
    cov = np.block([[np.eye(f), rho * np.eye(f)], [rho * np.eye(f), np.eye(f)]]) * noise.bulk_var
    w = stats.wishart(df=bulk_df, scale=cov).rvs(size=reps, random_state=rng).reshape(reps, 2 * f, 2 * f)
    rows = np.tile(root, 2)
    w = w * rows[:, :, None] * rows[:, None, :]
    return g(sa, sb) + w[:, :f, f:], g(sa, sa) + w[:, :f, :f], g(sb, sb) + w[:, f:, f:]


def truth_means(snr: float, sizes, cos_true: float, ratio: float, n_params: int = 1000):
    """(mu_a, mu_b) in the two signal coordinates for a twin at `snr` and the given cosine and norm ratio."""
    norm_b = np.sqrt(snr * n_params / np.sum(sizes))
    mu_b = np.array([norm_b, 0.0])
    mu_a = ratio * norm_b * np.array([cos_true, np.sqrt(max(1 - cos_true**2, 0.0))])
    return mu_a, mu_b
