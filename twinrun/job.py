"""The job: everything a twinrun job does, whatever it measures.

`run_job(run_dir)` runs in-process, or pickled by submitit onto a node: it reads only the run
directory (trusting only the builders twinrun ships or the user named), takes the run's locks,
applies determinism, fingerprints where it runs, refuses to straddle kernel paths, records itself
in run.json, then measures every pending unit, all arms of a unit back to back, each store written
atomically and recorded as it lands. Failures and interrupts are recorded before they propagate;
finished units are kept. What a unit holds is the measurement kind's (twinrun/measures).
"""

import hashlib
import json
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from twinrun.cold_check import cold_check
from twinrun.errors import (
    EXIT_INTERRUPTED,
    FAILURE_EXIT_CODES,
    ConfigError,
    Interrupted,
    KernelPathRefused,
    TwinrunError,
    signal_first,
)
from twinrun.files import make_dir, read_json, write_json
from twinrun.measures.failures import failure_record, to_model_error
from twinrun.measures.kind import Session, describe_device, resolve_device
from twinrun.measures.registry import load_index, measure_of
from twinrun.plan import load_arms
from twinrun.provenance import kernel_pin
from twinrun.provenance.compile_cache import existing_run_cache, is_run_cache, reuse_built_libraries
from twinrun.provenance.fingerprint import fingerprint
from twinrun.provenance.record import (
    compile_cache_root,
    kernel_path_sha256,
    setup_determinism,
    straddling_rule,
    unit_record,
)
from twinrun.storage.lock import run_lock
from twinrun.storage.records import GATE_REPLICATE, JobRecord, RunRecord, UnitEntry
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.store import write_store


def run_job(run_dir: str | Path, trusted=(), units: list[int] | None = None,
            gpus: int | None = None) -> RunRecord:
    """Measure every pending unit, all arms back to back on the same draws; one writer at a time.

    `trusted`: builders (`_target_`s or module names) beyond twinrun's own that the arms may name.
    `units`: measure only these unit indices (one array element of launcher.split=bins, holding only
    their locks); None = every pending unit. `gpus`: how many GPUs the launcher requested for this
    job (None: measured in this process, on whatever it sees).
    """
    rd = RunDir(run_dir)
    warn_once()
    with run_lock(rd.lock, _unit_locks(rd, units), shared=units is not None):
        if units is None:  # with units, another element may be writing: its temp files are not stale
            for stale in rd.tmp_files():  # a write cut short by a kill: never read
                stale.unlink(missing_ok=True)
        index = load_index(rd)[0]
        try:
            with signal_first():
                return _measure(index, load_arms(index, trusted), units, gpus)
        except (KeyboardInterrupt, Interrupted) as err:
            index.mark_interrupted(units)
            if isinstance(err, KeyboardInterrupt):
                raise Interrupted(EXIT_INTERRUPTED) from None
            raise


def _unit_locks(rd: RunDir, units: list[int] | None) -> list[Path]:
    """The unit locks a job holds: its own units', or (the whole run) every unit's and any left behind."""
    if units is not None:
        return [rd.unit_lock(i) for i in sorted(set(units))]
    found = set(rd.unit_locks_left())
    try:
        found.update(range(len(RunIndex.load(rd).units)))
    except TwinrunError:
        pass  # a damaged run.json is refused by whoever reads it next, with its own message
    return [rd.unit_lock(i) for i in sorted(found)]


# torch's warning when vmap falls back to a loop for scaled dot-product attention (any of its kernels).
SDPA_UNDER_VMAP = r"There is a performance drop because we have not yet implemented the batching rule for " \
    r"aten::_?scaled_dot_product"


