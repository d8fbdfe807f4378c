"""Reduce a probe run: validity checks → no-op gates → effects (only if everything passed). Writes nothing.

`reduce_run` reads every store once and returns a Reduction: the registered summary (the analysis
recorded at plan time) and, when any setting differs from the registered one, a labelled post-hoc
view beside it. Publishing them (summary.json, report.md, plots, views/) is twinrun.publish's.
"""

from pathlib import Path

import numpy as np

from twinrun.analysis.checks import (
    TWIN,
    bins_of,
    close,
    load_run,
    machinery_check,
    scan_run,
    validity_checks,
)
from twinrun.analysis.estimands import check_estimands
from twinrun.analysis.estimator import estimate
from twinrun.analysis.family import family_verdict
from twinrun.analysis.gates import gates, replicate_report
from twinrun.analysis.receipts import receipt_fields
from twinrun.analysis.reduction import Reduction, check, registered, used_settings, view_name
from twinrun.analysis.references import pair_row, reference_report
from twinrun.storage.records import Summary
from twinrun.storage.rundir import RunIndex


def effect_estimates(found, bins: list[int], sizes, inter: str, names: list[str], alpha: float) -> dict:
    """{(bin index, estimand): Estimate} of the intervention against its twin, every bin."""
    a, t = found.arms.index(inter), found.arms.index(TWIN)
    g = {n: found.gram(n, TWIN) for n in names}
    return {(b, n): estimate(g[n][b, a, :, t], g[n][b, a, :, a], g[n][b, t, :, t], sizes, sizes, alpha)
            for b in bins for n in names}


def effect_rows(estimates: dict, bins: list, names: list[str], receipts: dict | None = None) -> list[dict]:
    """The summary's effect rows, bin by bin (bins: the run's Bin records), every estimand of `names`;
    receipts: {(bin index, estimand): the row's pairing receipt fields} where read."""
    return [pair_row(estimates[b.index, n], sigma=b.sigma, estimand=n, gate=b.gate,
                     **(receipts or {}).get((b.index, n), {}))
            for b in bins for n in names]


def receipts_of(readers: dict, found, estimates: dict, bins: list, inter: str, names: list[str],
                groups: dict | None) -> dict:
    """{(bin index, estimand): pairing receipt fields} of the intervention against its twin, every bin."""
    a, t = found.arms.index(inter), found.arms.index(TWIN)
    return {(b.index, n): receipt_fields(readers[TWIN, b.index], readers[inter, b.index],
                                         found.gram(n, TWIN)[b.index], a, t, n, groups,
                                         not estimates[b.index, n].below_noise)
            for b in bins for n in names}


def analyse(index: RunIndex, readers: dict, found, used: dict) -> Summary:
    """The summary of one analysis (registered or post-hoc) of the same stores, from the run's one scan."""
    twin_meta = readers[TWIN, 0].meta
    # Checks, then gates, then effects: a reading is only as good as the instrument, so every effect waits on
    # both.
    checks = validity_checks(index, readers)
    inter = index.arm("intervention")["name"]
    sizes = np.asarray(twin_meta["fold_sizes"], dtype=np.float64)
    estimates = effect_estimates(found, [b.index for b in bins_of(index)], sizes, inter, used["estimands"],
                                 used["signal_alpha"])
    gate_rows = gates(index, found, estimates, inter, used["estimands"], used["gate_rule"])
    # Something must vouch that the intervention's code is harmless where it claims to do nothing: a gate bin
    # or a machinery arm. With neither, nothing does, and the run fails a check.
    machinery = index.arms_with_role("machinery")
    if machinery:
        checks.append(machinery_check(index, found, machinery[0]))
    elif not gate_rows:
        checks.append(check("has_gate", False, "no bin where the intervention is a no-op and no machinery "
                            "arm: nothing vouches for the instrument"))
    checks_passed = all(c["passed"] for c in checks)
    ok = checks_passed and all(g["passed"] for g in gate_rows)
    # Receipts, effects and their family-wise reading only for a run that passed: a broken instrument's
    # numbers are withheld, not shown with a warning.
    receipts = receipts_of(readers, found, estimates, bins_of(index), inter, used["estimands"],
                           used.get("groups")) if ok else None
    effects = effect_rows(estimates, bins_of(index), used["estimands"], receipts)
    summary = {"run_dir": str(index.run_dir.path), "arms": index.arm_names, "registered": registered(index),
               "used": used, "checks_passed": checks_passed, "passed": ok, "checks": checks,
               "gates": gate_rows, "effects": effects if ok else [],
               "family": family_reading(effects, used["family_alpha"]) if ok else None,
               "replicate": replicate_report(index, found)}
    if twin_meta.get("data_files"):  # the caches the data were read from (twinrun.caches), each file's sha256
        summary["data_files"] = twin_meta["data_files"]
    # The reference is read even for a run that failed: whether it is alive is the environment's question, not
    # this run's verdict.
    if index.reference:
        summary["reference"] = reference_report(index, readers, found, inter, Path(index.reference),
                                                used["signal_alpha"], ok)
    return summary


def family_reading(effects: list[dict], level: float) -> dict:
    """summary.json's family-wise reading of the effect rows (twinrun.analysis.family, Holm at the
    registered reduce.family_alpha); each row gains `family_p`, its hypothesis's Holm-adjusted p-value."""
    verdict = family_verdict(effects, level)
    for row in effects:
        row["family_p"] = verdict.adjusted_p.get((row["sigma"], row["estimand"]))
    return {"method": "holm", "level": verdict.level, "n_rows": verdict.n_rows,
            "n_hypotheses": verdict.n_hypotheses, "effect": verdict.effect,
            "rejected": [{"sigma": s, "estimand": e} for s, e in verdict.rejected],
            "detail": verdict.detail()}


def reduce_run(run_dir: Path, estimands=None, gate_rule=None, signal_alpha=None, family_alpha=None,
               chunk_params=1_000_000) -> Reduction:
    """The registered analysis and, when any setting differs, a post-hoc view; the stores are read
    once, in one pass. The registered verdict is always recomputed from the stores (never read from
    summary.json), so a post-hoc pass cannot turn a registered failure into exit 0."""
    index, readers = load_run(run_dir)
    try:
        reg = registered(index)
        used = used_settings(reg, estimands, gate_rule, signal_alpha, family_alpha)
        groups = reg.get("groups") or {}
        # (the registered ones were held to their rules by load_run, as run.json's fields)
        check_estimands(used["estimands"], groups, readers[TWIN, 0].meta["layout"], "--estimands")
        names = list(dict.fromkeys([*reg["estimands"], *used["estimands"]]))
        found = scan_run(index, readers, names, groups, chunk_params)
        summary = analyse(index, readers, found, reg)
        if used == reg:
            return Reduction(index, summary)
        view = analyse(index, readers, found, used)
    finally:
        close(readers)
    name = view_name(reg, used)
    view["post_hoc"] = {"registered": reg, "used": used, "view_dir": str(index.run_dir.view_dir(name)),
                        "registered_passed": summary["passed"]}
    return Reduction(index, summary, view, name)
