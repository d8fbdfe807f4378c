"""report.md and its plots, written beside summary.json by every reduce (or into a post-hoc view).

Order is part of the contract: verdict, validity checks, gates (with the rule that decided each),
and only then effects, never effects when a check or gate failed. Every number has its SE.
"""

import shlex
from pathlib import Path

from twinrun.errors import StoreError
from twinrun.files import atomic_write
from twinrun.provenance.version import version_text
from twinrun.publish.environment import env_summary
from twinrun.publish.probe_plots import effect_caption, plot_effect
from twinrun.publish.render import family_text, interval_text, noise_note, pm, reading_text
from twinrun.storage.run_paths import EFFECT_PNG, REPORT_MD
from twinrun.storage.rundir import RunIndex


def _table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


INTERVAL_NOTE = ("Intervals are 95% given that the row printed (the test of signal selects the rows it "
                 "prints; docs/estimator.md); they may be asymmetric, and — marks a side the data do not "
                 "bound. A row near the detection boundary shows each arm's |μ|² ± SE: there the cosine "
                 "reads towards the arms' noise correlation and the ratio low.")


def effect_table(effects: list[dict]) -> list[str]:
    rows = []
    for e in effects:
        if e["below_noise"]:
            rows.append([f"{e['sigma']:g}", e["estimand"], "below noise", "", "", "", noise_note(e)])
            continue
        note = (f"**near the detection boundary**: {noise_note(e)}" if e.get("near_boundary")
                else f"naive cos {e['cos_naive']:.4f}")
        rows.append([f"{e['sigma']:g}", e["estimand"], pm(e["cos"], e["se"]),
                     interval_text(e.get("cos_interval")), pm(e["norm_ratio"], e["norm_ratio_se"]),
                     interval_text(e.get("norm_ratio_interval"), whole="0 to ∞"), note])
    return _table(["σ", "estimand", "debiased cos ± se", "95% interval", "norm ratio ± se", "95% interval",
                   "note"], rows)


RECEIPT_NOTE = ("What the shared draws bought each row: ρ is the arms' noise correlation, the draw "
                "share the draw noise's share of the twin's noise, and each gain the variance the estimate "
                "would have had had the twin consumed draws of its own (same images, same folds) over its "
                "variance as measured. A gain near 1 says the images carry the variance: sharing draws "
                "bought little, and the twin's value is the no-op gate and the kernel-path control "
                "(docs/estimator.md).")


def _num(x, spec: str = ".3g") -> str:
    return "–" if x is None else f"{x:{spec}}"


def receipt_table(effects: list[dict]) -> list[str]:
    """The pairing receipt of every non-gate effect row (a row without one says why)."""
    rows = []
    for e in (e for e in effects if not e["gate"] and "pairing_rho" in e):
        gains = [_num(e[k]) for k in ("pairing_gain", "pairing_gain_ratio", "pairing_gain_effect")]
        rows.append([f"{e['sigma']:g}", e["estimand"], _num(e["pairing_rho"]), _num(e["draw_share"]), *gains,
                     e.get("pairing_note") or ""])
    if not rows:
        return []
    return ["", "### Pairing receipt", "", RECEIPT_NOTE, ""] + _table(
        ["σ", "estimand", "ρ", "draw share", "gain: cos", "gain: norm ratio", "gain: no-effect test", "note"],
        rows)


def family_line(summary: dict) -> list[str]:
    """The registered family-wise reading: how many effect rows, and which show an effect (those below
    noise counted apart: render.family_text)."""
    fam = summary.get("family")
    return [family_text(fam, summary.get("effects") or [])] if fam else []


def gate_table(gates: list[dict]) -> list[str]:
    return _table(["σ", "estimand", "passed", "decided by", "bit-identical", "max rel. diff", "replicate's",
                   "detail"],
                  [[f"{g['sigma']:g}", g["estimand"], "yes" if g["passed"] else "**NO**", g["rule"],
                    "yes" if g["bit_identical"] else "no", f"{g['max_shift']:.2e}",
                    "–" if g["replicate_max_shift"] is None else f"{g['replicate_max_shift']:.2e}",
                    g["detail"]]
                   for g in gates])


