"""twinrun as a package: the wheel carries conf/ and the weights, and installed it runs from anywhere."""

import json
import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, TINY

# What a wheel is built from: the tracked files it packages (never a developer's build/ leftovers).
SOURCES = ["pyproject.toml", "README.md", "conf", "twinrun"]


def _pip(python: Path | str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, check=False, timeout=timeout, env=_clean_env())


def _clean_env() -> dict:
    """The environment without the checkout on the import path: an installed twinrun must stand alone."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the tracked sources, as a user building from a fresh clone would."""
    tracked = subprocess.run(["git", "ls-files", "-z", *SOURCES], cwd=REPO, capture_output=True,
                             check=True).stdout
    src = tmp_path_factory.mktemp("src")
    for rel in filter(None, tracked.decode().split("\0")):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    dist = tmp_path_factory.mktemp("dist")
    built = _pip(sys.executable, "wheel", "--no-deps", "-w", str(dist), str(src))
    assert built.returncode == 0, built.stderr[-2000:]
    (whl,) = dist.glob("twinrun-*.whl")
    return whl


def test_wheel_carries_every_config_and_the_weights(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"twinrun/conf/{p.relative_to(REPO / 'conf').as_posix()}"
               for p in (REPO / "conf").rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert "twinrun/conf/hydra/help/twinrun.yaml" in names
    assert "twinrun/weights/dit_digits.safetensors" in names
    assert not any(n.startswith(("conf/", "tests/", "examples/")) for n in names), "only the package ships"


def test_wheel_declares_the_twinrun_command(wheel):
    dist_info = next(n for n in zipfile.ZipFile(wheel).namelist()
                     if n.endswith(".dist-info/entry_points.txt"))
    entry_points = zipfile.ZipFile(wheel).read(dist_info).decode()
    assert "[console_scripts]" in entry_points and "twinrun = twinrun.__main__:main" in entry_points


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv (no site packages) with the wheel installed under constraints.txt's pins."""
    root = tmp_path_factory.mktemp("fresh")
    t0 = time.perf_counter()
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    done = _pip(python, "install", "-c", str(REPO / "constraints.txt"), str(wheel))
    assert done.returncode == 0, done.stderr[-2000:]
    # Measured on the 2-core dev box with pip's cache warm: about 70 s, most of it unpacking torch.
    print(f"fresh venv + wheel install: {time.perf_counter() - t0:.0f} s")
    elsewhere = root / "elsewhere"  # outside the checkout: nothing there but what the wheel installed
    elsewhere.mkdir()
    yield {"python": python, "bin": python.parent, "cwd": elsewhere}
    shutil.rmtree(root / "venv")  # 1.3 GB, most of it torch: pytest keeps its last three base temp dirs


def _run(installed: dict, *args: str, env: dict | None = None, exe: str | None = None):
    argv = [str(installed["bin"] / exe)] if exe else [str(installed["python"]), "-m"]
    return subprocess.run([*argv, *args], cwd=installed["cwd"], capture_output=True, text=True, check=False,
                          timeout=900, env={**_clean_env(), **(env or {})})


@pytest.mark.slow
def test_installed_wheel_runs_every_documented_command_from_anywhere(installed):
    imported = subprocess.run([str(installed["python"]), "-c",
                               "import twinrun.app; print(twinrun.app.CONF_DIR)"], cwd=installed["cwd"],
                              capture_output=True, text=True, check=True, env=_clean_env())
    conf_dir = Path(imported.stdout.strip())
    assert REPO not in conf_dir.parents and conf_dir.parts[-2:] == ("twinrun", "conf"), conf_dir

    t0 = time.perf_counter()
    run = _run(installed, "twinrun", "+experiment=pin_sigma", "hydra.run.dir=default")
    print(f"default experiment from the installed wheel: {time.perf_counter() - t0:.0f} s")
    assert run.returncode == 0, run.stderr[-2000:]
    run_dir = installed["cwd"] / "default"
    assert json.loads((run_dir / "summary.json").read_text())["checks_passed"] is True
    # every record names the twinrun that wrote it: a wheel has its version and no git checkout
    for record in ("summary.json", "run.json"):
        assert json.loads((run_dir / record).read_text())["twinrun"]["version"] == "0.1.0"
        assert json.loads((run_dir / record).read_text())["twinrun"]["commit"] is None
    assert "Written by twinrun 0.1.0 (no git checkout)." in (run_dir / "report.md").read_text()

    # The console command is `python -m twinrun`: same tiny run, same stores, bit for bit.
    tiny = [*TINY, "+experiment=pin_sigma"]
    by_module = _run(installed, "twinrun", *tiny, "hydra.run.dir=by_module")
    by_command = _run(installed, *tiny, "hydra.run.dir=by_command", exe="twinrun")
    assert by_module.returncode == by_command.returncode == 0, by_command.stderr[-2000:]
    diff = _run(installed, "twinrun.diff", "by_module/arms", "by_command/arms")
    assert diff.returncode == 0 and diff.stdout.startswith("bit-identical"), diff.stdout + diff.stderr

    for args in (["twinrun.reduce", "default"], ["twinrun.resume", "default"], ["twinrun.status", "default"],
                 ["twinrun.compare", "by_module", "by_command"], ["twinrun.env"]):
        done = _run(installed, *args)
        assert done.returncode == 0, f"{args}: {done.stderr[-2000:]}"

    byo = REPO / "examples" / "byo"
    own = _run(installed, "twinrun", "--config-dir", str(byo / "conf"), "+experiment=byo_bars",
               "hydra.run.dir=byo", env={"PYTHONPATH": str(byo)})
    assert own.returncode == 0, own.stderr[-2000:]
    help_text = _run(installed, "--help", exe="twinrun")
    assert help_text.returncode == 0 and "pin_sigma" in help_text.stdout and "schema/" not in help_text.stdout
