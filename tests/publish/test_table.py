"""The tidy table: one row per run × σ × estimand with every column a researcher filters on, runs and
sweeps concatenated, seeds pooled; CSV and parquet round trips; bad input one line, exit 2."""

import importlib.util
import json
import shutil

import pytest
from conftest import TINY, run_twinrun
from rundirs import planned_run

from twinrun import table as table_cli
from twinrun.protocol import config_hash
from twinrun.publish import table

# the `table` extra (.ci/run installs it); without it only the refusal is tested
needs_pandas = pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="the table extra")
if importlib.util.find_spec("pandas") is not None:
    import pandas as pd


@pytest.fixture(scope="module")
def seed_sweep(tmp_path_factory):
    """A reduced 3-seed sweep of pin_sigma (one knob fixed) and one lone run of another setting."""
    root = tmp_path_factory.mktemp("table")
    sweep = root / "sweep"
    proc = run_twinrun(["-m", "+experiment=pin_sigma", *TINY, "probe.n_images=290",
                        "probe.n_draws=1", "probe.n_folds=20",
                        "seed=0,1,2", f"hydra.sweep.dir={sweep}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = root / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "intervention.sigma_pin=0.5",
                        f"hydra.run.dir={run}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sweep, run


@pytest.mark.slow
@needs_pandas
def test_one_row_per_run_sigma_estimand_with_the_summary_s_numbers(seed_sweep):
    sweep, run = seed_sweep
    df = table_cli.load([sweep, run])
    runs = df[df.row_kind == "run"]
    assert len(runs) == 4 * 3 * 3  # 4 runs × 3 σ bins × 3 registered estimands
    assert set(runs.seed) == {0, 1, 2} and list(runs[runs.run_dir == str(run)].seed.unique()) == [0]
    assert set(runs.estimand) == {"all", "cond", "residual"} and set(runs.sigma) == {0.2, 0.5, 1.2}
    assert (runs.verdict == "valid").all() and runs.passed.all()
    # the columns every analysis filters on, a swept override among them (typed from the config)
    for column in ("gate", "gate_passed", "below_noise", "cos", "se", "cos_lo", "cos_hi", "norm_ratio",
                   "norm_ratio_se", "norm_ratio_lo", "norm_ratio_hi", "kernel_path_sha256", "seed",
                   "experiment", "intervention.sigma_pin"):
        assert column in df.columns, column
    lone = runs[runs.run_dir == str(run)]
    assert set(lone["intervention.sigma_pin"]) == {0.5}  # its own override, as the resolved float
    summary = json.loads((run / "summary.json").read_text())
    for e in summary["effects"]:
        row = lone[(lone.sigma == e["sigma"]) & (lone.estimand == e["estimand"])].iloc[0]
        assert bool(row.below_noise) == e["below_noise"] and bool(row.gate) == e["gate"]
        if e["cos"] is not None:
            half = e["t_crit"] * e["se"]
            assert (row.cos, row.se, row.effect) == (e["cos"], e["se"], 1 - e["cos"])
            assert (row.cos_lo, row.cos_hi) == pytest.approx((e["cos"] - half, e["cos"] + half))
    gate = lone[lone.gate]
    assert set(gate.sigma) == {0.5} and gate.gate_passed.all()  # the registered gate bin, passed
    # Every resolved setting, defaults too: the sweep never overrode sigma_pin, the lone run did.
    for column in ("intervention.sigma_pin", "intervention._target_", "probe.n_images", "probe.n_draws",
                   "probe.n_folds", "probe.chunk_draws", "sigma_grid.sigmas"):
        assert runs[column].notna().all(), column
    assert set(runs["intervention.sigma_pin"]) == {0.5}
    assert set(runs[runs.run_dir != str(run)]["probe.n_images"]) == {290}
    assert runs["probe.n_images"].dtype.kind == "i" and runs["intervention.sigma_pin"].dtype.kind == "f"
    assert not [c for c in df.columns if c.split(".")[0] in ("launcher", "hydra", "tracker")]
    assert lone.kernel_path_sha256.str.fullmatch("[0-9a-f]{64}").all()


@pytest.mark.slow
@needs_pandas
def test_a_seed_sweep_adds_rows_pooled_over_seeds(seed_sweep):
    sweep, _ = seed_sweep
    df = table_cli.load(sweep)
    pooled = df[df.row_kind == "pooled over seeds"]
    assert len(pooled) == 3 * 3 and set(pooled.seeds) <= {"0,1,2", "0,1", "0,2", "1,2", ""}
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert len(summary["pooled_over_seeds"]) == 9  # the same cells in sweep_summary.json
    cell = next(c for c in summary["pooled_over_seeds"] if c["effect_mean"] is not None)
    row = pooled[(pooled.sigma == cell["sigma"]) & (pooled.estimand == cell["estimand"])].iloc[0]
    assert row.effect == cell["effect_mean"] and row.effect_between_se == cell["effect_between_se"]
    assert row.effect_p == cell["effect_p"]
    assert "## Pooled over seeds" in (sweep / "sweep_report.md").read_text()


@pytest.mark.slow
@needs_pandas
def test_csv_and_parquet_round_trip_through_the_command_line(seed_sweep, tmp_path, capsys):
    sweep, run = seed_sweep
    want = table_cli.load([sweep, run])
    assert table_cli.main([str(sweep), str(run), "--csv", str(tmp_path / "t.csv")]) == 0
    back = pd.read_csv(tmp_path / "t.csv")
    assert list(back.columns) == list(want.columns) and len(back) == len(want)
    assert back.cos.dropna().tolist() == pytest.approx(want.cos.dropna().tolist(), rel=1e-12)
    assert table_cli.main([str(sweep), str(run), "--parquet", str(tmp_path / "t.parquet")]) == 0
    back = pd.read_parquet(tmp_path / "t.parquet")
    assert (back.isna() == want.isna()).all().all()  # a missing value stays missing (None or NaN)
    pd.testing.assert_frame_equal(*(df.astype(object).where(df.notna(), None) for df in (back, want)),
                                  check_dtype=False)
    assert "rows ×" in capsys.readouterr().err
    assert table_cli.main([str(run)]) == 0  # no file: CSV on stdout
    assert capsys.readouterr().out.startswith("row_kind,run_dir,")


@needs_pandas
def test_a_run_not_yet_reduced_is_a_row_per_unit_and_estimand_without_numbers(tmp_path):
    config = {"seed": 3, "intervention": {}}  # the table reads it held to run.json's config_hash
    index = planned_run(tmp_path / "r", n_units=2)
    index = planned_run(tmp_path / "r2", n_units=2, hashes={a: config_hash(config) for a in index.arm_names})
    shutil.move(tmp_path / "r2" / "run.json", tmp_path / "r" / "run.json")
    arms = tmp_path / "r" / "arms"
    for arm in index.arm_names:
        (arms / arm).mkdir(parents=True)
        (arms / arm / "config.yaml").write_text("seed: 3\nintervention: {}\n")
    df = table_cli.load(tmp_path / "r")
    assert len(df) == 2 and set(df.verdict) == {"not reduced"} and df.cos.isna().all()
    assert list(df.seed) == [3, 3] and list(df.sigma) == [0.1, 0.2]


def test_bad_input_is_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(table, "pd", None)  # the extra not installed: one line naming it
    with pytest.raises(SystemExit) as exc:
        table_cli.main([str(tmp_path)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "twinrun: error: twinrun.table needs pandas: pip install 'twinrun[table]' (pandas and pyarrow)"]


@needs_pandas
def test_a_directory_that_is_no_run_is_one_line_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        table_cli.main([str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"twinrun: error: {tmp_path}: holds no run.json and no sweep point: give a run or a "
                    "sweep directory")]


def test_a_training_row_carries_its_segment_s_losses_and_settings_are_typed():
    summary = {"losses": [
        {"step": 2, "role": "twin", "train_loss": 0.5, "heldout_loss": 0.4, "heldout_se": 0.01},
        {"step": 2, "role": "intervention", "train_loss": 0.6, "heldout_loss": 0.45, "heldout_se": 0.01,
         "heldout_diff": 0.05, "heldout_diff_se": 0.002, "heldout_diff_significant": True},
        {"step": 4, "role": "chaos", "train_loss": 0.1, "heldout_loss": 0.1, "heldout_se": 0.0}]}
    got = table.loss_fields(summary, 2)
    assert (got["train_loss"], got["twin_train_loss"], got["heldout_diff"]) == (0.6, 0.5, 0.05)
    assert got["heldout_diff_significant"] is True and got["twin_heldout_loss"] == 0.4
    assert table.loss_fields(summary, 4) == {} and table.loss_fields(None, 2) == {}
    cols = table.settings({"seed": 1, "probe": {"n_images": 8, "params": ["*"]}, "intervention": {"f": 0.5}})
    assert cols == {"probe.n_images": 8, "probe.params": '["*"]', "intervention.f": 0.5}
