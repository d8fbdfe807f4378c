"""run.json as a typed record: the types are the validator's description, and the job reads it
through RunIndex (which units are whole, which kernel path they hold, which units a job measures)."""

import copy
import json
import os
import re
import signal
import typing

import pytest
from conftest import TINY
from rundirs import create, done, run_doc

from twinrun import job, plan
from twinrun.errors import Interrupted, KernelPathRefused, StoreError, raise_on_signals
from twinrun.job import run_job
from twinrun.measures.probe import PROBE
from twinrun.plan import plan_run
from twinrun.provenance.record import kernel_path_sha256, straddling_rule
from twinrun.storage.records import (
    ArmEntry,
    JobRecord,
    ProbeUnit,
    RunRecord,
    UnitEntry,
    validate_run,
    validate_units,
)
from twinrun.storage.rundir import RunDir, RunIndex

SHA_A, SHA_B = "a" * 64, "b" * 64
STRADDLES = r"its finished units were measured on another kernel path \(differs in threads\.intra_op\)"


def fingerprint_on(threads: int) -> dict:
    return {"kernel_path": {"threads": {"intra_op": threads}}, "info": {}}


def record(stores_done: list[list[str | None]]) -> RunRecord:
    """A run.json with one unit per entry: each arm's store done on that kernel path, or pending (None)."""
    doc = run_doc([0.5 * (i + 1) for i in range(len(stores_done))], status="running")
    for i, paths in enumerate(stores_done):
        for arm, path in zip(("pin_sigma", "native"), paths):
            if path is not None:
                done(doc, i, arm, path)
    return doc


def index_on_disk(run_dir, run: RunRecord, recorded: dict) -> RunIndex:
    """run.json, and the fingerprint of kernel path B as a job on it recorded it in env/."""
    index = create(run_dir, run)
    index.run_dir.env_dir.mkdir()
    index.run_dir.kernel_path_env(SHA_B).write_text(json.dumps(recorded))
    return index


def rule_of(index: RunIndex, fp: dict):
    return straddling_rule(index.run_dir.path, index.run_dir.kernel_path_env, fp)


def test_straddling_is_judged_on_whole_units_only(tmp_path):
    mine = fingerprint_on(2)
    # unit 0 half-measured on path B (cut short): it is measured again whole, so it commits to nothing
    index = index_on_disk(tmp_path / "half", record([[SHA_B, None], [None, None]]), fingerprint_on(1))
    assert index.whole_kernel_paths() == set()
    rule_of(index, mine)(index.whole_kernel_paths(), SHA_A)
    # unit 0 whole on path B: a job on path A may not add units to it
    index = index_on_disk(tmp_path / "whole", record([[SHA_B, SHA_B], [None, None]]), fingerprint_on(1))
    with pytest.raises(KernelPathRefused, match=STRADDLES):
        rule_of(index, mine)(index.whole_kernel_paths(), SHA_A)
    rule_of(index, mine)(index.whole_kernel_paths(), SHA_B)  # the same path joins


class _Session:
    """The measurement kind's side of a job that measures nothing (measure_units never calls measure)."""

    compile_mode = None
    identity: typing.ClassVar[dict] = {"model_sha256": "0" * 64}

    def arithmetic(self) -> dict:
        return {}

    def sentinel(self) -> dict:
        return {"digest": "0" * 64}


def test_a_job_with_no_unit_to_measure_refuses_nothing(tmp_path, monkeypatch):
    mine = fingerprint_on(2)
    monkeypatch.setattr(job, "fingerprint", lambda compile_mode=None, device=None: copy.deepcopy(mine))
    on_b = fingerprint_on(1)
    on_b["kernel_path"]["probe"] = {}  # as a job records it: with the kind's arithmetic settings
    index = index_on_disk(tmp_path, record([[SHA_B, SHA_B], [None, None]]), on_b)
    with pytest.raises(KernelPathRefused, match=STRADDLES):  # a unit to measure, on another path: refused
        job.measure_units(index, [], _Session(), index.units[1:], {})
    assert index.jobs == []  # refused before the job recorded itself
    job.measure_units(RunIndex.load(tmp_path), [], _Session(), [], {})  # nothing to measure: nothing refused
    (recorded,) = RunIndex.load(tmp_path).jobs
    on_mine = {"kernel_path": {**mine["kernel_path"], "probe": {}}}  # with the kind's arithmetic settings
    assert recorded["kernel_path_sha256"] == kernel_path_sha256(on_mine)


def test_a_damaged_kernel_path_record_still_refuses_in_one_line(tmp_path):
    index = index_on_disk(tmp_path, record([[SHA_B, SHA_B], [None, None]]), {})
    index.run_dir.kernel_path_env(SHA_B).write_bytes(b"\xff not json")
    with pytest.raises(KernelPathRefused, match=r"\(differs in \(unrecorded\)\)") as err:
        rule_of(index, fingerprint_on(2))(index.whole_kernel_paths(), SHA_A)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the types are the validator's


def _required_fields(schema, prefix=""):
    """Every required field of a TypedDict, as run.json field paths, and how to reach its parent."""
    for key in schema.__required_keys__:
        hint = typing.get_type_hints(schema)[key]
        if type(None) not in typing.get_args(hint):
            yield f"{prefix}{key}", key


