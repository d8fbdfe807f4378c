"""`python -m twinrun` end to end in a subprocess: results, exit codes, one-line errors."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY, measured, run_twinrun
from safetensors.torch import save_file

from twinrun.storage.rundir import RunIndex
from twinrun.storage.store import read_store

pytestmark = pytest.mark.slow


def tiny_run(tmp_path, *extra, name="run"):
    run_dir = tmp_path / name
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={run_dir}", *extra], cwd=tmp_path)
    return proc, run_dir


def test_tiny_run_end_to_end(tmp_path):
    proc, run_dir = tiny_run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checks_passed"] is True
    assert [c["passed"] for c in summary["checks"]] == [True] * len(summary["checks"])
    gates = summary["gates"]
    assert {g["estimand"] for g in gates} == {"all", "cond", "residual"}
    assert all(g["sigma"] == 0.5 and g["bit_identical"] and g["rule"] == "bit-identical" for g in gates)
    assert len(summary["effects"]) == 3 * 3
    for e in summary["effects"]:  # every row carries the printed intervals and its test of no effect
        assert {"cos_interval", "norm_ratio_interval", "near_boundary", "diff_norm2", "effect_p"} <= set(e)
        assert (e["cos_interval"] is None) == e["below_noise"]
    fam = summary["family"]
    assert fam["method"] == "holm" and fam["level"] == 0.05 and fam["n_rows"] == 2 * 3  # gate bin left out
    assert "effect rows read" in (run_dir / "report.md").read_text()
    # stores: one per (arm, bin), the fold sums as float32 [n_folds, n_params], identical draws across arms
    index = RunIndex.load(run_dir)
    assert index.measure == "probe" and index.arm_names == ["pin_sigma", "native"]
    for u in index.units:
        sums = {a: read_store(index.store_path(u, a)).sums for a in ("pin_sigma", "native")}
        assert sums["native"].shape[0] == 4 and sums["native"].dtype.is_floating_point
        if index.params(u)["sigma"] == 0.5:
            assert (sums["native"] == sums["pin_sigma"]).all()
        else:
            assert not (sums["native"] == sums["pin_sigma"]).all()
    diff = json.loads((run_dir / "config_diff.json").read_text())
    assert {d["key"] for d in diff} == {"intervention._target_", "intervention.sigma_pin"}
    assert "effects (debiased cos" in proc.stdout


def test_same_command_twice_is_bitwise_equal(tmp_path):
    (_, a), (_, b) = tiny_run(tmp_path, name="a"), tiny_run(tmp_path, name="b")
    stores_a, stores_b = measured(a), measured(b)
    assert len(stores_a) == 2 * 3 + 1 and stores_a == stores_b  # + the twin's replicate at the gate bin


BROKEN = textwrap.dedent("""
    import torch
    from twinrun.interventions import PinSigma

    class NotANoOpAtItsGate(PinSigma):
        '''Claims σ_pin as its no-op bin but feeds 3·σ_pin: the gate must catch it.'''
        def sigma_cond(self, sigma):
            return torch.full_like(sigma, 3 * self.sigma_pin)
