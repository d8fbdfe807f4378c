"""Experiment-tracker sinks of the publish step: `tracker=mlflow | wandb | tensorboard`.

Each sink is one module here, imported (through SINKS, by name) only when a run is published with it,
so twinrun never needs a tracker's package unless asked. What every sink logs is built once
(`payload`): the resolved config, the verdict and gates, the effects per σ bin with their SEs, the plots
and report as files, the kernel-path digest and run directory as tags, the native twin as the baseline.

A tracker is chosen by the user's own command (the config, or `reduce --tracker`), never read from a
run directory: its store lies outside the run, and a run directory is data written by a stranger.
Planning checks the tracker before any compute (package importable, store writable: `check_tracker`);
at publish time a sink that still fails is one line on stderr, after the run's own files are written,
and the exit code stays the reducer's.
"""

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from twinrun.arms import flatten
from twinrun.errors import ConfigError, StoreError
from twinrun.files import refuse_links_under
from twinrun.provenance.version import twinrun_version
from twinrun.storage.run_paths import DISTANCE_PNG, LOSS_PNG
from twinrun.storage.rundir import RunIndex


class Sink(NamedTuple):
    module: str  # the sink's module, imported at publish time
    packages: tuple[str, ...]  # what it needs installed (the `trackers` extra)


SINKS = {
    "mlflow": Sink("twinrun.publish.trackers.mlflow", ("mlflow", "sqlalchemy", "alembic")),
    "wandb": Sink("twinrun.publish.trackers.wandb", ("wandb",)),
    "tensorboard": Sink("twinrun.publish.trackers.tensorboard", ("tensorboard",)),
}
NONE = "none"
EXTRA_HINT = "pip install 'twinrun[trackers]'"
# Set before a sink's package is imported: no telemetry, no network, nothing in $HOME.
QUIET_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "WANDB_SILENT": "true",
             "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off",
             "WANDB_ERROR_REPORTING": "false", "TF_CPP_MIN_LOG_LEVEL": "2"}


# Set to 1 to see a tracker package's own log lines (MLflow's database migrations, W&B's notices).
VERBOSE_ENV = "TWINRUN_TRACKER_LOGS"
CHATTY_LOGGERS = ("mlflow", "alembic", "wandb", "tensorboard", "absl")


@contextlib.contextmanager
def quiet(name: str):
    """A tracker package's own output kept off the user's terminal while it logs (unless VERBOSE_ENV=1):
    its loggers raised to ERROR, and what it prints, at Python's level or the descriptors' (a helper
    process's), into a temporary file that is dropped. twinrun's own line says what was logged."""
    if os.environ.get(VERBOSE_ENV) == "1":
        yield
        return
    # Tracker packages log and print at length; twinrun prints its own one line of what was logged, so theirs
    # go to a file that is dropped.
    loggers = {n: logging.getLogger(n) for n in CHATTY_LOGGERS}
    levels = {n: lg.level for n, lg in loggers.items()}
    for lg in loggers.values():
        lg.setLevel(logging.ERROR)
    sys.stdout.flush()
    sys.stderr.flush()
    # At the descriptors too, not only sys.stdout: helper processes a tracker starts write to fd 1 and 2
    # directly. The saved descriptors put the terminal back whatever the tracker raised.
    saved = [os.dup(1), os.dup(2)]
    try:
        with tempfile.TemporaryFile() as sink, open(os.dup(sink.fileno()), "w") as text, \
                contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                text.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)
        for n, lg in loggers.items():
            lg.setLevel(levels[n])


def writable_dir(path: Path) -> None:
    """Create the directory and a file in it, or raise OSError: a store that cannot be written fails
    here at once (MLflow's SQLite store retries an unopenable database for about 100 s, and W&B falls
    back to /tmp/wandb while reporting success)."""
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".twinrun-probe-"):
        pass


