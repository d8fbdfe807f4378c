"""Seeds as an axis: the points of a sweep that differ only in `seed`, pooled σ by σ and estimand by estimand.

Every seed of one protocol probes the same images with other noise draws (draws are keyed by seed;
the images are not), so the seeds' spread is the draws' share of the noise, while each run's own SE
(the jackknife over folds of images) holds all of it. Pooled per σ × estimand, for the effect 1 − cos
and for the norm ratio: the mean over seeds, its between-seed SE (sd / √K), the SE the seeds' own SEs
imply (√Σse² / K), and Welch's (1951) test of equal means with estimated variances: do the seeds
disagree by more than their within-seed SEs allow? Welch's, not Cochran's Q, because each SE is
itself estimated from F − 1 degrees of freedom: Q treats it as known and rejects too often when
folds are few (docs/estimator.md, "Seeds as an axis", has the simulation; tests/publish/test_seeds.py holds
it).
"""

import numpy as np
from scipy import stats

from twinrun.arms import EXCLUDED

SEED_KEY = "seed"
DISAGREE_ALPHA = 0.05  # a pooled row names the seeds as disagreeing below this p-value
TEST_NAME = "Welch's test of equal means (heterogeneity), within-seed SEs with F − 1 df"


def _overrides_by_key(overrides: list[str]) -> dict[str, str]:
    """The science overrides by key: how a run is launched, logged or compared (launcher.*, hydra.*,
    tracker.*, reference.*) is no setting of the measurement, so it neither splits a seed group nor
    shows in what the group holds fixed."""
    pairs = (o.lstrip("+~").partition("=")[::2] for o in overrides)
    return {k: v for k, v in pairs if k.split(".")[0].split("/")[0] not in EXCLUDED}


def seed_groups(points: list[dict]) -> list[dict]:
    """Points alike in every override but `seed`, grouped, where a group holds at least two seeds.

    Returns [{"fixed": {override key: value} (what the group shares), "points": [point, ...]}]."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        rest = {k: v for k, v in _overrides_by_key(p["overrides"]).items() if k != SEED_KEY}
        groups.setdefault(tuple(sorted(rest.items())), []).append(p)
    out = []
    for fixed, members in groups.items():
        seeds = {m.get("seed") for m in members} - {None}
        if len(seeds) >= 2:
            out.append({"fixed": dict(fixed), "points": members})
    return out


def folds_df(t_crit: float) -> int:
    """The degrees of freedom F − 1 behind a row's 95% t half-width factor (the row records t_crit)."""
    for df in range(1, 100_000):
        if stats.t.ppf(0.975, df) <= t_crit + 1e-9:
            return df
    return 100_000


def welch(values, ses, dfs) -> tuple:
    """(F, df1, df2, p) of Welch's test that K means are equal, given each one's estimated SE and its
    degrees of freedom; vectorised over leading axes (the last axis is the K seeds)."""
    y, se, nu = (np.asarray(a, dtype=np.float64) for a in (values, ses, dfs))
    k = y.shape[-1]
    w = 1.0 / se**2
    total = w.sum(-1, keepdims=True)
    mean = (w * y).sum(-1, keepdims=True) / total
    between = (w * (y - mean) ** 2).sum(-1) / (k - 1)
    lam = 3.0 * ((1.0 - w / total) ** 2 / nu).sum(-1) / (k**2 - 1)
    f = between / (1.0 + 2.0 * (k - 2) * lam / 3.0)
    df2 = 1.0 / lam
    return f, k - 1, df2, stats.f.sf(f, k - 1, df2)


def _pooled(values: list[float], ses: list[float], dfs: list[int], prefix: str, alpha: float) -> dict:
    """Mean, between-seed SE, within-seed SE and Welch's test of one quantity over the seeds with a number."""
    k = len(values)
    out = {f"{prefix}_mean": None, f"{prefix}_between_se": None, f"{prefix}_within_se": None,
           f"{prefix}_F": None, f"{prefix}_p": None, f"{prefix}_disagree": None}
    if k < 2:
        return out
    out[f"{prefix}_mean"] = float(np.mean(values))
    out[f"{prefix}_between_se"] = float(np.std(values, ddof=1) / np.sqrt(k))
    out[f"{prefix}_within_se"] = float(np.sqrt(np.sum(np.square(ses))) / k)
    if min(ses) > 0:  # a zero SE (identical arms) makes any difference infinitely significant: no test
        f, _, _, p = welch(values, ses, dfs)
        out.update({f"{prefix}_F": float(f), f"{prefix}_p": float(p),
                    f"{prefix}_disagree": bool(p < alpha)})
    return out


def _cell(group: dict, sigma: float, estimand: str, alpha: float) -> dict:
    """One σ × estimand pooled over the group's seeds."""
    rows, below, missing = [], [], []
    for p in group["points"]:
        if not (p.get("checks_passed") and p.get("gates_passed")):
            missing.append(p.get("seed"))
            continue
        row = next((e for e in p["effects"] if e["sigma"] == sigma and e["estimand"] == estimand), None)
        if row is None or row["cos"] is None or row["se"] is None:
            below.append(p.get("seed"))
            continue
        rows.append((p.get("seed"), row))
    dfs = [folds_df(r["t_crit"]) for _, r in rows]
    effect = _pooled([1 - r["cos"] for _, r in rows], [r["se"] for _, r in rows], dfs, "effect", alpha)
    ratio = _pooled([r["norm_ratio"] for _, r in rows], [r["norm_ratio_se"] for _, r in rows], dfs,
                    "norm_ratio", alpha)
    return {"fixed": group["fixed"], "run_dirs": [p["run_dir"] for p in group["points"]], "sigma": sigma,
            "estimand": estimand, "seeds": [s for s, _ in rows],
            "n_seeds": len(rows), "below_noise_seeds": below, "withheld_seeds": missing, "test": TEST_NAME,
            "alpha": alpha, **effect, **ratio}


def pool_seeds(points: list[dict], alpha: float = DISAGREE_ALPHA) -> list[dict]:
    """Every σ × estimand of every seed group, pooled (sweep_summary.json's `pooled_over_seeds`)."""
    out = []
    for group in seed_groups(points):
        cells = dict.fromkeys((e["sigma"], e["estimand"]) for p in group["points"] for e in p["effects"])
        out += [_cell(group, sigma, estimand, alpha) for sigma, estimand in cells]
    return out


def disagreements(pooled: list[dict]) -> list[str]:
    """`σ=0.5 all: effect (F=7.1, p=0.002)` for every pooled cell whose seeds disagree."""
    lines = []
    for c in pooled:
        which = [f"{name} (F={c[f'{key}_F']:.2f}, p={c[f'{key}_p']:.3g})"
                 for key, name in (("effect", "1 − cos"), ("norm_ratio", "norm ratio"))
                 if c[f"{key}_disagree"]]
        if which:
            lines.append(f"σ={c['sigma']:g} `{c['estimand']}`: {', '.join(which)}")
    return lines
