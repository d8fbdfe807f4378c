"""report.md and its plots, written beside summary.json by every reduce (or into a post-hoc view).

Order is part of the contract: verdict, validity checks, gates (with the rule that decided each),
and only then effects, never effects when a check or gate failed. Every number has its SE.
"""

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from twinrun.estimands import ESTIMANDS
from twinrun.render import noise_note, pm
from twinrun.store import atomic_write

EFFECT_PNG = "effect.png"
HEATMAP_PNG = "sweep_effect.png"


def _segments(rows: list[dict]) -> list[list[dict]]:
    """Runs of consecutive bins with a number: a line never crosses a below-noise gap."""
    runs, current = [], []
    for row in rows:
        if row["below_noise"]:
            runs, current = runs + [current] if current else runs, []
        else:
            current.append(row)
    return runs + [current] if current else runs


def _panel(ax, rows: list[dict], key: str, se_key: str, color, label: str) -> None:
    """One estimand on one axis: segments with 95% t-interval error bars, below-noise bins as x."""
    for i, seg in enumerate(_segments(rows)):
        value = np.array([1 - r[key] if key == "cos" else r[key] for r in seg])
        half = np.array([r["t_crit"] * r[se_key] for r in seg])
        ax.errorbar([r["sigma"] for r in seg], value, yerr=half, marker="o", ms=4, capsize=3, color=color,
                    label=label if i == 0 else None)
    gaps = [r["sigma"] for r in rows if r["below_noise"]]
    if gaps:
        ax.plot(gaps, [0] * len(gaps) if key == "cos" else [1] * len(gaps), "x", color=color, ms=7)


def plot_effect(summary: dict, path: Path) -> Path:
    """1 − debiased cos and the norm ratio (95% t-intervals) against noising σ per estimand; log σ;
    gate bins marked; below-noise bins drawn as x on the no-effect line, never joined by a line."""
    fig = Figure(figsize=(6.4, 6.4), dpi=110)
    ax_cos, ax_ratio = fig.subplots(2, 1, sharex=True)
    names = [n for n in ESTIMANDS if any(e["estimand"] == n for e in summary["effects"])]
    for k, name in enumerate(names):
        rows = [e for e in summary["effects"] if e["estimand"] == name]
        _panel(ax_cos, rows, "cos", "se", f"C{k}", name)
        _panel(ax_ratio, rows, "norm_ratio", "norm_ratio_se", f"C{k}", name)
    for ax in (ax_cos, ax_ratio):
        for i, g in enumerate(sorted({g["sigma"] for g in summary["gates"]})):
            ax.axvline(g, color="0.5", ls="--", lw=1, label="no-op gate" if i == 0 else None)
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
    ax_cos.set_ylabel("1 − debiased cos to twin")
    ax_ratio.set_ylabel("norm ratio |μ_arm| / |μ_twin|")
    ax_ratio.set_xlabel("noising σ   (bars: 95% t-interval; x: below noise)")
    ax_cos.set_title("intervention vs native twin")
    ax_cos.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _interval(row: dict) -> str:
    half = row["t_crit"] * row["se"]
    return f"[{row['cos'] - half:.4f}, {row['cos'] + half:.4f}]"


def effect_table(effects: list[dict]) -> list[str]:
    rows = []
    for e in effects:
        if e["below_noise"]:
            rows.append([f"{e['sigma']:g}", e["estimand"], "below noise", "", "", noise_note(e)])
            continue
        rows.append([f"{e['sigma']:g}", e["estimand"], pm(e["cos"], e["se"]), _interval(e),
                     pm(e["norm_ratio"], e["norm_ratio_se"]), f"naive cos {e['cos_naive']:.4f}"])
    return _table(["σ", "estimand", "debiased cos ± se", "95% interval (t)", "norm ratio ± se", "note"], rows)


