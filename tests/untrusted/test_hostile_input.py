"""Hostile input that is consistent enough to pass a format check: bounded parsers, records held to the
rules of the config that wrote them, sizes checked against the run before any payload is read, and the
last tracebacks (a run directory Hydra cannot make, a moved data file) as one line."""

import json
import os
import struct
import types
from pathlib import Path

import pytest
import torch
from rundirs import create, done, run_doc
from stores import write_sums

from twinrun import app, compare, data, status
from twinrun.errors import StoreError, TwinrunError
from twinrun.files import read_json, read_yaml
from twinrun.launchers.record import read_launch
from twinrun.measures.probe import PROBE
from twinrun.provenance.record import kernel_path_sha256
from twinrun.storage.lock import read_holder
from twinrun.storage.records import validate_run, validate_units
from twinrun.storage.rundir import RunIndex
from twinrun.storage.store import STORE_FORMAT, TENSOR_SHA256, StoreReader, verify_store
from twinrun.storage.store_meta import validate_store_meta

LAYOUT = [{"name": "w", "offset": 0, "numel": 8, "shape": [8], "cond": False}]
META = {"arm": "native", "bin_index": 0, "sigma": 0.5, "sigma_cond": 0.5, "n_images": 6, "n_draws": 2,
        "fold_sizes": [2, 2, 2], "draws_digest": "ab" * 32, "config_hash": "0123456789abcdef",
        "layout": LAYOUT}


# ----------------------------------------------------------------------------- bounded parsers

HOSTILE_JSON = {
    "a 5,000-digit integer": ('{"format": ' + "9" * 5000 + "}", "digits"),
    "a 100-digit integer": ('{"format": ' + "9" * 100 + "}", "digits"),
    "100k levels deep": ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
    "900 levels deep (Python parses it; printing it would recurse)": ('{"a": ' + "[" * 900 + "]" * 900 + "}",
                                                                       "nested deeper than 64 levels"),
}


@pytest.mark.parametrize("text,says", HOSTILE_JSON.values(), ids=HOSTILE_JSON)
def test_json_of_any_depth_or_integer_length_is_one_named_error(tmp_path, text, says):
    path = tmp_path / "run.json"
    path.write_text(text)
    with pytest.raises(StoreError, match=rf"run.json: .*{says}") as err:
        read_json(path)
    assert "\n" not in str(err.value)


HOSTILE_YAML = {
    "a 5,000-digit integer": ("seed: " + "9" * 5000, "unreadable arm config"),
    "a 100-digit integer": ("seed: " + "9" * 100, "more than 64 digits"),
    "100k levels deep": ("[" * 100_000 + "]" * 100_000, "unreadable arm config"),
    "aliases repeating a node a billion times": (
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)),
        "more than 1,000,000 nodes"),
}


@pytest.mark.parametrize("text,says", HOSTILE_YAML.values(), ids=HOSTILE_YAML)
def test_yaml_of_any_depth_size_or_integer_length_is_one_named_error(tmp_path, text, says):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(StoreError, match=rf"config.yaml: .*{says}"):
        read_yaml(path, "arm config")


