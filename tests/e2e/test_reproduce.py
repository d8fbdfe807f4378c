"""The report's "Reproduce" command measures the run afresh into a new directory, bit for bit."""

import re
import shlex

import pytest
from conftest import CONF_DIR, TINY, measured, run_twinrun
from hydra import compose, initialize_config_dir
from hydra.conf import ConfigSourceInfo
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from twinrun.app import reproduce_command
from twinrun.config import register_configs


def _fenced_commands(report: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", report, flags=re.DOTALL)


def test_reproduce_keeps_config_dirs_and_overrides_but_no_hydra_directory(tmp_path):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=pin_sigma"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.overrides.task = ["+experiment=my exp", "hydra.run.dir=/old/run", "probe.n_images=8"]
        cfg.hydra.runtime.config_sources.append(ConfigSourceInfo(path=f"file://{tmp_path}/my conf",
                                                                 schema="file", provider="command-line"))
    HydraConfig.instance().set_config(cfg)
    try:
        command = reproduce_command()
    finally:
        HydraConfig.instance().cfg = None  # a process-wide singleton: leave it as found
    assert shlex.split(command) == ["python", "-m", "twinrun", "--config-dir", f"{tmp_path}/my conf",
                                    "+experiment=my exp", "probe.n_images=8"]


@pytest.mark.slow
def test_reproduce_measures_afresh_into_a_new_directory(tmp_path, model_args):
    first = tmp_path / "first"
    done = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, f"hydra.run.dir={first}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh, resume = _fenced_commands((first / "report.md").read_text())
    assert "hydra.run.dir" not in fresh and str(first) not in fresh, fresh
    assert resume == f"python -m twinrun.resume {first}"

    argv = shlex.split(fresh)
    assert argv[:3] == ["python", "-m", "twinrun"]
    again = run_twinrun(argv[3:], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    (second,) = (tmp_path / "outputs" / "runs").glob("*/*")  # a new directory, where fresh runs go
    assert measured(second) == measured(first)