def test_every_required_field_of_the_types_is_checked(tmp_path):
    """Deleting any required field the types declare is refused naming that field: the validator
    reads the types, so a field added to a type is checked without a second list."""
    valid = record([[SHA_B, SHA_B]])
    valid["jobs"] = [{"index": 0, "kernel_path_sha256": SHA_B, "sentinel_start": "s", "sentinel_end": None,
                      "hostname": None, "boot_id": None, "slurm_job_id": None}]
    path = tmp_path / "run.json"
    validate_run(path, copy.deepcopy(valid))
    parents = {RunRecord: lambda r: r, ArmEntry: lambda r: r["arms"][0], UnitEntry: lambda r: r["units"][0],
               ProbeUnit: lambda r: r["units"][0]["probe"], JobRecord: lambda r: r["jobs"][0]}
    prefixes = {RunRecord: "", ArmEntry: "arms[0].", UnitEntry: "units[0].", ProbeUnit: "units[0].probe.",
                JobRecord: "jobs[0]."}
    checked = 0
    for schema, parent in parents.items():
        for field, key in _required_fields(schema, prefixes[schema]):
            if field == "format":
                continue  # checked first, by value: "not a twinrun run index"
            run = copy.deepcopy(valid)
            del parent(run)[key]
            with pytest.raises(StoreError, match=f"field {re.escape(field)}: missing"):
                validate_run(path, run)
                validate_units(path, run, PROBE.unit_fields, PROBE.increasing)  # the kind's, handed down
            checked += 1
    assert checked >= 16
    run = copy.deepcopy(valid)
    del run["units"][0]["probe"]  # the unit's own fields, under the run's measurement kind
    with pytest.raises(StoreError, match=r"field units\[0\]\.probe: missing"):
        validate_run(path, run)


def test_a_type_mismatch_names_the_field_and_the_expected_type(tmp_path):
    run = record([[SHA_B, SHA_B]])
    run["units"][0]["gate"] = "yes"
    with pytest.raises(StoreError, match=r"field units\[0\]\.gate: 'yes' is not true/false"):
        validate_run(tmp_path / "run.json", run)
    run = record([[SHA_B, SHA_B]])
    run["units"][0]["stores"]["native"]["kernel_path_sha256"] = "not hex"
    field = r"field units\[0\]\.stores\.native\.kernel_path_sha256"
    with pytest.raises(StoreError, match=rf"{field}: 'not hex' is not a hex"):
        validate_run(tmp_path / "run.json", run)


# ----------------------------------------------------------------------------- run_job(units=...)


@pytest.mark.slow
def test_run_job_measures_only_the_units_given_and_is_measured_once_all_are_whole(tmp_path, compose_cfg):
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), tmp_path)
    run_job(tmp_path, units=[1])
    index = RunIndex.load(tmp_path)
    assert [u["index"] for u in index.whole_units(verify=True)] == [1]
    assert index.status == "running"  # not "measured": units 0 and 2 are pending
    assert [j["sentinel_end"] is not None for j in index.doc["jobs"]] == [True]
    run_job(tmp_path)
    index = RunIndex.load(tmp_path)
    assert [u["index"] for u in index.whole_units(verify=True)] == [0, 1, 2] and index.status == "measured"
    assert [j["index"] for j in index.doc["jobs"]] == [0, 1]


def test_the_first_update_keeps_the_document_in_memory(tmp_path):
    # run.json not written yet: the document in memory is the record, and stays whole after the update
    index = RunIndex(RunDir(tmp_path), record([[None, None], [None, None]]))
    held = index.doc
    index.set_status("running")
    assert index.doc is held and len(index.units) == 2 and index.doc["status"] == "running"
    assert json.loads((tmp_path / "run.json").read_text()) == index.doc


def test_an_element_hashes_only_its_own_units_stores(tmp_path, monkeypatch):
    read = []

    def verify_store(path, sha256, **checks):
        read.append(path.name)
        raise StoreError(path, "missing")

    monkeypatch.setattr("twinrun.storage.rundir.verify_store", verify_store)
    index = create(tmp_path, record([[SHA_A, SHA_A], [SHA_A, SHA_A], [None, None]]))
    files = [u["stores"]["native"]["file"] for u in index.units]
    # unit 1's stores are read (missing: measured again); unit 0 is judged by its record, unit 2 is pending
    assert [u["index"] for u in index.pending_units([1, 2])] == [1, 2]
    assert set(read) == {files[1]}
    read.clear()
    assert [u["index"] for u in index.pending_units(None)] == [0, 1, 2] and set(read) == set(files[:2])


def test_a_signal_while_the_plan_is_written_leaves_a_planned_run_not_configs_without_run_json(
        tmp_path, compose_cfg, monkeypatch):
    """SIGINT between the first arm config and run.json (a real signal, sent to this process from
    inside the write loop) acts only once run.json exists: a run that resumes, never a half plan."""
    written = []

    def write_then_signal(path, data):
        written.append(path)
        real_write(path, data)
        if len(written) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    real_write = plan.atomic_write
    monkeypatch.setattr(plan, "atomic_write", write_then_signal)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    raise_on_signals()
    try:
        with pytest.raises(Interrupted):
            plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), tmp_path)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert len(written) > 1, "the signal acted inside the write loop"
    assert RunIndex.load(RunDir(tmp_path)).status == "planned"
