"""Training runs, the table and the trackers held to the probe's reader standard: an edit anywhere that
would change a number (a config, a weight, a step digest, a store's seed or held-out ids or kernel path,
a summary row) is one line naming the file and the field, exit 2, never a verdict; a start checkpoint is
untrusted input; nothing written outside a run directory goes through a link or over a device node."""

import errno
import importlib.util
import json
import math
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import cli
from train_runs import train_run

from twinrun import reduce
from twinrun import table as table_cli
from twinrun.errors import ConfigError, StoreError
from twinrun.files import create_once
from twinrun.measures import train as train_kind
from twinrun.measures.registry import load_index
from twinrun.measures.train_state import load_start
from twinrun.model import DEFAULT_ARCH, DiTDenoiser
from twinrun.provenance import compile_cache
from twinrun.publish import publish, table, trackers
from twinrun.storage.rundir import RunIndex
from twinrun.storage.safetensors_file import SafetensorsFile
from twinrun.storage.train_store import read_train_store, write_train_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One tiny scale_lr training run, reduced and published; copy it before changing it."""
    run = tmp_path_factory.mktemp("train_untrusted") / "run"
    publish(train_run(run), train_kind.TRAIN)
    return run


@pytest.fixture
def run(made, tmp_path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "run", symlinks=True))


def refused(main, argv, capsys, *words) -> str:
    code, out, err = cli(main, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    assert "ABOVE" not in out and "CANNOT" not in out, out  # no verdict
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _doc(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())


def rewrite_store(run: Path, arm: str, unit: int, change) -> Path:
    """A training store rewritten consistently: `change(tensors, meta)` edits it, every tensor digest is
    recomputed by the writer and run.json's sha256 fixed: only what the digests cannot vouch for differs."""
    doc = _doc(run)
    path = run / "arms" / arm / doc["units"][unit]["stores"][arm]["file"]
    store = read_train_store(path)
    tensors = {k: v.clone() for k, v in store.tensors.items()}
    meta = json.loads(json.dumps(store.meta))
    change(tensors, meta)
    doc["units"][unit]["stores"][arm]["sha256"] = write_train_store(path, tensors, meta)
    (run / "run.json").write_text(json.dumps(doc))
    return path


def _last(run: Path) -> int:
    return len(_doc(run)["units"]) - 1


# ----------------------------------------------------------------------------- 1. config.yaml vs run.json


def test_a_floor_margin_edited_in_every_arm_is_refused_not_a_verdict(run, capsys):
    for config in run.glob("arms/*/config.yaml"):
        config.write_text(config.read_text().replace("floor_margin: 10.0", "floor_margin: 10000.0"))
    assert "floor_margin: 10000.0" in (run / "arms/native/config.yaml").read_text()
    refused(reduce.main, [run], capsys, "config.yaml", "config_hash")
    with pytest.raises(StoreError, match="config.yaml: does not match the config_hash"):
        table.run_rows(run, load_index)  # the seed column came from it
    index = RunIndex.load(run)
    with pytest.raises(StoreError, match="config.yaml: does not match the config_hash"):
        trackers.payload(index, index.run_dir.read_summary(), [], train_kind.TRAIN)  # its params


# ----------------------------------------------------------------------------- 2. step digests and weights


def test_one_weight_edited_in_the_twins_last_store_with_fresh_digests_is_refused(run, capsys):
    def edit(tensors, meta):
        name = f"weight/{meta['layout'][0]['name']}"
        tensors[name].view(-1)[0] += 1e-3

    rewrite_store(run, "native", _last(run), edit)
    refused(reduce.main, [run], capsys, "native", "step_digests", "is not the stored weight's")


def test_a_step_digest_edited_inside_a_unit_is_refused_not_blamed_on_the_intervention(run, capsys):
    def edit(tensors, meta):
        meta["step_digests"][0][0] = "0" * 16  # the first step of the unit: no weight vouches for it

    rewrite_store(run, "native", _last(run), edit)
    line = refused(reduce.main, [run], capsys, "step_digests", "bit-identical", "arms/native/seg")
    assert "CANNOT" not in line and "not a no-op" not in line


