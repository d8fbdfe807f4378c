"""The run directory's documents as types: run.json (RunRecord), summary.json (Summary); a store's metadata is
twinrun.storage.store_meta's.

The TypedDicts below are each document's one description: readers annotate with them, and
`check_typed` (twinrun.storage.typed) checks a document against them field by field (a field typed
`X | None` may be null or absent, NotRequired[X] may be absent). Annotated marks add what a Python
type cannot say; the few rules across fields (roles, positions, store sets) follow in `validate_run`.
A document that fails is one line naming the file and the field (exit 2), never a traceback or a number.

run.json's unit of twin validity is a *unit*: a σ bin for the probe, a training segment for the
training measure. Every unit carries the fields every measurement kind shares (index, label,
gate, stores) and, under the key of the run's measurement kind, that kind's own fields
(`"probe": {"sigma": 0.5}`). This room names no kind: a kind declares its own unit fields and summary
type (twinrun/measures/kind.py: `unit_fields`, `increasing`, `summary_type`), and whoever looked the kind
up hands them to `validate_units` and `validate_summary`; run.json alone is checked for what every kind
shares, the kind's fields as an object of plain values.
"""

import typing
from pathlib import Path
from typing import Annotated, Literal, NotRequired, TypedDict

from twinrun.config import GATE_RULES, SIGNAL_ALPHA_TEXT, signal_alpha_ok
from twinrun.errors import StoreError
from twinrun.files import SAFE_NAME
from twinrun.storage.typed import Checker, check_typed, show

RUN_FORMAT = "twinrun-run/2"  # units keyed by measurement kind
OLD_RUN_FORMATS = ("twinrun-run/1",)  # σ bins only: refused (measure again), never migrated
GATE_REPLICATE = "native_replicate"  # the twin measured again at gate units (twinrun/analysis/gates.py)
ROLES = ("intervention", "twin", "replicate", "machinery", "chaos")
RUN_STATUSES = ("planned", "running", "measured", "failed", "interrupted")
STORE_STATUSES = ("pending", "done", "failed")

HexDigest = Annotated[str, "hex digest"]
# A number of a summary: a JSON number, inf allowed (a ratio over a zero floor), NaN never (where a number is
# undefined twinrun writes null, so a NaN literal there is an edit the table would show).
Num = Annotated[float, "not nan"]
SafeName = Annotated[str, "safe name"]
Sigma = Annotated[float, "positive"]  # finite and > 0
RunStatus = Literal["planned", "running", "measured", "failed", "interrupted"]
StoreStatus = Literal["pending", "done", "failed"]
Role = Literal["intervention", "twin", "replicate", "machinery", "chaos"]


# ----------------------------------------------------------------------------- run.json


class ArmEntry(TypedDict):
    name: SafeName  # its directory under arms/
    role: Role
    config_hash: HexDigest  # of its resolved config.yaml (plan.config_hash)


class Failure(TypedDict):
    """Where the run failed (plus, when the model raised, its exception's type, message, frame)."""

    arm: str
    unit_index: int
    unit: str  # the unit's label, e.g. "bin 2 (σ=0.5)"


class StoreEntry(TypedDict):
    file: SafeName  # in arms/<arm>/
    status: StoreStatus
    sha256: NotRequired[HexDigest | None]  # of the whole file; present once done
    kernel_path_sha256: NotRequired[HexDigest | None]  # the kernel path it was measured on
    identity_sha256: NotRequired[HexDigest | None]  # what it measured: the model as built and the data
    # Its tensors' bytes, known at plan time from the run's protocol (layout x folds): a reader checks a
    # store's header against it before reading any payload (absent in run.json written before it was).
    payload_bytes: NotRequired[Annotated[int, "non-negative"]]
    # why it failed (each array element of a split run records its own; run.json's `failure` is the latest)
    failure: NotRequired[Failure | None]


class ProbeUnit(TypedDict):
    """A σ bin of the probe."""

    sigma: Sigma  # noising σ


class TrainUnit(TypedDict):
    """A training segment: every arm's optimizer steps from_step + 1 … to_step (the start unit: 0 … 0)."""

    from_step: int  # the step its arms start from (the previous unit's to_step)
    to_step: int  # the step its stores hold


