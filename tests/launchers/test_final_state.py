"""The final state a failed SLURM job is reported with, against a scheduler whose accounting lags its queue.

slurmdbd writes a job's end after squeue has shown it ended; a single sacct at that moment still says
RUNNING, and the report lost the exit code ("FAILED" instead of "FAILED 1:0") in one CI run in five."""

import submitit

from twinrun.launchers import wait


def a_slurm_job(job_id: str) -> submitit.SlurmJob:
    job = submitit.SlurmJob.__new__(submitit.SlurmJob)  # no folder, no scheduler: only its id is read
    job._job_id, job._cancel_at_deletion = job_id, False
    return job


def scheduler(monkeypatch, queue: list[str], accounting: list[str | None]):
    """squeue and sacct answer from these lists in turn, the last answer repeated."""
    asked = {"sacct": 0}

    def states(job_ids):
        return {j: queue.pop(0) if len(queue) > 1 else queue[0] for j in job_ids}

    def sacct(job_id):
        asked["sacct"] += 1
        return accounting.pop(0) if len(accounting) > 1 else accounting[0]

    monkeypatch.setattr(wait, "slurm_states", states)
    monkeypatch.setattr(wait, "sacct_state", sacct)
    monkeypatch.setattr(wait.time, "sleep", lambda s: None)
    return asked


def test_lagging_accounting_is_waited_for_to_give_the_exit_code(monkeypatch):
    asked = scheduler(monkeypatch, ["RUNNING", "FAILED"], ["RUNNING 0:0", "RUNNING 0:0", "FAILED 1:0"])
    assert wait._final_state(a_slurm_job("40"), "RUNNING") == "FAILED 1:0"
    assert asked["sacct"] == 3


def test_without_accounting_the_queues_word_stands_at_once(monkeypatch):
    asked = scheduler(monkeypatch, ["FAILED"], [None])
    assert wait._final_state(a_slurm_job("41"), "RUNNING") == "FAILED"
    assert asked["sacct"] == 1


def test_accounting_that_never_agrees_gives_up_at_the_deadline(monkeypatch):
    monkeypatch.setattr(wait, "FINAL_STATE_WAIT_S", 0.05)
    scheduler(monkeypatch, ["GONE"], ["RUNNING 0:0"])
    assert wait._final_state(a_slurm_job("42"), "RUNNING") == "GONE"


def test_a_job_still_queued_at_the_deadline_asks_accounting_once_more(monkeypatch):
    monkeypatch.setattr(wait, "FINAL_STATE_WAIT_S", 0.0)
    scheduler(monkeypatch, ["COMPLETING"], ["TIMEOUT 0:1"])
    assert wait._final_state(a_slurm_job("43"), "RUNNING") == "TIMEOUT 0:1"


def test_a_local_job_keeps_its_own_state(monkeypatch):
    asked = scheduler(monkeypatch, ["FAILED"], ["FAILED 1:0"])
    assert wait._final_state(object(), "FAILED") == "FAILED" and asked["sacct"] == 0