def test_a_blank_step_digest_at_a_units_last_step_is_refused(run, capsys):
    """Blank is a frozen weight's digest before the unit's last step (hashed once a segment); at the last
    step every weight is hashed, so a blank there would vouch for any weight the store holds."""
    def edit(tensors, meta):
        meta["step_digests"][-1][0] = ""

    rewrite_store(run, "native", _last(run), edit)
    refused(reduce.main, [run], capsys, "native", "step_digests[1]",
            "blank digests must be a frozen weight's")


# ----------------------------------------------------------------------------- 5. store metadata


@pytest.mark.parametrize("field,value", [
    ("seed", 1234),
    ("heldout_ids", "REVERSED"),
    ("kernel_path", {"forged": True}),
])
def test_a_store_field_forged_with_fresh_digests_is_refused(run, capsys, field, value):
    def edit(tensors, meta):
        meta[field] = meta[field][::-1] if value == "REVERSED" else value

    for unit in range(len(_doc(run)["units"])):  # in every store of every arm: consistent with each other
        for arm in _doc(run)["units"][unit]["stores"]:
            rewrite_store(run, arm, unit, edit)
    refused(reduce.main, [run], capsys, field)


# ----------------------------------------------------------------------------- 6. the start checkpoint


def _checkpoint_header(path: Path, entries: dict, payload: bytes = b"") -> None:
    head = json.dumps(entries).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + payload)


def _alarm(seconds: int):
    def hang(*_):
        raise AssertionError(f"blocked for {seconds} s")
    signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)


def test_a_fifo_as_the_start_checkpoint_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "ckpt.safetensors"
    os.mkfifo(fifo)
    _alarm(10)
    try:
        with pytest.raises(ConfigError, match=r"^train.start_checkpoint=.*not a regular file \(a FIFO\)"):
            load_start(DiTDenoiser(**DEFAULT_ARCH), str(fifo))
    finally:
        signal.alarm(0)


def test_a_checkpoint_declaring_64_gib_is_one_line_before_any_tensor_is_read(tmp_path):
    model = DiTDenoiser(**DEFAULT_ARCH)
    path = tmp_path / "huge.safetensors"
    _checkpoint_header(path, {"w": {"dtype": "F32", "shape": [2**34], "data_offsets": [0, 2**36]}})
    with pytest.raises(ConfigError, match=r"^train.start_checkpoint=.*truncated or padded") as err:
        load_start(model, str(path))
    assert "\n" not in str(err.value)
    # the same declaration, and the file really that large (sparse): refused from its block count, unread
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) + 2**36)
    with pytest.raises(ConfigError, match=r"sparse file|implausibly large"):
        load_start(model, str(path))


def test_a_checkpoint_of_another_model_is_refused_before_its_tensors_are_read(tmp_path, monkeypatch):
    other = tmp_path / "w16.safetensors"
    safetensors.torch.save_file(DiTDenoiser(**{**DEFAULT_ARCH, "width": 16}).state_dict(), other)
    monkeypatch.setattr(SafetensorsFile, "tensors", lambda self: pytest.fail("read before the check"))
    with pytest.raises(ConfigError, match=r"does not match: it .*has other shapes for"):
        load_start(DiTDenoiser(**DEFAULT_ARCH), str(other))


def test_a_matching_checkpoint_loads_bit_for_bit(tmp_path):
    source, target = DiTDenoiser(**DEFAULT_ARCH), DiTDenoiser(**DEFAULT_ARCH)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.5)
    path = tmp_path / "ok.safetensors"
    safetensors.torch.save_file(source.state_dict(), path)
    load_start(target, str(path))
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values(),
                                                 strict=True))


# ----------------------------------------------------------------------------- 3. the table at a user's path


def _special_files(tmp_path: Path) -> dict:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    victim = tmp_path / "victim.csv"
    victim.write_text("precious\n")
    link = tmp_path / "link.csv"
    link.symlink_to(victim)
    sub = tmp_path / "a_directory"
    sub.mkdir()
    out = {"fifo": fifo, "symlink": link, "directory": sub}
    try:  # a private device node (root only): what `--csv /dev/null` would replace
        node = tmp_path / "null"
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        out["device"] = node
    except PermissionError:
        pass
    return out