def warn_once() -> None:
    """From now on this process shows each warning (category and text) once. torch raises its C++
    warnings (e.g. "no batching rule for SDPA" under vmap) without a registry, so Python's own "once"
    and "default" filters cannot hold them back: planning's trial, the job's trial and every bin would
    each print it again. Idempotent; called by every entry point that measures.

    One warning is kept off altogether: under vmap, attention through SDPA (a diffusers DiT's) has no
    batching rule and runs a per-sample loop, which torch calls a "performance drop". The numbers are the
    same; planning's estimate times that very path, so the warning tells the user nothing to act on
    (twinrun's own adapters, twinrun.models, batch their attention and never raise it)."""
    warnings.filterwarnings("ignore", message=SDPA_UNDER_VMAP, category=UserWarning)
    show = warnings.showwarning
    if getattr(show, "twinrun_once", False):
        return
    seen: set = set()

    def once(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key not in seen:
            seen.add(key)
            show(message, category, filename, lineno, file, line)

    once.twinrun_once = True
    warnings.showwarning = once


def _measure(index: RunIndex, arms: list, units: list[int] | None, gpus: int | None = None) -> RunRecord:
    """The job's setup: determinism first, then the device and the kind's session, then the units."""
    config = arms[0].config  # every arm shares everything outside `intervention`
    kind = measure_of(index.measure)
    # Before any torch work; a compiled run compiles into a cache of its own (no other run's entries).
    determinism = setup_determinism(config, index.run_dir.path if kind.compiles(config) else None)
    todo = index.pending_units(units, kind.verify_store)
    if kind.sequential_units and todo:  # each unit continues the one before: measure on from the first gap
        todo = index.units[todo[0]["index"]:]
    with recorded_before_units(index, todo):
        # Judged here, on the node that measures (the planning host may have no GPU at all).
        device = resolve_device(kind.device(config), gpus, key=f"{kind.settings_key}.device")
        print(f"twinrun: measuring on {describe_device(device)}", flush=True)
        pin = open_pin(index, config, kind.compiles(config), device)  # a replay's bundle: before any compile
        session = kind.open_session(config, arms, device)
        if pin is not None and (config.get("determinism") or {}).get("cold_check"):
            pin["cold_check"] = cold_check_in_job(session.compile_mode, determinism["enabled"])
    mine = len(index.units) if units is None else len(units)
    if len(todo) < mine:
        print(f"twinrun: resuming: {mine - len(todo)} of {mine} {kind.unit_noun}s already measured",
              flush=True)
    if kind.sequential_units and todo and todo[0]["index"] > 0:
        # Every arm continues from its state at the end of the last whole unit, read back from its stores.
        last = index.units[todo[0]["index"] - 1]
        session.restore(last, {arm: (index.store_path(last, arm), entry["sha256"])
                               for arm, entry in last["stores"].items()})
    return measure_units(index, arms, session, todo, determinism, units, device, pin)

@contextmanager
def recorded_before_units(index: RunIndex, todo: list[UnitEntry]):
    """A failure before the first unit that a waiting launcher reads (no GPU, too little device memory, an
    op with no deterministic implementation) is recorded at the first pending unit, as one line."""
    try:
        yield
    except TwinrunError as err:
        if todo and (getattr(err, "record", None) or {}).get("error") in FAILURE_EXIT_CODES:
            index.mark_failed(todo[0], next(iter(todo[0]["stores"])), failure_record(err))
        raise


def measure_units(
    index: RunIndex,  # run.json: read for the units and arms, updated as each store lands
    arms: list,  # measured in this order in every unit
    session: Session,  # the kind's measurement in this job (components, trial, draws)
    todo: list[UnitEntry],  # run.json units this job measures, in order
    determinism: dict,  # what setup_determinism applied: recorded with this job
    units: list[int] | None = None,  # this array element's units (launcher.split=bins); None: the whole run
    device: torch.device | None = None,  # where the session measures: its GPU joins the kernel path
    pin: dict | None = None,  # open_pin's watch on the compiles, and the run a replay took its bundle from
) -> RunRecord:
    """Measure `todo`, unit by unit; every arm of a unit back to back. Returns run.json."""
    hashes = {a["name"]: a["config_hash"] for a in index.arms}
    hashes.setdefault(GATE_REPLICATE, index.arm("twin")["config_hash"])  # the twin, measured again

    # Step: fingerprint where this job runs, with the kind's own arithmetic settings. A job may not
    # add units on another path than the whole ones.
    fp = fingerprint(session.compile_mode, device)
    fp["kernel_path"][index.measure] = session.arithmetic()
    rd, sha = index.run_dir, kernel_path_sha256(fp)
    refuse = straddling_rule(rd.path, rd.kernel_path_env, fp)
    try:
        if todo:  # a job with no unit to measure commits the run to nothing, so refuses nothing
            refuse(index.whole_kernel_paths(), sha)
    except KernelPathRefused as err:
        # recorded at the first unit it would have measured, so a launcher waiting on the job (a whole-run
        # job or an array element alike) reads the refusal and exits 3, not 2
        index.mark_failed(todo[0], next(iter(todo[0]["stores"])), failure_record(err))
        raise
    identity = identity_sha256(session.identity)
    refuse_changed_identity(index, identity, todo)
    pinned = record_pin(rd, pin, session.compile_mode, device)
    job = start_job(index, fp, determinism, session.sentinel(), device, pinned)
    stamp = {"env": unit_record(fp, job["sentinel_start"]), "kernel_path": fp["kernel_path"]}
    index.set_status("running", units)  # an element never clears a failure recorded at another's unit

    kind = measure_of(index.measure)
    if kind.twin_first:  # a stable sort: the other arms keep their order
        arms = sorted(arms, key=lambda a: a.role != "twin")
    progress = Progress(sum(len(u["stores"]) for u in todo))
    for u in todo:
        t_unit, timings, landed = time.perf_counter(), [], {}
        session.begin_unit(u)
        for arm in (a for a in arms if a.name in u["stores"]):
            t_arm = time.perf_counter()
            with failure_recorded(index, u, arm.name):
                # Step: measure this arm, store it with what it is (written atomically), mark it done.
                tensors, meta = session.measure(u, arm.name, {"config_hash": hashes[arm.name], **stamp})
                path = index.store_path(u, arm.name)
                landed[arm.name] = (kind.write_store(path, tensors, meta) if kind.write_store is not None
                                    else write_store(path, tensors, meta, kind.store_format))
                if not kind.sequential_units:
                    index.mark_done(u, arm.name, landed[arm.name], sha, refuse, identity)
            timings.append(f"{arm.name} {time.perf_counter() - t_arm:.2f}s")
            progress.step(f"{u['label']} {arm.name}")
        if kind.sequential_units:  # only a whole unit is ever continued from: one run.json update for it
            with failure_recorded(index, u, next(reversed(landed))):
                index.mark_unit_done(u, landed, sha, refuse, identity)
        progress.log(f"{u['label']}: {', '.join(timings)} ({time.perf_counter() - t_unit:.2f}s)")
    progress.close()

    # Step: close the job: the sentinel read again; the run is "measured" once every unit is whole.
    index.end_job(job["index"], session.sentinel()["digest"], **close_pin(rd, job, pin, pinned))
    index.finish_measuring()
    return index.doc


@contextmanager
def failure_recorded(index: RunIndex, u: UnitEntry, arm: str):
    """Any failure measuring one arm of a unit, ours or user code's, is recorded in run.json (which
    arm, which unit, and the model's exception) before it propagates; earlier units stay valid."""
    try:
        yield
    except Interrupted:
        raise
    except Exception as err:  # user code may raise anything: recorded, then exit 4 (ours keep their code)
        failure = err if isinstance(err, TwinrunError) else to_model_error(arm, u, err)
        index.mark_failed(u, arm, failure_record(failure))
        if failure is err:
            raise
        raise failure from err


class Progress:
    """A tqdm bar with ETA on a terminal; plain log lines with ETA elsewhere (CI, SLURM logs)."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = (tqdm(total=total, unit="store", dynamic_ncols=True) if sys.stderr.isatty() and total
                    else None)

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    def log(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        print(f"{line} [{self.done}/{self.total} stores, ETA {eta:.0f}s]", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def identity_sha256(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def refuse_changed_identity(index: RunIndex, identity: str, todo: list[UnitEntry]) -> None:
    """A resume may not measure another model or other data than its finished units did (a weights
    file changed in place under the same path and config is caught here, not only at reduce)."""
    earlier = {e.get("identity_sha256") for u in index.whole_units() for e in u["stores"].values()} - {None}
    if todo and earlier - {identity}:
        raise TwinrunError(f"{index.run_dir.path}: the model or the probed data differ from what its "
                           "finished units measured (their digests, recorded in run.json, differ from this "
                           "job's): restore them, or measure into a new run directory")


def start_job(index: RunIndex, fp: dict, determinism: dict, sentinel: dict,
              device: torch.device | None = None, pinned: dict | None = None) -> JobRecord:
    """Record this job (a first run, a resume or a requeue) in run.json and its fingerprint in env/,
    with the device it measures on."""
    rd = index.run_dir
    make_dir(rd.env_dir)
    sha = kernel_path_sha256(fp)
    if not rd.kernel_path_env(sha).is_file():
        write_json(rd.kernel_path_env(sha), fp)
    job = {"kernel_path_sha256": sha, "hostname": fp["info"].get("hostname"),
           "boot_id": fp["info"].get("boot_id"),
           "slurm_job_id": (fp["info"].get("slurm") or {}).get("SLURM_JOB_ID"),
           "sentinel_start": sentinel["digest"], "sentinel_end": None,
           "device": None if device is None else describe_device(device)}
    if pinned is not None:  # the bundle (or that an eager job had nothing to pin) in run.json
        job["compile_bundle"] = pinned.get("bundle") or {"none": pinned.get("why")}
        if "cold_check" in pinned:  # determinism.cold_check: the control's verdict, its lines in env/
            job["cold_check"] = {"bit_identical": pinned["cold_check"]["bit_identical"],
                                 "line": pinned["cold_check"]["lines"][0]}
    index.add_job(job)
    write_json(rd.job_env(job["index"]), {"fingerprint": fp, "determinism": determinism,
                                          "sentinel": sentinel, **({"kernel_pin": pinned} if pinned else {})})
    return job


def open_pin(index: RunIndex, config: dict, compiles: bool, device: torch.device) -> dict | None:
    """Before the first compile: watch this process's compiles and, for a replay (determinism.
    kernel_path_from, or a reference that saved a bundle), load that run's bundle into this run's own
    cache. A bundle made for another torch, Triton, GPU or CPU is refused here, before any compute."""
    if not compiles:
        return None
    watch = kernel_pin.Watch()
    source, explicit = pin_source(index, config)
    if source is None:
        return {"watch": watch, "from": None}
    record = kernel_pin.recorded_pin(source)
    if record is None:
        if explicit:
            raise ConfigError("determinism.kernel_path_from", source, "that run recorded no compile bundle "
                              "(eager, or measured before twinrun saved bundles); name a compiled run")
        return {"watch": watch, "from": None}
    try:
        kernel_pin.refuse_other_capability(source, record.get("capability") or {},
                                           kernel_pin.capability(device))
        kernel_pin.refuse_untrusted("determinism.kernel_path_from" if explicit else "reference", source,
                                    record, bool((config.get("determinism") or {}).get("trust_bundle")))
    except (KernelPathRefused, ConfigError) as err:
        if explicit:
            raise
        # A reference measured elsewhere is still compared (and read dead or alive), just not replayed.
        print(f"twinrun: the reference's compile bundle is not replayed: {err}", flush=True)
        return {"watch": watch, "from": None}
    keys = kernel_pin.load_bundle(kernel_pin.read_bundle(source, record))
    print(f"twinrun: compile bundle of {source} loaded before the first compile "
          f"({sum(map(len, keys.values()))} cache entries)", flush=True)
    pin = {"watch": watch, "from": source, "source_record": record, "loaded_keys": keys}
    reused = reuse_libraries(config, source)
    if reused is not None:
        pin["libraries_reused"] = reused
        print(f"twinrun: {reused['libraries']} C++ libraries {source} built on this machine reused from its "
              "own compile cache (not rebuilt)", flush=True)
    return pin


def reuse_libraries(config: dict, source: str) -> dict | None:
    """On the machine that measured `source`: the C++ libraries Inductor built for it, copied from that
    run's own compile cache (twinrun's, under determinism.compile_cache_dir, its marker naming `source`;
    never from a run directory) into this run's cold one, so the replay does not run the C++ compiler
    again. None when that cache is gone, is elsewhere, or this run compiles into a cache the user chose."""
    own = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    theirs = existing_run_cache(compile_cache_root(config), os.path.expanduser(source))
    if not own or not is_run_cache(own) or theirs is None:
        return None
    if os.path.realpath(theirs) == os.path.realpath(own):  # a resume replaying its own run: warm already
        return None
    return reuse_built_libraries(theirs, own)


def pin_source(index: RunIndex, config: dict) -> tuple[str | None, bool]:
    """(the run whose bundle this job replays, whether the user named it) or (None, False)."""
    chosen = (config.get("determinism") or {}).get("kernel_path_from")
    if chosen == kernel_pin.COLD:
        return None, False
    if chosen:
        return str(chosen), True
    return index.doc.get("reference"), False


def record_pin(rd, pin: dict | None, compile_mode: str | None, device) -> dict:
    """After the warm-up: the job's bundle saved in env/, or that an eager job had nothing to pin."""
    if pin is None or compile_mode is None:
        return {"bundle": None, "why": kernel_pin.NOTHING_TO_PIN}
    make_dir(rd.env_dir)
    control = {k: pin[k] for k in ("cold_check", "libraries_reused") if k in pin}
    saved = kernel_pin.save_bundle(rd.env_dir, pin["watch"], device)
    return {**saved, "replayed_from": pin["from"], **control}


def cold_check_in_job(mode: str, determinism: bool) -> dict:
    """determinism.cold_check: the cold-against-warm control with this job's compile mode and determinism
    (fresh processes, caches of their own: this job's cache is untouched); its lines are printed."""
    same, lines = cold_check(None, mode, determinism)
    for line in lines:
        print(f"twinrun: cold check: {line}", flush=True)
    return {"bit_identical": same, "lines": lines}


def close_pin(rd, job: JobRecord, pin: dict | None, pinned: dict) -> dict:
    """At the job's end: its counters, and a replay's certificate (or PATH UNPINNED) in one line."""
    if pin is None:
        return {}
    pinned["counters_end"] = pin["watch"].counters()
    fields = {}
    if pin["from"] is not None:
        cert = kernel_pin.certificate(pin["from"], pin["watch"])
        pinned["certificate"] = cert
        fields["kernel_pin"] = {"from": pin["from"], "pinned": cert["pinned"], "line": cert["line"]}
        print(f"twinrun: {cert['line']}", flush=True)
    doc = read_json(rd.job_env(job["index"]))
    write_json(rd.job_env(job["index"]), {**doc, "kernel_pin": pinned})
    return fields
