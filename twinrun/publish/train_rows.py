"""Training's rows where researchers work: one per stored step for the experiment trackers, and what a
sweep's summary keeps of a reduced training point (the kind's `tracker_rows` and `sweep_point`,
measures/train.py)."""

from twinrun.publish.trackers import merge_rows
from twinrun.storage.rundir import RunIndex


def tracker_rows(index: RunIndex, summary: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(the comparison's rows, the twin's own, the intervention's own) of a training run: per stored step
    the distance to the twin, its chaos floor, cos and norm ratio of the updates per estimand; each arm's
    training loss at every optimizer step (`loss/train`) and held-out loss ± SE at every stored step
    (`loss/heldout`), under the same keys for both arms, so trackers overlay them."""
    steps = []
    for e in summary["effects"]:
        n = e["estimand"]
        # floor/{n} is the floor the row was read against (the whole model's under floor_scope=model, and
        # then own_floor/{n} is the estimand's own)
        steps.append({"step": e["step"], f"distance/{n}": e["distance"], f"floor/{n}": e["floor"],
                      f"above_floor/{n}": float(e["above_floor"]), f"cos/{n}": e["cos"],
                      f"norm_ratio/{n}": e["norm_ratio"],
                      **({f"own_floor/{n}": e["own_floor"]} if "floor_from" in e else {})})
    own: dict = {"intervention": [], "twin": []}
    for r in summary.get("losses", []):
        if r["role"] not in own:
            continue
        rows, per_step = own[r["role"]], r.get("train_loss_steps") or []
        first = r["step"] - len(per_step) + 1
        rows += [{"step": first + i, "loss/train": x} for i, x in enumerate(per_step)]
        rows.append({"step": r["step"], "loss/heldout": r["heldout_loss"],
                     "loss/heldout_se": r["heldout_se"]})
    return merge_rows("step", steps), merge_rows("step", own["twin"]), merge_rows("step", own["intervention"])


def last_train_effect(summary: dict) -> dict | None:
    """A training point's reading at its last stored step, for the registered first estimand (the one its
    verdict reads): distance from the twin, the chaos floor, their ratio. None when effects are withheld."""
    name = summary["used"]["estimands"][0]
    rows = [e for e in summary["effects"] if e["estimand"] == name]
    if not rows:
        return None
    last = rows[-1]
    # floor_from: the whole model's floor was read (train.floor_scope=model), not the estimand's own
    return {k: last[k] for k in ("step", "estimand", "distance", "floor", "floor_ratio", "above_floor",
                                 "floor_from") if k in last}


def sweep_point(summary: dict) -> dict:
    """A reduced training point in the sweep's summary: read per step, not per σ, the sweep lists its
    verdict and its last stored step's reading."""
    return {"verdict": summary["verdict"], "train_effect": last_train_effect(summary)}
