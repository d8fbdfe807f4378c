"""Resume a run in place: `python -m twinrun.resume RUN_DIR`.

Bins whose stores exist and verify are skipped; the rest are measured (all arms of a bin back to
back), then the run is reduced. Equivalent to rerunning the original command with
`hydra.run.dir=RUN_DIR`. Exit codes as `python -m twinrun`.
"""

import argparse
import sys
from pathlib import Path

from twinrun.errors import TwinrunError, fail
from twinrun.store import require_run_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.resume", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a twinrun run directory (holds run.json)")
    args = p.parse_args(argv)
    from twinrun.app import reduce_and_report
    from twinrun.run import run_job

    try:
        run_job(require_run_dir(args.run_dir))
        return reduce_and_report(args.run_dir)
    except TwinrunError as err:
        fail(err)


if __name__ == "__main__":
    sys.exit(main())