""")


def test_broken_intervention_fails_its_gate_and_withholds_effects(tmp_path):
    (tmp_path / "broken_intervention.py").write_text(BROKEN)
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={run_dir}",
                        "intervention._target_=broken_intervention.NotANoOpAtItsGate"],
                       cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["effects"] == []
    assert not all(g["passed"] for g in summary["gates"])
    assert not any(g["bit_identical"] for g in summary["gates"])
    assert "INSTRUMENT BROKEN" in proc.stdout and "effects (debiased" not in proc.stdout
    report = (run_dir / "report.md").read_text()  # the report withholds them too
    assert "## Effects" not in report and "INSTRUMENT BROKEN" in report
    assert not (run_dir / "effect.png").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ("intervention.sigma_pin=0.3", "intervention.sigma_pin"),
        ("sigma_grid.sigmas=[]", "sigma_grid.sigmas"),
        ("sigma_grid.sigmas=[0.5,0.2,0.5]", "sigma_grid.sigmas"),
        ("sigma_grid.sigmas=[-0.1,0.5]", "sigma_grid.sigmas"),
        ("probe.n_draws=0", "probe.n_draws"),
        ("probe.n_folds=1", "probe.n_folds"),
        ("probe.n_folds=9", "probe.n_folds"),
        ("probe.n_images=5000", "probe.n_images"),
        ("reduce.estimands=[all,curvature]", "reduce.estimands"),
        ("intervention._target_=twinrun.interventions.NoSuchThing", "intervention._target_"),
        ("probe.params=[nothing.matches]", "probe.params"),
        # its spelling only; a GPU is judged in the job (test_job_device.py)
        ("probe.device=cuda:x", "probe.device"),
        ("determinism.float32_matmul_precision=fast", "determinism.float32_matmul_precision"),
        ("probe.device=meta", "probe.device"),
        ("seed=99999999999999999999", "seed"),
        ("probe.n_draws=1000000000", "probe.n_draws"),  # sized at plan time: TiBs of noise refused
    ],
)
def test_bad_input_is_one_line_exit_2_before_any_compute(tmp_path, override, key):
    proc, run_dir = tiny_run(tmp_path, override)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("twinrun: error: ") and key in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()  # a rejected config leaves nothing on disk


def test_unknown_key_is_hydras_error_with_exit_2(tmp_path):
    proc, run_dir = tiny_run(tmp_path, "probe.n_imgaes=8")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Key 'n_imgaes' not in 'ProbeConfig'" in lines[0] and "hint:" in lines[0]
    assert not run_dir.exists()


def test_an_unknown_key_added_with_plus_is_refused_listing_the_schema(tmp_path):
    proc, run_dir = tiny_run(tmp_path, "+probe.n_draw=100")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "+probe.n_draw=100" in lines[0] and "n_draws" in lines[0], lines
    assert not run_dir.exists()  # nothing on disk for a rejected config


def test_the_run_log_holds_what_was_printed(tmp_path):
    proc, run_dir = tiny_run(tmp_path)
    assert proc.returncode == 0
    (log,) = run_dir.glob("*.log")
    assert "effects (debiased cos" in log.read_text() and "twinrun: run directory" in log.read_text()


def test_no_intervention_declared_is_refused(tmp_path):
    proc = run_twinrun([*TINY, f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert proc.returncode == 2 and "+experiment=pin_sigma" in proc.stderr


def test_twin_that_differs_outside_the_intervention_is_refused(tmp_path):
    proc, _ = tiny_run(tmp_path, "sigma_grid.sigmas=[0.2,${intervention.sigma_pin}]")
    assert proc.returncode == 2 and "intervention" in proc.stderr and "Traceback" not in proc.stderr


def test_reduce_command_reproduces_the_summary(tmp_path):
    proc, run_dir = tiny_run(tmp_path)
    assert proc.returncode == 0
    first = (run_dir / "summary.json").read_text()
    again = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.reduce")
    assert again.returncode == 0 and (run_dir / "summary.json").read_text() == first
    missing = run_twinrun([str(tmp_path / "nope")], cwd=tmp_path, module="twinrun.reduce")
    assert missing.returncode == 2 and "nope" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("module", ["twinrun.reduce", "twinrun.resume", "twinrun.status"])
@pytest.mark.parametrize("what", ["missing", "not_a_run"])
def test_every_run_dir_command_refuses_bad_paths_in_one_line(tmp_path, module, what):
    target = tmp_path / "nowhere"
    if what == "not_a_run":
        target.mkdir()
        (target / "run.json").write_text("[1, 2")  # damaged index
    proc = run_twinrun([str(target)], cwd=tmp_path, module=module)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nowhere" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("module", ["twinrun.compare", "twinrun.diff"])
def test_pair_commands_refuse_missing_paths_in_one_line(tmp_path, module):
    proc = run_twinrun([str(tmp_path / "a"), str(tmp_path / "b")], cwd=tmp_path, module=module)
    assert (proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
            and "Traceback" not in proc.stderr)


def test_estimands_are_chosen_at_reduce_time_as_a_post_hoc_view(tmp_path):
    proc, run_dir = tiny_run(tmp_path)
    assert proc.returncode == 0
    again = run_twinrun([str(run_dir), "--estimands", "all"], cwd=tmp_path, module="twinrun.reduce")
    assert again.returncode == 0, again.stderr
    summary = json.loads((run_dir / "views" / "estimands-all" / "summary.json").read_text())
    assert ({e["estimand"] for e in summary["effects"]} == {"all"}
            and summary["post_hoc"]["used"]["estimands"] == ["all"])
    bad = run_twinrun([str(run_dir), "--estimands", "all,curvature"], cwd=tmp_path, module="twinrun.reduce")
    assert bad.returncode == 2 and "curvature" in bad.stderr and "Traceback" not in bad.stderr


def test_a_family_wise_level_is_chosen_at_reduce_time_as_a_post_hoc_view(tmp_path):
    proc, run_dir = tiny_run(tmp_path)
    assert proc.returncode == 0
    again = run_twinrun([str(run_dir), "--family-alpha", "0.001"], cwd=tmp_path, module="twinrun.reduce")
    assert again.returncode == 0, again.stderr
    view = json.loads((run_dir / "views" / "family_alpha-0.001" / "summary.json").read_text())
    registered = json.loads((run_dir / "summary.json").read_text())
    assert view["family"]["level"] == 0.001 and view["post_hoc"]["used"]["family_alpha"] == 0.001
    assert registered["family"]["level"] == 0.05  # the registered reading is left as it was
    bad = run_twinrun([str(run_dir), "--family-alpha", "0.7"], cwd=tmp_path, module="twinrun.reduce")
    assert (bad.returncode == 2 and bad.stderr.strip() == "twinrun: error: --family-alpha=0.7: must be in "
            "(0, 0.5), e.g. 0.05")


def _reader_leaves_early(args, cwd):
    # `python -m twinrun.diff A B | head`: the reader closes the pipe before the command writes. The read
    # end is closed before the child has even imported torch, so its every write meets a closed pipe.
    child = subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    child.stdout.close()
    err = child.stderr.read()
    return child.wait(timeout=300), err
def test_a_reader_that_leaves_early_ends_a_read_only_command_quietly(tmp_path):
    save_file({"w": torch.zeros(3)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(3)}, tmp_path / "b.safetensors")
    code, err = _reader_leaves_early(["twinrun.diff", "a.safetensors", "b.safetensors"], tmp_path)
    assert code == 141 and "Traceback" not in err and "BrokenPipeError" not in err, err
    _, run_dir = tiny_run(tmp_path)
    for module in ("twinrun.status", "twinrun.reduce"):
        code, err = _reader_leaves_early([module, str(run_dir)], tmp_path)
        assert code == 141 and "Traceback" not in err, (module, err)
