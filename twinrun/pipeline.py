"""Orchestration: run a point, submit and collect, resume, reduce and publish. No argparse, no Hydra.

Every command line (python -m twinrun, .resume, .reduce, .sweep) goes through these functions and
never through another command line. Each returns the process's exit code (0 ok, 1 a gate or check
failed, 2 bad input, 3 refused, 4 the model raised; docs/exit-codes.md), the worst over several runs.
"""

import sys
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

from twinrun import launchers
from twinrun.errors import EXIT_GATE, EXIT_OK, EXIT_USAGE, TwinrunError
from twinrun.job import run_job
from twinrun.launchers.record import submitted_launcher
from twinrun.launchers.submit import submit
from twinrun.launchers.wait import wait
from twinrun.measures.registry import load_index, measure_of
from twinrun.plan import plan_run, trusted_targets
from twinrun.publish import publish
from twinrun.publish.sweep import write_sweep_summary
from twinrun.publish.trackers import check_tracker
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.sweepdir import SweepDir


class Point(NamedTuple):
    """What one run (one sweep point) came to: its exit code, or None when it waits to be submitted
    with the others of its sweep as one array."""

    run_dir: Path
    code: int | None
    launcher: dict | None
    trusted: tuple
    tracker: dict | None = None  # where the reduced run is also logged (check_tracker's), None: nowhere


def check_launcher(cfg: DictConfig) -> dict:
    """The config's launcher settings as plain data, refused (exit 2) before anything is written."""
    launcher = OmegaConf.to_container(cfg.launcher, resolve=True)
    kind = measure_of(cfg.measure)
    launchers.check(launcher, kind.compile_setting(cfg), kind.unit_noun if kind.sequential_units else None,
                    device=device_setting(cfg))
    return launcher


def device_setting(cfg: DictConfig) -> tuple[str, str]:
    """(key, value) of the measurement kind's device setting, e.g. ("probe.device", "auto")."""
    kind = measure_of(cfg.measure)
    return f"{kind.settings_key}.device", str(kind.device(cfg))


def run_point(cfg: DictConfig, run_dir: Path, command: str | None, sweeping: bool) -> Point:
    """Plan one run, then measure and reduce it (local), submit it, or defer it to the sweep's array."""
    trusted = tuple(trusted_targets(cfg))  # the user composed this config: its builders may run
    launcher = check_launcher(cfg)  # bad launcher settings fail before a run directory is written
    tracker = check_tracker(OmegaConf.to_container(cfg.tracker, resolve=True))
    plan_run(cfg, run_dir, command=command)
    print(f"twinrun: run directory {run_dir}", flush=True)
    note = launchers.device_note(launcher, *device_setting(cfg))
    if note is not None:
        print(note, flush=True)
    if launchers.LAUNCHERS[launcher["name"]].in_process:
        run_job(run_dir, trusted)
        return Point(run_dir, reduce_and_publish(run_dir, tracker=tracker), launcher, trusted, tracker)
    if sweeping:
        return Point(run_dir, None, launcher, trusted, tracker)
    code = submit_and_collect([run_dir], launcher, run_dir, trusted, tracker)
    return Point(run_dir, code, launcher, trusted, tracker)


def submit_and_collect(run_dirs: list[Path], launcher: dict, folder_root: Path, trusted=(),
                       tracker: dict | None = None) -> int:
    """Submit the runs (one job, or one array), wait unless told not to, reduce each."""
    submitted = submit(run_dirs, launcher, folder_root, trusted)
    if not launcher["wait"]:
        where = run_dirs[0] if len(run_dirs) == 1 else folder_root
        reduce = (f"python -m twinrun.reduce {where}" if len(run_dirs) == 1
                  else f"python -m twinrun.sweep {where}")
        print(f"twinrun: not waiting (launcher.wait=false); follow with `python -m twinrun.status {where}`; "
              f"once measured, `{reduce}` reduces {'it' if len(run_dirs) == 1 else 'every point'} (status "
              "says so too)", flush=True)
        return EXIT_OK
    failed = wait(submitted, launcher)
    return max(failed.get(Path(r).resolve()) or reduce_and_publish(r, tracker=tracker) for r in run_dirs)


def reduce_and_publish(run_dir: Path, estimands=None, gate_rule=None, signal_alpha=None,
                       tracker: dict | None = None, family_alpha=None) -> int:
    """Reduce a measured run with its kind's analysis, publish it (and log it to the tracker, when one
    is given), print it; the exit code."""
    kind = load_index(run_dir)[1]
    reduction = kind.reduce(Path(run_dir), estimands, gate_rule, signal_alpha, family_alpha)
    publish(reduction, kind, tracker)
    print(kind.render(reduction.shown), flush=True)
    return reduction.exit_code


def resume_run(rd: RunDir, local: bool, trusted: list[str]) -> int:
    """Measure what is missing (here, or by resubmitting a SLURM run), then reduce; the exit code."""
    launcher = None if local else submitted_launcher(rd)
    if launcher is not None:
        # launch.json's settings are held to the rules a config's are (split=bins with a compiled probe or
        # sequential units, the GPUs the device setting names)
        launchers.check(launcher, *_launch_rules(rd))
        return submit_and_collect([rd.path], launcher, rd.path, trusted)
    run_job(rd.path, trusted)
    return reduce_and_publish(rd.path)


def _launch_rules(rd: RunDir) -> tuple:
    """What the launcher rules depend on, read from the run's twin config: (the kind's compile setting, the
    noun of sequential units or None, (the kind's device key, its setting))."""
    index, kind = load_index(rd)
    config = rd.read_arm_config(index.arm("twin")["name"])
    return (kind.compile_setting(config), kind.unit_noun if kind.sequential_units else None,
            (f"{kind.settings_key}.device", str(kind.device(config))))


def submit_sweep(points: list[Point], sweep_dir: Path) -> int:
    """The points a submitit launcher deferred, as one job array; then wait and reduce each."""
    trusted = sorted({t for p in points for t in p.trusted})
    return submit_and_collect([p.run_dir for p in points], points[0].launcher, sweep_dir, trusted,
                              points[0].tracker)


def reduce_sweep(sweep_dir: Path, resume: bool, local: bool, trusted: list[str]) -> int:
    """Reduce every measured point (resume the others first if asked), then the sweep summary; the
    worst exit code, and at least 1 (every point reduced) or 2 (some never were) unless all are valid."""
    codes = []
    for run_dir in SweepDir(sweep_dir).point_dirs():
        try:
            if resume and RunIndex.load(run_dir).status != "measured":
                codes.append(resume_run(RunDir(run_dir), local, trusted))
                continue
            if not RunDir(run_dir).has_summary() or resume:
                codes.append(reduce_and_publish(run_dir))
        except TwinrunError as err:  # one point's damage does not hide the others
            print(f"twinrun: error: {run_dir}: {err}", file=sys.stderr, flush=True)
            codes.append(err.exit_code)
    code, summary = max(codes or [EXIT_OK]), write_sweep_summary(sweep_dir, load_index)
    if not summary["all_valid"]:
        code = max(code, EXIT_GATE if all(pt["status"] == "reduced" for pt in summary["points"])
                   else EXIT_USAGE)
    return code
