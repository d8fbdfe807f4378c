"""The frictions a new user met (issue 21, point 6), each held by a test: a way to reduce after
launcher.wait=false that status names; progress said once per run; Hydra's YAML sweeper params
validated like a comma sweep; --cfg with -m one line; the version on every record; lock files
hidden and documented; the README's commands."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, run_twinrun
from omegaconf import OmegaConf
from rundirs import create, done, run_doc

from twinrun import status
from twinrun.app import sweep_overrides
from twinrun.launchers.placement import Element
from twinrun.launchers.wait import wait
from twinrun.provenance.version import twinrun_version, version_text
from twinrun.storage.rundir import RunDir


def test_status_names_the_command_that_reduces_a_measured_run(tmp_path, capsys):
    run = tmp_path / "run"
    create(run, run_doc([0.2, 0.5], status="measured"))
    assert status.main([str(run)]) == 0
    assert f"not reduced yet: `python -m twinrun.reduce {run}`" in capsys.readouterr().out
    create(tmp_path / "sweep" / "0", run_doc([0.2], status="measured"))
    assert status.main([str(tmp_path / "sweep")]) == 0
    assert f"`python -m twinrun.sweep {tmp_path / 'sweep'}`" in capsys.readouterr().out


class FakeJob:
    """A submitit job whose state moves one step per poll: PENDING, RUNNING, COMPLETED."""

    def __init__(self, job_id: str, folder: Path, seq):
        self.job_id, self.seq = job_id, list(seq)
        self.paths = SimpleNamespace(result_pickle=folder / f"{job_id}.pkl", stderr=folder / "err",
                                     folder=folder)

    @property
    def state(self) -> str:
        return self.seq[0]

    def done(self) -> bool:
        if len(self.seq) > 1:
            self.seq.pop(0)
        if self.seq[0] == "COMPLETED":
            self.paths.result_pickle.touch()
        return self.seq[0] == "COMPLETED"

    def result(self):
        return "measured"


def test_split_bins_progress_is_one_line_per_run_when_it_changes(tmp_path, capsys):
    doc = run_doc([0.1 * (k + 1) for k in range(6)])
    for k in range(6):
        for arm in ("pin_sigma", "native"):
            done(doc, k, arm, "a" * 64)
    run = tmp_path / "run"
    create(run, doc)
    staggered = [["PENDING"] * (k % 3 + 1) + ["RUNNING"] * 2 + ["COMPLETED"] for k in range(6)]
    jobs = [(Element(run, [k]), FakeJob(f"77_{k}", tmp_path, seq)) for k, seq in enumerate(staggered)]
    assert wait(jobs, {"poll_s": 0}) == {}
    progress = [line for line in capsys.readouterr().out.splitlines() if "units done" in line]
    assert 1 < len(progress) <= 8, progress  # a line per change of the run, not per element and poll
    assert all(line.count(str(run)) == 1 and "77_3" not in line for line in progress)
    assert "6 COMPLETED" in progress[-1]


def test_yaml_sweeper_params_are_expanded_with_the_command_lines():
    config = OmegaConf.create({"hydra": {"sweeper": {"params": {"intervention.sigma_pin": "0.5,1.2"}},
                                         "overrides": {"task": ["+experiment=pin_sigma", "seed=0,1"]}}})
    assert sweep_overrides(config) == ["intervention.sigma_pin=0.5,1.2", "+experiment=pin_sigma", "seed=0,1"]


@pytest.mark.slow
def test_a_yaml_sweep_is_validated_point_by_point_before_any_runs(tmp_path):
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "sw.yaml").write_text("# @package _global_\ndefaults:\n  - override /intervention: pin_sigma\n"
                                  "hydra:\n  sweeper:\n    params:\n      probe.n_draws: 2,3\n"
                                  "      probe.n_imgs: 3\n")
    proc = run_twinrun(["-m", "--config-dir", str(tmp_path / "conf"), "+experiment=sw",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("twinrun: error: sweep point 0 (probe.n_draws=2 probe.n_imgs=3 ")
    assert "Key 'n_imgs' not in 'ProbeConfig'" in lines[0] and lines[0].endswith("nothing was run")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_cfg_with_multirun_is_one_line_with_exit_2(tmp_path):
    proc = run_twinrun(["-m", "+experiment=pin_sigma", "intervention.sigma_pin=0.5,1.2", "--cfg", "job"],
                       cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        ("twinrun: error: --cfg with -m: Hydra prints the config of one run, not of a sweep; drop -m and "
         "give one point's values (e.g. intervention.sigma_pin=0.5 --cfg job)")]


def test_the_version_names_package_and_commit():
    v = twinrun_version()
    assert v["version"] == "0.1.0" and set(v) == {"version", "commit", "dirty"}
    assert version_text({"version": "0.1.0", "commit": None}) == "twinrun 0.1.0 (no git checkout)"
    assert version_text({"version": "0.1.0", "commit": "ab" * 20, "dirty": True}) == \
        "twinrun 0.1.0 (git ababababab, dirty)"
    assert version_text(None).startswith("twinrun version not recorded")


def test_lock_files_are_hidden_and_documented(tmp_path):
    rd = RunDir(tmp_path)
    for lock in (rd.lock, rd.index_lock, rd.unit_lock(0), rd.unit_lock(5)):
        assert lock.name.startswith("."), lock  # not in `ls`, nor in the report's listing
    doc = (REPO / "docs" / "run-directory.md").read_text()
    assert ".lock, .lock-unit<k>, .run.json.lock" in doc and "never deleted" in doc


def test_readme_says_how_to_run_the_installed_command_and_its_first_example_reads_something():
    readme = (REPO / "README.md").read_text()
    assert "source .venv/bin/activate" in readme and ".venv/bin/python -m twinrun" in readme
    block = readme.split("## The default experiment", 1)[1]
    first = re.search(r"^(?:twinrun|python -m twinrun) \+experiment=\S+.*$", block, re.MULTILINE).group(0)
    # the default protocol (297 images × 8 draws) reads every effect of pin_sigma: no shrunken probe
    assert "n_images" not in first and "n_draws" not in first, first


@pytest.mark.slow
def test_hydra_sweeper_params_on_the_command_line_is_one_line_not_a_traceback(tmp_path):
    proc = run_twinrun(["-m", "+experiment=pin_sigma", '++hydra.sweeper.params.probe.n_draws="2,3"',
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "File " not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "hydra.sweeper.params is for a YAML file" in lines[0], lines


def test_a_warning_raised_without_a_registry_is_shown_once():
    """torch raises its C++ warnings with no registry, which Python's own "once" cannot hold back:
    warn_once shows each (category, text) once; another text still shows."""
    import warnings

    from twinrun.job import warn_once

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        warn_once()
        for _ in range(3):  # planning's trial, the job's trial, the first bin
            warnings.warn_explicit("no batching rule for aten::sdpa", UserWarning, "attention.py", 7,
                                   registry=None)
        warnings.warn_explicit("another", UserWarning, "attention.py", 7, registry=None)
        warn_once()  # idempotent: not wrapped twice
    assert [str(w.message) for w in shown] == ["no batching rule for aten::sdpa", "another"]


def test_sdpa_under_vmap_is_kept_off_and_other_fallbacks_still_show():
    """A diffusers DiT's attention under vmap: torch's per-sample-loop warning (raised from C++, with no
    registry; the text of functorch's BatchedFallback) is no news to act on; another op's still shows."""
    import warnings

    from twinrun.job import warn_once

    fallback = ("There is a performance drop because we have not yet implemented the batching rule for {}. "
                "Please file us an issue on GitHub so that we can prioritize its implementation.")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        warn_once()
        for op in ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                   "aten::other_op"):
            warnings.warn_explicit(fallback.format(op), UserWarning, "attention.py", 1, registry=None)
    said = [str(w.message) for w in shown]
    assert len(said) == 1 and "aten::other_op" in said[0], said