# A kind's (from, to) unit fields that chain, keyed by its unit type: each unit starts where the one before
# ended and moves on (a training run's segments: an overlapping one would train some steps twice).
CHAINED: dict[type, tuple[str, str]] = {TrainUnit: ("from_step", "to_step")}


class KindFields(TypedDict):
    """A kind that declares no unit fields of its own (or no summary type beyond SharedSummary's)."""


class UnitEntry(TypedDict):
    index: int  # its position in `units`
    label: str  # how every message names it, e.g. "bin 2 (σ=0.5)"
    gate: bool  # a no-op gate unit of the intervention
    stores: dict[str, StoreEntry]  # arm name -> its store (every arm, plus the gate replicate's)
    # replicates not measured in this unit (training's after its first K segments: arms.replicate_segments)
    without: NotRequired[list[str]]


class Registered(TypedDict):
    """The analysis registered at plan time (`reduce` with other settings is a post-hoc view)."""

    estimands: list[str]  # names from the registry (twinrun/analysis/estimands.py)
    gate_rule: str  # one of config.GATE_RULES
    signal_alpha: Annotated[float, "positive"]  # in config.SIGNAL_ALPHA_RANGE, as reduce.signal_alpha is
    # as reduce.family_alpha is (runs planned before it have none: 0.05)
    family_alpha: NotRequired[Annotated[float, "positive"]]


class JobRecord(TypedDict):
    index: int  # its position in `jobs`
    kernel_path_sha256: HexDigest
    sentinel_start: str
    sentinel_end: str | None  # None while the job runs (or if it died)
    hostname: str | None
    boot_id: str | None
    slurm_job_id: str | None
    device: NotRequired[str | None]  # where it measured, resolved in the job: "cpu", "cuda:0 (NVIDIA H200 …)"
    compile_bundle: NotRequired[dict]  # file, sha256, bytes of its compile bundle; {"none": why} if none
    kernel_pin: NotRequired[dict]  # a replay's certificate: from, pinned, line (provenance/kernel_pin.py)


class RunRecord(TypedDict):
    format: str  # RUN_FORMAT
    measure: str  # the measurement kind (twinrun/measures): the key of every unit's own fields
    status: RunStatus
    command: str | None  # the command that planned it (the report's Reproduce section)
    reference: str | None  # an earlier run directory whose twin is this run's reference
    arms: list[ArmEntry]
    registered: Registered
    units: list[UnitEntry]
    jobs: NotRequired[list[JobRecord]]
    failure: NotRequired[Failure | None]
    twinrun: NotRequired[dict | None]  # the twinrun that planned it: version, git commit (None outside git)


assert set(typing.get_args(RunStatus)) == set(RUN_STATUSES) and set(typing.get_args(Role)) == set(ROLES)
assert set(typing.get_args(StoreStatus)) == set(STORE_STATUSES)


# ----------------------------------------------------------------------------- summary.json


class Check(TypedDict):
    name: str
    passed: bool
    detail: str


class GateRow(TypedDict):
    sigma: Sigma
    estimand: str
    passed: bool
    rule: str  # which rule decided it (bit-identical, within the replicate, ...)
    bit_identical: bool
    max_shift: float
    replicate_max_shift: float | None
    # where the arms differ and replicates were measured: each replicate's shift, the bound of the wobble
    replicate_shifts: NotRequired[list[float]]
    wobble_bound: NotRequired[float | None]
    detail: str


class EffectRow(TypedDict):
    """One estimate of the intervention against its twin; numbers are None where below noise."""

    sigma: Sigma
    estimand: str
    gate: bool
    cos: Num | None
    se: Num | None
    norm_ratio: Num | None
    norm_ratio_se: Num | None
    cos_naive: float  # NaN where an arm's mean gradient is zero
    below_noise: bool
    norm2: float
    norm2_se: float
    norm2_base: float
    norm2_base_se: float
    t_crit: float
    # The printed 95% intervals, conditional on the row printing ([lo, hi]; a side the data do not bound is
    # null; the whole field null below noise), near_boundary and the test of no effect (docs/estimator.md).
    cos_interval: NotRequired[list[float | None] | None]
    norm_ratio_interval: NotRequired[list[float | None] | None]
    near_boundary: NotRequired[bool]
    diff_norm2: NotRequired[float]
    diff_norm2_se: NotRequired[float]
    effect_p: NotRequired[float]
    family_p: NotRequired[float | None]  # its hypothesis's Holm-adjusted p-value (summary.family)


