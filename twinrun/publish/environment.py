"""Where a run was measured, as report.md's lines: every kind's report shows them the same way."""

from twinrun.errors import StoreError
from twinrun.files import read_json
from twinrun.storage.rundir import RunIndex


def env_summary(index: RunIndex) -> list[str]:
    """A few lines on where the run was measured, from the jobs' recorded fingerprints (a job file
    that is missing or damaged is left out: the report is prose, the validity checks read the record)."""
    lines, rd = [], index.run_dir
    for job in index.jobs:
        try:
            rec = read_json(rd.job_env(job["index"]))
            lines.append(_job_line(job, rec["fingerprint"], rec.get("determinism") or {}))
        except (StoreError, KeyError, TypeError, AttributeError):
            continue
    return lines


def _job_line(job: dict, fp: dict, det: dict) -> str:
    kp, info = fp["kernel_path"], fp["info"]
    device = ", ".join(g.get("name", "?") for g in kp.get("gpus") or []) or f"CPU {kp['cpu'].get('model')}"
    slurm = info.get("slurm") or {}
    where = f"SLURM job {slurm.get('SLURM_JOB_ID')}" if slurm.get("SLURM_JOB_ID") else "local process"
    return (f"job {job['index']}: {where} on {info.get('hostname')} (boot {str(info.get('boot_id'))[:8]}), "
            f"{device}, torch {kp['torch'].get('version')}, {kp['threads'].get('intra_op')} threads, "
            f"determinism {'on' if det.get('enabled') else 'off'}, kernel path "
            f"{job['kernel_path_sha256'][:12]}{_git_text(info.get('git') or {})}")


def _git_text(git: dict) -> str:
    """`, twinrun git 1a2b3c4d5e (dirty)`; nothing outside a git checkout (the version line says which)."""
    if not git.get("commit"):
        return ""
    return f", twinrun git {str(git['commit'])[:10]}{' (dirty)' if git.get('dirty') else ''}"
