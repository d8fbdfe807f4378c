"""Reduce a run: validity checks → no-op gates → effects (only if everything passed).

    python -m twinrun.reduce RUN_DIR                      # the registered analysis
    python -m twinrun.reduce RUN_DIR --estimands all      # a labelled post-hoc view in RUN_DIR/views/

Exit codes: 0 every check and gate passed; 1 a check or gate failed (the instrument is broken:
effects withheld; a post-hoc view never turns a registered failure into 0); 2 bad input
(missing, damaged or foreign stores).
"""

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from twinrun.checks import (
    TWIN,
    check,
    close,
    load_run,
    machinery_check,
    registered,
    scan_run,
    validity_checks,
)
from twinrun.errors import EXIT_GATE, EXIT_OK, TwinrunError, fail
from twinrun.estimands import ESTIMANDS, check_estimands
from twinrun.estimator import estimate
from twinrun.gates import GATE_RULES, gates, replicate_report
from twinrun.references import pair_row, reference_report
from twinrun.render import render
from twinrun.report import write_report
from twinrun.rundir import RunDir
from twinrun.store import require_run_dir, write_json

__all__ = ["main", "reduce_run", "render"]


def effect_estimates(run: dict, found, sizes, inter: str, names: list[str], alpha: float) -> dict:
    """{(bin index, estimand): Estimate} of the intervention against its twin, every bin."""
    a, t = found.arms.index(inter), found.arms.index(TWIN)
    g = {n: found.gram(n, TWIN) for n in names}
    return {(i, n): estimate(g[n][i, a, :, t], g[n][i, a, :, a], g[n][i, t, :, t], sizes, sizes, alpha)
            for i in (b["index"] for b in run["bins"]) for n in names}


def analyse(run_dir: Path, run: dict, readers: dict, found, used: dict) -> dict:
    """The summary of one analysis (registered or post-hoc) of the same stores, from the run's one scan."""
    twin_meta = readers[TWIN, 0].meta
    checks = validity_checks(run_dir, run, readers)
    inter = next(a["name"] for a in run["arms"] if a["role"] == "intervention")
    sizes = np.asarray(twin_meta["fold_sizes"], dtype=np.float64)
    estimates = effect_estimates(run, found, sizes, inter, used["estimands"], used["signal_alpha"])
    gate_rows = gates(run, found, estimates, inter, used["estimands"], used["gate_rule"])
    machinery = [a["name"] for a in run["arms"] if a["role"] == "machinery"]
    if machinery:
        checks.append(machinery_check(run, found, machinery[0]))
    elif not gate_rows:
        checks.append(check("has_gate", False, "no bin where the intervention is a no-op and no machinery arm: "
                            "nothing vouches for the instrument"))
    valid = all(c["passed"] for c in checks)
    ok = valid and all(g["passed"] for g in gate_rows)
    effects = [pair_row(estimates[b["index"], n], sigma=b["sigma"], estimand=n, gate=b["gate"])
               for b in run["bins"] for n in used["estimands"]]
    summary = {"run_dir": str(run_dir), "arms": [a["name"] for a in run["arms"]], "registered": registered(run),
               "used": used, "valid": valid, "passed": ok, "checks": checks, "gates": gate_rows,
               "effects": effects if ok else [], "replicate": replicate_report(run, found)}
    if run.get("reference"):
        summary["reference"] = reference_report(run_dir, run, readers, found, inter, Path(run["reference"]),
                                                used["signal_alpha"], ok)
    return summary


def view_name(reg: dict, used: dict) -> str:
    """A directory name saying what the post-hoc view changed, e.g. `gate_rule-bit_identical`."""
    parts = [f"{k}-{','.join(v) if isinstance(v, list) else v}" for k, v in used.items() if v != reg[k]]
    return re.sub(r"[^A-Za-z0-9_.,=-]", "_", "_".join(parts))


def reduce_run(run_dir: Path, estimands=None, gate_rule=None, signal_alpha=None,
               chunk_params=1_000_000) -> tuple[dict, int]:
    """Reduce with the registered settings (writes RUN/summary.json, report.md), or, when any
    setting differs, also as a labelled post-hoc view (RUN/views/<what changed>/). Either way the
    stores are read once, in one pass, before anything is written."""
    rd = RunDir(run_dir)
    run, readers = load_run(rd.path)
    try:
        reg = registered(run)
        used = {**reg, "estimands": list(estimands or reg["estimands"]), "gate_rule": gate_rule or reg["gate_rule"],
                "signal_alpha": float(reg["signal_alpha"] if signal_alpha is None else signal_alpha)}
        groups = reg.get("groups") or {}
        for what, settings in (("registered estimands", reg), ("--estimands", used)):
            check_estimands(settings["estimands"], groups, readers[TWIN, 0].meta["layout"], what)
        names = list(dict.fromkeys([*reg["estimands"], *used["estimands"]]))
        found = scan_run(run, readers, names, groups, chunk_params)
        summary = analyse(rd.path, run, readers, found, reg)
        if used == reg:
            write_json(rd.summary_json, summary)
            write_report(rd.path, summary, run)
            return summary, EXIT_OK if summary["passed"] else EXIT_GATE
        # Post-hoc: the registered summary and report are left untouched; the registered verdict is
        # recomputed from the stores (never read from summary.json) so that a post-hoc pass cannot
        # turn a registered failure into exit 0.
        out = rd.view_dir(view_name(reg, used))
        view = analyse(rd.path, run, readers, found, used)
    finally:
        close(readers)
    view["post_hoc"] = {"registered": reg, "used": used, "view_dir": str(out), "registered_passed": summary["passed"]}
    out.mkdir(parents=True, exist_ok=True)
    write_json(RunDir(out).summary_json, view)
    write_report(out, view, run, run_dir=rd.path)
    return view, EXIT_OK if summary["passed"] and view["passed"] else EXIT_GATE


def parse_estimands(text: str | None) -> list[str] | None:
    """--estimands: comma-separated names (checked against the run's registry once the run is read)."""
    if text is None:
        return None
    names = [e.strip() for e in text.split(",")]
    if not all(names):
        raise TwinrunError(f"--estimands={text!r}: a comma-separated list of names, e.g. all,cond")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.reduce", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a twinrun run directory (holds run.json)")
    p.add_argument("--estimands", help=f"comma-separated views: {', '.join(ESTIMANDS)} or a group the run "
                   "registered (reduce.groups); post-hoc if not the registered ones")
    p.add_argument("--gate-rule", choices=GATE_RULES, help="post-hoc if not the registered one")
    p.add_argument("--signal-alpha", type=float, help="level of the test of signal, in (0, 0.5) (post-hoc if not "
                   "the registered one)")
    args = p.parse_args(argv)
    try:
        estimands = parse_estimands(args.estimands)
        if args.signal_alpha is not None and not 0 < args.signal_alpha < 0.5:
            raise TwinrunError(f"--signal-alpha={args.signal_alpha}: must be in (0, 0.5), e.g. 0.05")
        summary, code = reduce_run(require_run_dir(args.run_dir), estimands, args.gate_rule, args.signal_alpha)
    except TwinrunError as err:
        fail(err)
    print(render(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
