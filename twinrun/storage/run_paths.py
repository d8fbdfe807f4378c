"""Every path of a run directory (RunPaths, the base of twinrun.storage.rundir's RunDir) and their names.

A run directory is untrusted input (it may come from anyone): every name read from it is checked
against SAFE_NAME and every path resolved inside the directory before it is opened or written.
"""

import os
import stat
from pathlib import Path
from typing import Self

from twinrun.errors import StoreError
from twinrun.files import safe_name

RUN_JSON = "run.json"
SUMMARY_JSON = "summary.json"
LAUNCH_JSON = "launch.json"
CONFIG_DIFF_JSON = "config_diff.json"
LOCK_NAME = ".lock"
INDEX_LOCK_NAME = ".run.json.lock"  # held for one read-modify-write of run.json, never longer
ARMS_DIR = "arms"
ENV_DIR = "env"
ARM_CONFIG = "config.yaml"
VIEWS_DIR = "views"
LOG_NAME = "twinrun.log"
REPORT_MD = "report.md"  # in the run directory and in each post-hoc view
EFFECT_PNG = "effect.png"
LOSS_PNG = "loss.png"  # a training run's loss curves, every arm
DISTANCE_PNG = "distance.png"  # a training run's distance to the twin over steps, the chaos floor beside it


class RunPaths:
    """Every path of one run directory; each name is validated and each path kept inside it."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def run_json(self) -> Path:
        return self.path / RUN_JSON

    @property
    def summary_json(self) -> Path:
        return self.path / SUMMARY_JSON

    @property
    def launch_json(self) -> Path:
        return self.path / LAUNCH_JSON

    @property
    def config_diff_json(self) -> Path:
        return self.path / CONFIG_DIFF_JSON

    @property
    def report_md(self) -> Path:
        return self.path / REPORT_MD

    @property
    def effect_png(self) -> Path:
        return self.path / EFFECT_PNG

    @property
    def lock(self) -> Path:
        return self.path / LOCK_NAME

    @property
    def index_lock(self) -> Path:
        return self.path / INDEX_LOCK_NAME

    def unit_lock(self, index: int) -> Path:
        """Held by the one process measuring this unit (an array element of launcher.split=bins)."""
        return self.path / f"{LOCK_NAME}-unit{int(index):03d}"

    def unit_locks_left(self) -> list[int]:
        """The units whose lock file an element left behind (a whole-run job takes those locks too)."""
        prefix = f"{LOCK_NAME}-unit"
        found = (p.name.removeprefix(prefix) for p in self.path.glob(f"{prefix}*"))
        return sorted(int(n) for n in found if n.isdigit() and 3 <= len(n) <= 6)

    @property
    def env_dir(self) -> Path:
        return self.inside(self.path / ENV_DIR)  # start_job writes here: a symlinked env/ is refused

    @property
    def log(self) -> Path:
        return self.path / LOG_NAME

    def view_dir(self, name: str) -> Path:
        """A post-hoc view's directory (RUN/views/<what changed>/)."""
        return self.inside(self.path / VIEWS_DIR / name)

    def job_env(self, index: int) -> Path:
        return self.inside(self.env_dir / f"job{int(index):03d}.json")

    def kernel_path_env(self, sha: str) -> Path:
        return self.inside(self.env_dir / f"kernel_path-{sha[:12]}.json")

    def arm_dir(self, arm: str) -> Path:
        return self.inside(self.path / ARMS_DIR / safe_name(arm, "arm name", self.run_json))

    def arm_config(self, arm: str) -> Path:
        return self.inside(self.arm_dir(arm) / ARM_CONFIG)

    def store(self, arm: str, file: str) -> Path:
        return self.inside(self.arm_dir(arm) / safe_name(file, f"store file of arm {arm}", self.run_json))

    def tmp_files(self) -> list[Path]:
        """Writes cut short by a kill (atomic_write's temp files): never read, safe to delete. A link
        planted at such a name is one too (deleting a link leaves its target alone); a directory is not."""
        found = (p for p in self.path.glob(f"{ARMS_DIR}/*/.*.tmp-*") if self._is_inside(p.parent))
        return [p for p in found if stat.S_ISREG(p.lstat().st_mode) or stat.S_ISLNK(p.lstat().st_mode)]

    def inside(self, path: Path) -> Path:
        """`path` itself, once its resolved form (symlinks followed) is inside this run directory."""
        if not self._is_inside(path):
            raise StoreError(path, f"resolves outside the run directory {self.path} "
                             "(a symlink or '..'): refused")
        return path

    def _is_inside(self, path: Path) -> bool:
        return Path(path).resolve().is_relative_to(self.path.resolve())

    def is_run(self) -> bool:
        """Holds a run.json (of any kind: whether it is a readable one is RunIndex.load's to say)."""
        return os.path.lexists(self.run_json)

    def require(self) -> Self:
        """A run directory given on a command line: it must hold run.json."""
        if not self.is_run():
            raise StoreError(self.path, f"not a twinrun run directory (no {RUN_JSON})")
        return self
