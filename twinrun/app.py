"""The Hydra app: `python -m twinrun +experiment=pin_sigma [overrides]` (add `-m` to sweep).

Each run (each sweep point) is planned here: validated, its twin derived, its configs written.
With launcher=local it is then measured and reduced in this process; with submitit_local/slurm
it is submitted (a sweep as one job array), waited for, and reduced here. The process exits
with the reducer's code (0 ok, 1 a gate/check failed, 2 bad input), the worst over a sweep.
A sweep's state lives in its Hydra callback (SweepCallback, registered in conf/hydra/callbacks/).
"""

import functools
import io
import logging
import os
import re
import secrets
import shlex
import sys
import traceback
from pathlib import Path

import hydra
from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twinrun.config import TwinrunConfig, register_configs
from twinrun.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    ConfigError,
    Interrupted,
    TwinrunError,
    fail,
    raise_on_signals,
    raise_signal_in,
    signal_first,
)
from twinrun.files import refuse_links
from twinrun.job import warn_once
from twinrun.measures.registry import load_index, measure_names
from twinrun.pipeline import Point, check_launcher, run_point, submit_sweep
from twinrun.plan import plan_run
from twinrun.publish.sweep import write_sweep_summary
from twinrun.run_log import tee_output
from twinrun.storage.rundir import RunDir
from twinrun.storage.sweepdir import expand_sweep


def _conf_dir() -> Path:
    """twinrun's Hydra configs: inside the installed package, or conf/ beside it in a checkout."""
    # A wheel (pip install .) ships conf/ as twinrun/conf (pyproject's package-dir); a checkout or
    # an editable install keeps it at the top of the repository, next to twinrun/.
    here = Path(__file__).resolve().parent
    installed = here / "conf"
    return installed if (installed / "config.yaml").is_file() else here.parent / "conf"


CONF_DIR = _conf_dir()

# Whether the Hydra task started (to tell Hydra's own config errors from ours) and the stderr held
# until then: the process's, not a sweep's (a sweep's state is its SweepCallback's).
_state = {"task_started": False, "held_stderr": None}


@functools.cache
def _unique() -> str:
    # Hydra's ${now:} has one-second resolution: two runs started in the same second would share
    # a directory (Hydra #2925). A per-process random suffix keeps them apart.
    return secrets.token_hex(3)


@functools.cache
def _config_groups() -> str:
    """`--help`'s list of choices: Hydra's groups minus its own and the typed schema/* ones.

    Hydra resolves its own config (help template included) on every run, and listing the groups
    walks the whole search path: seconds of CPU that only `--help` needs."""
    if not {"--help", "-h"} & set(sys.argv[1:]):
        return "(listed by --help)"

    def chosen_by_users(group: str) -> bool:
        return not group.startswith(("hydra/", "schema/")) and group not in ("hydra", "schema")

    return GlobalHydra.instance().hydra.format_config_groups(chosen_by_users)


def reproduce_command() -> str:
    """The command that measures this run afresh, into a new run directory (resuming is twinrun.resume's)."""
    hc = HydraConfig.get()
    # --config-dir (bring your own) is not an override; without it the user's configs would not compose.
    config_dirs = [os.path.abspath(s.path.removeprefix("file://")) for s in hc.runtime.config_sources
                   if s.provider == "command-line"]
    overrides = [o for o in hc.overrides.task if not o.lstrip("+~").startswith("hydra.")]
    args = [*(arg for d in config_dirs for arg in ("--config-dir", d)), *overrides]
    return " ".join(["python -m twinrun", *map(shlex.quote, args)])


def _task(cfg: DictConfig) -> Point:
    _release_stderr()
    hc = HydraConfig.get()
    sweeping = hc.mode == RunMode.MULTIRUN
    run_dir = Path(hc.runtime.output_dir)
    try:
        with signal_first():
            refuse_unknown_additions(list(hc.overrides.task), set(hc.runtime.choices))
            with tee_output(run_dir / f"{hc.job.name}.log"):
                point = run_point(cfg, run_dir, reproduce_command(), sweeping)
    except Interrupted as err:
        discard_unplanned(run_dir)  # cut short while planning: nothing stays; once planned, it resumes
        if not sweeping and not RunDir(run_dir).is_run():  # no run to resume: say so, not "resume with"
            raise Interrupted(err.exit_code, "nothing was planned") from None
        raise
    except TwinrunError as err:
        discard_unplanned(run_dir)
        if not sweeping:
            fail(err)
        print(f"twinrun: error: {run_dir}: {err}", file=sys.stderr)
        point = Point(run_dir, err.exit_code, None, ())
    if not sweeping:
        raise SystemExit(point.code)
    return point


