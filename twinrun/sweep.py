"""Reduce a sweep again: `python -m twinrun.sweep SWEEP_DIR [--resume [--local] [--trust MODULE]]`.

`python -m twinrun -m ...` writes SWEEP_DIR/sweep_summary.json once every point is reduced. After
`launcher.wait=false` or Ctrl-C this reduces every measured point (resuming the unfinished ones first
with --resume) and rewrites the summary (twinrun/publish/sweep.py says what it holds). Exit codes as
`python -m twinrun`, the worst over the points (docs/exit-codes.md).
"""

from twinrun.errors import exit_on_signals

if __name__ == "__main__":  # as a command: a signal while the imports below load is one line too
    exit_on_signals()

import argparse
import sys
from pathlib import Path

from twinrun.errors import (
    EXIT_INTERRUPTED,
    Interrupted,
    StoreError,
    TwinrunError,
    fail,
    raise_on_signals,
    signal_first,
)
from twinrun.pipeline import reduce_sweep
from twinrun.storage.sweepdir import SweepDir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.sweep", description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a sweep directory (holds numbered run directories)")
    p.add_argument("--resume", action="store_true",
                   help="resume every point that is not measured, then reduce")
    p.add_argument("--local", action="store_true", help="with --resume: measure here even SLURM points")
    p.add_argument("--trust", action="append", default=[], metavar="MODULE",
                   help="a module whose builders the points' configs may name; repeatable")
    args = p.parse_args(argv)
    raise_on_signals()
    try:
        with signal_first():
            if not SweepDir(args.sweep_dir).is_sweep():
                raise StoreError(args.sweep_dir,
                                 "not a twinrun sweep directory (no numbered run directories)")
            return reduce_sweep(args.sweep_dir, args.resume, args.local, args.trust)
    except KeyboardInterrupt:
        fail(Interrupted(EXIT_INTERRUPTED))
    except (TwinrunError, Interrupted) as err:
        fail(err)


if __name__ == "__main__":
    sys.exit(main())
