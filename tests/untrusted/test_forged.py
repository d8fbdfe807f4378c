"""Forged but consistent: a run directory edited by someone who fixed every digest they could. Every
field a verdict depends on is held against what the run says it measured, so an edit that changes a
number is exit 2 naming the file and the field (or exit 1 naming the failed check), never a number; a
reference is checked at plan time; and what a reader reads is bounded by the run's own protocol."""

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import safetensors.torch
from conftest import TINY, cli

from twinrun import compare, reduce, resume, status
from twinrun.errors import ConfigError
from twinrun.plan import plan_run
from twinrun.provenance.record import kernel_path_sha256

pytestmark = pytest.mark.slow
READERS = {"reduce": reduce.main, "status": status.main, "compare": compare.main}


@pytest.fixture
def run(tiny_run, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_run, tmp_path / "run", symlinks=True))




def refused(main, argv, capsys, *words) -> str:
    code, out, err = cli(main, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    assert "cos ±" not in out and "[ok]" not in out, out  # no number, no verdict
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def edit_run_json(run: Path, change) -> None:
    doc = json.loads((run / "run.json").read_text())
    change(doc)
    (run / "run.json").write_text(json.dumps(doc))


def forge_store(run: Path, arm: str, unit: int, **fields) -> Path:
    """Rewrite metadata fields of one store, its tensors' digests untouched, run.json's sha256 fixed."""
    doc = json.loads((run / "run.json").read_text())
    path = run / "arms" / arm / doc["units"][unit]["stores"][arm]["file"]
    with open(path, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()})
    data = safetensors.torch.save(safetensors.torch.load_file(path), metadata=meta)
    path.write_bytes(data)
    doc["units"][unit]["stores"][arm]["sha256"] = hashlib.sha256(data).hexdigest()
    (run / "run.json").write_text(json.dumps(doc))
    return path


