"""A sweep directory's one owner (SweepDir): its numbered run directories, Hydra's record of the sweep,
and the summary, report and heatmap twinrun writes beside them.

Like a run directory it is read as untrusted data: Hydra's YAML records are read as plain data from
regular files of plausible size, and a point's overrides that cannot be read are shown as none.
"""

from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # Hydra's own expansion of a sweep
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from twinrun.errors import StoreError
from twinrun.files import read_yaml
from twinrun.storage.rundir import RunDir

MULTIRUN_YAML = "multirun.yaml"
SWEEP_SUMMARY_JSON = "sweep_summary.json"
SWEEP_REPORT_MD = "sweep_report.md"
HEATMAP_PNG = "sweep_effect.png"


def expand_sweep(task: list[str]) -> list[list[str]]:
    """A sweep's command-line overrides expanded into each point's, in job order (Hydra's basic sweeper)."""
    try:
        return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)[0]
    except HydraException as err:
        raise StoreError("sweep overrides", str(err).splitlines()[0]) from None


class SweepDir:
    """Every path of one sweep directory (Hydra's `hydra.sweep.dir`)."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"SweepDir({str(self.path)!r})"

    @property
    def multirun_yaml(self) -> Path:
        return self.path / MULTIRUN_YAML

    @property
    def summary_json(self) -> Path:
        return self.path / SWEEP_SUMMARY_JSON

    @property
    def report_md(self) -> Path:
        return self.path / SWEEP_REPORT_MD

    @property
    def heatmap_png(self) -> Path:
        return self.path / HEATMAP_PNG

    def point(self, number: int) -> Path:
        return self.path / str(int(number))

    def is_sweep(self) -> bool:
        """Holds numbered run directories, or Hydra's record of a sweep whose points never ran."""
        return self.path.is_dir() and (bool(self.point_dirs()) or self.multirun_yaml.exists())

    def point_dirs(self) -> list[Path]:
        """Hydra's numbered job directories that hold a twinrun run, in job order."""
        found = [p for p in self.path.iterdir() if p.is_dir() and RunDir(p).is_run()]
        return sorted(found, key=lambda p: (len(p.name), p.name))

    def expected_points(self) -> list[list[str]] | None:
        """Each point's overrides, in job order, expanded from Hydra's multirun.yaml (None without it)."""
        if not self.multirun_yaml.exists():
            return None
        task = read_yaml(self.multirun_yaml, "Hydra multirun record")
        try:
            return expand_sweep(list(task["hydra"]["overrides"]["task"]))
        except (KeyError, TypeError, StoreError) as err:  # StoreError: expand_sweep's parse failure
            raise StoreError(self.multirun_yaml, f"field hydra.overrides.task unreadable ({err})") from None


def point_overrides(run_dir: Path) -> list[str]:
    """The overrides Hydra recorded for one sweep point (RUN/.hydra/overrides.yaml); [] if unreadable."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    try:
        overrides = read_yaml(path, "Hydra overrides record")
    except StoreError:
        overrides = None
    return [str(o) for o in overrides] if isinstance(overrides, list) else []