class ReferenceReport(TypedDict):
    path: str
    alive: bool
    status: str  # alive | dead | unusable
    detail: str


class PostHoc(TypedDict):
    registered: dict
    used: dict
    view_dir: str
    registered_passed: bool


class Summary(TypedDict):
    """What one reduction of a run found: checks, then gates, then effects (empty unless all passed)."""

    run_dir: str
    arms: list[str]
    registered: dict  # the analysis registered at plan time
    used: dict  # the analysis this summary used (differs from `registered` in a post-hoc view)
    checks_passed: bool  # every validity check passed (the gates are not checks: see `passed`)
    passed: bool  # every check and every gate passed: the run's verdict
    checks: list[Check]
    gates: list[GateRow]
    effects: list[EffectRow]
    replicate: dict | None
    family: NotRequired[dict | None]  # the family-wise reading (Holm at family_alpha); None when failed
    reference: NotRequired[ReferenceReport | None]
    post_hoc: NotRequired[PostHoc]
    twinrun: NotRequired[dict | None]  # the twinrun that wrote it: version, git commit (None outside git)
    data_files: NotRequired[dict[str, str]]  # {path: sha256} of the caches the data were read from


class SharedSummary(TypedDict):
    """What every kind's summary.json holds, whatever it measures: read where no kind was looked up."""

    run_dir: str
    arms: list[str]
    registered: dict
    used: dict
    checks_passed: bool
    passed: bool
    checks: list[Check]
    gates: list[dict]
    effects: list[dict]


# ----------------------------------------------------------------------------- run.json's rules


def validate_run(path: Path, run: dict) -> RunRecord:
    """run.json checked against RunRecord field by field (extra keys allowed: later versions and other
    tools add some), then the rules across fields."""
    c = Checker(path)
    if run.get("format") in OLD_RUN_FORMATS:
        raise StoreError(path, f"format {run['format']!r} (σ bins, written by an earlier twinrun) is no "
                         "longer read; measure the run again into a new run directory "
                         f"(run.json is now {RUN_FORMAT})")
    if run.get("format") != RUN_FORMAT:
        c.fail("format", f"{show(run.get('format'))} is not {RUN_FORMAT!r} (not a twinrun run index)")
    check_typed(c, run, RunRecord, "")
    kind = run["measure"]
    if not SAFE_NAME.fullmatch(kind):
        c.fail("measure", f"{show(kind)} is not the name of a measurement kind")
    names = [a["name"] for a in run["arms"]]
    roles = [a["role"] for a in run["arms"]]
    if roles.count("intervention") != 1 or roles.count("twin") != 1 or len(set(names)) != len(names):
        c.fail("arms", f"roles {roles} with names {names}: need exactly one intervention and one twin, "
               "names unique")
    _validate_registered(c, run["registered"])
    if not run["units"]:
        c.fail("units", "empty: a run has at least one unit")
    # Units carry their own fields under the kind's name: if they hold another kind's and none this
    # one's, `measure` is what was edited.
    own = set(UnitEntry.__annotations__)
    held = sorted({k for u in run["units"] if isinstance(u, dict) for k in u} - own)
    if held and kind not in held:
        c.fail("measure", f"{show(kind)}, but the units hold the fields of {', '.join(held)}")
    replicates = {a["name"] for a in run["arms"] if a["role"] == "replicate"}
    for i, u in enumerate(run["units"]):
        _validate_unit(c, u, i, names, kind, replicates)
    for i, job in enumerate(run.get("jobs", [])):
        if job["index"] != i:
            c.fail(f"jobs[{i}].index", f"{job['index']!r} must equal its position {i}")
    return run


