"""A run directory is untrusted input: no code runs from it, no path escapes it, nothing damaged yields
a number, no reader waits forever; every refusal is one line with the documented exit code."""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import TINY, cli, run_twinrun
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinrun import compare, diff, reduce, resume, status
from twinrun.errors import StoreError
from twinrun.launchers.record import submitted_launcher
from twinrun.plan import config_hash
from twinrun.storage.rundir import RunDir

pytestmark = pytest.mark.slow

READERS = {"reduce": reduce.main, "status": status.main, "compare": compare.main}


@pytest.fixture(scope="module")
def made_run(tmp_path_factory) -> Path:
    """One finished tiny run, copied by each test that damages it."""
    root = tmp_path_factory.mktemp("made")
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "run"


@pytest.fixture
def run_copy(made_run, tmp_path) -> Path:
    return Path(shutil.copytree(made_run, tmp_path / "copy", symlinks=True))




def entry(name, run_dir, other):
    return [run_dir, other] if name == "compare" else [run_dir]


def one_line_refusal(code, out, err, *words):
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def edit_run_json(run_dir: Path, change) -> None:
    run = json.loads((run_dir / "run.json").read_text())
    change(run)
    (run_dir / "run.json").write_text(json.dumps(run))


# ----------------------------------------------------------------------------- no code from a run directory

PLANT = "import pathlib; pathlib.Path({marker!r}).write_text('ran')"


def plant_target(run_dir: Path, marker: Path, rehash: bool) -> None:
    """Point the intervention arm's model at exec() of code, keeping run.json's hash consistent if asked."""
    run = json.loads((run_dir / "run.json").read_text())
    arm = next(a for a in run["arms"] if a["role"] == "intervention")
    path = run_dir / "arms" / arm["name"] / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["model"] = {"_target_": "builtins.exec", "_args_": [PLANT.format(marker=str(marker))]}
    path.write_text(yaml.safe_dump(config))
    if rehash:
        arm["config_hash"] = config_hash(config)
        for u in run["units"]:
            u["stores"][arm["name"]]["status"] = "pending"  # so that resume would build the model
        (run_dir / "run.json").write_text(json.dumps(run))


@pytest.mark.parametrize("rehash", [True, False])
def test_resume_never_instantiates_a_planted_target(run_copy, tmp_path, capsys, rehash):
    marker = tmp_path / "pwned"
    plant_target(run_copy, marker, rehash)
    code, out, err = cli(resume.main, [run_copy, "--local"], capsys)
    line = one_line_refusal(code, out, err, "config.yaml")
    assert ("builtins.exec" in line) if rehash else ("config_hash" in line)
    assert not marker.exists(), "code from the run directory ran"


def test_an_edited_seed_is_refused_before_it_mixes_into_the_run(run_copy, capsys):
    path = run_copy / "arms" / "native" / "config.yaml"
    path.write_text(path.read_text().replace("seed: 0", "seed: 1"))
    edit_run_json(run_copy, lambda run: run["units"][0]["stores"]["native"].update(status="pending"))
    code, out, err = cli(resume.main, [run_copy, "--local"], capsys)
    one_line_refusal(code, out, err, "arms/native/config.yaml", "config_hash")


def test_a_forged_reference_claim_in_summary_json_is_refused(run_copy, made_run):
    summary = json.loads((run_copy / "summary.json").read_text())
    # a well-formed claim (every field of a reference report), about a run this run.json does not name
    summary["reference"] = {"path": str(made_run), "alive": True, "status": "alive",
                            "detail": "reference ALIVE"}
    (run_copy / "summary.json").write_text(json.dumps(summary))
    # compare asks whether A vouches for B only across kernel paths; it recomputes the verdict from the
    # stores (A's run.json names no reference), so the forged claim counts for nothing
    assert compare.vouched(run_copy, made_run) is False
    with pytest.raises(StoreError, match=r"summary.json: field reference.path"):
        RunDir(run_copy).read_summary()  # and every reader refuses the forged document itself


# ----------------------------------------------------------------------------- containment

