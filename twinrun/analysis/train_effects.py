"""A training run's effect rows: per stored step and estimand the intervention's distance from the twin
against the chaos floor (analysis/train_reduce.py reads the stores; this reads what it found), the
EMA weights' rows the same way, and the verdict's sentence. docs/training.md.
"""

import math

from twinrun.analysis.estimands import SHIFT_VIEW
from twinrun.analysis.vouch import TWIN


def effect_rows(run, records: list[dict], found: dict, names: list[str]) -> tuple[list, list]:
    """(floor rows, effect rows) per stored step after the start and estimand. Per estimand and step the
    floor is the largest distance of the chaos arms and the replicates, and the margin is
    train.floor_margin times the chaos arms' spread there (largest / smallest: 1 with one arm), so an
    estimand whose chaos lands unevenly asks for more before it reads "above". With train.floor_scope=model
    an estimand is read against the whole model's floor (every trained weight's: `all`) with its margin
    where that bar (floor × margin) is the higher: chaos that has reached the model's update that far is
    what a longer run carries into every part of it, and the model scope never reads an effect that its
    own floor would not (docs/training.md)."""
    inter, chaos = run.roles["intervention"], run.all_of("chaos")
    floor, effects = [], []
    for i, per in enumerate(records[1:], start=1):
        step = per[TWIN]["to_step"]
        scoped = [MODEL] if run.floor_scope == "model" else []
        own = {name: _floor_at(run, found, i, name) for name in dict.fromkeys([*names, *scoped])}
        for name in names:
            c = [found[i, a, name] for a in chaos]
            e = found[i, inter, name]
            floor_d, spread = own[name]
            read = name
            if run.floor_scope == "model" and _larger(_bar(*own[MODEL]), _bar(floor_d, spread)):
                read = MODEL
            floor_r, spread_r = own[read]
            margin = run.margin * spread_r
            if c:
                worst = max(c, key=lambda x: -math.inf if x["distance"] is None else x["distance"])
                floor.append({"step": step, "estimand": name, "distance": floor_d, "cos": worst["cos"],
                              "norm_ratio": worst["norm_ratio"], "spread": spread,
                              "margin": run.margin * spread,
                              "chaos_distances": [x["distance"] for x in c]})
            above = e["distance"] is not None and floor_r is not None and e["distance"] > margin * floor_r
            row = {"step": step, "estimand": name, "cos": e["cos"], "norm_ratio": e["norm_ratio"],
                   "distance": e["distance"], "floor": floor_r, "margin": margin,
                   "floor_ratio": _ratio(e["distance"], floor_r), "above_floor": bool(above),
                   **{f"{role}_distance": _largest(found[i, a, name]["distance"] for a in run.all_of(role)
                                                   if (i, a, name) in found)
                      for role in ("machinery", "replicate") if role in run.roles}}
            if read != name:  # read against the model's floor: its own beside it
                row.update(floor_from=read, own_floor=floor_d, own_floor_ratio=_ratio(e["distance"], floor_d))
            effects.append(row)
    return floor, effects


MODEL = SHIFT_VIEW  # the whole model's floor (train.floor_scope=model): every trained weight's chaos


def _floor_at(run, found: dict, i: int, name: str) -> tuple[float | None, float]:
    """(floor, chaos arms' spread) of one estimand at stored step i."""
    c = [found[i, a, name]["distance"] for a in run.all_of("chaos")]
    # (arms.replicate_segments: the replicates are measured in the first segments only)
    reps = [found[i, r, name]["distance"] for r in run.all_of("replicate") if (i, r, name) in found]
    return floor_of(c, reps), chaos_spread(c)


def _bar(floor: float | None, spread: float) -> float | None:
    """What an effect must exceed, up to train.floor_margin: the floor times the chaos arms' spread."""
    return None if floor is None else floor * spread


def _larger(a: float | None, b: float | None) -> bool:
    return a is not None and (b is None or a > b)


def _largest(values) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def floor_of(chaos: list, replicates: list) -> float | None:
    """The floor: the largest of the chaos arms' distances and the replicates' (on a nondeterministic path
    the path's own wobble may exceed what a one-ulp start does); None without a chaos arm."""
    known = [x for x in chaos if x is not None]
    if not known:
        return None
    return max([*known, *(r for r in replicates if r is not None)])


def chaos_spread(chaos: list) -> float:
    """How unevenly the chaos arms land in one estimand: their largest distance over their smallest (1 with
    one arm or none; inf where one of them sits on the twin's bits and another does not)."""
    known = [x for x in chaos if x is not None]
    if len(known) < 2 or max(known) == 0:
        return 1.0
    return max(known) / min(known) if min(known) > 0 else math.inf


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


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
    times = _num(last["floor_ratio"])
    scope = "floor_from" in last  # read against the whole model's floor (train.floor_scope=model)
    model = (f", the whole model's (`{last['floor_from']}`: train.floor_scope=model; {name}'s own "
             f"{_num(last['own_floor'])}, {_num(last['own_floor_ratio'])}×)" if scope else "")
    whose = f"`{last['floor_from']}`'s chaos arms' spread" if scope else "the chaos arms' spread"
    where = (f"at step {last['step']} its distance from the twin is {_num(last['distance'])}, the chaos "
             f"floor {_num(last['floor'])}{model} ({times}×; a margin of {_num(last['margin'])}× is "
             f"required: train.floor_margin={margin:g} × {whose})")
    if not above:
        moves = (f"a one-ulp wobble moves the whole model (`{last['floor_from']}`) nearly as far, for its "
                 f"update, as the intervention moves {name}" if scope else
                 "a one-ulp wobble moves this run nearly as far as the intervention does")
        return f"the intervention CANNOT be told from chaos ({name}): {where}; {moves} at every stored step"
    if last["above_floor"] and len(above) == len(rows):
        return f"the intervention is ABOVE the chaos floor at every stored step ({name}): {where}"
    if last["above_floor"]:
        return f"the intervention is ABOVE the chaos floor from step {above[0]} on ({name}): {where}"
    return (f"the intervention CANNOT be told from chaos by the end ({name}): {where}; it was above the "
            f"floor at steps {', '.join(map(str, above))} only")


EMA = "ema/all"  # the estimand of the EMA weights (train.ema), beside the registered ones


def ema_rows(run, records: list[dict], found: dict) -> list[dict]:
    """Per stored step: the intervention's EMA weights against the twin's EMA (start: the start weights),
    the chaos arms' the floor (margin × their spread), as the registered estimands' effect rows read them."""
    inter, chaos = run.roles["intervention"], run.all_of("chaos")
    rows = []
    for i, per in enumerate(records[1:], start=1):
        e = found.get((i, inter, EMA))
        c = [found[i, a, EMA]["distance"] for a in chaos if (i, a, EMA) in found]
        if e is None:
            continue
        floor, margin = floor_of(c, []), run.margin * chaos_spread(c)
        rows.append({"step": per[TWIN]["to_step"], "estimand": EMA, "distance": e["distance"],
                     "floor": floor, "floor_ratio": _ratio(e["distance"], floor), "cos": e["cos"],
                     "norm_ratio": e["norm_ratio"],
                     "above_floor": bool(e["distance"] is not None and floor is not None
                                         and e["distance"] > margin * floor)})
    return rows