def reference_lines(ref: dict, effects: list[dict]) -> list[str]:
    """The reference verdict, and the size of its shift beside the intervention's own effect."""
    lines = ["", "## Reference", "", ref["detail"]]
    if "native_vs_reference" not in ref:
        return lines
    own = {(e["sigma"], e["estimand"]): e for e in effects}
    rows = []
    for r in ref["native_vs_reference"]:
        e = own.get((r["sigma"], r["estimand"]))
        shift = ("below noise" if r["below_noise"]
                 else f"{pm(1 - r['cos'], r['se'])}; ratio {pm(r['norm_ratio'], r['norm_ratio_se'])}")
        effect = ("–" if e is None else "below noise" if e["below_noise"]
                  else f"{pm(1 - e['cos'], e['se'])}; ratio {pm(e['norm_ratio'], e['norm_ratio_se'])}")
        rows.append([f"{r['sigma']:g}", r["estimand"], "yes" if r["bit_identical"] else "no",
                     f"{r['max_shift']:.2e}", shift, effect])
    return lines + [""] + _table(["σ", "estimand", "bit-identical", "max rel. diff",
                                  "reference shift: 1 − cos; norm ratio",
                                  "intervention's effect: 1 − cos; norm ratio"], rows)


def plot_context(index: RunIndex) -> dict:
    """What the plot's title and σ axis need beyond the summary: the intervention arm's `intervention`
    node (its setting), its `probe` node (the protocol) and the run's σ bins. A config that cannot be
    read titles the plot without them (the report is prose; the checks read the record)."""
    sigmas = [index.params(u)["sigma"] for u in index.units if "sigma" in index.params(u)]
    try:
        config = index.arm_config(index.arm("intervention")["name"])
    except StoreError:
        config = {}
    node = (lambda key: config.get(key) if isinstance(config.get(key), dict) else None)
    return {"intervention": node("intervention"), "protocol": node("probe"), "sigmas": sigmas or None}


def _header(out_dir: Path, summary: dict) -> list[str]:
    lines = [f"# twinrun report: {out_dir.name}", ""]
    ph = summary.get("post_hoc")
    if ph:
        lines += [("**POST-HOC VIEW — not the registered analysis.** Registered at plan time: "
                  f"`{ph['registered']}`; used here: `{ph['used']}`. The registered analysis "
                  f"{'passed' if ph['registered_passed'] else '**FAILED**'} and stands (RUN/report.md)."), ""]
    else:
        lines += [f"Registered analysis (recorded at plan time): `{summary['registered']}`.", ""]
    lines += [f"Written by {version_text(summary.get('twinrun'))}.", ""]
    ok = summary["passed"]
    lines += ["## Verdict", "",
              "**VALID** — every validity check and no-op gate passed; effects below." if ok else
              "**INSTRUMENT BROKEN** — a validity check or no-op gate failed. Effects are withheld; "
              "nothing else from this run should be read."]
    return lines


def write_report(out_dir: Path, summary: dict, index: RunIndex) -> Path:
    """report.md (and effect.png) into out_dir: the run directory, or a post-hoc view inside it."""
    out_dir, run_dir = Path(out_dir), index.run_dir.path
    lines = _header(out_dir, summary) + ["", "## Validity checks", ""] + _table(
        ["check", "passed", "detail"], [[c["name"], "yes" if c["passed"] else "**NO**", c["detail"]]
                                        for c in summary["checks"]])
    # Order is the contract: the checks and gates come before any effect, so a reader meets the instrument's
    # state first.
    lines += ["", f"## No-op gates (rule: {summary['used']['gate_rule']})", ""] + gate_table(summary["gates"])
    rep = summary.get("replicate")
    if rep:
        lines += ["", "## Replicate (determinism control)", "", rep["detail"]]
    # Effects and their plot only for a passed run: a broken instrument's numbers are withheld, not flagged.
    if summary["passed"]:
        png = plot_effect(summary, out_dir / EFFECT_PNG, **plot_context(index))
        lines += ["", "## Effects", "", f"![effect vs σ]({png.name})", "", effect_caption(summary), ""]
        lines += family_line(summary)
        reading = reading_text(summary["effects"])
        lines += ["", INTERVAL_NOTE, ""] + ([f"**Reading.** {reading}", ""] if reading else [])
        lines += effect_table(summary["effects"])
        lines += receipt_table(summary["effects"])
    if summary.get("reference"):
        lines += reference_lines(summary["reference"], summary["effects"])
    if summary.get("data_files"):
        lines += ["", "## Data caches", ""] + [f"- `{path}`: sha256 `{sha}`"
                                               for path, sha in sorted(summary["data_files"].items())]
    # Where it ran and how to run it again: what a reader needs to reproduce a number or explain a reference
    # that died.
    env_lines = env_summary(index)
    if env_lines:
        lines += (["", "## Environment", "", "Full fingerprints: `env/job*.json`.", ""]
                  + [f"- {x}" for x in env_lines])
    if index.command:
        lines += ["", "## Reproduce", "", "Measure afresh, into a new run directory:", "", "```bash",
                  index.command, "```", "",
                  "Resume this run in place (verified bins are kept, the rest measured):", "", "```bash",
                  f"python -m twinrun.resume {shlex.quote(str(run_dir))}", "```"]
    path = out_dir / REPORT_MD
    atomic_write(path, ("\n".join(lines) + "\n").encode())
    return path
