"""The run directory's one owner: every path in it (RunDir) and run.json as a validated record (RunIndex).

A run directory is untrusted input (it may come from anyone): every name read from it is checked
against SAFE_NAME and every path resolved inside the directory before it is opened or written, and
run.json is validated field by field before anyone reads it, so a malformed one is one line naming
the file and the field (exit 2), never a traceback or a number.
"""

import math
import os
import re
from pathlib import Path

from twinrun.errors import StoreError

RUN_FORMAT = "twinrun-run/1"
RUN_JSON = "run.json"
SUMMARY_JSON = "summary.json"
LAUNCH_JSON = "launch.json"
CONFIG_DIFF_JSON = "config_diff.json"
LOCK_NAME = ".lock"
ARMS_DIR = "arms"
ENV_DIR = "env"
ARM_CONFIG = "config.yaml"
VIEWS_DIR = "views"
LOG_NAME = "twinrun.log"

# Arm directories and store files: one path component, no traversal, nothing a shell expands.
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
GATE_REPLICATE = "native_replicate"  # the twin measured again at gate bins (twinrun/gates.py)
ROLES = ("intervention", "twin", "replicate", "machinery")
RUN_STATUSES = ("planned", "running", "measured", "failed", "interrupted")
STORE_STATUSES = ("pending", "done", "failed")
HEX = re.compile(r"[0-9a-f]+")


def safe_name(value, what: str, where) -> str:
    """`value` as a single safe path component, else a StoreError naming `where` and `what`."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value or value == ".":
        raise StoreError(where, f"{what}={value!r} is not a safe name (letters, digits, '_', '.', '-'; "
                         "no '..'): refusing a path that could leave the run directory")
    return value


class RunDir:
    """Every path of one run directory; each name is validated and each path kept inside it."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def run_json(self) -> Path:
        return self.path / RUN_JSON

    @property
    def summary_json(self) -> Path:
        return self.path / SUMMARY_JSON

    @property
    def launch_json(self) -> Path:
        return self.path / LAUNCH_JSON

    @property
    def config_diff_json(self) -> Path:
        return self.path / CONFIG_DIFF_JSON

    @property
    def lock(self) -> Path:
        return self.path / LOCK_NAME

    @property
    def env_dir(self) -> Path:
        return self.path / ENV_DIR

    @property
    def log(self) -> Path:
        return self.path / LOG_NAME

    def view_dir(self, name: str) -> Path:
        """A post-hoc view's directory (RUN/views/<what changed>/)."""
        return self.inside(self.path / VIEWS_DIR / name)

    def job_env(self, index: int) -> Path:
        return self.env_dir / f"job{index:03d}.json"

    def kernel_path_env(self, sha: str) -> Path:
        return self.env_dir / f"kernel_path-{sha[:12]}.json"

    def arm_dir(self, arm: str) -> Path:
        return self.inside(self.path / ARMS_DIR / safe_name(arm, "arm name", self.run_json))

    def arm_config(self, arm: str) -> Path:
        return self.inside(self.arm_dir(arm) / ARM_CONFIG)

    def store(self, arm: str, file: str) -> Path:
        return self.inside(self.arm_dir(arm) / safe_name(file, f"store file of arm {arm}", self.run_json))

    def tmp_files(self) -> list[Path]:
        """Writes cut short by a kill (atomic_write's temp files): never read, safe to delete."""
        return [p for p in self.path.glob(f"{ARMS_DIR}/*/.*.tmp-*") if self._is_inside(p)]

    def inside(self, path: Path) -> Path:
        """`path` itself, once its resolved form (symlinks followed) is inside this run directory."""
        if not self._is_inside(path):
            raise StoreError(path, f"resolves outside the run directory {self.path} (a symlink or '..'): refused")
        return path

    def _is_inside(self, path: Path) -> bool:
        return Path(path).resolve().is_relative_to(self.path.resolve())

    def is_run(self) -> bool:
        """Holds a run.json (of any kind: whether it is a readable one is read_json's to say)."""
        return os.path.lexists(self.run_json)

    def require(self) -> "RunDir":
        """A run directory given on a command line: it must hold run.json."""
        if not self.is_run():
            raise StoreError(self.path, f"not a twinrun run directory (no {RUN_JSON})")
        return self


