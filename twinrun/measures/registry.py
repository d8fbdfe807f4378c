"""Measurement kinds: MEASURES lists each, and the config's `measure` key selects one (`probe` the
default; `train`: twin training runs)."""

from twinrun.errors import ConfigError
from twinrun.measures.kind import Measure
from twinrun.measures.probe import PROBE
from twinrun.measures.train import TRAIN

MEASURES: dict[str, Measure] = {m.name: m for m in (PROBE, TRAIN)}


def measure_of(name: str) -> Measure:
    """The kind a config (or run.json) names, or a one-line error listing the valid choices."""
    if name not in MEASURES:
        raise ConfigError("measure", name, f"choose one of {', '.join(MEASURES)}")
    return MEASURES[name]