def check_tracker(tracker: dict) -> dict | None:
    """The tracker settings of the user's config, checked before any compute (ConfigError, exit 2):
    a known name, its packages importable, its store writable. None for tracker=none."""
    name = tracker.get("name", NONE)
    if name == NONE:
        return None
    if name not in SINKS:
        raise ConfigError("tracker", name, f"choose one of {NONE}, {', '.join(SINKS)}")
    missing = [p for p in SINKS[name].packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError("tracker", name, f"needs the package{'s' * (len(missing) > 1)} "
                          f"{', '.join(missing)}: {EXTRA_HINT}, or tracker={NONE}")
    store = Path(tracker.get("dir") or Path("outputs") / name).expanduser().resolve()
    try:
        writable_dir(store)
    except OSError as err:
        raise ConfigError("tracker.dir", str(store), f"cannot be written ({err.strerror or err}); choose a "
                          "writable directory") from None
    try:  # a link planted in the store: refused before any compute, and again before each publish
        refuse_links_under(store, f"{name} store")
    except StoreError as err:
        raise ConfigError("tracker.dir", str(store), f"{err}; or choose a fresh directory") from None
    return {"name": name, "dir": str(store), "project": str(tracker.get("project") or "twinrun")}


# A probe's σ on the integer step axis of MLflow and TensorBoard: σ in millionths (σ = 0.5 is step
# 500000), so the x axis is σ itself, runs with other grids overlay at the same σ, and no two bins of a
# grid coarser than 1e-6 share a step; W&B plots against the logged `sigma` itself (define_metric).
SIGMA_STEP_SCALE = 1_000_000


@dataclass
class Payload:
    """What every sink logs of one reduced run, as plain data.

    Keys are shared across runs: what each arm has of its own (a probe's debiased |μ|² `norm2/<estimand>`,
    a training run's `loss/train`, `loss/heldout`) is logged under the same key in the twin's rows and the
    intervention's (`arm_steps`), so a tracker's run comparison overlays them; what compares the two
    (effects, distances, the floor, the gates) is in `steps`, logged with the intervention."""

    name: str  # the run directory's name: the tracker's run name
    run_dir: str
    arm: str  # the intervention arm's name
    baseline: str  # the native twin's
    config: dict  # the intervention arm's resolved config
    params: dict[str, str]  # the same, flattened (key: its text)
    tags: dict[str, str]  # run directory, kernel path, verdict, twinrun version
    verdict: dict[str, bool]  # passed, checks_passed (the gates are per-unit metrics: `gate/<name>`)
    steps: list[dict] = field(default_factory=list)  # the comparison, one row per unit: effects, gates
    baseline_steps: list[dict] = field(default_factory=list)  # the twin's own quantities
    files: list[Path] = field(default_factory=list)  # summary.json, report.md, the plots
    # The row field that is the step axis (the kind's tracker_step): a training run's optimizer step
    # ("step"), so its curves line up with the researcher's own training logs; a probe's σ ("sigma", in
    # millionths: SIGMA_STEP_SCALE); None: the row's index.
    step_key: str | None = "sigma"
    arm_steps: list[dict] = field(default_factory=list)  # the intervention arm's own, keys as the twin's

    def step_of(self, row: dict, i: int) -> int:
        if self.step_key is None:
            return i
        value = row[self.step_key]
        return round(float(value) * SIGMA_STEP_SCALE) if self.step_key == "sigma" else int(value)

    def logged(self, rows: list[dict]) -> list[tuple[int, dict]]:
        """(the tracker's step, row) for each row, by increasing step (as W&B requires)."""
        return sorted(((self.step_of(row, i), row) for i, row in enumerate(rows)), key=lambda pair: pair[0])

    def arm_rows(self) -> list[dict]:
        """The intervention run's rows: its own quantities and the comparison, merged by unit."""
        if self.step_key is None:
            return [{**mine, **row} for mine, row in zip(self.arm_steps, self.steps)] or self.steps
        return merge_rows(self.step_key, self.arm_steps + self.steps)

    def after_last_step(self) -> int:
        """A step past every row's: where a sink logs what belongs to the whole run (the plots)."""
        return max((step for step, _ in self.logged(self.arm_rows())), default=-1) + 1


def _kernel_paths(index: RunIndex) -> str:
    paths = {e.get("kernel_path_sha256") for u in index.units for e in u["stores"].values()} - {None}
    return ",".join(sorted(paths))


def merge_rows(key: str, rows: list[dict]) -> list[dict]:
    """Rows with the same step field as one row (a tracker takes one row per step)."""
    merged: dict = {}
    for row in rows:
        merged.setdefault(row[key], {}).update(row)
    return list(merged.values())


def _gate_key(g: dict, unit_key: str) -> str:
    """A gate's verdict name, for a kind whose rows have no step field: gate/<estimand, else arm>/<the kind's
    unit key><value>."""
    return f"gate/{g.get('estimand', g.get('arm'))}/{unit_key}{g[unit_key]:g}"


def _gate_rows(summary: dict, key: str) -> list[dict]:
    """One metric per gate, stepped by unit: `gate/<estimand>` at a probe's gate σ, `gate/<arm>` at each
    of a training run's stored steps (1 passed, 0 not)."""
    return [{key: g[key], f"gate/{g['estimand'] if 'estimand' in g else g['arm']}": float(g["passed"])}
            for g in summary["gates"]]


def payload(index: RunIndex, summary: dict, files: list[Path], kind) -> Payload:
    """The payload of one registered reduction (its summary, as summary.json holds it), its rows as its
    measurement `kind` reads them (twinrun/measures/kind.py: tracker_rows, tracker_step, unit_key):
    (the comparison's rows, the twin's own[, the intervention's own, under the twin's keys])."""
    rd = index.run_dir
    arm, twin = index.arm("intervention")["name"], index.arm("twin")["name"]
    config = index.arm_config(arm)  # held to run.json's config_hash: the params are the measured config
    version = twinrun_version()
    verdict = {"passed": bool(summary["passed"]), "checks_passed": bool(summary["checks_passed"])}
    tags = {"twinrun.run_dir": str(rd.path.resolve()), "twinrun.kernel_path": _kernel_paths(index),
            "twinrun.verdict": "valid" if summary["passed"] else "instrument broken",
            "twinrun.version": version["version"], "twinrun.commit": str(version["commit"]),
            "twinrun.arm": arm, "twinrun.baseline": twin}
    steps, base, mine = (*kind.tracker_rows(index, summary), [])[:3]
    if kind.tracker_step == kind.unit_key:  # the gates as metrics of their own, at their unit's step
        steps = merge_rows(kind.unit_key, steps + _gate_rows(summary, kind.unit_key))
    else:
        verdict.update({_gate_key(g, kind.unit_key): bool(g["passed"]) for g in summary["gates"]})
    params = {k: str(v) for k, v in flatten(config).items()}
    plots = [rd.path / LOSS_PNG, rd.path / DISTANCE_PNG]  # a training run's (the probe's effect.png is given)
    shown = list(dict.fromkeys(Path(f) for f in [*files, *plots]))
    return Payload(rd.path.name, str(rd.path), arm, twin, config, params, tags, verdict, steps, base,
                   [f for f in shown if f.is_file()], kind.tracker_step, mine)


def send(tracker: dict | None, index: RunIndex, summary: dict, files: list[Path], kind) -> bool:
    """Log one reduced run to the tracker (checked settings, check_tracker's), its rows as its `kind` reads
    them (twinrun/measures/kind.py); True if it was logged.
    A failure is one line on stderr: the run directory is already complete and stays the record."""
    if tracker is None:
        return False
    name = tracker["name"]
    try:
        store = Path(tracker["dir"])
        writable_dir(store)
        refuse_links_under(store, f"{name} store")  # before the tracker's package opens a file in it
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
        sink = importlib.import_module(SINKS[name].module)
        with quiet(name):
            where = sink.log(payload(index, summary, files, kind), store, tracker["project"])
    except (Exception, SystemExit) as err:  # noqa: BLE001 — a tracker is foreign code; its failure is one line
        said = " ".join(str(err).split())[:300] or type(err).__name__
        print(f"twinrun: warning: tracker={name} did not log {index.run_dir.path} ({type(err).__name__}: "
              f"{said}); the run directory is complete and stays the record", file=sys.stderr, flush=True)
        return False
    print(f"twinrun: logged to {name}: {where}", flush=True)
    return True
