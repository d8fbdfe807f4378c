"""Sweep summary: every point's verdict and the effect over (the intervention's sweep axis, noising σ).

Written by `python -m twinrun -m ...` once every point is reduced, to SWEEP_DIR/sweep_summary.json.
A point whose checks or gates failed contributes its verdict, never its numbers; a point that
failed, was interrupted or never ran is marked so, and the sweep is "all valid" only if every
point Hydra's sweep names (multirun.yaml) is. After `launcher.wait=false` or Ctrl-C:

    python -m twinrun.sweep SWEEP_DIR [--resume [--local] [--trust MODULE]]

reduces every measured point (resuming the unfinished ones first with --resume) and rewrites the
summary. Exit codes as `python -m twinrun`, the worst over the points (docs/exit-codes.md).
"""

import argparse
import sys
from pathlib import Path
from types import ModuleType

import yaml

from twinrun.errors import EXIT_GATE, EXIT_OK, EXIT_USAGE, StoreError, TwinrunError, fail
from twinrun.report import HEATMAP_PNG, plot_sweep, sweep_caption, swept_variables
from twinrun.rundir import RunDir, RunIndex
from twinrun.store import atomic_write, read_config, read_json, read_regular, write_json

MULTIRUN_YAML = "multirun.yaml"
MAX_YAML_BYTES = 16 * 1024 * 1024


def sweep_points(sweep_dir: Path) -> list[list[str]] | None:
    """Each point's overrides, in job order, expanded from Hydra's multirun.yaml (None without it)."""
    from hydra.errors import HydraException

    path = Path(sweep_dir) / MULTIRUN_YAML
    if not path.exists():
        return None
    try:
        task = yaml.safe_load(read_regular(path, MAX_YAML_BYTES, "Hydra multirun record").decode())
        return expand(list(task["hydra"]["overrides"]["task"]))
    except (UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, HydraException) as err:
        raise StoreError(path, f"field hydra.overrides.task unreadable ({str(err).splitlines()[0]})") from None


def expand(task: list[str]) -> list[list[str]]:
    """A sweep's command-line overrides expanded into each point's, in job order (Hydra's basic sweeper)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)[0]


def point_dirs(sweep_dir: Path) -> list[Path]:
    """Hydra's numbered job directories that hold a twinrun run, in job order."""
    found = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and RunDir(p).is_run()]
    return sorted(found, key=lambda p: (len(p.name), p.name))


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    try:
        overrides = yaml.safe_load(read_regular(path, MAX_YAML_BYTES, "Hydra overrides record").decode())
    except (UnicodeDecodeError, yaml.YAMLError):
        overrides = None
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def _point(run_dir: Path) -> dict:
    index = RunIndex.load(run_dir)
    intervention = _intervention(index)
    point = {"run_dir": str(run_dir), "overrides": _overrides(run_dir), "intervention": intervention,
             "axis": sweep_axis(intervention), "status": index.status, "valid": None, "gates_passed": None,
             "effects": []}
    rd = index.run_dir
    if rd.summary_json.exists():
        summary = read_json(rd.summary_json)
        point["valid"] = summary["valid"]
        # `passed`: every check and gate, the machinery arm's included (an intervention with a no-op
        # setting may have no gate bin at all).
        point["gates_passed"] = summary.get("passed", all(g["passed"] for g in summary["gates"]) and bool(summary["gates"]))
        point["effects"] = summary["effects"]
        point["gate_sigmas"] = sorted({g["sigma"] for g in summary["gates"]})  # boxed on the heatmap
        point["status"] = "reduced"
    return point


def _intervention(index: RunIndex) -> dict:
    """The intervention arm's `intervention` node (its sweep axis), as planned."""
    path = index.run_dir.arm_config(index.arm("intervention")["name"])
    config = read_config(path)
    if not isinstance(config.get("intervention"), dict):
        raise StoreError(path, "field intervention: missing or not a config node")
    return config["intervention"]


def sweep_axis(intervention: dict) -> dict | None:
    """The axis the intervention declares (its class's `sweep_axis`) and this point's value on it,
    {"key": "intervention.<axis>", "value": ...}; None if it declares none.

    The class is looked up, never imported: twinrun's own interventions, or one this process already
    imported to build it (a run directory names code; reading one must not run any)."""
    from twinrun import interventions

    module, _, name = str(intervention.get("_target_", "")).rpartition(".")
    owner = interventions if module == interventions.__name__ else sys.modules.get(module)
    # vars(), not getattr: a module's __getattr__ (PEP 562 lazy loaders) could import on a name read from disk.
    cls = vars(owner).get(name) if isinstance(owner, ModuleType) else None
    axis = getattr(cls, "sweep_axis", None) if isinstance(cls, type) else None
    if not isinstance(axis, str) or axis not in intervention:
        return None
    return {"key": f"intervention.{axis}", "value": intervention[axis]}