# ----------------------------------------------------------------------------- run.json schema


class _Check:
    """Field checks for one document; each failure names the file and the field's path."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, problem: str) -> "NoReturn":  # noqa: F821
        raise StoreError(self.path, f"field {field}: {problem}; the file is damaged or was edited by hand")

    def get(self, obj: dict, key: str, field: str, types, optional: bool = False):
        if key not in obj:
            if optional:
                return None
            self.fail(field, "missing")
        value = obj[key]
        if value is None and optional:
            return None
        # bool is an int in Python; a count or index must not be one.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            self.fail(field, f"{_show(value)} is not {_type_names(types)}")
        return value

    def number(self, obj: dict, key: str, field: str, low: float = -math.inf, optional: bool = False):
        value = self.get(obj, key, field, (int, float), optional)
        if value is not None and not (math.isfinite(value) and value > low):
            self.fail(field, f"{_show(value)} must be finite and > {low:g}")
        return value

    def one_of(self, obj: dict, key: str, field: str, choices) -> str:
        value = self.get(obj, key, field, str)
        if value not in choices:
            self.fail(field, f"{_show(value)} is not one of {', '.join(choices)}")
        return value

    def hex_digest(self, obj: dict, key: str, field: str, optional: bool = False) -> str | None:
        value = self.get(obj, key, field, str, optional)
        if value is not None and not HEX.fullmatch(value):
            self.fail(field, f"{_show(value)} is not a hex digest")
        return value


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types) -> str:
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number", "bool": "true/false",
                        "list": "a list", "dict": "an object"}[t.__name__] for t in _tuple(types))


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate_run(path: Path, run: dict) -> dict:
    """run.json checked field by field (extra keys allowed: later versions and other tools add some)."""
    c = _Check(Path(path))
    if run.get("format") != RUN_FORMAT:
        c.fail("format", f"{_show(run.get('format'))} is not {RUN_FORMAT!r} (not a twinrun run index)")
    c.one_of(run, "status", "status", RUN_STATUSES)
    c.get(run, "command", "command", str, optional=True)
    c.get(run, "reference", "reference", str, optional=True)
    arms = c.get(run, "arms", "arms", list)
    names = [_validate_arm(c, a, i) for i, a in enumerate(arms)]
    roles = [a["role"] for a in arms]
    if roles.count("intervention") != 1 or roles.count("twin") != 1 or len(set(names)) != len(names):
        c.fail("arms", f"roles {roles} with names {names}: need exactly one intervention and one twin, "
               "names unique")
    _validate_registered(c, run)
    bins = c.get(run, "bins", "bins", list)
    if not bins:
        c.fail("bins", "empty: a run has at least one bin")
    for i, b in enumerate(bins):
        _validate_bin(c, b, i, names)
    _contained(c, names, bins)
    for i, job in enumerate(c.get(run, "jobs", "jobs", list) if "jobs" in run else []):
        _validate_job(c, job, i)
    failure = c.get(run, "failure", "failure", dict, optional=True)
    if failure is not None:
        c.get(failure, "arm", "failure.arm", str)
        c.get(failure, "bin_index", "failure.bin_index", int)
        c.number(failure, "sigma", "failure.sigma", low=0)
    return run


def _validate_registered(c: _Check, run: dict) -> None:
    """The analysis registered at plan time (runs planned before registration: estimands and a
    gate threshold at the top level)."""
    reg = c.get(run, "registered", "registered", dict) if "registered" in run or "estimands" not in run else None
    where, holder = ("registered.", reg) if reg is not None else ("", run)
    estimands = c.get(holder, "estimands", f"{where}estimands", list)
    if not estimands or not all(isinstance(e, str) and SAFE_NAME.fullmatch(e) for e in estimands):
        c.fail(f"{where}estimands", f"{_show(estimands)} must be a non-empty list of names")
    if reg is None:
        threshold = c.number(run, "gate_threshold", "gate_threshold", low=0)
        if threshold > 1:
            c.fail("gate_threshold", f"{threshold!r} must be in (0, 1]")
        return
    c.get(reg, "gate_rule", "registered.gate_rule", str)
    alpha = c.number(reg, "signal_alpha", "registered.signal_alpha", low=0)
    if not 0 < alpha < 1:
        c.fail("registered.signal_alpha", f"{alpha!r} must be in (0, 1)")


def _validate_job(c: _Check, job, i: int) -> None:
    field = f"jobs[{i}]"
    if not isinstance(job, dict):
        c.fail(field, f"{_show(job)} is not an object")
    if c.get(job, "index", f"{field}.index", int) != i:
        c.fail(f"{field}.index", f"{job['index']!r} must equal its position {i}")
    c.hex_digest(job, "kernel_path_sha256", f"{field}.kernel_path_sha256")
    c.get(job, "sentinel_start", f"{field}.sentinel_start", str)
    c.get(job, "sentinel_end", f"{field}.sentinel_end", str, optional=True)
    for key in ("hostname", "boot_id", "slurm_job_id"):
        c.get(job, key, f"{field}.{key}", str, optional=True)


def _validate_arm(c: _Check, arm, i: int) -> str:
    field = f"arms[{i}]"
    if not isinstance(arm, dict):
        c.fail(field, f"{_show(arm)} is not an object")
    name = c.get(arm, "name", f"{field}.name", str)
    safe_name(name, f"{field}.name", c.path)
    c.one_of(arm, "role", f"{field}.role", ROLES)
    c.hex_digest(arm, "config_hash", f"{field}.config_hash")
    return name


def _validate_bin(c: _Check, b, i: int, names: list[str]) -> None:
    field = f"bins[{i}]"
    if not isinstance(b, dict):
        c.fail(field, f"{_show(b)} is not an object")
    if c.get(b, "index", f"{field}.index", int) != i:
        c.fail(f"{field}.index", f"{b['index']!r} must equal its position {i}")
    c.number(b, "sigma", f"{field}.sigma", low=0)
    c.get(b, "gate", f"{field}.gate", bool)
    stores = c.get(b, "stores", f"{field}.stores", dict)
    # Every arm has a store in every bin; the twin's gate replicate (measured only where the gate
    # rule needs it) may add one more.
    if not set(names) <= set(stores) <= set(names) | {GATE_REPLICATE}:
        c.fail(f"{field}.stores", f"arms {sorted(stores)} are not the run's arms {sorted(names)}")
    for arm, entry in stores.items():
        where = f"{field}.stores.{arm}"
        if not isinstance(entry, dict):
            c.fail(where, f"{_show(entry)} is not an object")
        safe_name(c.get(entry, "file", f"{where}.file", str), f"{where}.file", c.path)
        status = c.one_of(entry, "status", f"{where}.status", STORE_STATUSES)
        c.hex_digest(entry, "sha256", f"{where}.sha256", optional=status != "done")
        c.hex_digest(entry, "kernel_path_sha256", f"{where}.kernel_path_sha256", optional=True)


def _contained(c: _Check, names: list[str], bins: list[dict]) -> None:
    """Every arm directory and store file run.json names resolves inside its run directory
    (a symlinked arm directory or store is refused before anyone reads through it)."""
    rd = RunDir(c.path.parent)
    for name in names:
        rd.arm_dir(name)
    for b in bins:
        for arm, entry in b["stores"].items():
            rd.store(arm, entry["file"])


def validate_summary(path: Path, summary: dict) -> dict:
    """summary.json: the fields its readers (sweep summary, compare) rely on."""
    c = _Check(Path(path))
    c.get(summary, "valid", "valid", bool)
    for key in ("checks", "gates", "effects"):
        for i, item in enumerate(c.get(summary, key, key, list)):
            if not isinstance(item, dict):
                c.fail(f"{key}[{i}]", f"{_show(item)} is not an object")
            if key != "effects":
                c.get(item, "passed", f"{key}[{i}].passed", bool)
                continue
            c.number(item, "sigma", f"{key}[{i}].sigma", low=0)
            c.get(item, "estimand", f"{key}[{i}].estimand", str)
            c.number(item, "cos", f"{key}[{i}].cos", optional=True)
            c.number(item, "se", f"{key}[{i}].se", optional=True)
    reference = c.get(summary, "reference", "reference", dict, optional=True)
    if reference is not None:
        c.get(reference, "alive", "reference.alive", bool)
        c.get(reference, "path", "reference.path", str)
        _reference_is_the_runs(c, reference)
    return summary


def _reference_is_the_runs(c: _Check, reference: dict) -> None:
    """A summary may vouch only for the reference its own run.json names (a hand-edited claim
    of "alive" for another run is refused)."""
    from twinrun.store import read_json

    run_json = c.path.parent / RUN_JSON
    if not run_json.is_file():
        c.fail("reference", "present, but there is no run.json beside the summary to confirm it")
    named = read_json(run_json).get("reference")
    if named is None or Path(named).resolve() != Path(reference["path"]).resolve():
        c.fail("reference.path", f"{_show(reference['path'])} is not the reference run.json names ({named!r})")


def validate_store_meta(path: Path, meta: dict) -> dict:
    """A store's metadata (JSON-decoded strings): what reduce, compare and resume read from it."""
    c = _Check(Path(path))
    c.get(meta, "arm", "metadata.arm", str)
    if c.get(meta, "bin_index", "metadata.bin_index", int) < 0:
        c.fail("metadata.bin_index", f"{meta['bin_index']} is negative")
    c.number(meta, "sigma", "metadata.sigma", low=0)
    c.number(meta, "sigma_cond", "metadata.sigma_cond", low=0)
    n_images = c.get(meta, "n_images", "metadata.n_images", int)
    c.get(meta, "n_draws", "metadata.n_draws", int)
    sizes = c.get(meta, "fold_sizes", "metadata.fold_sizes", list)
    if len(sizes) < 2 or not all(type(n) is int and n >= 1 for n in sizes) or sum(sizes) != n_images:
        c.fail("metadata.fold_sizes", f"{_show(sizes)} must be ≥ 2 positive counts summing to n_images={n_images}")
    c.get(meta, "draws_digest", "metadata.draws_digest", str)
    c.get(meta, "config_hash", "metadata.config_hash", str)
    layout = c.get(meta, "layout", "metadata.layout", list)
    offset = 0
    for i, g in enumerate(layout):
        if not isinstance(g, dict):
            c.fail(f"metadata.layout[{i}]", f"{_show(g)} is not an object")
        c.get(g, "name", f"metadata.layout[{i}].name", str)
        c.get(g, "cond", f"metadata.layout[{i}].cond", bool)
        numel = c.get(g, "numel", f"metadata.layout[{i}].numel", int)
        if c.get(g, "offset", f"metadata.layout[{i}].offset", int) != offset or numel < 0:
            c.fail(f"metadata.layout[{i}]", "offsets and sizes do not tile the columns")
        offset += numel
    names = [g["name"] for g in layout]
    if len(set(names)) != len(names):
        c.fail("metadata.layout", "parameter names repeat: each names one tensor of the store")
    for key in ("env", "kernel_path"):
        c.get(meta, key, f"metadata.{key}", dict, optional=True)
    return meta