def _validate_registered(c: Checker, reg: Registered) -> None:
    estimands = reg["estimands"]
    if not estimands or not all(isinstance(e, str) and SAFE_NAME.fullmatch(e) for e in estimands):
        c.fail("registered.estimands", f"{show(estimands)} must be a non-empty list of names")
    # Held to the rules of the config that registered them (reduce.*): an α of 0.75 would print a cosine
    # where the registered test reads "below noise"; an unknown rule would act as another one.
    if not signal_alpha_ok(reg["signal_alpha"]):
        c.fail("registered.signal_alpha", f"{reg['signal_alpha']!r} must be {SIGNAL_ALPHA_TEXT}, as "
               "reduce.signal_alpha is")
    if "family_alpha" in reg and not signal_alpha_ok(reg["family_alpha"]):
        c.fail("registered.family_alpha", f"{reg['family_alpha']!r} must be {SIGNAL_ALPHA_TEXT}, as "
               "reduce.family_alpha is")
    if reg["gate_rule"] not in GATE_RULES:
        c.fail("registered.gate_rule", f"{show(reg['gate_rule'])} is not one of {', '.join(GATE_RULES)}")


def validate_units(path: Path, run: RunRecord, fields: type, increasing: str | None) -> None:
    """Every unit's own fields against the run's kind's type, and its `increasing` field strictly upward
    unit by unit (a σ grid: each σ once, in order): the kind is handed in by whoever looked it up."""
    c, kind = Checker(path), run["measure"]
    for i, u in enumerate(run["units"]):
        check_typed(c, u[kind], fields, f"units[{i}].{kind}")
    if fields in CHAINED:
        _validate_chain(c, run["units"], kind, *CHAINED[fields])
    if increasing is not None:
        _validate_order(c, run["units"], kind, increasing)


def _validate_chain(c: Checker, units: list[UnitEntry], kind: str, start: str, end: str) -> None:
    """The first unit is empty (from = to = 0: the start), every later one starts where the one before
    ended and ends after it starts."""
    for i, u in enumerate(units):
        first, last = u[kind][start], u[kind][end]
        before = units[i - 1][kind][end] if i else 0
        if first != before or (last <= first if i else last != first):
            c.fail(f"units[{i}].{kind}.{end}", f"{first!r} … {last!r} does not follow units[{i - 1}]'s end "
                   f"{before!r}" if i else f"{first!r} … {last!r}: the first unit is the start, 0 … 0")


def _validate_order(c: Checker, units: list[UnitEntry], kind: str, key: str) -> None:
    for i in range(1, len(units)):
        before, value = units[i - 1][kind][key], units[i][kind][key]
        if not value > before:
            c.fail(f"units[{i}].{kind}.{key}", f"{value!r} is not above units[{i - 1}]'s {before!r}: the "
                   f"{key} of the units increase strictly, each once")


def _validate_unit(c: Checker, u: UnitEntry, i: int, names: list[str], kind: str,
                   replicates: set = frozenset()) -> None:
    field = f"units[{i}]"
    check_typed(c, u, UnitEntry, field)
    if u["index"] != i:
        c.fail(f"{field}.index", f"{u['index']!r} must equal its position {i}")
    if kind not in u:
        c.fail(f"{field}.{kind}", f"missing (the fields of a {kind} unit)")
    if not isinstance(u[kind], dict):
        c.fail(f"{field}.{kind}", f"{show(u[kind])} is not an object")
    # Every arm has a store in every unit but the replicates a unit names `without`; the twin's gate
    # replicate (measured only where the gate rule needs it) may add one more.
    without = set(u.get("without", []))
    if not without <= set(replicates):
        c.fail(f"{field}.without", f"{sorted(without - set(replicates))} are not replicates of the run")
    if not set(names) - without <= set(u["stores"]) <= (set(names) - without) | {GATE_REPLICATE}:
        c.fail(f"{field}.stores", f"arms {sorted(u['stores'])} are not the run's arms {sorted(names)}")
    for arm, entry in u["stores"].items():
        if entry["status"] == "done" and entry.get("sha256") is None:
            c.fail(f"{field}.stores.{arm}.sha256", "missing (the store is recorded done)")


def validate_summary(path: Path, summary: dict, schema: type = SharedSummary) -> dict:
    """summary.json against its kind's type (the kind's `summary_type`; SharedSummary where the reader
    looked no kind up)."""
    if isinstance(summary, dict) and "valid" in summary and "checks_passed" not in summary:
        raise StoreError(path, "written by an older twinrun (its field `valid` is now `checks_passed`): "
                         "reduce the run again, `python -m twinrun.reduce RUN_DIR`")
    return check_typed(Checker(path), summary, schema, "")