def _missing(sweep_dir: Path, number: int, overrides: list[str]) -> dict:
    return {"run_dir": str(Path(sweep_dir) / str(number)), "overrides": overrides, "intervention": {},
            "axis": None, "status": "missing", "valid": None, "gates_passed": None, "effects": []}


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
    """Collect the points; lay the effects out as (the intervention's sweep axis, sigma, estimand): each
    entry names its axis ("axis": "sigma_pin") and holds the point's value under that name."""
    sweep_dir = Path(sweep_dir)
    points = [_point(d) for d in point_dirs(sweep_dir)]
    have = {Path(p["run_dir"]).name for p in points}
    expected = sweep_points(sweep_dir) or []
    points += [_missing(sweep_dir, n, o) for n, o in enumerate(expected) if str(n) not in have]
    effect_map = []
    for p in points:
        axis = (p["axis"] or {}).get("key", "intervention.(none)").removeprefix("intervention.")
        for e in p["effects"]:
            value = (p["axis"] or {}).get("value")
            effect_map.append({"axis": axis, axis: value, "sigma": e["sigma"], "estimand": e["estimand"],
                               "effect": None if e["cos"] is None else 1 - e["cos"], "cos": e["cos"],
                               "se": e["se"], "run_dir": p["run_dir"]})
    summary = {"sweep_dir": str(sweep_dir), "n_points": len(points),
               "all_valid": all(p["valid"] and p["gates_passed"] for p in points) if points else False,
               "points": points, "effects": effect_map}
    write_json(sweep_dir / "sweep_summary.json", summary)
    write_sweep_report(sweep_dir, summary)
    print(f"twinrun: sweep summary of {len(points)} points in {sweep_dir / 'sweep_summary.json'}", flush=True)
    return summary


# ----------------------------------------------------------------------------- CLI


def reduce_points(sweep_dir: Path, resume: bool, local: bool, trusted: list[str]) -> int:
    """Reduce every measured point (resume the others first if asked); the worst exit code."""
    from twinrun.app import reduce_and_report
    from twinrun.resume import resume_run

    codes = []
    for run_dir in point_dirs(sweep_dir):
        try:
            if resume and RunIndex.load(run_dir).status != "measured":
                codes.append(resume_run(RunDir(run_dir), local, trusted))
                continue
            if not RunDir(run_dir).summary_json.exists() or resume:
                codes.append(reduce_and_report(run_dir))
        except TwinrunError as err:  # one point's damage does not hide the others
            print(f"twinrun: error: {run_dir}: {err}", file=sys.stderr, flush=True)
            codes.append(err.exit_code)
    return max(codes or [EXIT_OK])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.sweep", description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a sweep directory (holds numbered run directories)")
    p.add_argument("--resume", action="store_true", help="resume every point that is not measured, then reduce")
    p.add_argument("--local", action="store_true", help="with --resume: measure here even SLURM points")
    p.add_argument("--trust", action="append", default=[], metavar="MODULE",
                   help="a module whose builders the points' configs may name; repeatable")
    args = p.parse_args(argv)
    from twinrun.run import raise_on_sigterm

    raise_on_sigterm()
    try:
        if not args.sweep_dir.is_dir() or (not point_dirs(args.sweep_dir) and sweep_points(args.sweep_dir) is None):
            raise StoreError(args.sweep_dir, "not a twinrun sweep directory (no numbered run directories)")
        code = reduce_points(args.sweep_dir, args.resume, args.local, args.trust)
        summary = write_sweep_summary(args.sweep_dir)
    except KeyboardInterrupt:
        from twinrun.errors import EXIT_INTERRUPTED, Interrupted

        fail(Interrupted(EXIT_INTERRUPTED))
    except TwinrunError as err:
        fail(err)
    if not summary["all_valid"]:
        code = max(code, EXIT_GATE if all(pt["status"] == "reduced" for pt in summary["points"]) else EXIT_USAGE)
    return code


if __name__ == "__main__":
    sys.exit(main())
