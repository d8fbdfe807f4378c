"""A training run's loss rows: per stored step and arm the training loss under the twin's objective, the
held-out loss, and its paired difference from the twin's (same images, same draws); the verdict's
sentence on them. docs/training.md.
"""

import math

import torch
from scipy import stats

from twinrun.analysis.vouch import TWIN


def paired(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean of a − b, its SE over images): a paired difference of per-image losses on the same draws."""
    d = (a.double() - b.double()).numpy()
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan


def loss_rows(run, records: list[dict], losses: list[dict], alpha: float) -> list[dict]:
    """Per stored step and arm: the mean training loss over the unit's steps (and each step's), the held-out
    loss ± SE over images, and its paired difference from the twin's ± SE (same images, same draws)."""
    rows = []
    for per, tensors in zip(records, losses, strict=True):
        twin = tensors[TWIN]["heldout_loss"]
        n = twin.numel()
        t_crit = float(stats.t.ppf(1 - alpha / 2, n - 1)) if n > 1 else math.nan
        for arm, t in tensors.items():
            held, train = t["heldout_loss"], t["train_loss"]
            # Every arm's training loss under one objective, the twin's unweighted (a store written
            # before it was recorded: the arm's own), beside the arm's own objective, labelled so.
            common = t.get("train_loss_common", train)
            diff, se = paired(held, twin)
            rows.append({"step": per[arm]["to_step"], "arm": arm, "role": _role(run, arm),
                         "train_loss": float(common.double().mean()) if common.numel() else None,
                         "train_loss_steps": [float(x) for x in common],
                         "train_loss_own": float(train.double().mean()) if train.numel() else None,
                         "train_loss_own_steps": [float(x) for x in train],
                         "heldout_loss": float(held.double().mean()),
                         "heldout_se": float(held.double().std() / math.sqrt(n)) if n > 1 else math.nan,
                         "heldout_diff": diff, "heldout_diff_se": se,
                         "heldout_diff_significant": bool(se > 0 and abs(diff) > t_crit * se),
                         "t_crit": t_crit})
    return rows


def _role(run, arm: str) -> str:
    return next((r for r, a in run.by_role.items() if arm in a), None) or next(
        r for r, a in run.roles.items() if a == arm)


def loss_sentence(rows: list[dict]) -> str:
    """The verdict's reading of the losses at the last stored step, like with like: the intervention's
    training loss under the twin's objective (unweighted) against the twin's, and the held-out difference."""
    last = max(r["step"] for r in rows)
    at = {r["role"]: r for r in rows if r["step"] == last}
    mine, twin = at.get("intervention"), at.get("twin")
    if mine is None or twin is None or mine["train_loss"] is None or twin["train_loss"] is None:
        return ""
    own = ("" if mine.get("train_loss_own") in (None, mine["train_loss"]) else
           f" (under its own objective {mine['train_loss_own']:.4g})")
    return (f"; losses at step {last}, under the twin's objective: training {mine['train_loss']:.4g} against "
            f"the twin's {twin['train_loss']:.4g}{own}, held-out {mine['heldout_diff']:+.2e} ± "
            f"{mine['heldout_diff_se']:.1e} from the twin's")
