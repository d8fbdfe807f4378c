"""Reduce a run: validity checks → no-op gates → effects (only if everything passed).

    python -m twinrun.reduce RUN_DIR                      # the registered analysis
    python -m twinrun.reduce RUN_DIR --estimands all      # a labelled post-hoc view in RUN_DIR/views/

Exit codes: 0 every check and gate passed; 1 a check or gate failed (the instrument is broken:
effects withheld; a post-hoc view never turns a registered failure into 0); 2 bad input
(missing, damaged or foreign stores).
"""

from twinrun.errors import exit_as_command, exit_on_signals

if __name__ == "__main__":  # as a command: a signal while the imports below load is one line too
    exit_on_signals()

import argparse
from pathlib import Path

from twinrun.analysis.estimands import ESTIMANDS
from twinrun.config import GATE_RULES, SIGNAL_ALPHA_TEXT, signal_alpha_ok
from twinrun.errors import Interrupted, TwinrunError, fail, raise_on_signals
from twinrun.pipeline import reduce_and_publish
from twinrun.publish.trackers import NONE, SINKS, check_tracker
from twinrun.storage.rundir import RunDir


def parse_estimands(text: str | None) -> list[str] | None:
    """--estimands: comma-separated names (checked against the run's registry once the run is read)."""
    if text is None:
        return None
    names = [e.strip() for e in text.split(",")]
    if not all(names):
        raise TwinrunError(f"--estimands={text!r}: a comma-separated list of names, e.g. all,cond")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.reduce", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a twinrun run directory (holds run.json)")
    p.add_argument("--estimands", help=f"comma-separated views: {', '.join(ESTIMANDS)} or a group the run "
                   "registered (reduce.groups); post-hoc if not the registered ones")
    p.add_argument("--gate-rule", choices=GATE_RULES, help="post-hoc if not the registered one")
    p.add_argument("--tracker", choices=[NONE, *SINKS], default=NONE, help="also log the registered analysis "
                   "to this experiment tracker (a run directory never chooses one)")
    p.add_argument("--tracker-dir", help="the tracker's local store (default: outputs/TRACKER here)")
    p.add_argument("--signal-alpha", type=float, help="level of the test of signal, in (0, 0.5) (post-hoc "
                   "if not the registered one)")
    p.add_argument("--family-alpha", type=float, help="family-wise level of the Holm reading, in (0, 0.5) "
                   "(post-hoc if not the registered one)")
    args = p.parse_args(argv)
    raise_on_signals()
    try:
        estimands = parse_estimands(args.estimands)
        for flag, level in (("--signal-alpha", args.signal_alpha), ("--family-alpha", args.family_alpha)):
            if level is not None and not signal_alpha_ok(level):
                raise TwinrunError(f"{flag}={level}: must be {SIGNAL_ALPHA_TEXT}, e.g. 0.05")
        tracker = check_tracker({"name": args.tracker, "dir": args.tracker_dir})
        return reduce_and_publish(RunDir(args.run_dir).require().path, estimands, args.gate_rule,
                                  args.signal_alpha, tracker, args.family_alpha)
    except (TwinrunError, Interrupted) as err:
        fail(err)


if __name__ == "__main__":
    exit_as_command(main)
