"""The run directory's one owner: every path in it (RunDir, on the paths of
twinrun.storage.run_paths) and run.json as a validated record (RunIndex).

A run directory is untrusted input (it may come from anyone): every name read from it is checked
against SAFE_NAME and every path resolved inside the directory before it is opened or written, and
run.json is validated field by field before anyone reads it (twinrun.storage.records), so a
malformed one is one line naming the file and the field (exit 2), never a traceback or a number.
RunIndex is the one writer of run.json: `create` writes a new one, every change afterwards is a
method here, and the one rule of when a unit is whole (every store of it done, and verifying on disk
where asked) is `RunIndex.is_whole`.
"""

import os
from collections.abc import Callable
from pathlib import Path

from twinrun.errors import StoreError
from twinrun.files import read_json, read_yaml, write_json
from twinrun.protocol import config_hash
from twinrun.storage.lock import update_lock
from twinrun.storage.records import (
    GATE_REPLICATE,
    RUN_STATUSES,
    ArmEntry,
    Failure,
    JobRecord,
    Role,
    RunRecord,
    SharedSummary,
    StoreEntry,
    Summary,
    UnitEntry,
    validate_run,
    validate_summary,
    validate_units,
)
from twinrun.storage.run_paths import RunPaths
from twinrun.storage.store import verify_store

# refuse(other kernel-path digests of whole units, this store's) raises when a store may not join the
# run (the straddling rule, twinrun.provenance.record.refuse_straddling): handed in, never imported.
StraddleRule = Callable[[set, str], None]


class RunDir(RunPaths):
    """Every path of one run directory (RunPaths), and its documents read through them: an arm's config,
    summary.json."""

    def read_arm_config(self, arm: str) -> dict:
        """An arm's resolved config.yaml as plain data (one StoreError line if it is not a config)."""
        path = self.arm_config(arm)
        config = read_yaml(path, "arm config")
        if not isinstance(config, dict):
            raise StoreError(path, "not a resolved twinrun config")
        return config

    def has_summary(self) -> bool:
        return self.summary_json.is_file()

    def read_summary(self, schema: type = SharedSummary) -> Summary:
        """summary.json, validated against `schema` (its kind's summary_type); a summary may vouch only
        for the reference its own run.json names (a hand-edited claim of "alive" for another run is
        refused)."""
        summary = validate_summary(self.summary_json, read_json(self.summary_json), schema)
        reference = summary.get("reference")
        if reference is not None:
            named = RunIndex.load(self).reference if self.is_run() else None
            if named is None or Path(named).resolve() != Path(reference["path"]).resolve():
                raise StoreError(self.summary_json, f"field reference.path: {reference['path']!r} is not the "
                                 f"reference run.json names ({named!r}); the file is damaged "
                                 "or was edited by hand")
        return summary


