"""What a twin sampling run (measure=sample) publishes: report.md, the lines the command prints, one
tracker row per chunk and what a sweep keeps of a reduced point (the kind's `report`, `render`,
`tracker_rows` and `sweep_point`, measures/sample.py)."""

import shlex
from pathlib import Path

from twinrun.files import atomic_write
from twinrun.publish.render import analysis_head, pm
from twinrun.storage.run_paths import REPORT_MD
from twinrun.storage.rundir import RunIndex

WHAT = {"distance": "RMS pixel distance of each sample to the twin's",
        "loss": "held-out denoising loss of the arm's samples − the twin's",
        "mmd": "MMD² between the arms' sample distributions (paired features)"}


def _check_lines(summary: dict) -> list[str]:
    lines = [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in summary["checks"]]
    lines += [f"  [{'ok' if g['passed'] else 'FAIL'}] gate ({g['rule']}): {g['detail']}"
              for g in summary["gates"]]
    if summary["no_machinery_arm"]:
        lines.append("  (no machinery arm: the intervention declares no no-op setting, so only the twin's "
                     "replicate vouches for the path, not for the intervention's code)")
    rep = summary.get("replicate")
    if rep:
        said = ("bit-identical to the twin in every chunk (a deterministic path)" if rep["bit_identical"]
                else f"differs from the twin by up to {rep['max_abs_diff']:.3e} (a nondeterministic path)")
        lines.append(f"  replicate {rep['arm']}: {said}")
    return lines


def _overall_lines(summary: dict) -> list[str]:
    lines = []
    for row in summary["overall"]:
        extra = (f"  (arm {row['arm_loss']:.4f}, twin {row['twin_loss']:.4f})" if row["estimand"] == "loss"
                 else "")
        lines.append(f"  {row['role']:<12} {row['estimand']:<9} {pm(row['value'], row['se'], '.4e')}{extra}")
    return lines


def render(summary: dict) -> str:
    """What the command prints after reducing: checks and gates, then the reading over every sample."""
    lines = [f"twinrun reduce (sampling): {summary['run_dir']}", analysis_head(summary), "",
             "validity checks and gates:"]
    lines += _check_lines(summary)
    if not summary["passed"]:
        return "\n".join([*lines, "", "instrument broken: no reading is shown"])
    lines += ["", f"over all {summary['n_samples']} samples, paired with the twin's (mean ± SE):"]
    lines += _overall_lines(summary)
    lines += ["", *(f"  {k}: {v}" for k, v in WHAT.items())]
    return "\n".join(lines)


def write_report(out_dir: Path, summary: dict, index: RunIndex) -> Path:
    """report.md into out_dir (the run directory, or a post-hoc view's)."""
    lines = [f"# twinrun sampling report: {Path(out_dir).name}", "", "```", render(summary), "```"]
    if summary["passed"]:
        lines += ["", "## Per chunk", "", "| first sample | estimand | mean | SE |", "|---|---|---|---|"]
        lines += [f"| {e['first']} | {e['estimand']} | {e['value']:.4e} | "
                  f"{'—' if e['se'] is None else format(e['se'], '.1e')} |" for e in summary["effects"]]
    if index.command:
        lines += ["", "## Reproduce", "", "Sample afresh, into a new run directory:", "", "```bash",
                  index.command, "```", "", "Resume this run in place (whole chunks are kept):", "",
                  "```bash",
                  f"python -m twinrun.resume {shlex.quote(str(index.run_dir.path))}", "```"]
    path = Path(out_dir) / REPORT_MD
    atomic_write(path, ("\n".join(lines) + "\n").encode())
    return path


def tracker_rows(index: RunIndex, summary: dict) -> tuple[list[dict], list[dict]]:
    """(the intervention's rows, the twin's rows), one per chunk: each metric's mean and SE."""
    by_chunk: dict = {}
    for e in summary["effects"]:
        row = by_chunk.setdefault(e["first"], {"first": e["first"]})
        row[f"{e['estimand']}"], row[f"{e['estimand']}_se"] = e["value"], e["se"]
        if e["estimand"] == "loss":
            row["loss_arm"] = e["arm_loss"]
    steps = [by_chunk.get(index.params(u)["first"], {"first": index.params(u)["first"]}) for u in index.units]
    base = []
    for r in steps:
        e = _loss(summary, r["first"])
        base.append({"first": r["first"], **({"loss_twin": e["twin_loss"]} if e else {})})
    return steps, base


def _loss(summary: dict, first: int) -> dict | None:
    return next((e for e in summary["effects"] if e["first"] == first and e["estimand"] == "loss"), None)


def sweep_point(summary: dict) -> dict:
    """A reduced sampling point in the sweep's summary: its reading over every sample."""
    return {"sample_overall": summary["overall"]}
