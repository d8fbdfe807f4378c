"""`python -m twinrun.env` shows the kernel path a run made here records, digest and determinism included."""

import json

import pytest
from conftest import TINY, run_twinrun


def _env_cli(cwd, *args) -> dict:
    done = run_twinrun(list(args), cwd=cwd, module="twinrun.env")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_env_digest_matches_the_kernel_path_file_a_run_writes(tmp_path, model_args):
    done = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, "hydra.run.dir=run"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (recorded,) = (tmp_path / "run" / "env").glob("kernel_path-*.json")
    run_sha = json.loads((tmp_path / "run" / "run.json").read_text())["jobs"][0]["kernel_path_sha256"]

    shown = _env_cli(tmp_path, "--device", "cpu")  # as the run (tests pin the CPU: conftest.CPU)
    assert f"env/{recorded.name}" == shown["kernel_path_file"]
    assert shown["kernel_path_sha256"] == run_sha
    assert shown["kernel_path"] == json.loads(recorded.read_text())["kernel_path"]
    assert shown["kernel_path"]["switches"]["deterministic_algorithms"] is True  # as runs record it


def test_env_without_determinism_is_another_kernel_path(tmp_path):
    on, off = _env_cli(tmp_path), _env_cli(tmp_path, "--determinism", "off")
    assert off["kernel_path"]["switches"]["deterministic_algorithms"] is False
    assert off["determinism"]["enabled"] is False and on["determinism"]["enabled"] is True
    assert off["kernel_path_sha256"] != on["kernel_path_sha256"]