def test_a_store_header_nested_too_deep_is_one_named_error(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    header = ('{"__metadata__": {"format": "' + STORE_FORMAT + '"}, "x": ' + deep + "}").encode()
    path = tmp_path / "s.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(StoreError, match="safetensors header.*nested deeper"):
        StoreReader(path)


def test_a_lock_record_of_any_shape_reads_as_no_holder(tmp_path):
    (tmp_path / ".lock").write_text("[" * 4000)
    assert read_holder(tmp_path / ".lock") is None
    (tmp_path / ".lock").write_text('{"pid": ' + "9" * 5000 + "}")
    assert read_holder(tmp_path / ".lock") is None


# ----------------------------------------------------------------------------- records held to their rules


def _refused(doc, field: str) -> None:
    """run.json refused naming `field`: its shared fields (validate_run), then the probe's unit fields as
    the kind, handed down, checks them (validate_units)."""
    with pytest.raises(StoreError, match=rf"run.json: field {field}\b") as err:
        validate_run(Path("run.json"), doc)
        validate_units(Path("run.json"), doc, PROBE.unit_fields, PROBE.increasing)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("alpha", [0.75, 0.5, 0.0, True, "0.05"])
def test_a_registered_signal_alpha_outside_the_configs_rule_is_refused(alpha):
    doc = run_doc([0.1, 0.5])
    doc["registered"]["signal_alpha"] = alpha  # 0.75 read "below noise" rows as cosines
    _refused(doc, "registered.signal_alpha")


def test_an_unknown_registered_gate_rule_is_refused_not_read_as_another():
    doc = run_doc([0.1, 0.5])
    doc["registered"]["gate_rule"] = "lenient"
    _refused(doc, "registered.gate_rule")


@pytest.mark.parametrize("sigmas", [[0.1, 0.5, 0.5], [0.1, 0.5, 0.2]])
def test_sigma_of_the_units_must_increase_strictly(sigmas):
    _refused(run_doc(sigmas), r"units\[2\].probe.sigma")


def test_a_store_size_must_be_a_byte_count():
    doc = run_doc([0.1, 0.5])
    doc["units"][1]["stores"]["native"]["payload_bytes"] = -4
    _refused(doc, r"units\[1\].stores.native.payload_bytes")


def test_a_kernel_path_object_rewritten_under_its_old_digest_is_refused():
    kernel_path = {"torch": {"version": "2.13.0"}, "threads": {"intra_op": 2}}
    meta = {**META, "kernel_path": kernel_path, "env": {"kernel_path_sha256": kernel_path_sha256(
        {"kernel_path": kernel_path})}}
    validate_store_meta(Path("s.safetensors"), json.loads(json.dumps(meta)))  # as a store holds it: passes
    forged = {**meta, "kernel_path": {**kernel_path, "threads": {"intra_op": 1}}}
    with pytest.raises(StoreError, match="field metadata.kernel_path: does not hash to its digest"):
        validate_store_meta(Path("s.safetensors"), forged)


# ----------------------------------------------------------------------------- sizes known before reading


def _huge_store(path: Path, n_params: int, n_folds: int = 4) -> int:
    """A store whose header describes n_params x n_folds float32 exactly, its payload a hole; its size."""
    meta = {**META, "n_images": 2 * n_folds, "fold_sizes": [2] * n_folds,
            "layout": [{"name": "w", "offset": 0, "numel": n_params, "cond": False}]}
    strings = {"format": STORE_FORMAT, TENSOR_SHA256: json.dumps({"w": "0" * 64}),
               **{k: json.dumps(v) for k, v in meta.items()}}
    payload = 4 * n_params * n_folds
    header = json.dumps({"__metadata__": strings, "w": {"dtype": "F32", "shape": [n_params, n_folds],
                                                         "data_offsets": [0, payload]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + payload)
    return payload


def test_a_sparse_store_whose_header_describes_64_gib_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "bin00_sigma0.5.safetensors"
    payload = _huge_store(path, 2**32)  # 2^32 parameters x 4 folds x 4 bytes: 64 GiB, exactly as described
    assert payload == 64 * 2**30 and path.stat().st_size > payload
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append(n) or real(fd, n, offset))
    with pytest.raises(StoreError, match="a sparse file"):
        verify_store(path, "0" * 64)
    assert reads == []  # refused from its block count, before its header was read


def test_a_store_is_held_to_the_size_its_run_planned(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    sha = write_sums(path, torch.ones(3, 8), META)
    verify_store(path, sha, payload_bytes=4 * 3 * 8)
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append((n, offset)) or real(fd, n, offset))
    with pytest.raises(StoreError, match="header describes 96 bytes of tensors, but the run's protocol"):
        verify_store(path, sha, payload_bytes=4 * 3 * 4)
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert all(offset + n <= header_end for n, offset in reads)  # the payload was never read


def test_run_json_planned_by_a_run_records_each_stores_size(tmp_path, compose_cfg):
    from conftest import TINY

    from twinrun.plan import plan_run

    run = plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), None, dry_run=True)
    sizes = {e["payload_bytes"] for u in run["units"] for e in u["stores"].values()}
    assert sizes == {4 * 4 * 49_284}  # 4 folds x the default model's 49,284 parameters, float32


