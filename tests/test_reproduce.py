"""The report's "Reproduce" command measures the run afresh into a new directory, bit for bit."""

import re
import shlex

import pytest
from conftest import TINY, measured, run_twinrun

pytestmark = pytest.mark.slow


def _fenced_commands(report: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", report, flags=re.DOTALL)


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