TRAVERSALS = [
    ("store file", lambda run: run["units"][0]["stores"]["native"].update(file="../../../X.safetensors")),
    ("empty store file", lambda run: run["units"][0]["stores"]["native"].update(file="")),
    ("arm name", lambda run: _rename_arm(run, "pin_sigma", "../../../escaped_arm")),
    ("empty arm name", lambda run: _rename_arm(run, "pin_sigma", "")),
    ("dot-dot arm name", lambda run: _rename_arm(run, "pin_sigma", "..")),
    ("absolute store file", lambda run: run["units"][1]["stores"]["pin_sigma"].update(file="/etc/passwd")),
]


def _rename_arm(run, old, new):
    for a in run["arms"]:
        if a["name"] == old:
            a["name"] = new
    for u in run["units"]:
        u["stores"][new] = u["stores"].pop(old)


@pytest.mark.parametrize("name", ["reduce", "status", "compare", "resume"])
@pytest.mark.parametrize("what,change", TRAVERSALS, ids=[t[0] for t in TRAVERSALS])
def test_no_path_from_run_json_leaves_the_run_directory(run_copy, made_run, capsys, name, what, change):
    edit_run_json(run_copy, change)
    before = sorted(p for p in run_copy.parent.rglob("*"))
    main = resume.main if name == "resume" else READERS[name]
    argv = [run_copy, "--local"] if name == "resume" else entry(name, run_copy, made_run)
    code, out, err = cli(main, argv, capsys)
    one_line_refusal(code, out, err, "run.json", "not a safe name")
    assert sorted(p for p in run_copy.parent.rglob("*")) == before, "something was written"


def test_a_symlinked_arm_directory_is_refused(run_copy, made_run, tmp_path, capsys):
    outside = tmp_path / "outside"
    shutil.copytree(run_copy / "arms" / "native", outside)
    shutil.rmtree(run_copy / "arms" / "native")
    (run_copy / "arms" / "native").symlink_to(outside)
    for name, main in READERS.items():
        code, out, err = cli(main, entry(name, run_copy, made_run), capsys)
        one_line_refusal(code, out, err, "outside the run directory", "native")


def test_an_unsafe_intervention_name_is_refused_at_plan_time(tmp_path):
    (tmp_path / "evil.py").write_text("from twinrun.interventions import PinSigma\n"
                                      "class Evil(PinSigma):\n    name = '../../escaped_arm'\n")
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={run_dir}",
                        "intervention._target_=evil.Evil"], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2 and "escaped_arm" in proc.stderr, proc.stderr
    assert not (tmp_path / "escaped_arm").exists() and not run_dir.exists()


# ----------------------------------------------------------------------------- FIFO, sparse, damaged


def _first_store(run_dir: Path) -> Path:
    return min(run_dir.glob("arms/native/*.safetensors"))


@pytest.mark.parametrize("kind", ["fifo", "sparse_1tib", "directory"])
def test_a_store_that_is_not_a_plausible_file_is_refused_at_once(run_copy, made_run, capsys, kind):
    store = _first_store(run_copy)
    store.unlink()
    if kind == "fifo":
        os.mkfifo(store)
    elif kind == "directory":
        store.mkdir()
    else:
        with open(store, "wb") as f:
            f.truncate(1 << 40)
    t0 = time.monotonic()
    for name, main in {**READERS, "diff": diff.main}.items():
        argv = [store, _first_store(made_run)] if name == "diff" else entry(name, run_copy, made_run)
        code, out, err = cli(main, argv, capsys)
        if name == "status":  # status reports each run (and the damage) on stdout, then exits 2
            assert code == 2 and "1 damaged store" in out and store.name in out, out
        else:
            one_line_refusal(code, out, err, store.name)
    assert time.monotonic() - t0 < 60


def test_a_fifo_in_place_of_run_json_does_not_hang(run_copy, capsys):
    (run_copy / "run.json").unlink()
    os.mkfifo(run_copy / "run.json")
    code, out, err = cli(reduce.main, [run_copy], capsys)
    one_line_refusal(code, out, err, "run.json", "not a regular file")