# ----------------------------------------------------------------------------- smaller


def test_compare_of_two_single_stores_shows_no_residual_row(tmp_path, capsys):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    sums = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    write_sums(a, sums, META)
    write_sums(b, sums, META)  # bit-identical: compared whatever their (absent) kernel-path records say
    assert compare.main([str(a), str(b)]) == 0
    out, err = capsys.readouterr()
    assert "residual" not in out and "nan" not in out and "all" in out, out
    assert "one bin: the residual view" in err


def test_status_names_the_units_of_an_element_that_is_gone_beside_running_ones(tmp_path, capsys):
    doc = run_doc([0.1, 0.2, 0.3], status="running")
    doc = done(done(doc, 0, "native", "e" * 64), 0, "pin_sigma", "e" * 64)
    for arm in ("native", "pin_sigma"):
        (tmp_path / "arms" / arm).mkdir(parents=True)
    create(tmp_path, doc)
    (tmp_path / "result0").write_text("")

    def element(units, job_id, result):
        return {"units": units, "job_id": str(job_id), "result": str(tmp_path / result), "stdout": "o",
                "stderr": "e"}
    # unit 0 ended with its result, unit 1 still runs (this process), unit 2's job is gone without one
    elements = [element([0], 1, "result0"), element([1], os.getpid(), "r1"), element([2], 2**22 - 3, "r2")]
    (tmp_path / "launch.json").write_text(json.dumps({"cluster": "local", **elements[0], "folder": "f",
                                                      "launcher": {}, "elements": elements}))
    index = RunIndex.load(tmp_path)
    assert status._live_status(index, read_launch(index.run_dir)) == \
        "running; unit 2 interrupted (its job is gone: resume the run once the others end)"


def test_a_moved_scikit_learn_digits_file_is_one_line(tmp_path, monkeypatch):
    data._digits_pixels.cache_clear()
    monkeypatch.setattr(data.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    with pytest.raises(TwinrunError, match=r"digits file is not at .*digits.csv.gz .*constraints.txt"):
        data.load_heldout_images()
    data._digits_pixels.cache_clear()


def test_hydras_failure_to_make_the_run_directory_is_one_line_naming_the_key(monkeypatch):
    held = app._HeldStderr()
    long = "/tmp/" + "a" * 300
    held.buffer.write(f'Traceback (most recent call last):\n  File "pathlib.py", line 1116, in mkdir\n'
                      f"    os.mkdir(self, mode)\nOSError: [Errno 36] File name too long: '{long}'\n")
    monkeypatch.setattr("sys.argv", ["twinrun", "+experiment=pin_sigma"])
    line = held.one_line()
    assert line.startswith(f"hydra.run.dir: cannot create {long} (File name too long)") and "\n" not in line
    assert "check the key" not in line  # not Hydra's hint about config keys



def test_the_reducer_raises_its_descriptor_limit_or_refuses_in_one_line(tmp_path):
    import resource

    from twinrun.files import ensure_descriptors

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a `ulimit -n 256` shell
        ensure_descriptors(1000, "reading 1000 stores")
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1000
        if hard != resource.RLIM_INFINITY:
            with pytest.raises(StoreError, match=r"reading .* stores: needs \d+ open files, more than this "
                                                  rf"process may open \(ulimit -n: hard limit {hard}\)"):
                ensure_descriptors(hard, f"reading {hard} stores")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
