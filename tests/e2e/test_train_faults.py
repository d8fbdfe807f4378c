"""Twin training runs end to end through the CLI: kill -9 at random instants then resume is bit-identical;
the default experiment, then status, resume, reduce, compare and diff on it; a SLURM requeue."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_when, resumes_killed_at_random, run_twinrun, slow_fsync_env, start_twinrun

from twinrun.storage.train_store import read_train_store

# Seven units (the start and six segments of two steps): kills land before, between and inside them.
FAULT_RUN = ["+experiment=train_scale_lr", "train.steps=12", "train.segment_steps=2", "train.batch_size=32",
             "train.heldout_images=32"]

def stores(run_dir: Path) -> dict:
    """Every store of a run as {arm/file: {tensor name: sha256}}, each read through its checks."""
    run = json.loads((run_dir / "run.json").read_text())
    return {f"{arm}/{e['file']}": read_train_store(run_dir / "arms" / arm / e["file"], e["sha256"]).digests
            for u in run["units"] for arm, e in u["stores"].items()}


@pytest.mark.slow
def test_kill_9_at_random_instants_then_resume_is_bit_identical(tmp_path):
    ref = tmp_path / "ref"
    done = run_twinrun([*FAULT_RUN, f"hydra.run.dir={ref}"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    env = slow_fsync_env(tmp_path / "inject", 0.1)
    run_dir, rng = tmp_path / "killed", random.Random(22)

    # 1. the first run, killed mid-write once a segment store is on its way
    proc = start_twinrun(["twinrun", *FAULT_RUN, f"hydra.run.dir={run_dir}"], tmp_path, env)
    kill_when(proc, lambda: list(run_dir.glob("arms/*/.seg*.tmp-*")) and
              list(run_dir.glob("arms/*/seg*.safetensors")), timeout_s=180)
    assert list(run_dir.glob("arms/*/.*.tmp-*")), "killed with a half-written store on disk"

    # 2. resumes killed at random instants (start-up, mid-segment, mid-write), then one left to finish
    outputs, final = resumes_killed_at_random(run_dir, tmp_path, env, rng, kills=4, wait_s=(1.0, 6.0))
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
    assert any("every arm continues from" in out for out in [*outputs, final.stdout]), outputs

    # every store of every arm, the final weights among them, bit for bit the uninterrupted run's
    assert stores(run_dir) == stores(ref)
    assert not list(run_dir.glob("arms/*/.*.tmp-*"))
    ref_summary, summary = (json.loads((d / "summary.json").read_text()) for d in (ref, run_dir))
    assert summary["effects"] == ref_summary["effects"] and summary["gates"] == ref_summary["gates"]


@pytest.mark.slow
def test_the_default_experiment_then_status_resume_reduce_compare_and_diff(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_twinrun(["+experiment=train_scale_lr", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    wall_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    print(f"default experiment: {wall_s:.1f} s wall")
    out = proc.stdout
    assert "segment 4 (steps 31–40):" in out and "ETA" in out  # progress per segment, with an ETA
    assert "verdict: the intervention is ABOVE the chaos floor" in out
    report = (run_dir / "report.md").read_text()
    order = ["## Verdict", "## Machinery gate", "## Replicate", "## Where each arm", "## The chaos floor",
             "## Effects", "## Losses"]
    assert [report.index(h) for h in order] == sorted(report.index(h) for h in order)
    assert all((run_dir / png).stat().st_size > 10_000 for png in ("loss.png", "distance.png"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["measure"] == "train" and summary["passed"] and len(summary["losses"]) == 5 * 6

    status = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.status")
    assert status.returncode == 0 and "native_chaos 5/5" in status.stdout
    assert "reduced: valid" in status.stdout
    again = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.resume")
    assert again.returncode == 0 and "(steps 1–10): scale_lr" not in again.stdout  # nothing left to train
    view = run_twinrun([str(run_dir), "--estimands", "cond"], cwd=tmp_path, module="twinrun.reduce")
    assert view.returncode == 0 and "POST-HOC VIEW" in view.stdout
    assert (run_dir / "views" / "estimands-cond" / "report.md").is_file()

    arms = run_dir / "arms"
    same = run_twinrun([str(arms / "native"), str(arms / "native_replicate")], cwd=tmp_path,
                       module="twinrun.compare")
    assert same.returncode == 0 and " 0 / 41 " in same.stdout
    other = run_twinrun([str(run_dir), str(arms / "scale_lr")], cwd=tmp_path, module="twinrun.compare")
    assert other.returncode == 0 and "41 / 41" in other.stdout
    diff = run_twinrun([str(arms / "native"), str(arms / "scale_lr_noop")], cwd=tmp_path,
                       module="twinrun.diff")
    assert diff.returncode == 0 and diff.stdout.startswith("bit-identical")
    diff = run_twinrun([str(arms / "native"), str(arms / "native_chaos")], cwd=tmp_path,
                       module="twinrun.diff")
    assert diff.returncode == 1 and "tensors differ" in diff.stdout


@pytest.mark.slow
def test_a_sweep_of_training_points_reports_each_ones_distance_against_its_chaos_floor(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_twinrun(["-m", "+experiment=train_scale_lr", "train.steps=4", "train.segment_steps=2",
                        "train.batch_size=16", "train.heldout_images=16", "intervention.factor=1.5,4",
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    points = json.loads((sweep / "sweep_summary.json").read_text())["points"]
    report = (sweep / "sweep_report.md").read_text()
    assert "## Training points" in report
    for p in points:  # each row carries what its own summary says at its last stored step
        own = json.loads((Path(p["run_dir"]) / "summary.json").read_text())
        last = [e for e in own["effects"] if e["estimand"] == "all"][-1]
        assert p["train_effect"] == {k: last[k] for k in p["train_effect"]} and p["train_effect"]["step"] == 4
        name = Path(p["run_dir"]).name
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} | 4 |"))
        assert f"| {last['distance']:.3g} | {last['floor']:.3g} |" in row and own["verdict"] in row


@pytest.mark.slow
@pytest.mark.parametrize("override,key", [("train.segment_steps=7", "train.segment_steps"),
                                          ("train.optimizer.lr=0", "train.optimizer.lr"),
                                          ("launcher.split=bins", "launcher.split")])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, override, key):
    run_dir = tmp_path / "run"
    extra = ["launcher=submitit_local"] if key == "launcher.split" else []
    proc = run_twinrun(["+experiment=train_scale_lr", override, *extra, f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"twinrun: error: {key}="), err
    assert not run_dir.exists()


@pytest.mark.slurm
def test_a_slurm_requeue_resumes_the_segments_bit_identically(slurm_cluster, tmp_path):
    common = ["+experiment=train_scale_lr", "train.steps=40", "train.segment_steps=4"]  # 11 units
    slurm = ["launcher=slurm", f"launcher.partition={slurm_cluster['partition']}",
             "launcher.gpus_per_node=0", "launcher.cpus_per_task=1", "launcher.timeout_min=5",
             "launcher.poll_s=0.5"]
    ref_dir, job_dir = tmp_path / "reference", tmp_path / "job"
    popen = {"cwd": tmp_path, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    job = subprocess.Popen([sys.executable, "-m", "twinrun", *common, *slurm, f"hydra.run.dir={job_dir}"],
                           **popen)

    def whole() -> int:
        try:
            run = json.loads((job_dir / "run.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return 0
        return sum(all(e["status"] == "done" for e in u["stores"].values()) for u in run["units"])

    deadline = time.time() + 240
    while whole() < 3:
        assert time.time() < deadline and job.poll() is None, "the job did not finish three units in time"
        time.sleep(0.05)
    launched = json.loads((job_dir / "launch.json").read_text())
    subprocess.run(["scancel", "--signal=USR2", launched["job_id"]], check=True)  # what a preemption sends
    assert whole() < 11, "the job finished before it was signalled: make the run longer"
    # the uninterrupted run, in-process with as many threads as the job found (its recorded kernel path)
    recorded = json.loads(next((job_dir / "env").glob("kernel_path-*.json")).read_text())
    threads = recorded["kernel_path"]["threads"]
    reference = subprocess.Popen([sys.executable, "-m", "twinrun", *common, f"hydra.run.dir={ref_dir}"],
                                 env={**os.environ, "OMP_NUM_THREADS": str(threads["intra_op"])}, **popen)
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    assert reference.wait(timeout=600) == 0
    log = Path(launched["stdout"]).read_text()
    assert "requeueing, the next start resumes from them" in log and "every arm continues from" in log
    assert stores(job_dir) == stores(ref_dir), "the requeued run's stores are not the uninterrupted run's"