MALFORMED = [
    ("missing role", lambda run: run["arms"][0].pop("role"), "arms[0].role"),
    ("no units", lambda run: run.update(units=[]), "units"),
    ("store entry a string", lambda run: run["units"][0]["stores"].update(native="done"),
     "units[0].stores.native"),
    ("no config_hash", lambda run: run["arms"][1].pop("config_hash"), "arms[1].config_hash"),
    ("sigma a string", lambda run: run["units"][2]["probe"].update(sigma="abc"), "units[2].probe.sigma"),
    ("no measure", lambda run: run.pop("measure"), "measure"),
    ("unknown measure", lambda run: run.update(measure="curvature"), "measure"),
    ("status unknown", lambda run: run.update(status="exploded"), "status"),
]


@pytest.mark.parametrize("what,change,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_run_json_is_one_line_naming_the_field(run_copy, made_run, capsys, what, change, field):
    edit_run_json(run_copy, change)
    for name, main in READERS.items():
        code, out, err = cli(main, entry(name, run_copy, made_run), capsys)
        one_line_refusal(code, out, err, "run.json", f"field {field}")


def test_status_verifies_stores_and_says_which_is_damaged(run_copy, capsys):
    store = _first_store(run_copy)
    store.write_bytes(store.read_bytes()[:-7])
    code, out, _ = cli(status.main, [run_copy], capsys)
    assert code == 2 and "damaged store" in out and store.name in out and "native 2/3" in out, out


# ----------------------------------------------------------------------------- hypothesis: mutate anything


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, (*prefix, i))


JUNK = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**20, max_value=10**30),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                 st.sampled_from(["../x", "", "..", "/etc/passwd", "a/b"]),
                 st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@st.composite
def mutations(draw, doc):
    paths = [p for p in _paths(doc) if p]
    path = draw(st.sampled_from(paths))
    return path, draw(st.one_of(st.just("<delete>"), JUNK))


def _mutate(doc, path, value):
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value == "<delete>" and isinstance(parent, dict):
        del parent[path[-1]]
    elif value == "<delete>":
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return doc


def _check_readers(run_dir, other, capsys):
    """Every reader: a documented exit code, no traceback, and on a refusal one line and no number."""
    for name, main in READERS.items():
        code, out, err = cli(main, entry(name, run_dir, other), capsys)
        assert code in (0, 1, 2, 3), (name, code, err)
        if code == 2 and name == "status":  # status lists the damage on stdout, every run's line
            assert "damaged store" in out or len(err.strip().splitlines()) == 1, (out, err)
        elif code == 2:
            one_line_refusal(code, out, err)
            assert "cos" not in out, out


@pytest.mark.parametrize("document", ["run.json", "summary.json"])
def test_hypothesis_mutated_documents_never_traceback(made_run, tmp_path_factory, capsys, document):
    original = json.loads((made_run / document).read_text())

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mutations(original))
    def check(mutation):
        run_dir = Path(shutil.copytree(made_run, tmp_path_factory.mktemp("mut") / "run"))
        mutated = _mutate(original, *mutation)
        (run_dir / document).write_text(json.dumps(mutated, allow_nan=True))
        _check_readers(run_dir, made_run, capsys)

    check()


def test_hypothesis_mutated_store_metadata_never_yields_a_number(made_run, tmp_path_factory, capsys):
    """Crafted stores with a valid payload hash (metadata rewritten, run.json's sha256 updated)."""
    import safetensors.torch

    store = _first_store(made_run)
    tensors = safetensors.torch.load_file(store)
    with open(store, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    keys = sorted(k for k in meta if k not in ("format", "sums_sha256"))

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(keys), st.one_of(st.just("<delete>"), JUNK.map(json.dumps)))
    def check(key, value):
        run_dir = Path(shutil.copytree(made_run, tmp_path_factory.mktemp("mut") / "run"))
        forged = {k: v for k, v in meta.items() if not (k == key and value == "<delete>")}
        if value != "<delete>":
            forged[key] = value
        path = _first_store(run_dir)
        data = safetensors.torch.save(tensors, metadata=forged)
        path.write_bytes(data)
        import hashlib

        edit_run_json(run_dir, lambda run: run["units"][0]["stores"]["native"].update(
            sha256=hashlib.sha256(data).hexdigest()))
        _check_readers(run_dir, made_run, capsys)

    check()


# ----------------------------------------------------------------------------- truthful state


