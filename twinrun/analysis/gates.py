"""The no-op gate rule and the replicate: may this run's effects be read at all?

At a gate bin the intervention claims to do nothing. Both arms ran in one process on the same
draws, so on a deterministic kernel path a true no-op is bit-identical: "close" is not a no-op.
The twin's replicate (the twin measured again in the same job: every bin with arms.replicate,
else automatically at a gate bin whose arms differ) tells the two cases apart.
"""

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


def decide(identical: bool, shift: float, replicate_shift: float | None, rule: str) -> tuple[bool, str]:
    """(passed, which rule decided) for one gate row; replicate_shift None = no replicate measured."""
    if identical:
        return True, "bit-identical"
    if replicate_shift is None:
        return False, "not bit-identical, no replicate"
    if replicate_shift == 0.0:
        return False, "not a no-op on a deterministic path"
    if rule == "bit_identical":
        return False, "not bit-identical (gate_rule=bit_identical)"
    return shift <= replicate_shift, ("within the replicate" if shift <= replicate_shift
                                      else "beyond the replicate")


def gate_row(sigma: float, name: str, est, identical: bool, shift: float, replicate_shift: float | None,
             rule: str) -> dict:
    passed, decided_by = decide(identical, shift, replicate_shift, rule)
    where = f"σ={sigma:g}, estimand {name}"
    if identical:
        detail = f"{where}: bit-identical to the twin"
    elif replicate_shift is None:
        detail = (f"{where}: the arms differ ({_size(est, shift)}) and no replicate of the twin was "
                  "measured, so nothing proves the kernel path nondeterministic (a run planned before gate "
                  "replicates existed: measure it again into a new run directory)")
    elif replicate_shift == 0.0:
        detail = ("not a no-op: the arms differ at a bin where the intervention claims to do nothing "
                  f"({where}: {_size(est, shift)}); the twin's replicate is bit-identical, so the kernel "
                  "path is deterministic")
    else:
        relation = "≤" if shift <= replicate_shift else ">"
        detail = (f"{where}: the replicate proves the kernel path nondeterministic (twin vs replicate: max "
                  f"relative difference {replicate_shift:.3e}); intervention vs twin: {_size(est, shift)} "
                  f"{relation} the replicate's"
                  + ("" if rule == "replicate" else "; gate_rule=bit_identical accepts no difference"))
    return {"sigma": sigma, "estimand": name, "passed": passed, "rule": decided_by,
            "bit_identical": identical, "max_shift": shift, "replicate_max_shift": replicate_shift,
            "detail": detail}


def gates(index, found, estimates: dict, inter: str, names: list[str], rule: str) -> list[dict]:
    """One row per gate bin and estimand; found: the run's Scan; estimates: {(bin index, estimand):
    Estimate} (intervention vs twin)."""
    rows = []
    for b in (b for b in bins_of(index) if b.gate):
        pair = found.pairs[inter, TWIN, b.index]
        rep = found.pairs.get((REPLICATE, TWIN, b.index))
        for name in names:
            rep_shift = None if rep is None else rep.shift(name)
            shift = 0.0 if pair.identical else pair.shift(name)
            rows.append(gate_row(b.sigma, name, estimates[b.index, name], pair.identical, shift, rep_shift,
                                 rule))
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
