"""Plugins (twinrun/plugins.py, docs/plugins.md): a measurement kind and an intervention from another
installed package, found by entry point and selected by name like a built-in. The worked example
(examples/twinrun_activation) is installed onto a temporary path and run end to end, twinrun unchanged."""

import json
import os
from importlib.metadata import EntryPoint

import pytest
from conftest import run_twinrun
from plugin_example import install_example

from twinrun import plugins
from twinrun.errors import ConfigError

GRID = ["sigma_grid.sigmas=[0.2,0.5,1.2]", "+plugin.n_images=8", "+plugin.device=cpu"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The environment of a process in which the example package is installed."""
    target = install_example(tmp_path_factory.mktemp("site"))
    return {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}


def test_a_misspelled_kind_is_one_line_listing_the_installed_ones(tmp_path, installed):
    proc = run_twinrun(["measure=activaton", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, env=installed)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "measure='activaton'" in err[0]
    assert err[0].endswith("choose one of probe, train, sample, activation")
    assert not (tmp_path / "r").exists()


def test_help_lists_the_installed_kinds_and_interventions(tmp_path, installed):
    proc = run_twinrun(["--help"], cwd=tmp_path, env=installed)
    assert proc.returncode == 0, proc.stderr
    assert "measure: probe, train, sample, activation" in proc.stdout
    choices = next(line for line in proc.stdout.splitlines() if line.startswith("intervention:"))
    assert "scale_sigma_cond" in choices
    bare = run_twinrun(["--help"], cwd=tmp_path)  # not installed: not listed
    assert "measure: probe, train, sample " in bare.stdout and "scale_sigma_cond" not in bare.stdout


def test_a_plugin_intervention_is_selected_by_name_like_a_built_in(tmp_path, installed):
    proc = run_twinrun(["+experiment=pin_sigma", "intervention=scale_sigma_cond", "intervention.factor=1.5",
                        "probe.device=cpu",
                        "--cfg", "job"], cwd=tmp_path, env=installed)
    assert proc.returncode == 0, proc.stderr
    assert "_target_: twinrun_activation.intervention.ScaleSigmaCond" in proc.stdout
    assert "factor: 1.5" in proc.stdout


def test_a_plugin_that_fails_to_load_is_one_line_naming_it(monkeypatch):
    broken = EntryPoint("broken", "no_such_module_anywhere:KIND", plugins.MEASURES_GROUP)
    monkeypatch.setattr(plugins, "installed", lambda group: {"broken": broken})
    with pytest.raises(ConfigError, match=r"^measure='broken': the plugin no_such_module_anywhere:KIND fail"):
        plugins.lookup(plugins.MEASURES_GROUP, "measure", "broken", {})


@pytest.mark.slow
def test_the_example_kind_runs_end_to_end_and_without_it_a_run_is_one_line(tmp_path, installed):
    run = tmp_path / "run"
    proc = run_twinrun(["measure=activation", "intervention=pin_sigma", *GRID, f"hydra.run.dir={run}"],
                       cwd=tmp_path, env=installed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["passed"] and [g["sigma"] for g in summary["gates"]] == [0.5]
    effects = {e["sigma"]: e for e in summary["effects"]}
    assert effects[0.5]["value"] == 0.0 and effects[0.2]["value"] != 0.0  # the gate bin is the twin
    doc = json.loads((run / "run.json").read_text())
    assert doc["measure"] == "activation" and doc["units"][1]["activation"] == {"sigma": 0.5}
    for module, args in (("twinrun.reduce", [str(run)]), ("twinrun.resume", [str(run)]),
                         ("twinrun.status", [str(run)])):
        proc = run_twinrun(args, cwd=tmp_path, module=module)  # the plugin is not installed here
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1, (module, proc.stderr)
        assert "field measure: 'activation' is no kind installed here" in err[0], err