class RunIndex:
    """run.json, validated, with the questions and updates every module asks of it.

    `doc` is the plain JSON document, typed RunRecord (what is written back); every change goes
    through a method here and is saved atomically, under the index lock.
    """

    def __init__(self, run_dir: RunDir, doc: RunRecord):
        self.run_dir, self.doc = run_dir, doc

    @classmethod
    def load(cls, run_dir) -> "RunIndex":
        rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        path = rd.require().run_json
        index = cls(rd, validate_run(path, read_json(path)))
        index._contained()
        return index

    @classmethod
    def create(cls, run_dir, doc: RunRecord) -> "RunIndex":
        """Write a new run.json (planning's only write of it); refused if one exists."""
        rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        if rd.is_run():
            raise StoreError(rd.run_json, "exists already: a run directory is planned once")
        index = cls(rd, validate_run(rd.run_json, doc))
        index._contained()
        write_json(rd.run_json, doc)
        return index

    def _contained(self) -> None:
        """Every arm directory and store file run.json names resolves inside its run directory
        (a symlinked arm directory or store is refused before anyone reads through it)."""
        for name in self.arm_names:
            self.run_dir.arm_dir(name)
        for u in self.units:
            for arm in u["stores"]:
                self.store_path(u, arm)

    # ---- questions

    @property
    def status(self) -> str:
        return self.doc["status"]

    @property
    def measure(self) -> str:
        return self.doc["measure"]

    @property
    def units(self) -> list[UnitEntry]:
        return self.doc["units"]

    @property
    def arms(self) -> list[ArmEntry]:
        return self.doc["arms"]

    @property
    def arm_names(self) -> list[str]:
        return [a["name"] for a in self.arms]

    @property
    def registered(self) -> dict:
        return self.doc["registered"]

    @property
    def reference(self) -> str | None:
        return self.doc.get("reference")

    @property
    def command(self) -> str | None:
        return self.doc.get("command")

    @property
    def jobs(self) -> list[JobRecord]:
        return self.doc.get("jobs", [])

    @property
    def failure(self) -> Failure | None:
        return self.doc.get("failure")

    def arm(self, role: Role) -> ArmEntry:
        """The arm entry with this role (intervention, twin, replicate, machinery)."""
        found = [a for a in self.arms if a["role"] == role]
        if not found:
            raise StoreError(self.run_dir.run_json, f"no arm with role {role!r}")
        return found[0]

    def arm_config(self, name: str) -> dict:
        """An arm's config.yaml, held to the config_hash run.json records for it: what every reader (the
        reducers, the table, the trackers) takes from a config is the config that was measured; an
        edited one is one line naming the file (exit 2), never a verdict, a seed or a param."""
        path = self.run_dir.arm_config(name)
        config = self.run_dir.read_arm_config(name)
        recorded = next((a["config_hash"] for a in self.arms if a["name"] == name), None)
        if recorded is None:
            raise StoreError(self.run_dir.run_json, f"has no arm {name!r}")
        if config_hash(config) != recorded:
            raise StoreError(path, f"does not match the config_hash {recorded} run.json records for it "
                             "(edited after planning?); restore it, or measure again into a new run "
                             "directory")
        return config

    def arms_with_role(self, role: Role) -> list[str]:
        return [a["name"] for a in self.arms if a["role"] == role]

    def has_gate_replicate(self) -> bool:
        """The twin measured again at gate units only (not an arm of its own)."""
        return GATE_REPLICATE not in self.arm_names and any(GATE_REPLICATE in u["stores"] for u in self.units)

    def check_units(self, fields: type, increasing: str | None) -> None:
        """The units' own fields against the run's kind's (handed in by whoever looked the kind up)."""
        validate_units(self.run_dir.run_json, self.doc, fields, increasing)

    def params(self, u: UnitEntry) -> dict:
        """The unit's own fields under its measurement kind (e.g. {"sigma": 0.5} for the probe)."""
        return u[self.measure]

    def store_entry(self, u: UnitEntry, arm: str) -> StoreEntry:
        return u["stores"][arm]

    def store_path(self, u: UnitEntry, arm: str) -> Path:
        return self.run_dir.store(arm, u["stores"][arm]["file"])

    def is_whole(self, u: UnitEntry, verify: bool = False, reader=None) -> bool:
        """Every store of the unit is recorded done and, with verify, exists and matches its sha256.

        The unit is the unit of twin validity: one missing or damaged store makes the whole unit
        pending again (all of its arms are measured afresh, back to back in one process). `reader`: the
        run's kind's store check (path, sha256, payload_bytes) -> metadata (its `verify_store`), None for
        storage/store.py's."""
        if not all(entry["status"] == "done" for entry in u["stores"].values()):
            return False
        return not verify or all(self._verifies(u, arm, reader or verify_store) for arm in u["stores"])

    def _verifies(self, u: UnitEntry, arm: str, reader) -> bool:
        entry = u["stores"][arm]
        try:
            reader(self.store_path(u, arm), entry["sha256"], payload_bytes=entry.get("payload_bytes"))
        except StoreError as err:
            print(f"twinrun: re-measuring {err}", flush=True)
            return False
        return True

    def whole_units(self, verify: bool = False, only: list[int] | None = None,
                    reader=None) -> list[UnitEntry]:
        """The units whose every store is done (verified on disk with verify; `only`: verify just these
        units, an array element's own, and judge the others by their record)."""
        return [u for u in self.units
                if self.is_whole(u, verify and (only is None or u["index"] in only), reader)]

    def pending_units(self, only: list[int] | None = None, reader=None) -> list[UnitEntry]:
        """The units a job must measure: every unit not whole on disk (among `only`, if given); `reader`:
        as is_whole's."""
        whole = {u["index"] for u in self.whole_units(verify=True, only=only, reader=reader)}
        return [u for u in self.units if u["index"] not in whole and (only is None or u["index"] in only)]

    def whole_kernel_paths(self, doc: RunRecord | None = None, except_unit: int | None = None) -> set[str]:
        """The kernel paths the whole units (of `doc`, default run.json as last read) were measured on."""
        units = (doc or self.doc)["units"]
        return {e.get("kernel_path_sha256") for u in units if u["index"] != except_unit and
                all(x["status"] == "done" for x in u["stores"].values())
                for e in u["stores"].values()} - {None}

    def own_failure(self, units: list[int] | None) -> Failure | None:
        """The failure recorded at these units (an array element's; never another element's), or the
        run's latest when `units` is None."""
        if units is None:
            return self.failure
        for u in self.units:
            if u["index"] in units:
                for entry in u["stores"].values():
                    if entry.get("failure"):
                        return entry["failure"]
        return None

    # ---- updates (each a read-modify-write of run.json under its lock)

    def _update(self, change) -> None:
        """Apply `change(doc)` to run.json as it is on disk now and write it back atomically, all under
        RUN_DIR/.run.json.lock: the array elements of a split run update run.json concurrently, and
        none may lose another's record. `self.doc` becomes the document written (same object)."""
        with update_lock(self.run_dir.index_lock):
            # A run.json not written yet has no other writer: the document in memory is the record.
            rd = self.run_dir
            doc = (validate_run(rd.run_json, read_json(rd.run_json)) if os.path.lexists(rd.run_json)
                   else self.doc)
            change(doc)
            write_json(rd.run_json, doc)
        if doc is not self.doc:  # (clearing the very document read back would empty it)
            self.doc.clear()
            self.doc.update(doc)  # in place: callers holding `index.doc` see the fresh document

    def set_status(self, status: str, units: list[int] | None = None) -> None:
        """units: the units this job measures; a failure recorded at another unit (another array
        element's) is kept, and so is the run's "failed" status."""
        assert status in RUN_STATUSES, status

        def change(doc: RunRecord) -> None:
            failure = doc.get("failure")
            other = units is not None and failure is not None and failure["unit_index"] not in units
            if status == "running" and not other:
                doc.pop("failure", None)
            if status == "running":  # this job's units start afresh; another element's failures stay
                for u in doc["units"]:
                    if units is None or u["index"] in units:
                        for entry in u["stores"].values():
                            entry.pop("failure", None)
            if not (status == "running" and other):
                doc["status"] = status

        self._update(change)

    def finish_measuring(self) -> None:
        """The run is "measured" once every unit is whole, whichever job or array element ends last;
        until then its status stays as it is (another element may still be measuring)."""
        def change(doc: RunRecord) -> None:
            if all(e["status"] == "done" for u in doc["units"] for e in u["stores"].values()):
                doc["status"] = "measured"

        self._update(change)

    def add_job(self, job: JobRecord) -> int:
        """Append this job's record to run.json's `jobs`; its index is its position there."""
        def change(doc: RunRecord) -> None:
            jobs = doc.setdefault("jobs", [])
            job["index"] = len(jobs)
            jobs.append({"index": job["index"], **job})

        self._update(change)
        return job["index"]

    def end_job(self, index: int, sentinel_end: str, **fields) -> None:
        """The job's closing record: the sentinel read again, and `fields` (a replay's kernel_pin)."""
        def change(doc: RunRecord) -> None:
            doc["jobs"][index]["sentinel_end"] = sentinel_end
            doc["jobs"][index].update(fields)

        self._update(change)

    def mark_done(self, u: UnitEntry, arm: str, sha256: str, kernel_path_sha256: str,
                  refuse: StraddleRule, identity_sha256: str | None = None) -> None:
        """Record the store done (with the kernel path it ran on and what it measured), unless `refuse`
        objects to joining the whole units of run.json as it is now (another array element's, finished
        since this job started) on this kernel path."""
        def change(doc: RunRecord) -> None:
            refuse(self.whole_kernel_paths(doc, except_unit=u["index"]), kernel_path_sha256)
            doc["units"][u["index"]]["stores"][arm].update(sha256=sha256, status="done",
                                                          kernel_path_sha256=kernel_path_sha256,
                                                          identity_sha256=identity_sha256)

        self._update(change)

    def mark_unit_done(self, u: UnitEntry, digests: dict[str, str], kernel_path_sha256: str,
                       refuse: StraddleRule, identity_sha256: str | None = None) -> None:
        """Record every store of a unit done at once ({arm: sha256}), as mark_done does each: for a kind
        whose units continue each other, a unit with some arms done is never continued from anyway."""
        def change(doc: RunRecord) -> None:
            refuse(self.whole_kernel_paths(doc, except_unit=u["index"]), kernel_path_sha256)
            for arm, sha256 in digests.items():
                doc["units"][u["index"]]["stores"][arm].update(sha256=sha256, status="done",
                                                              kernel_path_sha256=kernel_path_sha256,
                                                              identity_sha256=identity_sha256)

        self._update(change)

    def mark_failed(self, u: UnitEntry, arm: str, cause: dict | None = None) -> None:
        """Record which arm and unit failed (and, when the model raised, its exception's type, message
        and frame); best effort (on a full disk run.json may not be writable)."""
        def change(doc: RunRecord) -> None:
            failure = {"arm": arm, "unit_index": u["index"], "unit": u["label"], **(cause or {})}
            doc["units"][u["index"]]["stores"][arm].update(status="failed", failure=failure)
            doc["status"] = "failed"
            doc["failure"] = failure  # the latest; the unit's store entry keeps its own

        self._update_best_effort(change)

    def mark_interrupted(self, units: list[int] | None = None) -> None:
        """The run is "interrupted" (resume continues); not so when one array element (`units`) was:
        the others may still be measuring, and its units stay pending for a resume."""
        def change(doc: RunRecord) -> None:
            if units is None:
                doc["status"] = "interrupted"

        self._update_best_effort(change)

    def _update_best_effort(self, change) -> None:
        try:
            self._update(change)
        except StoreError as err:
            print(f"twinrun: could not record the state in run.json: {err}", flush=True)