def test_the_table_never_replaces_a_device_node_or_writes_through_a_link(run, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    for kind, path in _special_files(tmp_path / "out").items():
        before = os.lstat(path)
        line = refused(table_cli.main, [run, "--csv", path], capsys, str(path))
        assert ("symlink" in line) if kind == "symlink" else ("not a regular file" in line), line
        after = os.lstat(path)
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode), kind
    assert (tmp_path / "out" / "victim.csv").read_text() == "precious\n"
    code, _, err = cli(table_cli.main, [run, "--csv", tmp_path / "new.csv"], capsys)
    assert code == 0 and (tmp_path / "new.csv").read_text().startswith("row_kind,"), err


# ----------------------------------------------------------------------------- 7. a hand-edited summary


def _mutations(summary: dict):
    """(where, new document) for every scalar and row of the training summary: wrong types, absent keys,
    NaN literals."""
    for key in ("effects", "gates", "floor", "losses", "first_differing"):
        for i, row in enumerate(summary[key][:2]):
            for field in row:
                for value in ("x", None, [], float("nan")):
                    doc = json.loads(json.dumps(summary))
                    doc[key][i][field] = value
                    yield f"{key}[{i}].{field}={value!r}", doc
                doc = json.loads(json.dumps(summary))
                del doc[key][i][field]
                yield f"{key}[{i}].{field} deleted", doc
    for key in ("used", "registered"):
        for value in (3, {"estimands": 3}, {"estimands": [1]}):
            doc = json.loads(json.dumps(summary))
            doc[key] = value
            yield f"{key}={value!r}", doc


def test_a_hand_edited_training_summary_never_tracebacks_the_table(run, capsys):
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text())
    tried = 0
    for where, doc in _mutations(summary):
        summary_path.write_text(json.dumps(doc))
        code, out, err = cli(table_cli.main, [run], capsys)
        assert "Traceback" not in err and code in (0, 2), (where, err)
        if code == 2:
            assert len(err.strip().splitlines()) == 1 and "summary.json" in err, (where, err)
        assert "nan" not in out.lower() or "nan" not in where, (where, out)
        tried += 1
    assert tried > 100
    doc = json.loads(json.dumps(summary))
    doc["effects"][0]["distance"] = float("nan")
    summary_path.write_text(json.dumps(doc))
    refused(table_cli.main, [run], capsys, "summary.json", "effects[0].distance", "NaN")


# ----------------------------------------------------------------------------- 8. the plots a tracker logs


def test_a_tracker_logs_the_training_plots_and_never_a_planted_one(run, monkeypatch):
    (run / "effect.png").write_bytes((run / "loss.png").read_bytes())  # planted: training never draws it
    sent = []
    monkeypatch.setattr("twinrun.publish.send", lambda *a: sent.append(a[3]))
    from twinrun.analysis.train_reduce import reduce_train
    publish(reduce_train(run), train_kind.TRAIN, tracker={"name": "x"})
    names = sorted(Path(f).name for f in sent[0])
    assert names == ["distance.png", "loss.png", "report.md", "summary.json"], names


# ----------------------------------------------------------------------------- 9. smaller


def test_overlapping_segments_in_run_json_are_exit_2_naming_the_field(run, capsys):
    doc = _doc(run)
    doc["units"][2]["train"]["from_step"] = 1  # overlaps segment 1 (steps 1–2)
    (run / "run.json").write_text(json.dumps(doc))
    refused(reduce.main, [run], capsys, "run.json", "units[2].train.to_step")


def test_a_replicate_left_out_by_an_edited_run_json_is_refused_not_dropped_from_the_floor(run, capsys):
    # `without` is how arms.replicate_segments leaves the replicate out; written into a run planned
    # without it (its store removed too), the replicates would silently leave the floor.
    doc = _doc(run)
    last = doc["units"][-1]
    rep = next(a for a in last["stores"] if a.endswith("_replicate"))
    last["without"] = [rep]
    del last["stores"][rep]
    (run / "run.json").write_text(json.dumps(doc))
    refused(reduce.main, [run], capsys, "run.json", "arms.replicate_segments=None")


