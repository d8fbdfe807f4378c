"""A training run's effect rows: per stored step and estimand the intervention's distance from the twin
against the chaos floor (analysis/train_reduce.py reads the stores; this reads what it found), the
EMA weights' rows the same way, and the verdict's sentence. docs/training.md.
"""

import math

from twinrun.analysis.vouch import TWIN


def effect_rows(run, records: list[dict], found: dict, names: list[str]) -> tuple[list, list]:
    """(floor rows, effect rows) per stored step after the start and estimand."""
    inter, chaos = run.roles["intervention"], run.roles.get("chaos")
    floor, effects = [], []
    for i, per in enumerate(records[1:], start=1):
        step = per[TWIN]["to_step"]
        for name in names:
            c = found.get((i, chaos, name)) if chaos else None
            e = found[i, inter, name]
            floor_d = floor_of(None if c is None else c["distance"],
                               [found[i, r, name]["distance"] for r in run.all_of("replicate")])
            if c is not None:
                floor.append({"step": step, "estimand": name, "distance": floor_d, "cos": c["cos"],
                              "norm_ratio": c["norm_ratio"]})
            above = e["distance"] is not None and floor_d is not None and e["distance"] > run.margin * floor_d
            effects.append({"step": step, "estimand": name, "cos": e["cos"], "norm_ratio": e["norm_ratio"],
                            "distance": e["distance"], "floor": floor_d, "margin": run.margin,
                            "floor_ratio": _ratio(e["distance"], floor_d),
                            "above_floor": bool(above),
                            **{f"{role}_distance": _largest(found[i, a, name]["distance"]
                                                            for a in run.all_of(role))
                               for role in ("machinery", "replicate") if role in run.roles}})
    return floor, effects


def _largest(values) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def floor_of(chaos: float | None, replicates: list) -> float | None:
    """The floor: the larger of the chaos arm's distance and the replicates' (on a nondeterministic path
    the path's own wobble may exceed what one ulp does); None without a chaos arm."""
    if chaos is None:
        return None
    return max([chaos, *(r for r in replicates if r is not None)])


def _ratio(distance: float | None, floor: float | None) -> float | None:
    """The intervention's distance in floors (inf over a zero floor: a chaos arm back on the twin's bits)."""
    if distance is None or floor is None:
        return None
    return distance / floor if floor > 0 else (math.inf if distance > 0 else None)


def verdict(effects: list[dict], name: str, margin: float) -> str:
    """One sentence on the registered first estimand: above the chaos floor, or not told from chaos."""
    rows = [e for e in effects if e["estimand"] == name]
    if not rows:
        return "no training step was stored after the start: nothing to read"
    last = rows[-1]
    above = [e["step"] for e in rows if e["above_floor"]]
    times = "–" if last["floor_ratio"] is None else f"{last['floor_ratio']:.3g}"
    where = (f"at step {last['step']} its distance from the twin is {last['distance']:.3g}, the chaos floor "
             f"{last['floor']:.3g} ({times}×; a margin of {margin:g}× is required)")
    if not above:
        return (f"the intervention CANNOT be told from chaos ({name}): {where}; a one-ulp wobble moves this "
                "run as far as the intervention does at every stored step")
    if last["above_floor"] and len(above) == len(rows):
        return f"the intervention is ABOVE the chaos floor at every stored step ({name}): {where}"
    if last["above_floor"]:
        return f"the intervention is ABOVE the chaos floor from step {above[0]} on ({name}): {where}"
    return (f"the intervention CANNOT be told from chaos by the end ({name}): {where}; it was above the "
            f"floor at steps {', '.join(map(str, above))} only")


EMA = "ema/all"  # the estimand of the EMA weights (train.ema), beside the registered ones


def ema_rows(run, records: list[dict], found: dict) -> list[dict]:
    """Per stored step: the intervention's EMA weights against the twin's EMA (start: the start weights),
    the chaos arm's the floor, as the registered estimands' effect rows read the weights."""
    inter, chaos = run.roles["intervention"], run.roles.get("chaos")
    rows = []
    for i, per in enumerate(records[1:], start=1):
        e, c = found.get((i, inter, EMA)), found.get((i, chaos, EMA)) if chaos else None
        if e is None:
            continue
        floor = None if c is None else c["distance"]
        rows.append({"step": per[TWIN]["to_step"], "estimand": EMA, "distance": e["distance"],
                     "floor": floor, "floor_ratio": _ratio(e["distance"], floor), "cos": e["cos"],
                     "norm_ratio": e["norm_ratio"],
                     "above_floor": bool(e["distance"] is not None and floor is not None
                                         and e["distance"] > run.margin * floor)})
    return rows
