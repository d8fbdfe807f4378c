"""run.json as a typed record: the types are the validator's description, and the job reads it
through RunIndex (which bins are whole, which kernel path they hold, which bins a job measures)."""

import copy
import json
import re
import typing

import pytest
from conftest import TINY

from twinrun import provenance
from twinrun.errors import StoreError
from twinrun.run import plan_run, run_job
from twinrun.rundir import (
    RUN_FORMAT,
    ArmEntry,
    BinEntry,
    JobRecord,
    RunDir,
    RunIndex,
    RunRecord,
    validate_run,
)

SHA_A, SHA_B = "a" * 64, "b" * 64


def fingerprint_on(threads: int) -> dict:
    return {"kernel_path": {"threads": {"intra_op": threads}}, "info": {}}


def record(stores_done: list[list[str | None]]) -> RunRecord:
    """A run.json with one bin per entry: each arm's store done on that kernel path, or pending (None)."""
    arms: list[ArmEntry] = [{"name": "pin_sigma", "role": "intervention", "config_hash": "0" * 16},
                            {"name": "native", "role": "twin", "config_hash": "1" * 16}]
    bins: list[BinEntry] = []
    for i, paths in enumerate(stores_done):
        stores = {}
        for arm, path in zip(("pin_sigma", "native"), paths):
            stores[arm] = {"file": f"bin{i}.safetensors", "status": "pending"} if path is None else {
                "file": f"bin{i}.safetensors", "status": "done", "sha256": "c" * 64, "kernel_path_sha256": path}
        bins.append({"index": i, "sigma": 0.5 * (i + 1), "gate": i == 0, "stores": stores})
    return {"format": RUN_FORMAT, "status": "running", "command": None, "reference": None, "arms": arms,
            "registered": {"estimands": ["all"], "gate_rule": "replicate", "signal_alpha": 0.05}, "bins": bins}


def index_on_disk(tmp_path, run: RunRecord, recorded: dict) -> RunIndex:
    rd = RunDir(tmp_path)
    rd.env_dir.mkdir()
    (rd.kernel_path_env(SHA_B)).write_text(json.dumps(recorded))
    return RunIndex(rd, run)


def test_straddling_is_judged_on_whole_bins_only(tmp_path, monkeypatch):
    mine = fingerprint_on(2)
    monkeypatch.setattr(provenance, "kernel_path_sha256", lambda fp: SHA_A if fp is mine else SHA_B)
    # bin 0 half-measured on path B (cut short): it is measured again whole, so it commits to nothing
    index = index_on_disk(tmp_path, record([[SHA_B, None], [None, None]]), fingerprint_on(1))
    provenance.refuse_straddling(index, mine, index.bins)
    # bin 0 whole on path B: a job on path A may not add bins to it
    index = RunIndex(index.run_dir, record([[SHA_B, SHA_B], [None, None]]))
    with pytest.raises(provenance.KernelPathRefused, match=r"differs in threads\.intra_op"):
        provenance.refuse_straddling(index, mine, index.bins[1:])


def test_a_job_with_no_bin_to_measure_refuses_nothing(tmp_path, monkeypatch):
    mine = fingerprint_on(2)
    monkeypatch.setattr(provenance, "kernel_path_sha256", lambda fp: SHA_A if fp is mine else SHA_B)
    index = index_on_disk(tmp_path, record([[SHA_B, SHA_B]]), fingerprint_on(1))
    provenance.refuse_straddling(index, mine, [])


def test_a_damaged_kernel_path_record_still_refuses_in_one_line(tmp_path, monkeypatch):
    mine = fingerprint_on(2)
    monkeypatch.setattr(provenance, "kernel_path_sha256", lambda fp: SHA_A if fp is mine else SHA_B)
    index = index_on_disk(tmp_path, record([[SHA_B, SHA_B], [None, None]]), {})
    index.run_dir.kernel_path_env(SHA_B).write_bytes(b"\xff not json")
    with pytest.raises(provenance.KernelPathRefused, match=r"\(unrecorded\)"):
        provenance.refuse_straddling(index, mine, index.bins[1:])


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
    parents = {RunRecord: lambda r: r, ArmEntry: lambda r: r["arms"][0], BinEntry: lambda r: r["bins"][0],
               JobRecord: lambda r: r["jobs"][0]}
    prefixes = {RunRecord: "", ArmEntry: "arms[0].", BinEntry: "bins[0].", JobRecord: "jobs[0]."}
    checked = 0
    for schema, parent in parents.items():
        for field, key in _required_fields(schema, prefixes[schema]):
            if field == "format":
                continue  # checked first, by value: "not a twinrun run index"
            run = copy.deepcopy(valid)
            del parent(run)[key]
            with pytest.raises(StoreError, match=f"field {re.escape(field)}: missing"):
                validate_run(path, run)
            checked += 1
    assert checked >= 12


def test_a_type_mismatch_names_the_field_and_the_expected_type(tmp_path):
    run = record([[SHA_B, SHA_B]])
    run["bins"][0]["gate"] = "yes"
    with pytest.raises(StoreError, match=r"field bins\[0\]\.gate: 'yes' is not true/false"):
        validate_run(tmp_path / "run.json", run)
    run = record([[SHA_B, SHA_B]])
    run["bins"][0]["stores"]["native"]["kernel_path_sha256"] = "not hex"
    with pytest.raises(StoreError, match=r"field bins\[0\]\.stores\.native\.kernel_path_sha256: 'not hex' is not a hex"):
        validate_run(tmp_path / "run.json", run)


# ----------------------------------------------------------------------------- run_job(bins=...)


@pytest.mark.slow
def test_run_job_measures_only_the_bins_given_and_is_measured_once_all_are_whole(tmp_path, compose_cfg):
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), tmp_path)
    run_job(tmp_path, bins=[1])
    index = RunIndex.load(tmp_path)
    assert [b["index"] for b in index.whole_bins()] == [1]
    assert index.status == "running"  # not "measured": bins 0 and 2 are pending
    assert [j["sentinel_end"] is not None for j in index.doc["jobs"]] == [True]
    run_job(tmp_path)
    index = RunIndex.load(tmp_path)
    assert [b["index"] for b in index.whole_bins()] == [0, 1, 2] and index.status == "measured"
    assert [j["index"] for j in index.doc["jobs"]] == [0, 1]


def test_the_first_update_keeps_the_document_in_memory(tmp_path):
    # run.json not written yet: the document in memory is the record, and stays whole after the update
    index = RunIndex(RunDir(tmp_path), record([[None, None], [None, None]]))
    held = index.doc
    index.set_status("running")
    assert index.doc is held and len(index.bins) == 2 and index.doc["status"] == "running"
    assert json.loads((tmp_path / "run.json").read_text()) == index.doc


def test_an_element_hashes_only_its_own_bins_stores(tmp_path, monkeypatch):
    from twinrun import store
    from twinrun.run import pending_bins

    read = []

    def verify_store(path, sha256):
        read.append(path.name)
        raise StoreError(path, "missing")

    monkeypatch.setattr(store, "verify_store", verify_store)
    index = RunIndex(RunDir(tmp_path), record([[SHA_A, SHA_A], [SHA_A, SHA_A], [None, None]]))
    # bin 1's stores are read (missing: measured again); bin 0 is judged by its record, bin 2 is pending
    assert [b["index"] for b in pending_bins(index, [1, 2])] == [1, 2]
    assert set(read) == {"bin1.safetensors"}
    read.clear()
    assert [b["index"] for b in pending_bins(index, None)] == [0, 1, 2] and set(read) == {"bin0.safetensors",
                                                                                           "bin1.safetensors"}
