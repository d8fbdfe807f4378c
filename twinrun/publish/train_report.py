"""A training run's report.md and plots, and the text `python -m twinrun` prints after reducing one.

Order is part of the contract: the verdict, the validity checks, the machinery gate (bit-identical?)
and the replicate (k / N tensors differ), where each arm's bits leave the twin's, then the chaos
floor, and only then the effects and the losses, never effects when a check or the gate failed.
"""

import shlex
from pathlib import Path

from twinrun.files import atomic_write
from twinrun.publish.environment import env_summary
from twinrun.publish.render import analysis_head
from twinrun.publish.train_plots import plot_distance, plot_losses
from twinrun.storage.run_paths import DISTANCE_PNG, LOSS_PNG, REPORT_MD
from twinrun.storage.rundir import RunIndex


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def num(x, spec: str = ".3e") -> str:
    return "–" if x is None else f"{x:{spec}}"


def yes(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def _never(first: dict, said: str) -> str:
    """`said`, or for an arm measured in the first segments only what was seen: not through its last step."""
    through = first.get("measured_through")
    return said if through is None else f"not through step {through} (measured there only)"


def first_lines(summary: dict) -> list[str]:
    """Where each arm's bits first leave the twin's (the chaos arm's at step 0 by construction)."""
    rows = [[f["arm"], _never(f, "never (bit-identical at every step)") if f["step"] is None else f["step"],
             f["first_tensor"] or "–", f"{f['n_differ']} / {f['n_tensors']}"]
            for f in summary["first_differing"]]
    return table(["arm", "first step its bits leave the twin's", "first tensor that differs",
                  "tensors differing at that step"], rows)


def gate_lines(summary: dict) -> list[str]:
    rows = [[g["step"], yes(g["passed"]), g["rule"], "yes" if g["bit_identical"] else "no",
             num(g["distance"]), num(g["replicate_distance"]), g["first_tensor"] or "–"]
            for g in summary["gates"]]
    return table(["step", "passed", "decided by", "bit-identical", "rel. distance", "replicate's",
                  "first tensor that differs"], rows)


def replicate_lines(rep: dict) -> list[str]:
    rows = [[r["step"], f"{r['n_differ']} / {r['n_tensors']}", r["first_tensor"] or "–", num(r["distance"])]
            for r in rep["steps"]]
    return [rep["detail"], ""] + table(["step", "tensors that differ", "first", "rel. distance"], rows)


def effect_lines(summary: dict) -> list[str]:
    rows = [[e["step"], e["estimand"], num(e["distance"]), _floor_cell(e), num(e["floor_ratio"], ".3g"),
             "**yes**" if e["above_floor"] else "no", num(e["cos"], ".6f"), num(e["norm_ratio"], ".4f")]
            for e in summary["effects"]]
    return table(["step", "estimand", "distance to twin", "chaos floor", "× floor", "above floor × margin",
                  "cos of updates", "norm ratio of updates"], rows)


def _floor_cell(e: dict) -> str:
    """The floor an effect row was read against; the model's (train.floor_scope=model) says so, with the
    estimand's own beside it."""
    if "floor_from" not in e:
        return num(e["floor"])
    return (f"{num(e['floor'])} (`{e['floor_from']}`'s; own {num(e['own_floor'])}, "
            f"{num(e['own_floor_ratio'], '.3g')}×)")


def loss_lines(summary: dict) -> list[str]:
    rows = [[r["step"], r["arm"], num(r["train_loss"], ".5f"), num(r.get("train_loss_own"), ".5f"),
             f"{r['heldout_loss']:.5f} ± {r['heldout_se']:.1e}", _difference(r)] for r in summary["losses"]]
    return table(["step", "arm", "training loss, the twin's objective (segment mean)",
                  "training loss, the arm's own objective", "held-out loss ± SE",
                  "held-out − twin's ± paired SE (* beyond the t interval)"], rows)


def _difference(r: dict) -> str:
    if r["role"] == "twin":
        return "–"
    mark = " *" if r["heldout_diff_significant"] else ""
    return f"{r['heldout_diff']:+.2e} ± {r['heldout_diff_se']:.1e}{mark}"


def _head(summary: dict) -> list[str]:
    ph = summary.get("post_hoc")
    if ph:
        stands = "passed" if ph["registered_passed"] else "**FAILED**"
        said = (f"**POST-HOC VIEW — not the registered analysis.** Registered: `{ph['registered']}`; used "
                f"here: `{ph['used']}`. The registered analysis {stands} and stands (RUN/report.md).")
    else:
        said = f"Registered analysis (recorded at plan time): `{summary['registered']}`."
    state = ("**VALID** — every validity check and the machinery gate passed. " if summary["passed"] else
             "**INSTRUMENT BROKEN** — a validity check or the machinery gate failed. Effects are withheld; "
             "nothing else from this run should be read. ")
    verdict = summary["verdict"]
    return [said, "", "## Verdict", "", f"{state}{verdict[:1].upper()}{verdict[1:]}."]


SCOPE_SAID = {
    "model": ("This run reads each estimand against the whole model's floor (`all`'s) with its margin "
              "where that bar is the higher (train.floor_scope=model; docs/training.md): such a row names "
              "the floor it read and keeps its own beside it."),
    "estimand": "This run reads each estimand against its own floor (train.floor_scope=estimand).",
}


def _floor_lines(summary: dict) -> list[str]:
    rows = [[f["step"], f["estimand"], num(f["distance"]), num(f["cos"], ".6f"),
             num(f.get("spread", 1.0), ".3g"), num(f.get("margin"), ".3g")] for f in summary["floor"]]
    said = ("Each chaos arm is the twin moved by one ulp at the start (every weight, or one: "
            "`train.chaos.weights`): its distance from the twin is how far this training run carries a "
            "rounding-sized wobble by each step. The floor is the largest of the chaos arms' distances and "
            "the replicates'; the margin an effect must clear is train.floor_margin × the chaos arms' spread "
            "(largest / smallest) in that estimand. " + SCOPE_SAID[summary.get("floor_scope", "estimand")])
    header = ["step", "estimand", "floor (distance to twin)", "cos of its update to the twin's",
              "chaos arms' spread", "margin"]
    return [said, "", f"![distance to the twin]({DISTANCE_PNG})", ""] + table(header, rows)


def _tail(index: RunIndex, summary: dict) -> list[str]:
    lines, env_lines = [], env_summary(index)
    if summary.get("data_files"):  # the latent/conditioning caches trained on, each file's sha256
        lines += ["", "## Data caches", ""] + [f"- `{path}`: sha256 `{sha}`"
                                               for path, sha in sorted(summary["data_files"].items())]
    if env_lines:
        lines += ["", "## Environment", "", "Full fingerprints: `env/job*.json`.", ""]
        lines += [f"- {x}" for x in env_lines]
    if index.command:
        resume = f"python -m twinrun.resume {shlex.quote(str(index.run_dir.path))}"
        kept = "Resume this run in place (whole segments are kept, the rest trained):"
        lines += ["", "## Reproduce", "", "Train afresh, into a new run directory:", "", "```bash",
                  index.command, "```", "", kept, "", "```bash", resume, "```"]
    return lines


def write_train_report(out_dir: Path, summary: dict, index: RunIndex) -> Path:
    """report.md (with loss.png and distance.png) into out_dir: the run directory, or a post-hoc view."""
    out_dir = Path(out_dir)
    lines = [f"# twinrun training report: {out_dir.name}", ""] + _head(summary)
    lines += ["", "## Validity checks", ""] + table(["check", "passed", "detail"],
                                                   [[c["name"], yes(c["passed"]), c["detail"]]
                                                    for c in summary["checks"]])
    lines += ["", f"## Machinery gate: bit-identical to the twin? (rule: {summary['used']['gate_rule']})", ""]
    lines += gate_lines(summary)
    if summary.get("replicate"):
        lines += ["", "## Replicate (determinism control)", ""] + replicate_lines(summary["replicate"])
    # Where the bits first differ is shown whatever the verdict: it is how a failed gate is debugged.
    lines += ["", "## Where each arm's bits leave the twin's", ""] + first_lines(summary)
    # Plots and effects only for a passed run, as for every kind: a broken instrument's numbers are withheld.
    if summary["passed"]:
        plot_distance(summary, out_dir / DISTANCE_PNG, summary["used"]["estimands"][0])
        plot_losses(summary, out_dir / LOSS_PNG)
        lines += ["", "## The chaos floor", ""] + _floor_lines(summary)
        lines += ["", "## Effects (the intervention against the twin, beside the floor)", ""]
        lines += effect_lines(summary)
        lines += ["", "## Losses", "", f"![loss curves]({LOSS_PNG})", ""] + loss_lines(summary)
        if summary.get("ema"):  # train.ema: the averaged weights, their own estimand
            lines += ["", "## The EMA of the weights (train.ema)", ""] + table(
                ["step", "distance to the twin's EMA", "chaos floor", "× floor"],
                [[r["step"], num(r["distance"], ".3e"), num(r["floor"], ".3e"), num(r["floor_ratio"], ".3g")]
                 for r in summary["ema"]])
    lines += _tail(index, summary)
    path = out_dir / REPORT_MD
    atomic_write(path, ("\n".join(lines) + "\n").encode())
    return path


def render_train(summary: dict) -> str:
    """What the command prints: checks, the gate, the replicate, the first differing steps, the verdict."""
    lines = [f"twinrun reduce (training): {summary['run_dir']}", analysis_head(summary), "",
             "validity checks:"]
    lines += [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in summary["checks"]]
    lines += ["", f"machinery gate (rule: {summary['used']['gate_rule']}):"]
    lines += [f"  [{'ok' if g['passed'] else 'FAIL'}] ({g['rule']}) {g['detail']}" for g in summary["gates"]]
    if summary.get("replicate"):
        lines += ["", f"replicate: {summary['replicate']['detail']}"]
    lines += ["", "first step each arm's bits leave the twin's:"]
    lines += [f"  {f['arm']}: {_never(f, 'never')}" if f["step"] is None else
              f"  {f['arm']}: step {f['step']} ({f['first_tensor']}, {f['n_differ']} / {f['n_tensors']} "
              "tensors)" for f in summary["first_differing"]]
    if summary["passed"]:
        last = {}
        for e in summary["effects"]:
            last[e["estimand"]] = e
        lines += ["", "at the last stored step (distance to the twin; the chaos floor; × floor):"]
        lines += [f"  {n:<9} {num(e['distance'])}  floor {_floor_cell(e)}  {num(e['floor_ratio'], '.3g')}×  "
                  f"cos of updates {num(e['cos'], '.6f')}  norm ratio {num(e['norm_ratio'], '.4f')}"
                  for n, e in last.items()]
    lines += ["", f"verdict: {summary['verdict']}"]
    return "\n".join(lines)
