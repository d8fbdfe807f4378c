"""Sweep summary: every point's verdict and the effect over (pinned σ, noising σ).

Written by `python -m twinrun -m ...` once every point is reduced, to SWEEP_DIR/sweep_summary.json.
A point whose checks or gates failed contributes its verdict, never its numbers.
"""

from pathlib import Path

import yaml

from twinrun.report import HEATMAP_PNG, plot_sweep, sweep_caption, swept_variables
from twinrun.store import atomic_write, read_json, write_json


def point_dirs(sweep_dir: Path) -> list[Path]:
    """Hydra's numbered job directories that hold a twinrun run, in job order."""
    found = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and (p / "run.json").is_file()]
    return sorted(found, key=lambda p: (len(p.name), p.name))


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else []


def _point(run_dir: Path) -> dict:
    run = read_json(run_dir / "run.json")
    inter = next(a for a in run["arms"] if a["role"] == "intervention")
    config = yaml.safe_load((run_dir / "arms" / inter["name"] / "config.yaml").read_text())
    point = {"run_dir": str(run_dir), "overrides": _overrides(run_dir), "intervention": config["intervention"],
             "status": run.get("status"), "valid": None, "gates_passed": None, "effects": []}
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        summary = read_json(summary_path)
        point["valid"] = summary["valid"]
        point["gates_passed"] = all(g["passed"] for g in summary["gates"]) and bool(summary["gates"])
        point["effects"] = summary["effects"]
        point["gate_sigmas"] = sorted({g["sigma"] for g in summary["gates"]})  # boxed on the heatmap
    return point


def write_sweep_report(sweep_dir: Path, summary: dict) -> Path:
    """sweep_report.md: each point's verdict linked to its run, then the heatmap and what its cells mean."""
    n = summary["n_points"]
    verdict = ("every point valid with its gates passed" if summary["all_valid"]
               else "NOT every point passed its checks and gates")
    swept = swept_variables(summary["points"])
    lines = ["# twinrun sweep report", "", f"{n} {'point' if n == 1 else 'points'}; {verdict}.",
             f"Swept: {', '.join(f'`{k}`' for k in swept) or 'nothing (one point)'}.",
             "", "| point | overrides | status | valid | gates passed | report |", "|---|---|---|---|---|---|"]
    for p in summary["points"]:
        rel = Path(p["run_dir"]).relative_to(sweep_dir)
        lines.append(f"| {rel} | `{' '.join(p['overrides'])}` | {p['status']} | {_yes_no(p['valid'])} "
                     f"| {_yes_no(p['gates_passed'])} | [report]({rel}/report.md) |")
    png = plot_sweep(summary, sweep_dir / HEATMAP_PNG)
    if png is not None:
        lines += ["", f"![sweep heatmap]({png.name})", "", sweep_caption(summary)]
    path = sweep_dir / "sweep_report.md"
    atomic_write(path, ("\n".join(lines) + "\n").encode())
    return path


def _yes_no(flag: bool | None) -> str:
    return "–" if flag is None else ("yes" if flag else "**NO**")


def write_sweep_summary(sweep_dir: Path) -> dict:
    """Collect the points; for pin_sigma, lay the effects out as (sigma_pin, sigma, estimand)."""
    sweep_dir = Path(sweep_dir)
    points = [_point(d) for d in point_dirs(sweep_dir)]
    effect_map = []
    for p in points:
        pin = p["intervention"].get("sigma_pin")
        for e in p["effects"]:
            effect_map.append({"sigma_pin": pin, "sigma": e["sigma"], "estimand": e["estimand"],
                               "effect": None if e["cos"] is None else 1 - e["cos"], "cos": e["cos"],
                               "se": e["se"], "run_dir": p["run_dir"]})
    summary = {"sweep_dir": str(sweep_dir), "n_points": len(points),
               "all_valid": all(p["valid"] and p["gates_passed"] for p in points) if points else False,
               "points": points, "effects": effect_map}
    write_json(sweep_dir / "sweep_summary.json", summary)
    write_sweep_report(sweep_dir, summary)
    print(f"twinrun: sweep summary of {len(points)} points in {sweep_dir / 'sweep_summary.json'}", flush=True)
    return summary
