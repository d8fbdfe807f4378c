"""No write follows a link: temporary files are created exclusively, a link at a file's own name is
replaced, never written through, and lock files are the run directory's own (one link) or refused. The
slow test plants symlinks and hard links at every name a resume writes and checks that nothing outside
the run directory changed."""

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest
from rundirs import job_lock, planned_run

from twinrun import files, resume
from twinrun.errors import StoreError
from twinrun.files import write_json
from twinrun.storage.rundir import RunIndex


def _victim(outside: Path, name: str, content: bytes = b"precious") -> Path:
    outside.mkdir(exist_ok=True)
    path = outside / name.replace("/", "_")
    path.write_bytes(content)
    return path


def test_a_write_never_follows_a_link_planted_at_its_temporary_name(tmp_path, monkeypatch):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    victim = _victim(outside, "victim")
    symlink, hard = run / ".run.json.tmp-a", run / ".run.json.tmp-b"
    symlink.symlink_to(victim)
    os.link(victim, hard)
    names = iter([symlink, hard, run / ".run.json.tmp-c"])  # the first two names taken: a third is tried
    monkeypatch.setattr(files, "temp_name", lambda path: next(names))
    write_json(run / "run.json", {"a": 1})
    assert victim.read_bytes() == b"precious" and victim.stat().st_nlink == 2
    assert json.loads((run / "run.json").read_text()) == {"a": 1}
    assert symlink.is_symlink() and not (run / ".run.json.tmp-c").exists()  # plants left, ours renamed


def test_every_temporary_name_taken_is_one_line_not_a_write(tmp_path, monkeypatch):
    victim = _victim(tmp_path / "outside", "victim")
    (tmp_path / ".x.tmp-planted").symlink_to(victim)
    monkeypatch.setattr(files, "temp_name", lambda path: tmp_path / ".x.tmp-planted")
    with pytest.raises(StoreError, match=r"x.json: no free temporary name after 100 tries"):
        write_json(tmp_path / "x.json", {"a": 1})
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("link", ["symlink", "hard"])
def test_a_link_at_a_files_own_name_is_replaced_never_written_through(tmp_path, link):
    victim = _victim(tmp_path / "outside", "victim")
    target = tmp_path / "summary.json"
    target.symlink_to(victim) if link == "symlink" else os.link(victim, target)
    write_json(target, {"b": 2})
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.stat().st_nlink == 1
    assert json.loads(target.read_text()) == {"b": 2}


@pytest.mark.parametrize("name", [".lock", ".lock-unit001", ".run.json.lock"])
def test_a_hard_linked_lock_is_refused_and_the_file_it_links_to_untouched(tmp_path, name):
    run = tmp_path / "run"
    planned_run(run, 3)
    victim = _victim(tmp_path / "outside", "victim", b'{"pid": 1, "host": "elsewhere"}')
    (run / name).unlink(missing_ok=True)
    os.link(victim, run / name)
    with pytest.raises(StoreError, match=rf"{name}: the run lock has 2 links \(a hard link"):
        if name == ".run.json.lock":
            RunIndex.load(run).set_status("running")  # every run.json update takes this one
        else:
            with job_lock(run):
                pass
    assert victim.read_bytes() == b'{"pid": 1, "host": "elsewhere"}'


# ----------------------------------------------------------------------------- a resume, every name planted


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.lstat().st_ino, p.lstat().st_mtime_ns, p.lstat().st_size)
            for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}


def _resumable(tiny_run: Path, where: Path) -> Path:
    """A copy of the finished run with its last unit to measure again (its stores gone)."""
    run = Path(shutil.copytree(tiny_run, where, symlinks=True))
    doc = json.loads((run / "run.json").read_text())
    last = doc["units"][-1]
    for arm, entry in last["stores"].items():
        entry.update(status="pending", sha256=None)
        (run / "arms" / arm / entry["file"]).unlink()
    (run / "run.json").write_text(json.dumps(doc))
    return run


def _resume(run: Path, capsys) -> tuple[int, str]:
    try:
        code = resume.main([str(run), "--local"])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def written(tiny_run, tmp_path_factory) -> list[str]:
    """Every name (relative to the run directory) a resume of one unit creates or changes."""
    run = _resumable(tiny_run, tmp_path_factory.mktemp("probe") / "run")
    before = _snapshot(run)
    assert resume.main([str(run), "--local"]) == 0
    after = _snapshot(run)
    names = sorted(n for n in after if before.get(n) != after[n])
    # (.run.json.lock is only flocked, never written: the lock test plants a link there too)
    assert {"run.json", ".lock", ".lock-unit002", "summary.json", "report.md"} <= set(names), names
    assert any(n.startswith("arms/native/bin02") for n in names)
    assert any(n.startswith("env/job") for n in names)
    return names


