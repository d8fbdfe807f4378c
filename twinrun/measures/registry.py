"""Measurement kinds: MEASURES lists the built-in ones, the config's `measure` key selects one (`probe`
the default; `train`: twin training runs; `sample`: twin sampling), and an installed package may add its own
(twinrun/plugins.py, entry point group `twinrun.measures`). A kind is looked up here once and handed
down: the rooms below name none."""

from pathlib import Path

from twinrun.errors import ConfigError, StoreError
from twinrun.measures.kind import Measure
from twinrun.measures.probe import PROBE
from twinrun.measures.sample import SAMPLE
from twinrun.measures.train import TRAIN
from twinrun.plugins import MEASURES_GROUP, lookup, names
from twinrun.storage.rundir import RunDir, RunIndex

MEASURES: dict[str, Measure] = {m.name: m for m in (PROBE, TRAIN, SAMPLE)}


def measure_names() -> list[str]:
    """Every kind `measure=` can select: the built-in ones, then the installed plugins'."""
    return names(MEASURES_GROUP, MEASURES)


def measure_of(name: str) -> Measure:
    """The kind a config names, or a one-line error listing the installed choices."""
    kind = lookup(MEASURES_GROUP, "measure", name, MEASURES)
    if not isinstance(kind, Measure) or kind.name != name:
        raise ConfigError("measure", name, f"the entry point is not a twinrun Measure named {name!r}; "
                          "fix its package's entry point")
    return kind


def load_index(run_dir) -> tuple[RunIndex, Measure]:
    """A run's run.json and its kind, the kind's own unit fields checked: a run made with a plugin that is
    not installed here is one line (exit 2), never a traceback."""
    index = RunIndex.load(run_dir)
    try:
        kind = measure_of(index.measure)
    except ConfigError:
        raise StoreError(index.run_dir.run_json, f"field measure: {index.measure!r} is no kind installed "
                         f"here (installed: {', '.join(measure_names())}); install the package whose "
                         f"{MEASURES_GROUP} entry point measured it") from None
    index.check_units(kind.unit_fields, kind.increasing)
    return index, kind


def kind_of(run_dir: Path | RunDir) -> Measure:
    """The kind of a run directory (load_index's, for a caller that needs only the kind)."""
    return load_index(run_dir)[1]
