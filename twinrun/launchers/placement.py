"""Placement: which job measures what. `pair`: one job per run (every unit in one process); `bins`:
one job per pending unit (all arms of the unit inside it: the unit is the unit of twin validity)."""

from pathlib import Path
from typing import NamedTuple

from twinrun.storage.rundir import RunIndex

SPLITS = ("pair", "bins")  # launcher.split: one job per run, or one job per unit


class Element(NamedTuple):
    """One job to submit: the run directory it measures and its units (None: every pending unit)."""

    run_dir: Path
    units: list[int] | None


def place(run_dirs: list[Path], split: str) -> list[Element]:
    """What each job will measure: a whole run (split=pair), or one pending unit of it (split=bins).

    A run whose every unit is already whole gets one whole-run job, which only marks it measured."""
    if split == "pair":
        return [Element(r, None) for r in run_dirs]
    out = []
    for run_dir in run_dirs:
        pending = RunIndex.load(run_dir).pending_units()
        out += [Element(run_dir, [u["index"]]) for u in pending] or [Element(run_dir, None)]
    return out
