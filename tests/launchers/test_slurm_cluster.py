"""Submitit against the real local single-node SLURM that launch/slurm-up.sh starts (needs root or a cluster).

The `slurm_cluster` fixture lives in conftest.py."""

import sys
import time

import cloudpickle
import pytest
import submitit
from submitit.core.utils import FailedJobError

pytestmark = pytest.mark.slurm

TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


# pytest imports this file as the top-level module "test_slurm_cluster" (its folder goes on sys.path),
# which the job's interpreter cannot import: ship this module's functions by value instead of by reference.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def double(x):
    return 2 * x


def boom(x):
    raise ValueError(f"boom {x}")


def _executor(folder, cluster):
    ex = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    ex.update_parameters(slurm_partition=cluster["partition"], timeout_min=5, cpus_per_task=1)
    return ex


def _wait_terminal(jobs, timeout_s=120):
    """SLURM state of each job once all have ended. Polls sacct directly: job.state is cached and lags."""
    deadline = time.time() + timeout_s
    while True:
        states = [(j.get_info(mode="force").get("State") or "UNKNOWN").split()[0] for j in jobs]
        if all(s in TERMINAL for s in states):
            return states
        assert time.time() < deadline, f"jobs {[j.job_id for j in jobs]} still {states} after {timeout_s} s"
        time.sleep(0.5)


def test_submit_returns_result(slurm_cluster, tmp_path):
    job = _executor(tmp_path, slurm_cluster).submit(double, 21)
    assert _wait_terminal([job]) == ["COMPLETED"]
    assert job.result() == 42


def test_batch_is_one_array_job(slurm_cluster, tmp_path):
    ex = _executor(tmp_path, slurm_cluster)
    with ex.batch():
        jobs = [ex.submit(double, i) for i in (1, 2)]
    array_id = jobs[0].job_id.split("_")[0]
    assert [j.job_id for j in jobs] == [f"{array_id}_0", f"{array_id}_1"]
    assert _wait_terminal(jobs) == ["COMPLETED", "COMPLETED"]
    assert [j.result() for j in jobs] == [2, 4]


def test_raising_job_ends_failed(slurm_cluster, tmp_path):
    # Plain submitit re-raises in the job, so python, then srun, then the batch script exit 1: FAILED 1:0.
    # (hydra-submitit-launcher catches the exception itself, so there the job ends COMPLETED.)
    job = _executor(tmp_path, slurm_cluster).submit(boom, 7)
    assert _wait_terminal([job]) == ["FAILED"]
    with pytest.raises(FailedJobError, match="ValueError: boom 7"):
        job.result()
