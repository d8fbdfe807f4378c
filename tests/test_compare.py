"""compare and the report agree: `compare RUN/arms/ARM RUN/arms/native` prints the report's own effects,
in the report's direction (norm ratio arm / twin) and with the same `residual` (the twin's mean over
bins removed from both), to every printed digit."""

import json

import pytest
from conftest import TINY, run_twinrun

from twinrun import compare

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "probe.n_images=290",
                        "probe.n_draws=1", "probe.n_folds=20",
                        f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "run"


def _rows(out: str) -> dict:
    """{(σ, estimand): (cos, norm ratio)} from compare's table ("below noise" as None)."""
    rows = {}
    for line in out.splitlines()[2:]:
        if "below noise" in line:
            rows[float(line.split()[0]), line.split()[1]] = None
            continue
        f = line.split()
        rows[float(f[0]), f[1]] = (float(f[4]), float(f[7]))
    return rows


def test_compare_arm_against_twin_prints_the_reports_effects(run, capsys):
    assert compare.main([str(run / "arms" / "pin_sigma"), str(run / "arms" / "native")]) == 0
    out = capsys.readouterr().out
    assert "norm ratio A/B" in out
    rows = _rows(out)
    effects = json.loads((run / "summary.json").read_text())["effects"]
    numbers = [e for e in effects if e["cos"] is not None]
    assert {e["estimand"] for e in numbers} >= {"all", "residual"}  # the residual is compared too
    for e in effects:
        got = rows[e["sigma"], e["estimand"]]
        if e["cos"] is None:
            assert got is None
            continue
        assert got == (round(e["cos"], 6), round(e["norm_ratio"], 6)), (e["sigma"], e["estimand"])
