"""Resume a run in place: `python -m twinrun.resume RUN_DIR [--trust MODULE] [--local]`.

Bins whose stores exist and verify are skipped; the rest are measured (all arms of a bin back to
back), then the run is reduced. A run that was submitted to SLURM is submitted again (the same
launcher settings, from launch.json) unless --local; others are measured in this process. Only
twinrun's own builders are instantiated from the run directory's configs, plus the modules named
with --trust (or rerun the original command, with its --config-dir, and `hydra.run.dir=RUN_DIR`).
Exit codes as `python -m twinrun` (docs/exit-codes.md).
"""

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twinrun.errors import EXIT_INTERRUPTED, Interrupted, StoreError, TwinrunError, fail
from twinrun.rundir import RunDir, safe_name
from twinrun.store import read_json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.resume", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a twinrun run directory (holds run.json)")
    p.add_argument("--trust", action="append", default=[], metavar="MODULE",
                   help="a module whose builders the run's configs may name (e.g. your model's); repeatable")
    p.add_argument("--local", action="store_true", help="measure in this process even if the run was submitted")
    args = p.parse_args(argv)
    from twinrun.run import raise_on_sigterm

    raise_on_sigterm()
    if not RunDir(args.run_dir).is_run() and (args.run_dir / "multirun.yaml").exists():  # a sweep directory
        from twinrun import sweep

        return sweep.main([str(args.run_dir), "--resume", *(["--local"] if args.local else []),
                           *(f"--trust={t}" for t in args.trust)])
    try:
        return resume_run(RunDir(args.run_dir).require(), args.local, args.trust)
    except KeyboardInterrupt:
        fail(Interrupted(EXIT_INTERRUPTED))
    except TwinrunError as err:
        fail(err)


def resume_run(rd: RunDir, local: bool, trusted: list[str]) -> int:
    """Measure what is missing (here, or by resubmitting a SLURM run), then reduce; the exit code."""
    from twinrun.app import reduce_and_report, submit_and_collect
    from twinrun.run import run_job

    launcher = None if local else submitted_launcher(rd)
    if launcher is not None:
        return submit_and_collect([rd.path], launcher, rd.path, trusted)
    run_job(rd.path, trusted)
    return reduce_and_report(rd.path)


def submitted_launcher(rd: RunDir) -> dict | None:
    """The SLURM launcher settings launch.json recorded, checked like a config; None if not a SLURM run."""
    from twinrun.config import LauncherConfig
    from twinrun.launch import ACTIVE, job_state, unsafe_sbatch_knob

    if not rd.launch_json.is_file():
        return None
    launch = read_json(rd.launch_json)
    if launch["cluster"] != "slurm":
        return None
    state = job_state(launch)
    if state is not None and state.split()[0] in ACTIVE:
        raise StoreError(rd.path, f"its job {launch['job_id']} is still {state}: wait for it, or scancel it "
                         "and resume again")
    try:
        launcher = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(LauncherConfig), launch["launcher"]))
    except OmegaConfBaseException as err:
        raise StoreError(rd.launch_json, f"field launcher: {str(err).splitlines()[0]}") from None
    safe_name(launcher["folder"], "launcher.folder", rd.launch_json)
    if launcher["setup"]:
        # Shell lines from a file anyone could have edited: run them only from the user's own command.
        raise StoreError(rd.launch_json, f"field launcher.setup holds shell lines {launcher['setup']}; a run "
                         "directory never runs code: rerun your original command with hydra.run.dir=RUN_DIR, "
                         "or resume with --local")
    if launcher["additional_parameters"]:
        # sbatch options from a file anyone could have edited (`export: LD_PRELOAD=…`): the user's own only.
        raise StoreError(rd.launch_json, f"field launcher.additional_parameters holds sbatch options "
                         f"{launcher['additional_parameters']}; a run directory chooses no job options: rerun your "
                         "original command with hydra.run.dir=RUN_DIR, or resume with --local")
    bad = unsafe_sbatch_knob(launcher, trusted=False)
    if bad is not None:
        raise StoreError(rd.launch_json, f"field launcher.{bad[0]}: {bad[1]!r} may hold only letters, digits "
                         "and _.,:@%+=|&()[]*- (it becomes a line of the sbatch script); fix or remove it, "
                         "or resume with --local")
    print(f"twinrun: {rd.path} was a SLURM run: submitting it again (--local to measure here)", flush=True)
    return launcher


if __name__ == "__main__":
    sys.exit(main())
