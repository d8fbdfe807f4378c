"""Publishing a reduction: the sinks that write what a researcher reads. Reducing writes nothing itself.

The registered analysis goes to RUN/summary.json and RUN/report.md (with its plots), then, when the
user's command names one, to an experiment tracker (twinrun.publish.trackers: each sink one module,
imported only when it is configured); a post-hoc view goes to RUN/views/<what changed>/, never over
the registered files, and to no tracker. The tidy table (twinrun.publish.table) reads what is written.
"""

import os
from pathlib import Path

from twinrun.files import make_dir, write_json
from twinrun.provenance.version import twinrun_version
from twinrun.publish.trackers import send
from twinrun.storage.rundir import RunDir


def _plots(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).glob("*.png") if not p.is_symlink() and p.is_file())


def _identity(path: Path) -> tuple | None:
    """(device, inode, mtime): what changes when a file is written anew by an atomic rename."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def publish(reduction, kind, tracker: dict | None = None) -> None:
    """Write a Reduction (twinrun.analysis.reduction): the registered summary, or the post-hoc view; every
    summary carries the twinrun that wrote it. `kind`: the run's measurement kind (its `report` writer
    (out_dir, summary, index) and its tracker rows). `tracker`: checked settings (check_tracker), or None."""
    report = kind.report
    rd = reduction.index.run_dir
    if reduction.view is None:
        summary = {**reduction.summary, "twinrun": twinrun_version()}
        before = {p: _identity(p) for p in _plots(rd.path)}
        write_json(rd.summary_json, summary)
        written = report(rd.path, summary, reduction.index)
        # The plots this report wrote (each a new file, renamed into place), whatever the kind names them;
        # a plot left from an earlier reduction or planted in the run directory is never logged as its own.
        fresh = [p for p in _plots(rd.path) if _identity(p) != before.get(p)]
        send(tracker, reduction.index, summary, [rd.summary_json, written, *fresh], kind)
        return
    out = make_dir(rd.view_dir(reduction.view_name))
    view = {**reduction.view, "twinrun": twinrun_version()}
    write_json(RunDir(out).summary_json, view)
    report(out, view, reduction.index)
