"""tracker=mlflow: one parent run per twinrun run in a local SQLite store, the native twin and the
intervention arm as its children (`mlflow.parentRunId`, tag `twinrun.role`: baseline, intervention).
Each child logs its own quantities under the same keys (`norm2/<estimand>`, `loss/train`,
`loss/heldout`), so selecting both children in MLflow's run comparison overlays them on one chart; the
parent holds the comparison (effects, distances, `gate/<name>`), the params, plots and report. A probe's
step is σ in millionths, and `sigma` is logged as a metric too (a chart's x axis may be set to it).

The store is DIR/mlflow.db with artifacts under DIR/artifacts (MLflow 3 refuses its old file store
unless MLFLOW_ALLOW_FILE_STORE is set; SQLite is its offline store). MLflow truncates a param longer
than its limit without a word, so a longer one is logged as a pointer to config.json, the whole
resolved config, logged as an artifact beside the plots.
"""

import json
import tempfile
import time
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

PARAM_CHARS = 6000  # MLflow's param value limit (3.x); longer values would be cut silently
BATCH = 100  # params (or tags) per log_batch call


def _metrics(logged: list[tuple[int, dict]], now_ms: int) -> list[Metric]:
    return [Metric(key, float(value), now_ms, step) for step, row in logged
            for key, value in row.items() if value is not None]


def _params(params: dict[str, str]) -> list[Param]:
    return [Param(k, v if len(v) <= PARAM_CHARS else "(longer than MLflow keeps: see config.json)")
            for k, v in params.items()]


def _log_batches(client, run_id: str, metrics: list, params: list) -> None:
    for i in range(0, len(params), BATCH):
        client.log_batch(run_id, params=params[i:i + BATCH])
    for i in range(0, len(metrics), 1000):  # MLflow's metrics per batch
        client.log_batch(run_id, metrics=metrics[i:i + 1000])


def log(p, store: Path, project: str) -> str:
    """Log the payload; returns where (the store URI and the parent run's id)."""
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(project)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        project, artifact_location=(store / "artifacts").as_uri())
    now = int(time.time() * 1000)
    # One parent run holds the comparison and the verdict, one child per arm, so MLflow's UI overlays the arms
    # under the run they belong to.
    parent = client.create_run(exp_id, run_name=p.name, tags={**p.tags, "twinrun.role": "comparison"})
    pid = parent.info.run_id
    children = {}
    for role, arm in (("baseline", p.baseline), ("intervention", p.arm)):
        children[role] = client.create_run(exp_id, run_name=f"{p.name}/{arm}", tags={
            "mlflow.parentRunId": pid, "twinrun.role": role, "twinrun.arm": arm,
            "twinrun.run_dir": p.tags["twinrun.run_dir"],
            "twinrun.kernel_path": p.tags["twinrun.kernel_path"]})
    client.set_tag(pid, "twinrun.baseline_run_id", children["baseline"].info.run_id)
    verdict = [Metric(k, float(v), now, 0) for k, v in p.verdict.items()]
    _log_batches(client, pid, _metrics(p.logged(p.steps), now) + verdict, _params(p.params))
    _log_batches(client, children["baseline"].info.run_id, _metrics(p.logged(p.baseline_steps), now), [])
    _log_batches(client, children["intervention"].info.run_id, _metrics(p.logged(p.arm_steps), now), [])
    # The resolved config as an artifact too: MLflow's params are flat strings, the JSON keeps its structure.
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(p.config, indent=1, sort_keys=True))
        client.log_artifact(pid, str(config))
    for f in p.files:
        client.log_artifact(pid, str(f))
    # Ended explicitly: a run never terminated shows as still running in MLflow's UI.
    for run in (*children.values(), parent):
        client.set_terminated(run.info.run_id, "FINISHED")
    return f"{uri} run {pid}"
