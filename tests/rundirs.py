"""Run directories for tests that build one by hand, through the owners the code itself uses.

run.json is a valid twinrun-run/2 document of a probe run whose units are laid out as planning lays
them out (twinrun.plan.unit_entry: a pending store per arm, the gate replicate at gate units; labels
and file names from twinrun.measures.probe), written by RunIndex.create, its one writer. Stores are
written by tests/stores.py (write_store of fold_tensors). A test that needs a damaged or hostile
run.json edits one of these documents and writes it raw.
"""

from contextlib import AbstractContextManager
from pathlib import Path

from twinrun.arms import Arm
from twinrun.job import _unit_locks
from twinrun.measures.probe import bin_label, store_name
from twinrun.plan import unit_entry
from twinrun.provenance.record import straddling_rule
from twinrun.storage.lock import run_lock
from twinrun.storage.records import RUN_FORMAT, RunRecord
from twinrun.storage.rundir import RunDir, RunIndex

ARMS = (("pin_sigma", "intervention"), ("native", "twin"))
REGISTERED = {"estimands": ["all"], "gate_rule": "replicate", "signal_alpha": 0.05}


def run_doc(sigmas, gates=(), arms=ARMS, status: str = "planned", hashes: dict | None = None,
            registered: dict | None = None) -> RunRecord:
    """A probe run's run.json: one unit per σ (a gate unit where σ is in `gates`), every store pending.

    arms: (name, role) pairs; hashes: {arm: config_hash} (default: a distinct hex digest per arm)."""
    planned = [Arm(name, {}, role) for name, role in arms]
    hashes = {a.name: f"{k + 1:016x}" for k, a in enumerate(planned)} | (hashes or {})
    units = [unit_entry({"index": i, "label": bin_label(i, s), "gate": s in gates, "probe": {"sigma": s},
                         "file": store_name(i, s)}, planned) for i, s in enumerate(sigmas)]
    return {"format": RUN_FORMAT, "measure": "probe", "status": status, "command": None, "reference": None,
            "arms": [{"name": a.name, "role": a.role, "config_hash": hashes[a.name]} for a in planned],
            "registered": dict(registered or REGISTERED), "units": units}


def done(doc: RunRecord, unit: int, arm: str, kernel_path: str, sha256: str = "c" * 64) -> RunRecord:
    """Record one store of the document done on a kernel path, as mark_done records it."""
    doc["units"][unit]["stores"][arm].update(status="done", sha256=sha256, kernel_path_sha256=kernel_path)
    return doc


def create(run_dir, doc: RunRecord) -> RunIndex:
    """run.json written by its one writer (validated first), in a directory made for it."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return RunIndex.create(run_dir, doc)


def planned_run(run_dir, n_units: int = 3, **settings) -> RunIndex:
    """A run directory holding only run.json: `n_units` units at σ = 0.1, 0.2, ...; no gate unit."""
    return create(run_dir, run_doc([round(0.1 * (i + 1), 6) for i in range(n_units)], **settings))


def refuse(index: RunIndex, fp: dict | None = None):
    """The straddling rule a job hands to mark_done, for a job whose fingerprint is `fp`."""
    return straddling_rule(index.run_dir.path, index.run_dir.kernel_path_env, fp or {"kernel_path": {}})


def job_lock(run_dir, units: list[int] | None = None) -> AbstractContextManager:
    """The locks run_job holds: the whole run (every unit's lock too), or one array element's units."""
    rd = RunDir(run_dir)
    return run_lock(rd.lock, _unit_locks(rd, units), shared=units is not None)
