"""The launchers (LAUNCHERS: local, submitit_local, slurm): where a run's job runs and how its settings
are checked. Adding a launcher is one entry here.

launcher.split=pair: one run is one job whose single process measures every arm unit by unit.
launcher.split=bins: each pending unit of a run is its own job (every arm of the unit inside it).
launcher.pack=N: N runs in one job, one process per run and per GPU (launchers/jobs.py: PackedJob).
Everything submitted at once (a sweep's points, or points × units) goes out as one SLURM job array
(launchers/submit.py); on SLURM's preemption or time-limit signal (USR2) a job requeues itself and
the next start resumes from its finished units (launchers/jobs.py); waiting follows each job through
its run directory and the scheduler (launchers/wait.py); launch.json records it (launchers/record.py).
"""

from collections.abc import Callable
from dataclasses import dataclass

from twinrun.errors import ConfigError
from twinrun.launchers.local import check_in_process, check_submitit, local_state
from twinrun.launchers.placement import SPLITS
from twinrun.launchers.slurm import check_slurm, fill_from_partition, slurm_state, unsafe_sbatch_knob
from twinrun.measures.kind import parse_device


@dataclass(frozen=True)
class Launcher:
    """One launcher: where its jobs run, how its settings are checked, how a job's state is told."""
    cluster: str | None  # submitit's cluster name; None: measured in the calling process, no job
    check: Callable[[dict], None]  # raises ConfigError naming the knob
    state: Callable[[dict], str] | None  # the state of a job record of launch.json

    @property
    def in_process(self) -> bool:
        return self.cluster is None


LAUNCHERS = {
    "local": Launcher(cluster=None, check=check_in_process, state=None),
    "submitit_local": Launcher(cluster="local", check=check_submitit, state=local_state),
    "slurm": Launcher(cluster="slurm", check=check_slurm, state=slurm_state),
}


def check_pack(launcher: dict) -> None:
    """launcher.pack: whole runs per job, one process (and one GPU) each."""
    pack, split = launcher.get("pack", 1), launcher.get("split", "pair")
    if type(pack) is not int or pack < 1:
        raise ConfigError("launcher.pack", pack, "must be an integer ≥ 1 (1: one job per run)")
    if pack == 1:
        return
    if LAUNCHERS[launcher["name"]].in_process:
        raise ConfigError("launcher.pack", pack, "packs runs into one SLURM job: use launcher=slurm (or "
                          "submitit_local); launcher=local measures in this process, run after run")
    if split != "pair":
        raise ConfigError("launcher.pack", pack, f"packs whole runs, launcher.split={split} splits one: "
                          "choose one of them")
    if 0 < launcher["gpus_per_node"] < pack:
        raise ConfigError("launcher.pack", pack, f"gives each run its own GPU, but launcher.gpus_per_node="
                          f"{launcher['gpus_per_node']}: ask for gpus_per_node={pack} (or 0 to run on CPUs)")


def check(launcher: dict, compiled: tuple[str, object] | None = None, sequential: str | None = None,
          device: tuple[str, str] | None = None) -> None:
    """Refuse launcher settings that cannot work, naming the knob (ConfigError: exit 2).

    compiled: (key, value) of the run's compile setting (the kind's compile_setting, e.g.
    ("probe.compile", "default")), None for a kind that never compiles. sequential: the noun of a kind
    whose units continue each other (training segments), which split=bins cannot place. device: (its
    key, its setting), e.g. ("probe.device", "cuda:1"): a submitted job must request the GPUs its device
    setting names. For SLURM, asks sinfo about the partition and its GPUs; call it before planning to
    fail early.
    """
    name = launcher["name"]
    if name not in LAUNCHERS:
        raise ConfigError("launcher.name", name, f"choose one of {', '.join(LAUNCHERS)}")
    split = launcher.get("split", "pair")
    if split not in SPLITS:
        raise ConfigError("launcher.split", split, "choose pair (one job per run) or bins (one job per bin)")
    if split == "bins" and sequential is not None:
        raise ConfigError("launcher.split", split, f"the run's {sequential}s are sequential (each "
                          f"starts from the weights the one before ends with), so they cannot run as one job "
                          f"per {sequential}; use launcher.split=pair (requeues resume from the last whole "
                          f"{sequential})")
    if split == "bins" and compiled is not None and compiled[1]:  # false/None: eager; "default": compiled
        # Concurrent elements would compile into one shared cache, each fingerprinting another cache
        # digest: every bin on its own kernel path, and the run refused as straddling.
        key, value = compiled
        raise ConfigError("launcher.split", split, f"cannot run with {key}={value!r}: "
                          "the bins' jobs would share one compile cache and land on different kernel "
                          f"paths; use launcher.split=pair, or {key}=false")
    if LAUNCHERS[name].cluster == "slurm":
        fill_from_partition(launcher)  # knobs left null, read from sinfo (in place: the job asks for them)
    check_pack(launcher)
    if LAUNCHERS[name].cluster != "slurm" and launcher.get("constraint") is not None:
        raise ConfigError("launcher.constraint", launcher["constraint"], f"launcher={name} runs on this "
                          "machine and would ignore it: remove it, or use launcher=slurm")
    bad = unsafe_sbatch_knob(launcher, trusted=True)
    if bad is not None:
        raise ConfigError(f"launcher.{bad[0]}", bad[1], "may hold only letters, digits and _.,:@%+=|&()[]*- "
                          "(it becomes a line of the sbatch script)")
    if device is not None and not LAUNCHERS[name].in_process:
        check_device_request(launcher, *device)
    LAUNCHERS[name].check(launcher)


def check_device_request(launcher: dict, key: str, setting: str) -> None:
    """What planning can know of a submitted job's device: the GPUs it requests. Whether they exist is
    the job's to say, on its node (the planning host, e.g. a SLURM login node, may have none)."""
    kind, index = parse_device(key, setting)
    gpus = launcher["gpus_per_node"]
    if kind == "cuda" and gpus < 1:
        raise ConfigError("launcher.gpus_per_node", gpus, f"{key}={setting} needs a GPU, and the job would "
                          f"request none: set launcher.gpus_per_node=1, or {key}=cpu")
    pack = launcher.get("pack", 1)
    if index is not None and index > 0 and pack > 1:  # each run of a pack sees its own GPU, as cuda:0
        raise ConfigError(key, setting, f"launcher.pack={pack} gives each run one GPU of the job, which it "
                          f"sees as cuda:0; use {key}=cuda (or auto)")
    if index is not None and index >= gpus:
        raise ConfigError(key, setting, f"the job requests launcher.gpus_per_node={gpus}, which it sees as "
                          f"cuda:0 to cuda:{gpus - 1}; use {key}=cuda (or auto), or request more GPUs")


def device_note(launcher: dict, key: str, setting: str) -> str | None:
    """What a plan says about a submitted job's device when the config leaves it to the job."""
    if LAUNCHERS[launcher["name"]].in_process or parse_device(key, setting)[0] != "auto":
        return None
    if launcher["gpus_per_node"] == 0:
        return (f"twinrun: {key}=auto with launcher.gpus_per_node=0: the job requests no GPU and will "
                "measure on the CPU")
    return None
