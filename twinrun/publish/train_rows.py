"""Training's rows where researchers work: one per stored step for the experiment trackers, and what a
sweep's summary keeps of a reduced training point (the kind's `tracker_rows` and `sweep_point`,
measures/train.py)."""

from twinrun.storage.rundir import RunIndex


def tracker_rows(index: RunIndex, summary: dict) -> tuple[list[dict], list[dict]]:
    """(the intervention's rows, the twin's rows), one per stored step of a training run: the distance to
    the twin, its chaos floor, cos and norm ratio of the updates per estimand, and the held-out losses."""
    effects = {(e["step"], e["estimand"]): e for e in summary["effects"]}
    names = list(dict.fromkeys(e["estimand"] for e in summary["effects"]))
    loss = {(r["step"], r["role"]): r["heldout_loss"] for r in summary.get("losses", [])}
    steps, base = [], []
    for u in index.units:
        step = index.params(u)["to_step"]
        row, twin = {"step": step}, {"step": step, "heldout_loss": loss.get((step, "twin"))}
        row["loss_arm/heldout"] = loss.get((step, "intervention"))
        for n in names:
            e = effects.get((step, n))
            if e is None:
                continue
            row[f"distance/{n}"], row[f"floor/{n}"] = e["distance"], e["floor"]
            row[f"above_floor/{n}"] = float(e["above_floor"])
            row[f"cos/{n}"], row[f"norm_ratio/{n}"] = e["cos"], e["norm_ratio"]
        steps.append(row)
        base.append(twin)
    return steps, base


def last_train_effect(summary: dict) -> dict | None:
    """A training point's reading at its last stored step, for the registered first estimand (the one its
    verdict reads): distance from the twin, the chaos floor, their ratio. None when effects are withheld."""
    name = summary["used"]["estimands"][0]
    rows = [e for e in summary["effects"] if e["estimand"] == name]
    if not rows:
        return None
    last = rows[-1]
    return {k: last[k] for k in ("step", "estimand", "distance", "floor", "floor_ratio", "above_floor")}


def sweep_point(summary: dict) -> dict:
    """A reduced training point in the sweep's summary: read per step, not per σ, the sweep lists its
    verdict and its last stored step's reading."""
    return {"verdict": summary["verdict"], "train_effect": last_train_effect(summary)}