def _interrupt(tmp_path, sig) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "inject"),
                                                                      os.environ.get("PYTHONPATH")]))}
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(
        "import os, time\n_f = os.fsync\nos.fsync = lambda fd: (time.sleep(0.3), _f(fd))[1]\n")
    # A shell starts background commands with SIGINT ignored, and an ignored signal stays ignored
    # across exec (Python then installs no KeyboardInterrupt handler): while the child starts, this
    # process handles SIGINT, so the child begins with the disposition of a foreground command.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "twinrun", "+experiment=pin_sigma", *TINY,
                                 f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 300
    while not list(run_dir.glob("arms/*/*.safetensors")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    return proc, run_dir


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_is_recorded_as_interrupted_in_one_line(tmp_path, capsys, sig, code):
    proc, run_dir = _interrupt(tmp_path, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err, err
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    # and it resumes to a valid run
    assert run_twinrun([str(run_dir), "--local"], cwd=tmp_path, module="twinrun.resume").returncode == 0


def test_status_tells_a_killed_run_from_a_running_one(run_copy, capsys):
    edit_run_json(run_copy, lambda run: run.update(status="running"))
    (run_copy / ".lock").write_text(json.dumps({"pid": 2**22 + 17, "host": os.uname().nodename}))
    code, out, _ = cli(status.main, [run_copy], capsys)
    assert code == 0 and "interrupted (its process is gone" in out, out
    assert "reduced: valid, gates passed" in out


def test_a_rejected_config_leaves_nothing_on_disk(tmp_path):
    # Hydra's default layout: its date folder goes too
    run_dir = tmp_path / "outputs" / "runs" / "day" / "run"
    proc = run_twinrun(["+experiment=pin_sigma", "probe.n_images=1", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path)
    assert proc.returncode == 2 and "probe.n_images" in proc.stderr
    assert not run_dir.exists() and not run_dir.parent.exists()
    mine = tmp_path / "mine"  # a folder the user chose stays, even empty
    proc = run_twinrun(["+experiment=pin_sigma", "probe.n_images=1", f"hydra.run.dir={mine / 'run'}"],
                       cwd=tmp_path)
    assert proc.returncode == 2 and not (mine / "run").exists() and mine.is_dir()


RAISES_AT_HIGH_SIGMA = """
from twinrun.interventions import PinSigma

class RaisesAboveOne(PinSigma):
    def sigma_cond(self, sigma):
        if float(sigma) > 1:
            raise RuntimeError("user code broke")
        return super().sigma_cond(sigma)
"""


def test_user_code_raising_mid_run_is_exit_4_in_one_line(tmp_path):
    (tmp_path / "raising.py").write_text(RAISES_AT_HIGH_SIGMA)
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={run_dir}",
                        "intervention._target_=raising.RaisesAboveOne"], cwd=tmp_path,
                       env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 4, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bin 2 (σ=1.2)" in lines[0] and "user code broke" in lines[0], lines
    failure = json.loads((run_dir / "run.json").read_text())["failure"]
    assert failure["unit_index"] == 2 and failure["unit"] == "bin 2 (σ=1.2)"


# ----------------------------------------------------------------------------- the streaming store format


def test_compare_addresses_the_gate_replicate_at_its_gate_bins(made_run, capsys):
    code, out, err = cli(compare.main, [made_run / "arms" / "native_replicate", made_run], capsys)
    assert code == 0, (out, err)
    rows = [line.split() for line in out.splitlines()[2:]]
    # bit-identical, gate bin only
    assert {r[0] for r in rows} == {"0.5"} and all(r[2] == "yes" for r in rows), out
    assert "gate bins" in err


def test_an_old_format_store_asks_for_a_new_measurement(run_copy, capsys):
    import hashlib

    import safetensors.torch
    import torch

    store = _first_store(run_copy)
    data = safetensors.torch.save({"sums": torch.ones(4, 3)}, metadata={"format": "twinrun-store/1"})
    store.write_bytes(data)
    edit_run_json(run_copy, lambda run: run["units"][0]["stores"]["native"].update(
        sha256=hashlib.sha256(data).hexdigest()))
    code, out, err = cli(reduce.main, [run_copy], capsys)
    one_line_refusal(code, out, err, store.name, "twinrun-store/1", "measure the run again")


@pytest.mark.parametrize("name", ["reduce", "status", "compare", "resume"])
def test_a_format_1_run_json_asks_for_a_new_measurement(run_copy, made_run, capsys, name):
    """run.json of σ bins (twinrun-run/1, written before units) is refused in one line, never migrated."""
    edit_run_json(run_copy, lambda run: run.update(format="twinrun-run/1"))
    main = resume.main if name == "resume" else READERS[name]
    argv = [run_copy, "--local"] if name == "resume" else entry(name, run_copy, made_run)
    code, out, err = cli(main, argv, capsys)
    one_line_refusal(code, out, err, "run.json", "twinrun-run/1", "measure the run again")


def test_a_forged_tensor_with_a_matching_file_digest_yields_no_number(run_copy, capsys):
    """One float changed inside a tensor, run.json's sha256 updated to the new file: the tensor's own
    digest (in the store's metadata) still refuses it, and no summary is written."""
    import hashlib

    from twinrun.storage.store import StoreReader

    store = _first_store(run_copy)
    with StoreReader(store) as reader:
        start = reader.tensors[-1].start
    data = bytearray(store.read_bytes())
    data[start + 2] ^= 0x04
    store.write_bytes(bytes(data))
    edit_run_json(run_copy, lambda run: run["units"][0]["stores"]["native"].update(
        sha256=hashlib.sha256(bytes(data)).hexdigest()))
    (run_copy / "summary.json").unlink()
    code, out, err = cli(reduce.main, [run_copy], capsys)
    one_line_refusal(code, out, err, store.name, "does not match its sha256")
    assert not (run_copy / "summary.json").exists()


def test_an_estimand_the_run_did_not_register_is_one_line(run_copy, capsys):
    code, out, err = cli(reduce.main, [run_copy, "--estimands", "all,block9"], capsys)
    one_line_refusal(code, out, err, "--estimands", "block9", "reduce.groups")


@pytest.mark.parametrize("knob, value, field", [
    ("constraint", "a100\ntouch /tmp/x\n#", "launcher.constraint"),
    ("partition", "gpu;id", "launcher.partition"),
    ("additional_parameters", {"export": "ALL,LD_PRELOAD=RUN/x.so"}, "launcher.additional_parameters"),
])
def test_launch_json_writes_no_line_into_the_sbatch_script(tmp_path, knob, value, field):
    # resume resubmits with launch.json's launcher: nothing in it may become a shell line of sbatch's script
    job = {"job_id": "999999", "result": str(tmp_path / "r"), "stdout": "o", "stderr": "e"}
    launched = {"cluster": "slurm", **job, "folder": "f", "launcher": {"name": "slurm", knob: value}}
    (tmp_path / "launch.json").write_text(json.dumps(launched))
    with pytest.raises(StoreError, match=rf"launch.json: field {field}\b.*resume with --local") as err:
        submitted_launcher(RunDir(tmp_path))
    assert "\n" not in str(err.value).replace(repr(value), "") and "Traceback" not in str(err.value)


@pytest.mark.parametrize("job_id", ["99999999999999999999", "0", "7_1", str(2**22)])
def test_a_local_job_id_that_is_no_process_id_is_refused(run_copy, capsys, job_id):
    # status signals a local job's pid: a huge one overflowed, 0 read RUNNING forever (kill(0, 0))
    job = {"job_id": job_id, "result": str(run_copy / "r"), "stdout": "o", "stderr": "e"}
    (run_copy / "launch.json").write_text(json.dumps({"cluster": "local", **job, "folder": "f",
                                                      "launcher": {}}))
    code, out, err = cli(status.main, [run_copy], capsys)
    one_line_refusal(code, out, err, "launch.json", "field job_id", "not a local job's process id")


def test_a_symlinked_env_directory_is_refused_before_a_job_writes_through_it(run_copy, tmp_path):
    from twinrun.job import start_job
    from twinrun.storage.rundir import RunIndex

    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(run_copy / "env")
    (run_copy / "env").symlink_to(outside)
    fp = {"kernel_path": {"threads": {"intra_op": 1}}, "info": {}}
    with pytest.raises(StoreError, match="resolves outside the run directory"):
        start_job(RunIndex.load(run_copy), fp, {}, {"digest": "0" * 64})
    assert list(outside.iterdir()) == []
