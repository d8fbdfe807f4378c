"""The no-op gate rule and the replicate: may this run's effects be read at all?

At a gate bin the intervention claims to do nothing. Both arms ran in one process on the same
draws, so on a deterministic kernel path a true no-op is bit-identical: "close" is not a no-op.
The twin's replicate (the twin measured again in the same job: every bin with arms.replicate,
else automatically at a gate bin whose arms differ) tells the two cases apart.

On a nondeterministic path a true no-op is not bit-identical, and its distance from the twin is one draw
of the path's own wobble, as is each replicate's: given the twin, the no-op arm's and the K replicates'
distances are independent draws of one distribution. One replicate cannot say how far that distribution
reaches (a no-op beats it half the time), so the rule is a prediction bound from K replicates: on the log
scale, mean + t · sd · √(1 + 1/K), t the one-sided Student quantile with K − 1 degrees of freedom at
GATE_ALPHA / G, G the run's gate rows (Bonferroni, so all rows together). Exact for log-normal
distances (GATE_ALPHA per run); tests/analysis/test_gates_operating_characteristic.py measures it on norms
and maxima of atomic-add noise, where the tails differ, at ≤ 5 % per run (docs/estimator.md, "The gate on a
nondeterministic path").
"""

import functools
import math

from scipy import stats

from twinrun.analysis.checks import REPLICATE, TWIN, bins_of
from twinrun.analysis.estimands import SHIFT_VIEW
from twinrun.config import GATE_RULES  # noqa: F401 — the rules `decide` knows, defined with the config


def _size(est, shift: float) -> str:
    """The size of a difference, in the words every verdict uses."""
    parts = [f"max relative difference of the sums {shift:.3e}"]
    if est.cos is not None:
        parts += [f"1 − cos {1 - est.cos:.3e} ± {est.se:.1e}",
                  f"norm ratio {est.norm_ratio:.6f} ± {est.norm_ratio_se:.1e}"]
    return ", ".join(parts)


GATE_ALPHA = 0.025  # nominal false-failure rate of a true no-op per run, all gate rows together
MIN_REPLICATES = 2  # differing replicates needed for a spread; arms.replicates sets how many are measured


def wobble_bound(replicate_shifts, n_rows: int, alpha: float = GATE_ALPHA) -> float | None:
    """The largest shift a true no-op reaches but with probability alpha / n_rows: the upper prediction
    bound of the path's wobble from the replicates' nonzero shifts (None: fewer than MIN_REPLICATES)."""
    logs = [math.log(s) for s in replicate_shifts if s > 0]
    k = len(logs)
    if k < MIN_REPLICATES:
        return None
    mean = sum(logs) / k
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (k - 1))
    return math.exp(mean + bound_factor(k, n_rows, alpha) * sd)


@functools.lru_cache(maxsize=256)
def bound_factor(k: int, n_rows: int, alpha: float = GATE_ALPHA) -> float:
    """How many standard deviations of the replicates' log shifts the bound sits above their mean."""
    return float(stats.t.ppf(1 - alpha / max(n_rows, 1), k - 1)) * math.sqrt(1 + 1 / k)


def decide(identical: bool, shift: float, replicate_shifts, rule: str, n_rows: int = 1) -> tuple[bool, str]:
    """(passed, which rule decided) for one gate row; replicate_shifts: each replicate's shift from the twin
    at this row (None or empty = no replicate measured); n_rows: the run's gate rows (the family)."""
    if identical:
        return True, "bit-identical"
    if not replicate_shifts:
        return False, "not bit-identical, no replicate"
    if all(r == 0.0 for r in replicate_shifts):
        return False, "not a no-op on a deterministic path"
    if rule == "bit_identical":
        return False, "not bit-identical (gate_rule=bit_identical)"
    bound = wobble_bound(replicate_shifts, n_rows)
    if bound is None:
        return False, "too few replicates differ to bound the path's wobble"
    return shift <= bound, ("within the path's wobble" if shift <= bound else "beyond the path's wobble")


