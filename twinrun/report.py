"""report.md and its plots, written beside summary.json by every reduce.

Order is part of the contract: verdict, validity checks, gates (with bit-identity), and only
then effects, never effects when a check or gate failed.
"""

import json
import shlex
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: SLURM nodes and CI have no display
import matplotlib.pyplot as plt
import numpy as np

from twinrun.store import atomic_write

EFFECT_PNG = "effect.png"
HEATMAP_PNG = "sweep_effect.png"


def plot_effect(summary: dict, path: Path) -> Path:
    """1 − debiased cos (± SE) against noising σ per estimand, log σ, gate bins marked."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    estimands = sorted({e["estimand"] for e in summary["effects"]}, key=["all", "cond", "residual"].index)
    for name in estimands:
        rows = [e for e in summary["effects"] if e["estimand"] == name and e["cos"] is not None]
        sigma = np.array([e["sigma"] for e in rows])
        effect = np.array([1 - e["cos"] for e in rows])
        se = np.array([e["se"] if e["se"] is not None else np.nan for e in rows])
        ax.errorbar(sigma, effect, yerr=se, marker="o", ms=4, capsize=3, label=name)
    for i, g in enumerate({g["sigma"] for g in summary["gates"]}):
        ax.axvline(g, color="0.5", ls="--", lw=1, label="no-op gate" if i == 0 else None)
    floor = (summary.get("replicate") or {}).get("max_effect")
    if floor is not None:
        ax.axhline(floor, color="tab:red", ls=":", lw=1, label="replicate floor")
    ax.set_xscale("log")
    ax.set_xlabel("noising σ")
    ax.set_ylabel("effect = 1 − debiased cos to twin")
    ax.set_title("intervention vs native twin")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(x, spec=".4f") -> str:
    return "below noise" if x is None else format(x, spec)


def _se(row: dict, spec: str) -> str:
    return "–" if row["se"] is None else format(row["se"], spec)


def _table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


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


def write_report(run_dir: Path, summary: dict, run: dict) -> Path:
    run_dir = Path(run_dir)
    ok = summary["valid"] and bool(summary["gates"]) and all(g["passed"] for g in summary["gates"])
    verdict = ("**VALID** — every validity check and no-op gate passed; effects below." if ok else
               "**INSTRUMENT BROKEN** — a validity check or no-op gate failed. Effects are withheld; "
               "nothing else from this run should be read.")
    lines = [f"# twinrun report: {run_dir.name}", "", "## Verdict", "", verdict, "", "## Validity checks", "",
             ] + _table(["check", "passed", "detail"],
                        [[c["name"], "yes" if c["passed"] else "**NO**", c["detail"]] for c in summary["checks"]])
    lines += ["", "## No-op gates", ""] + _table(
        ["σ", "estimand", "debiased cos", "± se", "threshold", "passed", "bit-identical"],
        [[f"{g['sigma']:g}", g["estimand"], _fmt(g["cos"], ".6f"), _se(g, ".1e"), g["threshold"],
          "yes" if g["passed"] else "**NO**", "yes" if g["bit_identical"] else "no"] for g in summary["gates"]])
    rep = summary.get("replicate")
    if rep:
        lines += ["", "## Replicate (determinism control)", "", rep["detail"]]
    if ok:
        png = plot_effect(summary, run_dir / EFFECT_PNG)
        lines += ["", "## Effects", "", f"![effect vs σ]({png.name})", ""] + _table(
            ["σ", "estimand", "debiased cos", "± se", "naive cos", "effect 1 − cos"],
            [[f"{e['sigma']:g}", e["estimand"], _fmt(e["cos"]), _se(e, ".4f"), f"{e['cos_naive']:.4f}",
              _fmt(None if e["cos"] is None else 1 - e["cos"])] for e in summary["effects"]])
    ref = summary.get("reference")
    if ref:
        lines += ["", "## Reference", "", ref["detail"]]
    env_lines = env_summary(run_dir, run)
    if env_lines:
        lines += ["", "## Environment", "", "Full fingerprints: `env/job*.json`.", ""] + [f"- {x}" for x in env_lines]
    if run.get("command"):
        lines += ["", "## Reproduce", "", "Measure afresh, into a new run directory:", "", "```bash", run["command"],
                  "```", "", "Resume this run in place (verified bins are kept, the rest measured):", "", "```bash",
                  f"python -m twinrun.resume {shlex.quote(str(run_dir))}", "```"]
    path = run_dir / "report.md"
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
