"""A replay on the machine that measured its source run loads the C++ libraries Inductor built for that
run instead of compiling them again, and takes them only from a cache that is this user's alone.

The signal is the C++ compiler itself: every run here compiles through a wrapper (`CXX`, which Inductor
reads) that appends each invocation to a log and then runs g++. A library Inductor builds is one
invocation whose `-o` names `<key>.so`; a library it loads from its cache is none. Timing is no signal:
on a loaded machine a reused library and a rebuilt one can take the same wall time."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_twinrun

from twinrun.errors import EXIT_OK

SMALL = ["+experiment=pin_sigma", "probe.n_images=8", "probe.n_draws=2", "probe.n_folds=4",
         "sigma_grid.sigmas=[0.2,0.5]", "probe.compile=default"]
LOG_ENV = "TWINRUN_TEST_CXX_LOG"


def compiler_wrapper(folder: Path) -> Path:
    """An executable named g++ (Inductor picks gcc's flags by the name) that logs its arguments, one
    invocation a line, to $TWINRUN_TEST_CXX_LOG and runs the real g++ with them."""
    real = shutil.which("g++")
    if real is None:
        pytest.skip("no g++ on this machine: Inductor cannot compile for the CPU")
    folder.mkdir()
    wrapper = folder / "g++"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "${LOG_ENV}"\nexec {shlex.quote(real)} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def built_libraries(log: Path) -> set[str]:
    """The `.so` files the C++ compiler wrote, by name (`<key>.so`), from the wrapper's log."""
    if not log.is_file():
        return set()
    built = set()
    for line in log.read_text().splitlines():
        args = line.split()
        built.update(Path(args[i + 1]).name for i, a in enumerate(args[:-1])
                     if a == "-o" and args[i + 1].endswith(".so"))
    return built


def cache_libraries(compile_cache: Path, run: Path) -> set[str]:
    """The `.so` files in the run's own Inductor cache (twinrun's, under compile_cache/runs/), by name."""
    (home,) = [h for h in (compile_cache / "runs").iterdir()
               if str(run.resolve()) in (h / "twinrun-run-cache.txt").read_text()]
    return {p.name for p in (home / "inductor").glob("*/*.so")}


@pytest.mark.slow
def test_a_replay_here_loads_its_source_s_libraries_and_never_ones_others_could_write(tmp_path):
    wrapper = compiler_wrapper(tmp_path / "bin")
    shared = tmp_path / "compile"  # one determinism.compile_cache_dir, as on one machine

    def run(name: str, *extra: str):
        log = tmp_path / f"{name}.cxx.log"
        t0 = time.perf_counter()
        proc = run_twinrun([*SMALL, f"determinism.compile_cache_dir={shared}",
                            f"hydra.run.dir={tmp_path / name}", *extra], cwd=tmp_path, timeout=2400,
                           env={"CXX": str(wrapper), LOG_ENV: str(log)})
        print(f"{name}: exit {proc.returncode} after {time.perf_counter() - t0:.0f} s, "
              f"{len(built_libraries(log))} libraries built")
        assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
        (job,) = json.loads((tmp_path / name / "run.json").read_text())["jobs"]
        pin = json.loads((tmp_path / name / "env" / "job000.json").read_text())["kernel_pin"]
        return tmp_path / name, proc, job, pin, built_libraries(log)

    def bit_identical(a: Path, b: Path) -> bool:
        diff = subprocess.run([sys.executable, "-m", "twinrun.diff", str(a / "arms"), str(b / "arms")],
                              capture_output=True, text=True, check=False)
        return diff.returncode == 0

    source, _, _, _, source_built = run("source")
    assert source_built, "the source run compiled no C++: nothing to reuse, the test shows nothing"
    assert source_built <= cache_libraries(shared, source)

    # Replayed here: certified, the source's bits, and not one of the source's libraries built again.
    replay, proc, job, pin, replay_built = run("replay", f"determinism.kernel_path_from={source}")
    assert job["kernel_pin"]["pinned"] is True and f"kernel path pinned from {source}" in proc.stdout
    assert bit_identical(source, replay)
    assert pin["libraries_reused"]["libraries"] >= len(source_built)
    assert replay_built.isdisjoint(source_built), sorted(replay_built & source_built)
    assert source_built <= cache_libraries(shared, replay)  # loaded from there, at their keys

    # The source's cache made writable by its group: another user could have put code there, so nothing
    # is taken from it, the compiler builds every library again, and the replay is still certified (no
    # kernel was chosen, only compiled) with the source's bits.
    home = next(iter({p.parents[2] for p in (shared / "runs").glob("*/inductor/*/*.so")
                      if str(source.resolve()) in (p.parents[2] / "twinrun-run-cache.txt").read_text()}))
    os.chmod(home, 0o775)
    refused, proc, job, pin, refused_built = run("refused", f"determinism.kernel_path_from={source}")
    assert "libraries_reused" not in pin and "C++ libraries" not in proc.stdout
    assert source_built <= refused_built
    assert job["kernel_pin"]["pinned"] is True and bit_identical(source, refused)
