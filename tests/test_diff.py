"""`python -m twinrun.diff`: bit-identical vs close vs different, and bad input."""

import pytest
import torch
from conftest import run_twinrun
from safetensors.torch import save_file

from twinrun.diff import diff_tensors, load_tensors


def test_counts_max_diff_and_cosine(tmp_path):
    a = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.5])}
    b = {"w": torch.tensor([1.0, 2.0, 3.5]), "b": torch.tensor([0.5])}
    d = diff_tensors(a, b)
    assert (d.n_tensors, d.n_differ, d.differing) == (2, 1, ["w"])
    assert d.max_abs_diff == pytest.approx(0.5)
    expected = (1 + 4 + 10.5 + 0.25) / ((1 + 4 + 9 + 0.25) * (1 + 4 + 12.25 + 0.25)) ** 0.5
    assert d.cosine == pytest.approx(expected, rel=1e-12)
    same = diff_tensors(a, {k: v.clone() for k, v in a.items()})
    assert same.n_differ == 0 and same.max_abs_diff == 0.0


def test_one_ulp_is_not_bit_identical():
    x = torch.randn(100)
    y = x.clone()
    y[3] = torch.nextafter(y[3], torch.tensor(10.0))
    d = diff_tensors({"x": x}, {"x": y})
    assert d.n_differ == 1 and 0 < d.max_abs_diff < 1e-6 and d.cosine == pytest.approx(1.0)


def test_cli_files_and_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    t = {"w": torch.arange(4.0)}
    save_file(t, tmp_path / "a" / "x.safetensors")
    save_file(t, tmp_path / "b" / "x.safetensors")
    same = run_twinrun([str(tmp_path / "a"), str(tmp_path / "b")], cwd=tmp_path, module="twinrun.diff")
    assert same.returncode == 0 and "0 / 1 tensors differ" in same.stdout
    save_file({"w": torch.arange(4.0) + 1e-3}, tmp_path / "b" / "x.safetensors")
    other = run_twinrun([str(tmp_path / "a" / "x.safetensors"), str(tmp_path / "b" / "x.safetensors")],
                        cwd=tmp_path, module="twinrun.diff")
    assert other.returncode == 1 and "1 / 1 tensors differ" in other.stdout
    assert len(load_tensors(tmp_path / "a")) == 1


@pytest.mark.parametrize("bad", ["missing", "garbage", "mismatch"])
def test_cli_bad_input_exit_2(tmp_path, bad):
    save_file({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    b = tmp_path / "b.safetensors"
    if bad == "garbage":
        b.write_bytes(b"\x00" * 50)
    elif bad == "mismatch":
        save_file({"v": torch.zeros(2)}, b)
    proc = run_twinrun([str(tmp_path / "a.safetensors"), str(b)], cwd=tmp_path, module="twinrun.diff")
    assert (proc.returncode == 2 and proc.stderr.startswith("twinrun: error:")
            and "Traceback" not in proc.stderr)
