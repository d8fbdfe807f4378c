"""arms.replicate_segments=K, the cheaper protocol: the replicate is measured in the first K segments only,
with determinism on, and only while it repeats the twin bit for bit there; the other arms' results are
those of the full protocol, and a replicate that leaves the twin within the K segments stops the run."""

import json

import pytest
from train_runs import compose_cfg, tiny_cfg, train_run

from twinrun.errors import ConfigError
from twinrun.job import run_job
from twinrun.measures.train_session import ReplicateLeft
from twinrun.plan import plan_run, trusted_targets
from twinrun.publish.train_report import first_lines
from twinrun.storage.rundir import RunIndex
from twinrun.storage.train_store import read_train_store

REP = "native_replicate"


def last_digests(red, arm="native"):
    return read_train_store(red.index.store_path(red.index.units[-1], arm)).digests


@pytest.mark.slow
def test_the_replicate_measured_for_the_first_segment_only_leaves_every_other_result_alone(tmp_path):
    full = train_run(tmp_path / "full")
    cheap = train_run(tmp_path / "cheap", ["arms.replicate_segments=1"])
    units = json.loads((tmp_path / "cheap" / "run.json").read_text())["units"]
    assert [REP in u["stores"] for u in units] == [True, True, False]  # the start, segment 1; not 2
    s = cheap.summary
    assert s["passed"] and s["replicate"]["deterministic"], s["checks"]
    assert [r["step"] for r in s["replicate"]["steps"]] == [0, 2]
    assert "measured through step 2 only: arms.replicate_segments" in s["replicate"]["detail"]
    # where its bits first leave the twin's: not through step 2, which is all it was measured for
    first = next(f for f in s["first_differing"] if f["arm"] == REP)
    assert first["step"] is None and first["measured_through"] == 2
    assert any("not through step 2 (measured there only)" in line for line in first_lines(s)), first_lines(s)
    for arm in ("native", "scale_lr", "scale_lr_noop", "native_chaos"):
        assert last_digests(cheap, arm) == last_digests(full, arm)
    assert [e["floor"] for e in s["effects"]] == [e["floor"] for e in full.summary["effects"]]
    # the full protocol, the default, measures it in every segment
    assert "measured through" not in full.summary["replicate"]["detail"]


@pytest.mark.slow
def test_a_replicate_that_leaves_the_twin_within_its_segments_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    # A step that draws from torch's global generator: the replicate leaves the twin at step 1.
    cfg = tiny_cfg(["arms.replicate_segments=1", "train.step={_target_: test_train_loop.global_step}"])
    plan_run(cfg, tmp_path / "run")
    with pytest.raises(ReplicateLeft) as err:
        run_job(tmp_path / "run", trusted_targets(cfg))
    assert err.value.exit_code == 1 and "\n" not in str(err.value)
    assert str(err.value).startswith(f"arm {REP}, segment 1 (steps 1–2): the replicate left the twin's "
                                     "bits at step 1")
    assert RunIndex.load(tmp_path / "run").failure["arm"] == REP


@pytest.mark.parametrize("override, why", [
    (["arms.replicate_segments=3"], "must be a whole number of segments in 1 … 2"),
    (["arms.replicate_segments=0"], "must be a whole number of segments in 1 … 2"),
    (["arms.replicate_segments=1", "determinism.enabled=false"], "needs determinism.enabled=true"),
])
def test_the_cheaper_protocol_is_refused_where_it_is_not_honest(tmp_path, override, why):
    with pytest.raises(ConfigError) as err:
        plan_run(tiny_cfg(override), tmp_path / "run")
    assert str(err.value).startswith("arms.replicate_segments=") and why in str(err.value)
    assert not (tmp_path / "run").exists()


def test_a_probe_run_has_no_segments_to_cut(tmp_path):
    cfg = compose_cfg(["+experiment=pin_sigma", "arms.replicate_segments=1"])
    with pytest.raises(ConfigError, match=r"^arms.replicate_segments=1: applies to runs whose units"):
        plan_run(cfg, tmp_path / "run")