def test_the_compile_cache_marker_never_follows_a_dangling_link(tmp_path):
    root, run_dir = tmp_path / "cache", tmp_path / "run"
    home = Path(compile_cache.run_cache_dir(str(root), run_dir))  # the marker, created
    marker = home / compile_cache.RUN_CACHE_MARKER
    assert marker.is_file() and not marker.is_symlink()
    compile_cache.run_cache_dir(str(root), run_dir)  # again: kept
    marker.unlink()
    victim = tmp_path / "elsewhere" / "victim.txt"
    marker.symlink_to(victim)  # dangling: open(marker, "w") created the victim
    with pytest.raises(StoreError, match="is a symlink"):
        compile_cache.run_cache_dir(str(root), run_dir)
    assert not victim.exists() and not victim.parent.exists()
    with pytest.raises(StoreError, match="not a regular file"):
        create_once(tmp_path, b"x", "marker")


def test_a_nan_literal_where_twinrun_writes_a_number_is_refused(run):
    summary = json.loads((run / "summary.json").read_text())
    summary["gates"][0]["distance"] = math.nan
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(StoreError, match=r"field gates\[0\].distance: NaN"):
        RunIndex.load(run).run_dir.read_summary(train_kind.TRAIN.summary_type)


# ----------------------------------------------------------------------------- the attack's categories


def _weights(run: Path) -> dict:
    """Every store's tensor digests, each store read through its checks."""
    doc = _doc(run)
    return {f"{arm}/{e['file']}": read_train_store(run / "arms" / arm / e["file"], e["sha256"]).digests
            for u in doc["units"] for arm, e in u["stores"].items()}


def test_a_full_disk_during_a_training_segment_is_one_line_and_the_run_completes_later(made, tmp_path,
                                                                                       monkeypatch):
    from train_runs import tiny_cfg

    from twinrun.job import run_job
    from twinrun.plan import plan_run, trusted_targets

    cfg = tiny_cfg()
    run = tmp_path / "run"
    plan_run(cfg, run)
    real_fsync = os.fsync

    def fsync_until_full(fd):
        # full once the first segment's stores are being written (the start unit's are on disk)
        if list(run.glob("arms/*/.seg001*.tmp-*")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_until_full)
    with pytest.raises(StoreError, match="No space left on device") as err:
        run_job(run, trusted_targets(cfg))
    assert "\n" not in str(err.value) and "finished stores are kept" in str(err.value)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert not list(run.glob("arms/*/.*.tmp-*")), "no half-written store is left"
    index = RunIndex.load(run)
    verify = train_kind.TRAIN.verify_store  # the train kind's store check
    assert index.is_whole(index.units[0], verify=True, reader=verify) and not index.is_whole(index.units[1])
    run_job(run, trusted_targets(cfg))  # room again: the run completes, bit-identical to one never stopped
    assert _weights(run) == _weights(made)


def _planted(store: Path, outside: Path, name: str) -> Path:
    """A link planted in a tracker's store: mlflow.db to a victim file, a run folder to a folder outside."""
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    at = store / name
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(victim if name.endswith(".db") else outside)
    return victim


@pytest.mark.parametrize("sink,name", [("mlflow", "mlflow.db"), ("tensorboard", "twinrun/run"),
                                       ("wandb", "wandb")])