def gate_row(sigma: float, name: str, est, identical: bool, shift: float, replicate_shifts: list[float],
             rule: str, n_rows: int = 1) -> dict:
    passed, decided_by = decide(identical, shift, replicate_shifts, rule, n_rows)
    where = f"σ={sigma:g}, estimand {name}"
    rep_max = max(replicate_shifts) if replicate_shifts else None
    bound = wobble_bound(replicate_shifts, n_rows) if replicate_shifts else None
    # The detail names the evidence the verdict rests on: bit-identity; no replicate to prove the path
    # nondeterministic; a deterministic path, where any difference fails; or the shift against the replicates'
    # wobble.
    if identical:
        detail = f"{where}: bit-identical to the twin"
    elif not replicate_shifts:
        detail = (f"{where}: the arms differ ({_size(est, shift)}) and no replicate of the twin was "
                  "measured, so nothing proves the kernel path nondeterministic (a run planned before gate "
                  "replicates existed: measure it again into a new run directory)")
    elif rep_max == 0.0:
        detail = ("not a no-op: the arms differ at a bin where the intervention claims to do nothing "
                  f"({where}: {_size(est, shift)}); the twin's replicate is bit-identical, so the kernel "
                  "path is deterministic")
    else:
        detail = (f"{where}: the replicates prove the kernel path nondeterministic (twin vs replicates: max "
                  f"relative difference {', '.join(f'{r:.3e}' for r in replicate_shifts)}); intervention vs "
                  f"twin: {_size(est, shift)}; " + _against(shift, bound, len(replicate_shifts), n_rows)
                  + ("" if rule == "replicate" else "; gate_rule=bit_identical accepts no difference"))
    # The replicates' shifts and the bound are kept where they decided the gate, so a reader can redo the
    # comparison from summary.json.
    spread = {} if identical or not replicate_shifts else {"replicate_shifts": list(replicate_shifts),
                                                            "wobble_bound": bound}
    return {"sigma": sigma, "estimand": name, "passed": passed, "rule": decided_by,
            "bit_identical": identical, "max_shift": shift, "replicate_max_shift": rep_max, **spread,
            "detail": detail}


def _against(shift: float, bound: float | None, k: int, n_rows: int) -> str:
    """The gate's comparison in words: the shift against the bound of the path's wobble."""
    if bound is None:
        return (f"{k} replicate(s), fewer than {MIN_REPLICATES} differing: the path's wobble cannot be "
                f"bounded (measure with arms.replicates ≥ {MIN_REPLICATES + 1})")
    return (f"{'≤' if shift <= bound else '>'} {bound:.3e}, the bound of the path's wobble from {k} "
            f"replicates (a true no-op exceeds it in any of the run's {n_rows} gate rows with probability "
            f"≤ {GATE_ALPHA:g})")


def replicate_arms(index) -> list[str]:
    """The twin's replicates: the gate replicate (at gate bins, or an arm) and every replicate arm."""
    arms = [a["name"] for a in index.arms if a["role"] == "replicate"]
    return ([] if REPLICATE in arms else [REPLICATE]) + arms


def gates(index, found, estimates: dict, inter: str, names: list[str], rule: str) -> list[dict]:
    """One row per gate bin and estimand; found: the run's Scan; estimates: {(bin index, estimand):
    Estimate} (intervention vs twin)."""
    gate_bins = [b for b in bins_of(index) if b.gate]
    reps, n_rows = replicate_arms(index), len(gate_bins) * len(names)
    rows = []
    for b in gate_bins:
        pair = found.pairs[inter, TWIN, b.index]
        measured = [found.pairs[r, TWIN, b.index] for r in reps if (r, TWIN, b.index) in found.pairs]
        for name in names:
            rep_shifts = [p.shift(name) for p in measured]
            shift = 0.0 if pair.identical else pair.shift(name)
            rows.append(gate_row(b.sigma, name, estimates[b.index, name], pair.identical, shift, rep_shifts,
                                 rule, n_rows))
    return rows


def replicate_report(index, found) -> dict | None:
    """The native twin measured twice in one job: bit-identical, or how far apart (per bin)."""
    bins = [(b, found.pairs[REPLICATE, TWIN, b.index]) for b in bins_of(index)
            if (REPLICATE, TWIN, b.index) in found.pairs]
    if not bins:
        return None
    rows = [{"sigma": b.sigma, "bit_identical": p.identical,
             "max_abs_diff": 0.0 if p.identical else p.max_abs_diff,
             "max_shift": 0.0 if p.identical else p.shift(SHIFT_VIEW)} for b, p in bins]
    differ = sum(not r["bit_identical"] for r in rows)
    detail = (f"{differ} / {len(rows)} bins differ between the native twin and its replicate (each bin's "
              "fold sums compared bit for bit)")
    if differ:
        detail += (f"; max |Δ| = {max(r['max_abs_diff'] for r in rows):.3e}, max relative difference "
                   f"{max(r['max_shift'] for r in rows):.3e}: this kernel path is nondeterministic")
    return {"n_tensors": len(rows), "n_differ": differ, "max_abs_diff": max(r["max_abs_diff"] for r in rows),
            "bins": rows, "detail": detail}
