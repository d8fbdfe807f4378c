"""The tidy table of runs and sweeps: `python -m twinrun.table RUN_OR_SWEEP… [--csv F | --parquet F]`.

One row per run × σ bin × estimand (verdict, gate, below-noise flag, cos, norm ratio, SEs and intervals,
the pairing receipt, the kernel-path digest, the seed and every override as a column); a sweep adds its
σ × estimand pooled over seeds. Without --csv or --parquet the CSV goes to stdout. Needs the `table`
extra: `pip install 'twinrun[table]'`. Exit codes: 0 written; 2 bad input (not a run or sweep directory,
a damaged record, pandas or pyarrow missing, an output path that is a link or not a regular file).
"""

import argparse
import sys
from pathlib import Path

from twinrun.errors import EXIT_OK, TwinrunError, exit_as_command, fail
from twinrun.files import refuse_unsafe_target
from twinrun.measures.registry import load_index
from twinrun.publish.table import frame, write


def load(paths) -> "pd.DataFrame":  # noqa: F821 — pandas is the `table` extra, imported by publish.table
    """The tidy table of the runs and sweeps at `paths` (one path or several) as a pandas DataFrame, each
    run read as its measurement kind says (looked up here, once per run)."""
    return frame(paths, load_index)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.table", description=__doc__.splitlines()[0])
    p.add_argument("paths", type=Path, nargs="+", help="run directories and sweep directories")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--csv", type=Path, metavar="FILE", help="write the table as CSV")
    out.add_argument("--parquet", type=Path, metavar="FILE", help="write the table as parquet (pyarrow)")
    args = p.parse_args(argv)
    try:
        target = args.parquet or args.csv
        if target is not None:  # before any run is read: a device node or a link is refused at once
            refuse_unsafe_target(target, "table")
        df = load(args.paths)
        if args.csv is None and args.parquet is None:
            sys.stdout.write(df.to_csv(index=False))
            return EXIT_OK
        path = write(df, args.parquet or args.csv, "parquet" if args.parquet else "csv")
    except TwinrunError as err:
        fail(err)
    print(f"twinrun table: {len(df)} rows × {len(df.columns)} columns → {path}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    exit_as_command(main)
