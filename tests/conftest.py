import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from twinrun.app import CONF_DIR
from twinrun.config import register_configs

REPO = Path(__file__).resolve().parent.parent

# Every run a test makes measures on the CPU unless the test names its device: on a GPU box
# probe.device=auto would move it to CUDA, where its expected bits and timings do not hold. Runs made
# by `run_twinrun` and configs made by `compose_cfg` get this override unless they set probe.device.
CPU = "probe.device=cpu"


def pin_device(overrides) -> list[str]:
    """The overrides with probe.device=cpu added, unless they already choose a device."""
    overrides = list(overrides)
    chosen = any(o.lstrip("+~").startswith("probe.device=") for o in overrides)
    return overrides if chosen else [*overrides, CPU]


# A run small enough for a unit test: 3 bins, 8 images x 2 draws, 4 folds.
TINY = [
    "probe.n_images=8",
    "probe.n_draws=2",
    "probe.n_folds=4",
    "sigma_grid.sigmas=[0.2,0.5,1.2]",
]


@pytest.fixture
def compose_cfg():
    """Compose the real conf/ with overrides, as `python -m twinrun` would."""
    register_configs()

    def _compose(overrides=()):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=pin_device(overrides))

    return _compose


def run_twinrun(args, cwd, module="twinrun", timeout=600, env=None):
    """`python -m twinrun ...` in a subprocess; returns CompletedProcess (text). A run measures on the
    CPU unless its args choose probe.device (`pin_device`)."""
    if module == "twinrun":
        args = pin_device(args)
    full_env = {**os.environ, **(env or {})}
    if env and "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):  # keep a worktree's twinrun first
        full_env["PYTHONPATH"] = os.pathsep.join([os.environ["PYTHONPATH"], env["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=timeout, env=full_env)


def start_twinrun(args, cwd, env=None) -> subprocess.Popen:
    """`python -m MODULE ARGS` (args[0] the module) started, not waited for, stdout and stderr as one
    text stream; a run is device-pinned as run_twinrun pins it, so its config hash is a reference's."""
    if args[0] == "twinrun":
        args = ["twinrun", *pin_device(args[1:])]
    return subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def slow_fsync_env(folder: Path, sleep_s: float) -> dict:
    """Test-side fault injection (no hook in twinrun): an env whose sitecustomize makes every fsync of the
    child sleep first, so a store's temporary file sits half-committed long enough to be killed mid-write.
    The caller's PYTHONPATH (a worktree's twinrun) stays after the injection."""
    folder.mkdir(parents=True)
    (folder / "sitecustomize.py").write_text(
        f"import os, time\n_fsync = os.fsync\n\n\ndef _slow_fsync(fd):\n    time.sleep({sleep_s!r})\n"
        "    _fsync(fd)\n\n\nos.fsync = _slow_fsync\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}



def kill_when(proc: subprocess.Popen, condition, timeout_s: float = 120) -> None:
    """SIGKILL a started run the moment `condition()` holds (polled every 5 ms); it must not finish first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"finished before the kill point:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "kill point never reached"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def resumes_killed_at_random(run_dir: Path, cwd: Path, env: dict, rng: random.Random, kills: int,
                             wait_s: tuple[float, float]) -> tuple[list[str], subprocess.CompletedProcess]:
    """`twinrun.resume RUN` killed `kills` times after a random wait in `wait_s` (start-up, mid-unit,
    mid-write: wherever it lands), then one resume left to finish: (the killed ones' outputs, the last)."""
    outputs = []
    for _ in range(kills):
        proc = start_twinrun(["twinrun.resume", str(run_dir)], cwd, env)
        time.sleep(rng.uniform(*wait_s))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        outputs.append(proc.stdout.read())
    return outputs, run_twinrun([str(run_dir)], cwd=cwd, module="twinrun.resume")


# ----------------------------------------------------------------------------- launching (SLURM, submitit)

SLURM_UP = REPO / "launch" / "slurm-up.sh"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A usable SLURM partition: starts the local cluster (idempotent) when we are root."""
    import shutil

    if os.geteuid() != 0:
        if shutil.which("sbatch") is None:
            pytest.skip("no SLURM here and not root, so launch/slurm-up.sh cannot install one")
        return {"partition": "debug"}  # somebody else's cluster: we cannot (and need not) start it
    # first run installs ~28 Debian packages (16 s here, debs cached); later runs take 0.1-2 s
    subprocess.run(["bash", str(SLURM_UP)], check=True, timeout=600)
    return {"partition": "debug"}


@pytest.fixture(scope="session")
def model_args(tmp_path_factory) -> list[str]:
    """Overrides choosing the denoiser: the committed weights, or a random-init stand-in until they exist."""
    import torch

    from twinrun.model import DEFAULT_ARCH, DEFAULT_WEIGHTS_PATH, DiTDenoiser, save_pretrained

    if DEFAULT_WEIGHTS_PATH.is_file():
        return []
    path = tmp_path_factory.mktemp("weights") / "random_dit.safetensors"
    model = DiTDenoiser(**DEFAULT_ARCH, sigma_data=0.75)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    save_pretrained(model, path, {"note": "random init: a stand-in for tests"})
    return [f"model.path={path}"]


def measured(run_dir):
    """Every store of a run as {relative path: (sums bytes, metadata without provenance)}.

    Provenance (pid, host, boot, job ids) legitimately differs between two processes; the
    measured tensor and everything else in the store must not.
    """
    from twinrun.storage.store import read_store

    out = {}
    for path in sorted(Path(run_dir).glob("arms/*/*.safetensors")):
        store = read_store(path)
        meta = {k: v for k, v in store.meta.items() if k != "env"}
        out[path.relative_to(run_dir).as_posix()] = (store.sums.numpy().tobytes(), meta)
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One finished tiny run of the default experiment, shared by the session; copy it before changing it."""
    root = tmp_path_factory.mktemp("tiny_run")
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "run"


def cli(main, argv, capsys) -> tuple[int, str, str]:
    """An entry point in process: its exit code and output; any exception but SystemExit fails the test."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
