"""train.compile: every arm's step runs torch.compile's module of its model, compiled before the first
segment into the run's own cache; the replicate and the machinery arm stay bit-identical to the twin,
a resume from a whole segment is bit-identical to the uninterrupted run, and the compiled path is not the
eager one. Inductor's C++ backend compiles on a CPU (gcc), tens of seconds a graph here: slow."""

import json
from pathlib import Path

import pytest
from conftest import run_twinrun

from twinrun.errors import EXIT_OK
from twinrun.provenance import compile_cache
from twinrun.storage.train_store import read_train_store

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]  # tests/: the child imports fault_models from its cwd
RUN = ["+experiment=train_scale_lr", "model._target_=fault_models.tiny", "train.steps=4",
       "train.segment_steps=2", "train.batch_size=8", "train.heldout_images=8", "train.device=cpu"]


def last_digests(run_dir: Path) -> dict:
    run = json.loads((run_dir / "run.json").read_text())
    unit = run["units"][-1]
    return {arm: read_train_store(run_dir / "arms" / arm / e["file"], e["sha256"]).digests
            for arm, e in unit["stores"].items()}


def resume_without_the_last_segment(run_dir, cwd, env) -> None:
    """The run as if interrupted after its first segment (the last one pending again, its stores gone),
    then resumed in a new process, which restores every arm from the first segment's stores."""
    run = json.loads((run_dir / "run.json").read_text())
    for arm, entry in run["units"][-1]["stores"].items():
        (run_dir / "arms" / arm / entry["file"]).unlink()
        entry.update(status="pending", sha256=None)
    (run_dir / "run.json").write_text(json.dumps(run))
    resumed = run_twinrun([str(run_dir), "--trust", "fault_models"], cwd=cwd, module="twinrun.resume",
                          env=env)
    assert resumed.returncode == EXIT_OK, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "every arm continues from segment 1" in resumed.stdout


def test_a_compiled_run_keeps_its_gates_and_resumes_bit_identically(tmp_path, monkeypatch):
    # An in-process run earlier in the session sets the cache variables in this process's environment;
    # inherited, they would be a user's choice the child keeps, and its caches no longer the run's own.
    for name in compile_cache.CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    env = {"PYTHONPATH": str(TESTS)}
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    compiled = [*RUN, "train.compile=default", f"determinism.compile_cache_dir={cache}"]
    proc = run_twinrun([*compiled, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env)
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = run_dir.glob("env/kernel_path-*.json")
    compile_path = json.loads(path.read_text())["kernel_path"]["compile"]
    assert compile_path["mode"] == "default" and compile_path["caches"]["inductor"] != "absent"
    assert list((cache / "runs").glob("*/inductor"))  # the run's own cache
    whole = last_digests(run_dir)
    assert whole["native_replicate"] == whole["native"] and whole["scale_lr_noop"] == whole["native"]

    # Interrupted after the first segment: the last one pending again, its stores gone; a new process
    # restores every arm from the first segment's stores, finds the run's cache as it left it, and
    # trains the last segment to the same bits.
    resume_without_the_last_segment(run_dir, tmp_path, env)
    assert last_digests(run_dir) == whole

    # The compiled path is not the eager one (Inductor's fused kernels round differently on this CPU).
    eager_dir = tmp_path / "eager"
    proc = run_twinrun([*RUN, f"hydra.run.dir={eager_dir}"], cwd=tmp_path, env=env)
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last_digests(eager_dir)["native"] != whole["native"]


def test_a_compiled_run_parked_on_disk_is_bit_identical_to_all_resident_and_resumes_so(tmp_path, monkeypatch):
    # Parking empties every parameter in place and refills it with new memory at the arm's next segment:
    # the compiled module must run on the refilled weights exactly as on weights that never left.
    for name in compile_cache.CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    env = {"PYTHONPATH": str(TESTS)}
    compiled = [*RUN, "train.compile=default", f"determinism.compile_cache_dir={tmp_path / 'cache'}"]
    resident, parked = tmp_path / "resident", tmp_path / "parked"
    for run_dir, layout in ((resident, "none"), (parked, "disk")):
        proc = run_twinrun([*compiled, f"train.offload={layout}", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                           env=env)
        assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    whole = last_digests(resident)
    assert last_digests(parked) == whole  # every arm's last store, tensor by tensor

    # The parked run interrupted after its first segment and resumed in a new process: the same bits.
    resume_without_the_last_segment(parked, tmp_path, env)
    assert last_digests(parked) == whole