def gate_table(gates: list[dict]) -> list[str]:
    return _table(["σ", "estimand", "passed", "decided by", "bit-identical", "max rel. diff", "replicate's", "detail"],
                  [[f"{g['sigma']:g}", g["estimand"], "yes" if g["passed"] else "**NO**", g["rule"],
                    "yes" if g["bit_identical"] else "no", f"{g['max_shift']:.2e}",
                    "–" if g["replicate_max_shift"] is None else f"{g['replicate_max_shift']:.2e}", g["detail"]]
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
        shift = "below noise" if r["below_noise"] else f"{pm(1 - r['cos'], r['se'])}; ratio {pm(r['norm_ratio'], r['norm_ratio_se'])}"
        effect = ("–" if e is None else "below noise" if e["below_noise"]
                  else f"{pm(1 - e['cos'], e['se'])}; ratio {pm(e['norm_ratio'], e['norm_ratio_se'])}")
        rows.append([f"{r['sigma']:g}", r["estimand"], "yes" if r["bit_identical"] else "no", f"{r['max_shift']:.2e}",
                     shift, effect])
    return lines + [""] + _table(["σ", "estimand", "bit-identical", "max rel. diff", ("reference shift: 1 − cos; norm "
                                  "ratio"), "intervention's effect: 1 − cos; norm ratio"], rows)


def env_summary(run_dir: Path, run: dict) -> list[str]:
    """A few lines on where the run was measured, from the jobs' recorded fingerprints."""
    lines = []
    for job in run.get("jobs", []):
        path = Path(run_dir) / "env" / f"job{job['index']:03d}.json"
        if not path.is_file():
            continue
        rec = json.loads(path.read_text())
        fp, det = rec["fingerprint"], rec.get("determinism", {})
        kp, info = fp["kernel_path"], fp["info"]
        device = ", ".join(g.get("name", "?") for g in kp.get("gpus") or []) or f"CPU {kp['cpu'].get('model')}"
        slurm = info.get("slurm") or {}
        where = f"SLURM job {slurm.get('SLURM_JOB_ID')}" if slurm.get("SLURM_JOB_ID") else "local process"
        lines.append(f"job {job['index']}: {where} on {info.get('hostname')} (boot {str(info.get('boot_id'))[:8]}), "
                     f"{device}, torch {kp['torch'].get('version')}, {kp['threads'].get('intra_op')} threads, "
                     f"determinism {'on' if det.get('enabled') else 'off'}, kernel path "
                     f"{job['kernel_path_sha256'][:12]}, twinrun git {str((info.get('git') or {}).get('commit'))[:10]}"
                     f"{' (dirty)' if (info.get('git') or {}).get('dirty') else ''}")
    return lines


def _header(out_dir: Path, summary: dict) -> list[str]:
    lines = [f"# twinrun report: {out_dir.name}", ""]
    ph = summary.get("post_hoc")
    if ph:
        lines += [("**POST-HOC VIEW — not the registered analysis.** Registered at plan time: "
                  f"`{ph['registered']}`; used here: `{ph['used']}`. The registered analysis "
                  f"{'passed' if ph['registered_passed'] else '**FAILED**'} and stands (RUN/report.md)."), ""]
    else:
        lines += [f"Registered analysis (recorded at plan time): `{summary['registered']}`.", ""]
    ok = summary["passed"]
    lines += ["## Verdict", "", "**VALID** — every validity check and no-op gate passed; effects below." if ok else
              "**INSTRUMENT BROKEN** — a validity check or no-op gate failed. Effects are withheld; "
              "nothing else from this run should be read."]
    return lines


def write_report(out_dir: Path, summary: dict, run: dict, run_dir: Path | None = None) -> Path:
    """report.md (and effect.png) into out_dir: the run directory, or a post-hoc view inside it."""
    out_dir = Path(out_dir)
    run_dir = Path(run_dir or out_dir)
    lines = _header(out_dir, summary) + ["", "## Validity checks", ""] + _table(
        ["check", "passed", "detail"], [[c["name"], "yes" if c["passed"] else "**NO**", c["detail"]]
                                        for c in summary["checks"]])
    lines += ["", f"## No-op gates (rule: {summary['used']['gate_rule']})", ""] + gate_table(summary["gates"])
    rep = summary.get("replicate")
    if rep:
        lines += ["", "## Replicate (determinism control)", "", rep["detail"]]
    if summary["passed"]:
        png = plot_effect(summary, out_dir / EFFECT_PNG)
        lines += ["", "## Effects", "", f"![effect vs σ]({png.name})", ""] + effect_table(summary["effects"])
    if summary.get("reference"):
        lines += reference_lines(summary["reference"], summary["effects"])
    env_lines = env_summary(run_dir, run)
    if env_lines:
        lines += ["", "## Environment", "", "Full fingerprints: `env/job*.json`.", ""] + [f"- {x}" for x in env_lines]
    if run.get("command"):
        lines += ["", "## Reproduce", "", "```bash", run["command"], "```"]
    path = out_dir / "report.md"
    atomic_write(path, ("\n".join(lines) + "\n").encode())
    return path


def plot_sweep(sweep_summary: dict, path: Path, estimand: str = "all") -> Path | None:
    """Heatmap of the effect over (pinned σ, noising σ), the no-op diagonal marked."""
    rows = [e for e in sweep_summary["effects"] if e["estimand"] == estimand and e["sigma_pin"] is not None]
    if not rows:
        return None
    pins = sorted({e["sigma_pin"] for e in rows})
    sigmas = sorted({e["sigma"] for e in rows})
    grid = np.full((len(pins), len(sigmas)), np.nan)
    for e in rows:
        if e["effect"] is not None:
            grid[pins.index(e["sigma_pin"]), sigmas.index(e["sigma"])] = e["effect"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(sigmas), 1.4 + 0.5 * len(pins)), dpi=110)
    im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=ax, label=f"effect 1 − cos ({estimand})")
    ax.set_xticks(range(len(sigmas)), [f"{s:g}" for s in sigmas], rotation=45)
    ax.set_yticks(range(len(pins)), [f"{p:g}" for p in pins])
    for i, p in enumerate(pins):
        if p in sigmas:
            ax.add_patch(plt.Rectangle((sigmas.index(p) - 0.5, i - 0.5), 1, 1, fill=False, ec="white", lw=2))
    ax.set_xlabel("noising σ")
    ax.set_ylabel("pinned σ")
    ax.set_title("no-op diagonal boxed")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