def test_a_link_planted_in_a_trackers_store_is_refused_and_nothing_outside_changes(run, tmp_path, capsys,
                                                                                    sink, name):
    store, outside = tmp_path / sink, tmp_path / "outside"
    victim = _planted(store, outside, name)
    index = RunIndex.load(run)
    tracker = {"name": sink, "dir": str(store), "project": "twinrun"}
    assert not trackers.send(tracker, index, index.run_dir.read_summary(), [], train_kind.TRAIN)
    err = capsys.readouterr().err
    assert f"warning: tracker={sink} did not log" in err and "symlink" in err and name in err, err
    assert victim.read_bytes() == b"precious" and sorted(p.name for p in outside.iterdir()) == ["victim"]
    if all(importlib.util.find_spec(p) for p in trackers.SINKS[sink].packages):  # the `trackers` extra
        with pytest.raises(ConfigError, match=rf"^tracker.dir=.*{name}: is a symlink"):  # before any compute
            trackers.check_tracker({"name": sink, "dir": str(store)})


def test_a_hard_link_or_a_fifo_in_a_trackers_store_is_refused(tmp_path):
    from twinrun.files import refuse_links_under

    store = tmp_path / "store"
    (store / "a").mkdir(parents=True)
    (store / "a" / "ok").write_text("x")
    (store / "inner").symlink_to(store / "a")  # a pointer the tracker keeps inside its store: allowed
    refuse_links_under(store, "store")
    os.link(store / "a" / "ok", tmp_path / "outside")
    with pytest.raises(StoreError, match=r"ok: is a hard link \(2 names\)"):
        refuse_links_under(store, "store")
    (tmp_path / "outside").unlink()
    os.mkfifo(store / "a" / "fifo")
    with pytest.raises(StoreError, match="fifo: is a FIFO"):
        refuse_links_under(store, "store")


def _wait_for(proc, ready, what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"finished before {what}:\n{proc.stdout.read()[-2000:]}"
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.005)


def _recorded_not_indexed(run: Path, prefix: str) -> bool:
    """A store of this unit renamed into place whose run.json entry is not yet done: the instant between
    the two writes that record a segment."""
    try:
        doc = _doc(run)
    except (OSError, ValueError):
        return False
    for u in doc["units"]:
        for arm, e in u["stores"].items():
            on_disk = (run / "arms" / arm / e["file"]).exists()
            if e["file"].startswith(prefix) and e["status"] != "done" and on_disk:
                return True
    return False


def test_kill_9_as_a_segment_is_recorded_and_in_the_last_segment_then_resume_is_bit_identical(made,
                                                                                              tmp_path):
    from conftest import slow_fsync_env, start_twinrun
    from train_runs import TINY

    env = slow_fsync_env(tmp_path / "inject", 0.15)
    run = tmp_path / "killed"
    args = ["twinrun", "+experiment=train_scale_lr", *TINY, f"hydra.run.dir={run}"]
    proc = start_twinrun(args, tmp_path, env)
    _wait_for(proc, lambda: _recorded_not_indexed(run, "seg001"), "segment 1's store on disk, unindexed")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = start_twinrun(["twinrun.resume", str(run)], tmp_path, env)
    _wait_for(proc, lambda: list(run.glob("arms/*/.seg002*.tmp-*")), "the last segment's store on its way")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(run.glob("arms/*/.seg002*.tmp-*")), "killed with a half-written store of the last segment"
    proc = start_twinrun(["twinrun.resume", str(run)], tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert not list(run.glob("arms/*/.*.tmp-*"))
    assert _weights(run) == _weights(made)  # every store, the final weights among them, bit for bit


@pytest.mark.trackers
@pytest.mark.parametrize("sink", ["mlflow", "wandb"])
def test_a_tracker_logs_twice_into_its_store_and_keeps_its_own_chatter_off_the_terminal(made, tmp_path, capfd,
                                                                                        sink):
    """MLflow printed its database migrations on stderr; W&B's own links in its store (latest-run,
    debug.log) are the tracker's and never refused on the second publish."""
    for package in trackers.SINKS[sink].packages:
        pytest.importorskip(package)
    index = RunIndex.load(made)
    tracker = {"name": sink, "dir": str(tmp_path / sink), "project": "twinrun"}
    for _ in range(2):
        assert trackers.send(tracker, index, index.run_dir.read_summary(), [made / "summary.json"],
                             train_kind.TRAIN)
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert err == "" and len(lines) == 2, (out, err)
    assert all(line.startswith(f"twinrun: logged to {sink}: ") for line in lines), lines