def _release_stderr() -> None:
    _state["task_started"] = True
    if _state["held_stderr"] is not None:
        _state["held_stderr"].release()
        _state["held_stderr"] = None


def _loud(method):
    """Hydra turns an exception in a callback into a warning and carries on: an unexpected one must
    instead end the process as an uncaught exception would (its traceback, exit 1)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 — re-raised as the exit below, after the traceback
            raise_signal_in(err)  # unless a signal's unwinding became it: then the signal ends the run
            traceback.print_exc()
            raise SystemExit(1) from None

    return wrapper


# What Hydra writes into a run directory before the task starts, each opened in place (following links).
HYDRA_RECORDS = (".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


class SweepCallback(Callback):
    """One sweep (`python -m twinrun -m ...`), held by Hydra for its duration: every point validated
    before the first runs; the points a submitit launcher defers go out as one job array at the end;
    then the sweep summary, and the process exits with the worst point's code. For a single run, it
    checks the run directory before Hydra writes into it."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.deferred: list[Point] = []

    @_loud
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        """An existing run directory (resumed by the original command) is a stranger's: Hydra would write its
        records and the job log through a link planted at their names, so one is refused first."""
        run_dir = Path(str(config.hydra.run.dir))
        if not os.path.isdir(run_dir):
            return  # a new directory: Hydra makes it (a name it cannot make is one line, `_cannot_create`)
        try:
            refuse_links([run_dir / name for name in (*HYDRA_RECORDS, f"{config.hydra.job.name}.log")])
        except TwinrunError as err:
            _release_stderr()
            fail(err)

    @_loud
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _release_stderr()
        try:
            points = expand_sweep(sweep_overrides(config))
            check_sweep(points, set(config.hydra.runtime.choices), Path(config.hydra.sweep.dir))
        except TwinrunError as err:
            fail(err)  # nothing was written yet: Hydra makes the sweep directory when the jobs start
        if config.launcher.name != "local":
            # Hydra's own launcher plans each point in this process and says "Launching N jobs locally"
            # just before twinrun submits them as one job array: say what happens instead, once.
            logging.getLogger(HYDRA_LAUNCHER_LOG).setLevel(logging.WARNING)
            pack = int(config.launcher.get("pack", 1) or 1)
            jobs = -(-len(points) // pack)  # packs of `pack` runs, the last one may hold fewer
            packs = (f"one job of {len(points)} runs" if jobs == 1 else
                     f"one job array of {jobs} jobs, up to {pack} runs each")
            each = "each with launcher.cpus_per_task CPUs and mem_gb of its own: the job asks for pack × each"
            how = f"as {packs} (launcher.pack={pack}, one process a run, {each})" if pack > 1 else \
                "as one job array"
            if len(points) == 1:  # a lone run is a plain pair job (placement.place), packed or not
                how = "as one job"
            print(f"twinrun: planning {len(points)} sweep points here; launcher={config.launcher.name} then "
                  f"submits them together, {how}", flush=True)

    @_loud
    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        point = job_return.return_value  # a point's task never raises in a sweep (errors become codes)
        if point.code is None:
            self.deferred.append(point)
        else:
            self.codes.append(point.code)

    @_loud
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        launcher = self.deferred[0].launcher if self.deferred else None
        if self.deferred:
            try:
                self.codes.append(submit_sweep(self.deferred, sweep_dir))
            except TwinrunError as err:
                fail(err)
        if launcher is None or launcher["wait"]:
            write_sweep_summary(sweep_dir, load_index)
        raise SystemExit(max(self.codes or [EXIT_OK]))


HYDRA_LAUNCHER_LOG = "hydra._internal.core_plugins.basic_launcher"


def sweep_overrides(config: DictConfig) -> list[str]:
    """Every override the sweep expands, as Hydra's basic sweeper gathers them: `hydra.sweeper.params`
    (a YAML file's sweep) first, then the command line's, which win on the same key."""
    params = config.hydra.sweeper.get("params") or {}
    return [*(f"{k}={v}" for k, v in params.items()), *config.hydra.overrides.task]


def refuse_unknown_additions(overrides: list[str], groups: set[str]) -> None:
    """`+key=value` adds a key even where the schema has none (Hydra lifts the struct flag for `+`),
    so `+probe.n_draw=100` would be silently ignored: refuse a key the schema does not declare,
    listing the keys it does. Config groups (`+experiment=...`) and free-form nodes (the model's,
    data's and intervention's own builder arguments, launcher.additional_parameters) stay open."""
    schema = OmegaConf.structured(TwinrunConfig)
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.key_or_group
        if not o.is_add() or key in groups or o.package is not None:
            continue
        node = schema
        for part in key.split("."):
            if not isinstance(node, DictConfig) or node._is_missing() or OmegaConf.get_type(node) is dict:
                break  # a free-form node: its keys are its builder's business
            if part not in node:
                where = key.rpartition(".")[0] or "the root config"
                raise ConfigError(f"+{key}", o.value(), f"{where} has no key {part!r} (a typo?); its keys "
                                  f"are {', '.join(node.keys())}; override an existing key without '+'")
            node = node._get_node(part)


def check_sweep(points: list[list[str]], choices: set[str], sweep_dir: Path | None = None) -> None:
    """Every point of the sweep validated (planned dry) before the first one runs: a bad point is
    one line naming its overrides, and nothing has been measured. The points share one launcher
    config: a submitit sweep goes out as one job array. Paths and free space are judged where the
    sweep will write (sweep_dir), not where the command was started."""
    launchers = []
    for number, overrides in enumerate(points):
        try:
            refuse_unknown_additions(list(overrides), choices)
            cfg = _compose(list(overrides))
            launchers.append(check_launcher(cfg))
            plan_run(cfg, sweep_dir, dry_run=True)
        except TwinrunError as err:
            raise TwinrunError(f"sweep point {number} ({' '.join(overrides)}): {err}; "
                               "nothing was run") from None
        if launchers[-1] != launchers[0]:
            raise TwinrunError(f"sweep point {number} ({' '.join(overrides)}): launcher.*: a sweep is "
                               "submitted as one job array, so every point must share one launcher config; "
                               "sweep the experiment, not the launcher; nothing was run")
    if points:
        print(f"twinrun: all {len(points)} sweep points validated", flush=True)


def _compose(overrides: list[str]) -> DictConfig:
    """One sweep point's config; Hydra's refusal (a typo'd key, a bad type or option in a YAML file's
    `hydra.sweeper.params`, which Hydra composes only when the point runs) as one line."""
    try:
        return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        said = [line.strip() for line in str(err).splitlines() if line.strip()]
        cause = err.__cause__
        why = f" ({str(cause).splitlines()[0]})" if cause is not None and str(cause) else ""
        raise TwinrunError(f"{said[0] if said else type(err).__name__}{why}") from None


def discard_unplanned(run_dir: Path,
                      own_files=(".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")):
    """A rejected config leaves nothing on disk: remove the directory Hydra made for it (a run's or a
    sweep's), if it holds nothing twinrun wrote (no run.json) but Hydra's own record and empty logs."""
    rd = RunDir(run_dir)
    if rd.run_json.exists() or not rd.path.is_dir():
        return
    hydra_files = [rd.path / n for n in own_files]
    logs = [p for p in rd.path.glob("*.log") if p.is_file() and p.stat().st_size == 0]
    for path in hydra_files + logs:
        path.unlink(missing_ok=True)
    # The date folder of Hydra's default layout (outputs/runs/DATE/) goes too when empty; a parent the
    # user chose (hydra.run.dir=SOMEWHERE/NAME) is theirs and stays.
    dated = rd.path.parent.parent.name in ("runs", "sweeps")
    for folder in (rd.path / ".hydra", rd.path, *([rd.path.parent] if dated else [])):
        if not folder.exists():
            continue
        try:
            folder.rmdir()  # only if empty: anything else stays
        except OSError:
            return


class _HeldStderr:
    """Holds what is written to stderr until the task starts: Hydra's own composition errors come
    as several lines and a hint about HYDRA_FULL_ERROR; twinrun shows them as one line."""

    NOISE = ("Set the environment variable HYDRA_FULL_ERROR", "full_key:", "reference_type=", "object_type=",
             "To append to your config use")

    def __init__(self):
        self.buffer, self.real = io.StringIO(), None

    def __enter__(self):
        self.real, sys.stderr = sys.stderr, self.buffer
        return self

    def __exit__(self, *exc):
        self.release()

    def release(self) -> None:
        """Restore stderr; what was held is passed on unless it is reported as one line instead."""
        if self.real is not None:
            sys.stderr, self.real = self.real, None
            if _state["task_started"]:
                sys.stderr.write(self.buffer.getvalue())

    def one_line(self) -> str:
        text = self.buffer.getvalue().partition("Config search path:")[0]
        cannot = self._cannot_create(text)
        if cannot is not None:
            return cannot
        if "Traceback (most recent call last):" in text:
            # An error Hydra did not expect comes with its traceback: its last line says what happened.
            text = [ln for ln in text.splitlines() if ln.strip() and not ln[:1].isspace()][-1]
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        kept = [ln for ln in lines if not ln.startswith(self.NOISE)]
        hint = "check the key against `python -m twinrun --cfg job`; `--help` lists the config groups"
        if any("hydra.sweeper.params" in a for a in sys.argv[1:]):
            hint = ("on the command line a sweep is a comma list (`-m key=a,b`); hydra.sweeper.params is for "
                    "a YAML file (`hydra: {sweeper: {params: {key: a,b}}}`)")
        return f"{'; '.join(kept) or 'Hydra could not compose the config'} (hint: {hint})"

    @staticmethod
    def _cannot_create(text: str) -> str | None:
        """Hydra failing to make the run (or sweep) directory: the directory and why, as one line, instead
        of its flattened traceback and a hint about config keys that has nothing to do with it."""
        found = re.findall(r"^\w*Error: \[Errno \d+\] ([^:\n]+): '([^'\n]*)'$", text, re.MULTILINE)
        if "in mkdir" not in text or not found:
            return None
        why, path = found[-1]  # the innermost: the first directory of the path that cannot be made
        key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(sys.argv[1:]) else "hydra.run.dir"
        return (f"{key}: cannot create {path} ({why}); choose a directory whose parent you can write, "
                f"each name at most 255 bytes ({key}=...)")


MODES = ({"-m", "--multirun"}, {"-c", "--cfg"})


def refuse_mixed_modes(argv: list[str]) -> None:
    """Hydra takes one of --multirun and --cfg and raises a traceback on both: one line, exit 2."""
    flags = {a.partition("=")[0] for a in argv}
    if all(flags & mode for mode in MODES):
        fail(TwinrunError("--cfg with -m: Hydra prints the config of one run, not of a sweep; drop -m and "
                          "give one point's values (e.g. intervention.sigma_pin=0.5 --cfg job)"))


def main() -> None:
    refuse_mixed_modes(sys.argv[1:])
    register_configs()
    if not OmegaConf.has_resolver("twinrun.unique"):
        OmegaConf.register_new_resolver("twinrun.unique", _unique)
    if not OmegaConf.has_resolver("twinrun.config_groups"):
        OmegaConf.register_new_resolver("twinrun.config_groups", _config_groups)
    if not OmegaConf.has_resolver("twinrun.measures"):
        OmegaConf.register_new_resolver("twinrun.measures", lambda: ", ".join(measure_names()))
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_task)
    raise_on_signals()
    warn_once()
    held = _HeldStderr()
    _state["held_stderr"] = held
    try:
        with held:
            app()
    except KeyboardInterrupt:
        fail(Interrupted(EXIT_INTERRUPTED))
    except Interrupted as err:  # before the task (Hydra composing, a sweep's checks) nothing was written
        fail(err if _state["task_started"] else Interrupted(err.exit_code, "nothing was started"))
    except SystemExit as exc:
        # Hydra reports a config it cannot compose (typo'd key, bad type, unknown option) in several
        # lines with exit 1, which twinrun reserves for a failed gate: one line, bad input.
        if exc.code == 1 and not _state["task_started"]:
            print(f"twinrun: error: {held.one_line()}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
        raise