def store_meta(run: Path, arm: str, unit: int) -> dict:
    doc = json.loads((run / "run.json").read_text())
    path = run / "arms" / arm / doc["units"][unit]["stores"][arm]["file"]
    with open(path, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    return {k: _decoded(v) for k, v in meta.items() if k != "format"}


def _decoded(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:  # a plain string (write_store keeps strings as they are)
        return value


# ----------------------------------------------------------------------------- stores rewritten consistently


def test_a_forged_sigma_cond_is_refused_naming_the_field(run, capsys):
    path = forge_store(run, "native", 0, sigma_cond=0.5)  # the twin claims the pin's σ_cond
    refused(reduce.main, [run], capsys, path.name, "metadata field sigma_cond", "0.5")


def test_image_ids_forged_in_every_store_are_refused_against_the_data_set(run, capsys):
    doc = json.loads((run / "run.json").read_text())
    for u in doc["units"]:
        for arm in u["stores"]:
            forge_store(run, arm, u["index"], image_ids=list(range(8)))  # training images, every store alike
    refused(reduce.main, [run], capsys, "metadata field image_ids", "what its config's data set holds")


def test_a_forged_seed_is_refused(run, capsys):
    path = forge_store(run, "pin_sigma", 2, seed=1)
    refused(reduce.main, [run], capsys, path.name, "metadata field seed: 1 is not 0")


def test_a_kernel_path_object_forged_under_its_old_digest_is_refused(run, capsys):
    meta = store_meta(run, "native", 1)
    kernel_path = {**meta["kernel_path"], "threads": {"intra_op": 64}}
    path = forge_store(run, "native", 1, kernel_path=kernel_path)
    for name, main in READERS.items():
        argv = [path, path] if name == "compare" else [run]
        if name == "status":  # status lists the store as damaged, exit 2
            code, out, _ = cli(main, argv, capsys)
            assert code == 2 and "damaged" in out and "metadata.kernel_path" in out, out
        else:
            refused(main, argv, capsys, path.name, "metadata.kernel_path: does not hash to its digest")


def test_a_kernel_path_forged_with_a_fresh_digest_is_refused_against_run_json(run, capsys):
    meta = store_meta(run, "native", 1)
    kernel_path = {**meta["kernel_path"], "threads": {"intra_op": 64}}
    env = {**meta["env"], "kernel_path_sha256": kernel_path_sha256({"kernel_path": kernel_path})}
    path = forge_store(run, "native", 1, kernel_path=kernel_path, env=env)
    refused(reduce.main, [run], capsys, path.name, "env.kernel_path_sha256 is not the kernel path run.json")


# ----------------------------------------------------------------------------- records edited


@pytest.mark.parametrize("what,change,field", [
    ("signal_alpha 0.75", lambda d: d["registered"].update(signal_alpha=0.75), "registered.signal_alpha"),
    ("gate_rule lenient", lambda d: d["registered"].update(gate_rule="lenient"), "registered.gate_rule"),
    ("a duplicated σ", lambda d: d["units"][2]["probe"].update(sigma=0.5), "units[2].probe.sigma"),
    ("a group that matches nothing", lambda d: d["registered"].update(groups={"ghost": ["nothing.*"]}),
     "registered.groups.ghost"),
    ("an unknown estimand", lambda d: d["registered"].update(estimands=["all", "block9"]),
     "registered.estimands"),
    ("a gate unit turned off", lambda d: d["units"][1].update(gate=False), "units[1].gate"),
    ("a gate unit turned on", lambda d: d["units"][0].update(gate=True), "units[0].gate"),
])
def test_an_edited_record_is_one_line_naming_its_field_in_every_reader(run, tiny_run, capsys, what, change,
                                                                       field):
    edit_run_json(run, change)
    refused(reduce.main, [run], capsys, "run.json", field)
    if field.startswith(("registered.signal", "registered.gate", "units[2]")):  # run.json's own rules
        for name in ("status", "compare"):
            refused(READERS[name], [run, tiny_run] if name == "compare" else [run], capsys, "run.json", field)


def test_a_reference_to_the_run_itself_is_refused(run, capsys):
    edit_run_json(run, lambda d: d.update(reference=str(run)))
    refused(reduce.main, [run], capsys, "run.json", "field reference", "is this run itself")


def test_a_sigma_grid_edited_in_run_json_and_every_store_is_refused_against_the_configs(run, capsys):
    doc = json.loads((run / "run.json").read_text())
    edit_run_json(run, lambda d: d["units"][2]["probe"].update(sigma=1.5))
    for arm in doc["units"][2]["stores"]:
        forge_store(run, arm, 2, sigma=1.5)
    refused(reduce.main, [run], capsys, "run.json", "is not the σ grid [0.2, 0.5, 1.2]")


def test_an_arm_config_edited_after_planning_is_exit_2_in_reduce_too(run, capsys):
    path = run / "arms" / "pin_sigma" / "config.yaml"
    path.write_text(path.read_text().replace("sigma_pin: 0.5", "sigma_pin: 1.2"))
    refused(reduce.main, [run], capsys, "arms/pin_sigma/config.yaml", "config_hash")


def test_json_nested_100k_deep_or_a_5000_digit_integer_is_one_line_in_every_reader(run, tiny_run, capsys):
    for text in ("[" * 100_000 + "]" * 100_000, '{"format": ' + "7" * 5000 + "}"):
        (run / "run.json").write_text(text)
        for name, main in READERS.items():
            refused(main, [run, tiny_run] if name == "compare" else [run], capsys, "run.json")


# ----------------------------------------------------------------------------- sizes from the run's protocol


def test_a_store_grown_into_a_consistent_64_gib_sparse_file_costs_no_read(run, capsys):
    doc = json.loads((run / "run.json").read_text())
    path = run / "arms" / "native" / doc["units"][0]["stores"]["native"]["file"]
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__")
    layout = json.loads(meta["layout"])
    numel = 2**34 // len(json.loads(meta["fold_sizes"]))  # one tensor of 64 GiB, as its header says
    layout = [{**layout[0], "offset": 0, "numel": numel, "shape": [numel]}]
    meta.update(layout=json.dumps(layout), tensor_sha256=json.dumps({layout[0]["name"]: "0" * 64}))
    folds = len(json.loads(meta["fold_sizes"]))
    tensor = {"dtype": "F32", "shape": [numel, folds], "data_offsets": [0, 4 * numel * folds]}
    head = json.dumps({"__metadata__": meta, layout[0]["name"]: tensor}).encode()
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        f.truncate(8 + len(head) + 4 * numel * folds)
    t0 = time.monotonic()
    code, out, _ = cli(status.main, [run], capsys)
    assert code == 2 and "a sparse file" in out, out
    code, out, err = cli(resume.main, [run, "--local"], capsys)
    assert code == 0 and "re-measuring" in out, (out, err)  # the damaged unit is measured again
    assert time.monotonic() - t0 < 120


# ----------------------------------------------------------------------------- references, at plan time


def _plan_with_reference(compose_cfg, reference, run_dir=None):
    cfg = compose_cfg(["+experiment=pin_sigma", *TINY, f"reference={reference}"])
    return plan_run(cfg, run_dir, dry_run=True)


def test_a_reference_whose_twin_is_unmeasured_is_refused_at_plan_time(run, compose_cfg):
    edit_run_json(run, lambda d: d["units"][1]["stores"]["native"].update(status="pending"))
    with pytest.raises(ConfigError, match=r"reference=.*native twin is measured .*bin 1 \(σ=0.5\) of its "
                                          r"twin is pending"):
        _plan_with_reference(compose_cfg, run)


def test_a_reference_whose_twin_is_damaged_is_refused_at_plan_time(run, compose_cfg):
    store = min((run / "arms" / "native").glob("*.safetensors"))
    data = bytearray(store.read_bytes())
    data[-5] ^= 0x01
    store.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"reference=.*{store.name}.*does not match"):
        _plan_with_reference(compose_cfg, run)


def test_a_reference_to_the_run_being_planned_is_refused(run, compose_cfg):
    with pytest.raises(ConfigError, match="is this run's own directory"):
        _plan_with_reference(compose_cfg, run, run_dir=run)


def test_an_intact_reference_is_accepted(run, compose_cfg):
    assert _plan_with_reference(compose_cfg, run)["reference"] == str(run.resolve())


# ----------------------------------------------------------------------------- a read-only file system


@pytest.fixture
def read_only_copy(tiny_run, tmp_path):
    """The finished run on a file system mounted read-only (needs mount: root in a privileged container)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mnt)], capture_output=True,
                                           check=False).returncode != 0:
        pytest.skip("cannot mount a file system here")
    try:
        shutil.copytree(tiny_run, mnt / "run", symlinks=True)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt / "run"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_post_hoc_view_on_a_read_only_file_system_is_one_line(read_only_copy, capsys):
    refused(reduce.main, [read_only_copy, "--estimands", "all"], capsys, "views",
            "cannot create this directory", "Read-only file system")
    refused(reduce.main, [read_only_copy], capsys, "summary.json", "Read-only file system")

