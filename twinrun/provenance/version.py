"""Which twinrun wrote a record: the package version and, in a git checkout, the commit.

Every record twinrun writes (run.json, summary.json, sweep_summary.json, report.md) carries it, so a
wheel install (no git) still names its version. The package's own version is the one installed
(importlib.metadata), which a checkout's editable install shares.
"""

import functools
from importlib import metadata

import twinrun
from twinrun.provenance.host import _git_state  # the fingerprint's own reading of the checkout


@functools.cache
def twinrun_version() -> dict:
    """{"version": "0.1.0", "commit": hex or None, "dirty": bool or None} of the twinrun running now."""
    try:
        version = metadata.version("twinrun")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        version = twinrun.__version__
    return {"version": version, **_git_state()}


def version_text(record: dict | None) -> str:
    """`twinrun 0.1.0 (git 1a2b3c4d5e, dirty)`, or `twinrun 0.1.0 (no git checkout)`; a record from a
    twinrun that wrote none reads as such."""
    if not isinstance(record, dict) or not record.get("version"):
        return "twinrun version not recorded (written by an earlier twinrun)"
    commit = record.get("commit")
    dirty = ", dirty" if record.get("dirty") else ""
    where = f"git {str(commit)[:10]}{dirty}" if commit else "no git checkout"
    return f"twinrun {record['version']} ({where})"
