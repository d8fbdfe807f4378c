"""`python -m twinrun --help` tells a new user what twinrun does, what to choose and where results go."""

from pathlib import Path

import pytest
from conftest import REPO, run_twinrun

from twinrun.app import CONF_DIR


def _options(group: str, conf_dir: Path = Path(CONF_DIR)) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def help_text(tmp_path_factory) -> str:
    done = run_twinrun(["--help", "probe.n_images=7"], cwd=tmp_path_factory.mktemp("anywhere"))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_says_what_twinrun_does_and_where_results_go(help_text):
    assert help_text.startswith("twinrun:")
    for needle in ("native twin", "no-op gate", "outputs/runs/", "report.md", "python -m twinrun.resume",
                   "Exit codes", "docs/index.md"):
        assert needle in help_text, needle


def test_help_lists_every_experiment_and_intervention_but_no_schema(help_text):
    lines = help_text.splitlines()
    assert f"experiment: {', '.join(_options('experiment'))}" in lines
    assert f"intervention: {', '.join(_options('intervention'))}" in lines
    assert "schema" not in help_text, "the typed schema/* groups are not choices"


def test_help_shows_knobs_as_composed_and_keeps_hydra_flags(help_text):
    assert "probe.n_images=7 " in help_text  # the override given on the command line, not the default
    for flag in ("--multirun,-m", "--cfg,-c", "--config-dir,-cd", "--hydra-help"):
        assert flag in help_text, flag


def test_help_lists_a_users_own_experiments(tmp_path):
    byo = REPO / "examples" / "byo" / "conf"
    done = run_twinrun(["--config-dir", str(byo), "--help"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    experiments = sorted(_options("experiment") + _options("experiment", byo))
    assert f"experiment: {', '.join(experiments)}" in done.stdout.splitlines()


@pytest.mark.parametrize(("module", "codes"),
                         [("twinrun.diff", "0 bit-identical; 1 at least one tensor differs; 2 bad"),
                          ("twinrun.compare", "0 compared; 2 bad; 3 kernel paths differ")])
def test_diff_and_compare_help_document_every_exit_code(module, codes, capsys):
    main = __import__(module, fromlist=["main"]).main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for item in codes.split("; "):
        assert item in text, item
    if module == "twinrun.compare":
        assert "--force printed with every number marked INVALID (still 3" in text