LOCKS = (".lock", ".run.json.lock")


def _plant(run: Path, names, outside: Path, link: str) -> dict[Path, bytes]:
    """A link at each name to a file outside (the name's own content, where it has one, so that what a
    resume reads through it still reads); {outside file: its content}."""
    victims = {}
    for name in names:
        path = run / name
        content = path.read_bytes() if path.is_file() else b"precious"
        victim = _victim(outside, name, content)
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(victim) if link == "symlink" else os.link(victim, path)
        victims[victim] = content
    return victims


def _untouched(victims: dict, mtimes: dict) -> None:
    for victim, content in victims.items():
        assert victim.read_bytes() == content, f"{victim} was written through a link"
        assert victim.stat().st_mtime_ns == mtimes[victim], f"{victim} was touched"


@pytest.mark.slow
def test_hard_links_at_every_name_a_resume_writes_leave_the_files_outside_untouched(written, tiny_run,
                                                                                     tmp_path, capsys,
                                                                                     monkeypatch):
    run = _resumable(tiny_run, tmp_path / "run")
    outside = tmp_path / "outside"
    victims = _plant(run, [n for n in written if not n.startswith(LOCKS)], outside, "hard")
    mtimes = {v: v.stat().st_mtime_ns for v in victims}
    temps = [run / f".run.json.tmp-planted{k}" for k in range(3)]
    victims |= _plant(run, [t.relative_to(run).as_posix() for t in temps], outside, "hard")
    mtimes |= {v: v.stat().st_mtime_ns for v in victims}
    names = itertools.chain(temps, itertools.repeat(None))  # the first temporary names asked for: planted
    real = files.temp_name
    monkeypatch.setattr(files, "temp_name", lambda path: next(names) or real(path))
    code, err = _resume(run, capsys)
    assert code == 0, err
    _untouched(victims, mtimes)
    for name in written:  # each now the run's own file
        assert (run / name).stat().st_nlink == 1 and not (run / name).is_symlink(), name


@pytest.mark.slow
def test_symlinks_at_every_name_a_resume_writes_leave_the_files_outside_untouched(written, tiny_run, tmp_path,
                                                                                  capsys):
    run = _resumable(tiny_run, tmp_path / "run")
    # (stores, env/ records and locks are paths a symlink would take outside: refused, tested below)
    names = [n for n in written if not n.startswith((*LOCKS, "arms/", "env/"))]
    victims = _plant(run, names, tmp_path / "outside", "symlink")
    mtimes = {v: v.stat().st_mtime_ns for v in victims}
    code, err = _resume(run, capsys)
    assert code == 0, err
    _untouched(victims, mtimes)
    assert not any((run / n).is_symlink() for n in names)


@pytest.mark.slow
def test_a_symlink_where_a_resume_writes_a_store_or_a_job_record_is_refused(written, tiny_run, tmp_path,
                                                                            capsys):
    for prefix in ("arms/native/bin02", "env/job"):
        run = _resumable(tiny_run, tmp_path / prefix.replace("/", "_") / "run")
        victims = _plant(run, [n for n in written if n.startswith(prefix)], tmp_path / "outside", "symlink")
        mtimes = {v: v.stat().st_mtime_ns for v in victims}
        code, err = _resume(run, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "resolves outside the run directory" in err, err
        _untouched(victims, mtimes)


@pytest.mark.slow
@pytest.mark.parametrize("lock", [".lock", ".lock-unit002", ".run.json.lock"])
def test_a_linked_lock_stops_a_resume_before_it_writes_anything(tiny_run, tmp_path, capsys, lock):
    run = _resumable(tiny_run, tmp_path / "run")
    victims = _plant(run, [lock], tmp_path / "outside", "hard")
    mtimes = {v: v.stat().st_mtime_ns for v in victims}
    before = _snapshot(run)
    code, err = _resume(run, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "hard link" in err, err
    _untouched(victims, mtimes)
    assert {k: v for k, v in _snapshot(run).items() if not k.startswith(".lock")} == \
        {k: v for k, v in before.items() if not k.startswith(".lock")}
