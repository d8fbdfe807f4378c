"""Resume a run in place: `python -m twinrun.resume RUN_DIR [--trust MODULE] [--local]`.

Bins whose stores exist and verify are skipped; the rest are measured (all arms of a bin back to
back), then the run is reduced. A run that was submitted to SLURM is submitted again (the same
launcher settings, from launch.json) unless --local; others are measured in this process. Only
twinrun's own builders are instantiated from the run directory's configs, plus the modules named
with --trust (or rerun the original command, with its --config-dir, and `hydra.run.dir=RUN_DIR`).
Exit codes as `python -m twinrun` (docs/exit-codes.md).
"""

from twinrun.errors import exit_on_signals

if __name__ == "__main__":  # as a command: a signal while the imports below load is one line too
    exit_on_signals()

import argparse
import sys
from pathlib import Path

from twinrun.errors import EXIT_INTERRUPTED, Interrupted, TwinrunError, fail, raise_on_signals, signal_first
from twinrun.pipeline import reduce_sweep, resume_run
from twinrun.storage.rundir import RunDir
from twinrun.storage.sweepdir import SweepDir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.resume", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a twinrun run directory (holds run.json)")
    p.add_argument("--trust", action="append", default=[], metavar="MODULE",
                   help="a module whose builders the run's configs may name (e.g. your model's); repeatable")
    p.add_argument("--local", action="store_true",
                   help="measure in this process even if the run was submitted")
    args = p.parse_args(argv)
    raise_on_signals()
    try:
        with signal_first():
            if not RunDir(args.run_dir).is_run() and SweepDir(args.run_dir).multirun_yaml.exists():  # a sweep
                return reduce_sweep(args.run_dir, True, args.local, args.trust)
            return resume_run(RunDir(args.run_dir).require(), args.local, args.trust)
    except KeyboardInterrupt:
        fail(Interrupted(EXIT_INTERRUPTED))
    except (TwinrunError, Interrupted) as err:
        fail(err)


if __name__ == "__main__":
    sys.exit(main())
