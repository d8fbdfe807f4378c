"""Placement: which job measures what. `pair`: one job per run (every unit in one process); `bins`:
one job per pending unit (all arms of the unit inside it: the unit is the unit of twin validity);
`pack`: N runs in one job, one process per run (and per GPU) on one node."""

from pathlib import Path
from typing import NamedTuple

from twinrun.storage.rundir import RunIndex

SPLITS = ("pair", "bins")  # launcher.split: one job per run, or one job per unit


class Element(NamedTuple):
    """What one run asks of a job: its run directory, its units (None: every pending unit), and the
    runs its job measures side by side (launcher.pack; () when the job measures this run alone)."""

    run_dir: Path
    units: list[int] | None
    pack: tuple[Path, ...] = ()


def place(run_dirs: list[Path], split: str, pack: int = 1) -> list[Element]:
    """What each job will measure: a whole run (split=pair), one pending unit of it (split=bins), or,
    with pack > 1, whole runs in packs of `pack` (one job each, the last pack maybe smaller).

    A run whose every unit is already whole gets one whole-run job, which only marks it measured."""
    if split == "pair" and pack > 1:
        packs = [tuple(run_dirs[i:i + pack]) for i in range(0, len(run_dirs), pack)]
        return [Element(r, None, p if len(p) > 1 else ()) for p in packs for r in p]
    if split == "pair":
        return [Element(r, None) for r in run_dirs]
    out = []
    for run_dir in run_dirs:
        pending = RunIndex.load(run_dir).pending_units()
        out += [Element(run_dir, [u["index"]]) for u in pending] or [Element(run_dir, None)]
    return out


def jobs_of(planned: list[Element]) -> list[tuple[Element, ...]]:
    """The planned elements grouped by the job that measures them: a pack is one job for its runs."""
    groups: dict = {}
    for k, e in enumerate(planned):
        groups.setdefault(e.pack or k, []).append(e)
    return [tuple(g) for g in groups.values()]
