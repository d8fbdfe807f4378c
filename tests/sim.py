"""Simulated fold Gram matrices with a known truth, for the calibration tests (numpy only, vectorised).

Two arms' per-fold sums S_f = n_f·μ + noise_f over P coordinates. The per-sample noise has total variance P
(SNR = |μ_twin|² / (P / N) is then the twin's squared mean over the noise the plain mean of N samples
carries),
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

from twinrun.analysis.estimator import estimate_batch, residual_gram


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
    explicit_var = np.concatenate([np.full(noise.k, noise.dominant_var),
                                   np.full(n_explicit - noise.k, noise.bulk_var)])
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


def pairing_grams(rng, images_per_fold, n_draws: int, mu_a, mu_b, image_var, draw_var, rho_image: float,
                  rho_draw: float, reps: int, paired: bool = True, chunk: int = 200,
                  draw_scale2=None) -> dict:
    """Fold sums with image and draw noise, explicitly in P = len(mu_a) coordinates, and the blocks of the
    pairing receipt: {"g_ab", "g_aa", "g_bb", "q_aa", "q_ab", "q_ba", "q_bb", "r_aa", "r_ab", "r_bb"}, each
    [reps, F, F] (twinrun.pairing.PairingBlocks' fields).

    A sample (image i, draw d) of arm x is μ^x + α^x_i + β^x_id: the image's part α (variance image_var
    per coordinate, the arms' correlated rho_image: same images) and the draw's β (draw_var, correlated
    rho_draw when paired, independent when not: the twin's own draws). Fold f sums its images' D draws;
    H_f = sqrt(k1·k2)·(S_f,1/k1 − S_f,2/k2) over the two halves of the draws.

    draw_scale2: each image's draw variance as a multiple of draw_var, [images] (the same images in every
    run) or [reps, images] (other images each run), images in fold order; None: 1 for every image. Only
    its sum over a fold's images matters (the fold's draw sums are Gaussian with that variance), so no
    per-image noise is drawn."""
    k1 = n_draws // 2
    k2 = n_draws - k1
    m = np.asarray(images_per_fold)
    n_samples = (m * n_draws).astype(np.float64)
    mu = np.stack([np.asarray(mu_a, float), np.asarray(mu_b, float)])  # [2, P]
    sd_img, sd_draw = np.sqrt(np.asarray(image_var, float)), np.sqrt(np.asarray(draw_var, float))
    if draw_scale2 is None:
        draw_weight = np.broadcast_to(m, (reps, len(m)))  # Σ_{i ∈ f} s_i², here the image count
    else:
        scale2 = np.broadcast_to(np.asarray(draw_scale2, float), (reps, m.sum()))
        draw_weight = np.add.reduceat(scale2, np.concatenate([[0], np.cumsum(m)[:-1]]), axis=1)
    out = {k: [] for k in ("g_ab", "g_aa", "g_bb", "q_aa", "q_ab", "q_ba", "q_bb", "r_aa", "r_ab", "r_bb")}
    for start in range(0, reps, chunk):
        r = min(chunk, reps - start)
        shape = (r, len(m), mu.shape[1])

        def pair(rho, shape=shape):  # two arms' standard normals with correlation rho
            z = rng.standard_normal(shape)
            return np.stack([z, rho * z + np.sqrt(1 - rho**2) * rng.standard_normal(shape)], axis=1)

        image = pair(rho_image) * (n_draws * np.sqrt(m))[None, None, :, None] * sd_img  # Σ_i D·α_i
        rho_halves = rho_draw if paired else 0.0
        weight = draw_weight[start:start + r, None, :, None]
        halves = [pair(rho_halves) * np.sqrt(weight * k) * sd_draw for k in (k1, k2)]
        sums = n_samples[None, None, :, None] * mu[None, :, None, :] + image + halves[0] + halves[1]
        diff = np.sqrt(k1 * k2) * (halves[0] / k1 - halves[1] / k2)  # the images' share cancels
        gram = lambda x, y: np.einsum("rfp,rgp->rfg", x, y)
        s, h = {"a": sums[:, 0], "b": sums[:, 1]}, {"a": diff[:, 0], "b": diff[:, 1]}
        for k in ("ab", "aa", "bb"):
            out[f"g_{k}"].append(gram(s[k[0]], s[k[1]]))
        for k in ("aa", "ab", "ba", "bb"):
            out[f"q_{k}"].append(gram(s[k[0]], h[k[1]]))
        for k in ("aa", "ab", "bb"):
            out[f"r_{k}"].append(gram(h[k[0]], h[k[1]]))
    return {k: np.concatenate(v) for k, v in out.items()}


def run_fold_sums(rng, sizes, mu_arm, mu_twin, rho: float, reps: int, bin_corr: float = 0.5, spectrum=None):
    """[reps, B, 2, F, P] fold sums of a whole run: B bins, arms (intervention, twin), P coordinates.

    mu_arm, mu_twin: [B, P] mean gradients. Per sample the noise has unit variance per coordinate (times
    `spectrum`, [P], if given), the arms' correlated rho (shared draws and images); bins share the images,
    so a fold's noise is correlated bin_corr across bins."""
    n = np.asarray(sizes, dtype=np.float64)
    mu = np.stack([np.asarray(mu_arm, float), np.asarray(mu_twin, float)], axis=1)  # [B, 2, P]
    n_bins, _, p = mu.shape
    scale = np.ones(p) if spectrum is None else np.sqrt(np.asarray(spectrum, float))
    shape = (reps, 1, 1, len(n), p)
    common = rng.standard_normal(shape)  # the images, in every bin

    def arms(z_shared):
        per_bin = rng.standard_normal((reps, n_bins, 1, len(n), p))
        z = np.sqrt(bin_corr) * z_shared + np.sqrt(1 - bin_corr) * per_bin
        own = np.sqrt(bin_corr) * rng.standard_normal(shape) + np.sqrt(1 - bin_corr) * rng.standard_normal(
            (reps, n_bins, 1, len(n), p))
        return np.concatenate([z, rho * z + np.sqrt(1 - rho**2) * own], axis=2)

    noise = arms(common) * scale
    fold = n[None, None, None, :, None]
    return fold * mu[None, :, :, None, :] + np.sqrt(fold) * noise


def run_effect_rows(sums, sizes, cond_cols: int, alpha: float, gate: int) -> list[list[dict]]:
    """Per simulated run, its summary rows (σ = bin index) for the estimands all, cond and residual
    (the twin's mean direction removed, twinrun.analysis.estimator.residual_gram), each with effect_p and
    below_noise: what twinrun.analysis.family reads."""
    reps, n_bins = sums.shape[:2]
    within = lambda s: np.einsum("rbafp,rbcgp->rbafcg", s, s)
    views = {"all": within(sums), "cond": within(sums[..., :cond_cols])}
    cross = np.einsum("rbafp,rcgp->rbafcg", sums, sums[:, :, 1])
    views["residual"] = np.stack([residual_gram(views["all"][r], cross[r], 1, float(np.sum(sizes)))
                                  for r in range(reps)])
    runs = [[] for _ in range(reps)]
    for name, g in views.items():
        b = estimate_batch(g[:, :, 0, :, 1], g[:, :, 0, :, 0], g[:, :, 1, :, 1], sizes, sizes, alpha)
        for r in range(reps):
            for k in range(n_bins):
                runs[r].append({"sigma": float(k), "estimand": name, "gate": k == gate,
                                "effect_p": float(b.fields["effect_p"][r, k]),
                                "below_noise": not b.printed[r, k]})
    return runs
