"""Tracker sinks, each for real and offline: a reduced run logged to MLflow (read back with MLflow's own
client), W&B offline (read back from its run files), TensorBoard (read back with TensorBoard's reader);
a tracker outside the config hash; a failing sink one line that loses nothing."""

import glob
import json
from pathlib import Path

import pytest
from conftest import TINY, run_twinrun

from twinrun.errors import ConfigError
from twinrun.measures.probe import PROBE
from twinrun.publish import trackers
from twinrun.storage.rundir import RunIndex


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A TINY pin_sigma run with tracker=mlflow in its config, then reduced again into W&B and TensorBoard."""
    for package in ("mlflow", "sqlalchemy", "wandb", "tensorboard"):
        pytest.importorskip(package)
    root = tmp_path_factory.mktemp("trackers")
    run = root / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "tracker=mlflow", f"tracker.dir={root / 'mlflow'}",
                        f"hydra.run.dir={run}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "twinrun: logged to mlflow: sqlite:///" in proc.stdout
    for name in ("wandb", "tensorboard"):
        proc = run_twinrun([str(run), "--tracker", name, "--tracker-dir", str(root / name)], cwd=root,
                           module="twinrun.reduce")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"twinrun: logged to {name}: " in proc.stdout
        assert "warning" not in proc.stderr.lower(), proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    return root, run, summary


def _effects(summary, estimand="all"):
    """{the tracker's step (σ in millionths): effect row}."""
    rows = [e for e in summary["effects"] if e["estimand"] == estimand]
    return {round(e["sigma"] * trackers.SIGMA_STEP_SCALE): e for e in rows}


def _kernel_path(run):
    index = RunIndex.load(run)
    return ",".join(sorted({e["kernel_path_sha256"] for u in index.units for e in u["stores"].values()}))


@pytest.mark.slow
@pytest.mark.trackers
def test_mlflow_store_read_back_with_mlflows_client(logged):
    from mlflow.tracking import MlflowClient

    root, run, summary = logged
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("twinrun")
    parent = client.search_runs([exp.experiment_id], filter_string="tags.`twinrun.role` = 'comparison'")
    assert len(parent) == 1
    p = parent[0]
    assert p.info.run_name == run.name and p.info.status == "FINISHED"
    assert p.data.tags["twinrun.run_dir"] == str(run.resolve())
    assert p.data.tags["twinrun.kernel_path"] == _kernel_path(run)
    assert p.data.tags["twinrun.verdict"] == "valid" and p.data.tags["twinrun.version"]
    assert p.data.params["intervention.sigma_pin"] == "0.5" and p.data.params["probe.n_images"] == "8"
    assert p.data.metrics["passed"] == 1.0
    gate = client.get_metric_history(p.info.run_id, "gate/all")  # one metric, at the gate's σ
    assert [(m.step, m.value) for m in gate] == [(500_000, 1.0)]
    effect = {m.step: m.value for m in client.get_metric_history(p.info.run_id, "effect/all")}
    se = {m.step: m.value for m in client.get_metric_history(p.info.run_id, "effect_se/all")}
    for step, e in _effects(summary).items():  # effects per σ with their SEs; step = σ in millionths
        if e["cos"] is not None:
            assert (effect[step], se[step]) == pytest.approx((1 - e["cos"], e["se"]), rel=1e-6)
        else:
            assert step not in effect
    artifacts = {a.path for a in client.list_artifacts(p.info.run_id)}
    assert {"effect.png", "report.md", "summary.json", "config.json"} <= artifacts
    local = client.download_artifacts(p.info.run_id, "summary.json", dst_path=str(root / "dl"))
    assert json.loads(Path(local).read_text())["effects"] == summary["effects"]
    children = client.search_runs([exp.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{p.info.run_id}'")
    roles = {c.data.tags["twinrun.role"]: c for c in children}
    assert set(roles) == {"baseline", "intervention"}
    assert roles["baseline"].info.run_id == p.data.tags["twinrun.baseline_run_id"]
    assert roles["baseline"].data.tags["twinrun.arm"] == "native"
    # Twin and arm under one key, overlaid at the same σ steps: what MLflow's run comparison draws.
    overlay = {role: {m.step: m.value for m in client.get_metric_history(c.info.run_id, "norm2/all")}
               for role, c in roles.items()}
    assert overlay["baseline"] == pytest.approx({s: e["norm2_base"] for s, e in _effects(summary).items()},
                                                rel=1e-6)
    assert overlay["intervention"] == pytest.approx({s: e["norm2"] for s, e in _effects(summary).items()},
                                                    rel=1e-6)
    sigma = {m.step: m.value for m in client.get_metric_history(roles["baseline"].info.run_id, "sigma")}
    assert sigma == pytest.approx({s: e["sigma"] for s, e in _effects(summary).items()})
    assert not any(k.startswith("norm2_arm") for c in roles.values() for k in c.data.metrics)


@pytest.mark.slow
@pytest.mark.trackers
def test_wandb_offline_run_read_back_from_its_files(logged):
    import wandb_reader

    root, run, summary = logged
    logs = sorted(glob.glob(str(root / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(logs) == 2  # the intervention arm and the native twin, one group
    read = [wandb_reader.summarize(f) for f in logs]
    by_job = {r["run"]["job_type"]: r for r in read}
    assert set(by_job) == {"baseline", "intervention"}
    assert {r["run"]["group"] for r in read} == {run.name}
    arm = by_job["intervention"]
    assert arm["config"]["intervention"]["sigma_pin"] == 0.5 and arm["config"]["seed"] == 0
    assert arm["config"]["twinrun"]["kernel_path"] == _kernel_path(run)
    assert arm["config"]["twinrun"]["run_dir"] == str(run.resolve())
    assert arm["summary"]["passed"] is True
    history = {h["_step"]: h for h in arm["history"] if "sigma" in h}
    for step, e in _effects(summary).items():
        assert history[step]["sigma"] == e["sigma"]
        if e["cos"] is not None:
            assert history[step]["effect/all"] == pytest.approx(1 - e["cos"])
            assert history[step]["effect_se/all"] == pytest.approx(e["se"])
        else:
            assert "effect/all" not in history[step] and history[step]["below_noise/all"] == 1.0
    assert history[500_000]["gate/all"] == 1.0
    assert not any("gate/all/" in k for h in arm["history"] for k in h)
    assert any("plots/effect" in h for h in arm["history"])  # the plot, as an image
    # Twin and arm under one key at the same σ: W&B's group view overlays them.
    base = {h["_step"]: h for h in by_job["baseline"]["history"]}
    for step, e in _effects(summary).items():
        assert base[step]["norm2/all"] == pytest.approx(e["norm2_base"])
        assert history[step]["norm2/all"] == pytest.approx(e["norm2"])
        assert base[step]["sigma"] == history[step]["sigma"]
    assert {"norm2_arm/all"}.isdisjoint(k for h in arm["history"] for k in h)
    assert arm["kinds"].get("metric", 0) >= 2  # define_metric: sigma, and every metric against it
    assert not Path("/tmp/wandb").exists() or not any(Path("/tmp/wandb").glob(f"*{run.name}*"))


@pytest.mark.slow
@pytest.mark.trackers
def test_tensorboard_event_files_read_back_with_tensorboards_reader(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, run, summary = logged
    folder = root / "tensorboard" / "twinrun" / run.name
    arm = EventAccumulator(str(folder / "pin_sigma"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    arm.Reload()
    sigma = {e.step: e.value for e in arm.Scalars("sigma")}
    for step, e in _effects(summary).items():
        assert sigma[step] == pytest.approx(e["sigma"], rel=1e-6)  # float32
        if e["cos"] is not None:
            effect = {x.step: x.value for x in arm.Scalars("effect/all")}
            assert effect[step] == pytest.approx(1 - e["cos"], rel=1e-5, abs=1e-7)
    assert arm.Scalars("passed")[0].value == 1.0
    tags = arm.Tensors("tags/text_summary")[0].tensor_proto.string_val[0].decode()
    assert _kernel_path(run) in tags and str(run.resolve()) in tags
    config = arm.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "`intervention.sigma_pin` | `0.5`" in config
    assert arm.Images("plots/effect")[0].width > 200
    assert [(x.step, x.value) for x in arm.Scalars("gate/all")] == [(500_000, 1.0)]
    base = EventAccumulator(str(folder / "native"), size_guidance={"scalars": 0})
    base.Reload()
    # Twin and arm under one tag, stepped by σ (millionths): TensorBoard draws them as two runs of one chart.
    twin = {x.step: x.value for x in base.Scalars("norm2/all")}
    mine = {x.step: x.value for x in arm.Scalars("norm2/all")}
    assert twin == pytest.approx({s: e["norm2_base"] for s, e in _effects(summary).items()}, rel=1e-5)
    assert mine == pytest.approx({s: e["norm2"] for s, e in _effects(summary).items()}, rel=1e-5)
    assert "norm2_arm/all" not in arm.Tags()["scalars"]


@pytest.mark.slow
@pytest.mark.trackers
def test_the_tracker_is_outside_the_config_hash(logged, tmp_path):
    """Resuming a run with another tracker (or none) is not refused: the arms' configs hold none."""
    root, run, _ = logged
    assert "tracker" not in (run / "arms" / "pin_sigma" / "config.yaml").read_text()
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "tracker=tensorboard", f"tracker.dir={tmp_path}",
                        f"hydra.run.dir={run}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "logged to tensorboard" in proc.stdout


@pytest.mark.slow
@pytest.mark.trackers
def test_a_failing_sink_is_one_line_and_the_run_stays_whole(logged, tmp_path, capsys):
    _, run, summary = logged
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    index = RunIndex.load(run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for name in trackers.SINKS:
        ok = trackers.send({"name": name, "dir": str(blocker / "store"), "project": "twinrun"}, index,
                           summary, [run / "summary.json"], PROBE)
        assert ok is False
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"twinrun: warning: tracker={name} did not log {run} (")
        assert err[0].endswith("the run directory is complete and stays the record")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.trackers
def test_a_training_run_is_logged_at_its_optimizer_steps(tmp_path):
    """The tracker's step axis of a training run is its optimizer step (0, 2, 4 here), not the unit's
    index (0, 1, 2): the curves line up with the researcher's own training logs."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = run_twinrun(["+experiment=train_scale_lr", "train.steps=4", "train.segment_steps=2",
                        "train.batch_size=16", "train.heldout_images=16", "tracker=tensorboard",
                        f"tracker.dir={tmp_path / 'tb'}", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0 and "logged to tensorboard" in proc.stdout, proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    distance = {e["step"]: e["distance"] for e in summary["effects"] if e["estimand"] == "all"}
    folder = tmp_path / "tb" / "twinrun" / run.name / "scale_lr"
    arm = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    arm.Reload()
    logged = {x.step: x.value for x in arm.Scalars("distance/all")}
    assert sorted(logged) == sorted(distance) == [2, 4]
    assert all(logged[k] == pytest.approx(v, rel=1e-6) for k, v in distance.items())
    losses = {(r["role"], r["step"]): r for r in summary["losses"]}
    twin = EventAccumulator(str(folder.parent / "native"), size_guidance={"scalars": 0, "images": 0})
    twin.Reload()
    for reader, role in ((arm, "intervention"), (twin, "twin")):  # one key, both runs: overlaid
        held = {x.step: x.value for x in reader.Scalars("loss/heldout")}
        assert held == pytest.approx({s: losses[(role, s)]["heldout_loss"] for s in (0, 2, 4)}, rel=1e-6)
        train = {x.step: x.value for x in reader.Scalars("loss/train")}
        assert sorted(train) == [1, 2, 3, 4]  # every optimizer step's training loss
        assert [train[3], train[4]] == pytest.approx(losses[(role, 4)]["train_loss_steps"], rel=1e-6)
    assert "loss_arm/heldout" not in arm.Tags()["scalars"]
    gates = {}  # one metric per gated arm, stepped by the optimizer step
    for g in summary["gates"]:
        gates.setdefault(f"gate/{g['arm']}", []).append((g["step"], float(g["passed"])))
    assert gates and all([(x.step, x.value) for x in arm.Scalars(k)] == v for k, v in gates.items())
    assert {"plots/loss", "plots/distance"} <= set(arm.Tags()["images"])
    report = arm.Tensors("report/text_summary")[0].tensor_proto.string_val[0].decode()
    assert report.startswith("# twinrun training report")
    assert "every segment's arms ran back to back" in report and "every bin's" not in report


def test_a_missing_package_or_unwritable_store_is_refused_before_any_compute(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"tracker\.dir=.*cannot be written"):
        trackers.check_tracker({"name": "tensorboard", "dir": str(blocker / "tb")})
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs the packages mlflow, sqlalchemy, alembic: pip install "
                       r"'twinrun\[trackers\]', or tracker=none"):
        trackers.check_tracker({"name": "mlflow"})
    with pytest.raises(ConfigError, match="choose one of none, mlflow, wandb, tensorboard"):
        trackers.check_tracker({"name": "neptune"})
    assert trackers.check_tracker({"name": "none"}) is None