def validate_launch(path: Path, launch: dict) -> dict:
    """launch.json: the job a run was submitted as (its id reaches squeue/sacct as an argument)."""
    c = _Check(Path(path))
    c.one_of(launch, "cluster", "cluster", ("local", "slurm"))
    job_id = c.get(launch, "job_id", "job_id", str)
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        c.fail("job_id", f"{_show(job_id)} is not a job id")
    for key in ("result", "stdout", "stderr", "folder"):
        c.get(launch, key, key, str)
    c.get(launch, "launcher", "launcher", dict)
    return launch


# The documents read_json validates, by file name.
SCHEMAS = {RUN_JSON: validate_run, SUMMARY_JSON: validate_summary, LAUNCH_JSON: validate_launch}


# ----------------------------------------------------------------------------- the record


class RunIndex:
    """run.json, validated, with the questions and updates every module asks of it.

    `doc` is the plain JSON document (what is written back); readers that only need the data may
    use it directly, but every change goes through a method here and is saved atomically.
    """

    def __init__(self, run_dir: RunDir, doc: dict):
        self.run_dir, self.doc = run_dir, doc

    @classmethod
    def load(cls, run_dir) -> "RunIndex":
        from twinrun.store import read_json

        rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        return cls(rd, read_json(rd.require().run_json))  # read_json validates run.json

    def save(self) -> None:
        from twinrun.store import write_json

        write_json(self.run_dir.run_json, self.doc)

    # ---- questions

    @property
    def status(self) -> str:
        return self.doc["status"]

    @property
    def bins(self) -> list[dict]:
        return self.doc["bins"]

    @property
    def arm_names(self) -> list[str]:
        return [a["name"] for a in self.doc["arms"]]

    def arm(self, role: str) -> dict:
        """The arm entry with this role (intervention, twin, replicate, machinery)."""
        found = [a for a in self.doc["arms"] if a["role"] == role]
        if not found:
            raise StoreError(self.run_dir.run_json, f"no arm with role {role!r}")
        return found[0]

    def store_path(self, b: dict, arm: str) -> Path:
        return self.run_dir.store(arm, b["stores"][arm]["file"])

    def marked_done(self, b: dict) -> bool:
        """Every store of the bin is recorded done (no file is read)."""
        return all(entry["status"] == "done" for entry in b["stores"].values())

    def is_done(self, b: dict, arm: str) -> bool:
        """The store is recorded done, exists, and verifies against its sha256 in run.json."""
        from twinrun.store import verify_store

        entry = b["stores"][arm]
        if entry["status"] != "done":
            return False
        try:
            verify_store(self.store_path(b, arm), entry["sha256"])
        except StoreError as err:
            print(f"twinrun: re-measuring {err}", flush=True)
            return False
        return True

    def whole_bins(self, verify: bool = True) -> list[dict]:
        """The bins whose every arm is done (verified on disk unless verify=False)."""
        if not verify:
            return [b for b in self.bins if self.marked_done(b)]
        return [b for b in self.bins if all(self.is_done(b, a) for a in b["stores"])]

    # ---- updates (each saved at once)

    def set_status(self, status: str) -> None:
        assert status in RUN_STATUSES, status
        self.doc["status"] = status
        if status == "running":
            self.doc.pop("failure", None)
        self.save()

    def mark_done(self, b: dict, arm: str, sha256: str, kernel_path_sha256: str) -> None:
        entry = b["stores"][arm]
        entry.update(sha256=sha256, status="done", kernel_path_sha256=kernel_path_sha256)
        self.save()

    def mark_failed(self, b: dict, arm: str, cause: dict | None = None) -> None:
        """Record which arm and bin failed (and, when the model raised, its exception's type, message
        and frame); best effort (on a full disk run.json may not be writable)."""
        b["stores"][arm]["status"] = "failed"
        self.doc["status"] = "failed"
        self.doc["failure"] = {"arm": arm, "bin_index": b["index"], "sigma": b["sigma"], **(cause or {})}
        self._save_best_effort()

    def mark_interrupted(self) -> None:
        self.doc["status"] = "interrupted"
        self._save_best_effort()

    def _save_best_effort(self) -> None:
        try:
            self.save()
        except StoreError as err:
            print(f"twinrun: could not record the state in run.json: {err}", flush=True)
