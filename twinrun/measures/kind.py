"""What a measurement kind is: the interface twinrun's planning, job and reducer call.

A kind declares its units (σ bins for the probe), which of them are gates, what its stores hold and
how its run is analysed; planning, the job skeleton (locks, run.json, fingerprint, sentinel, job
records, failures, interrupts, progress) and the launchers are the same for every kind.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig

from twinrun.errors import ConfigError, DeviceError
from twinrun.storage.records import KindFields, SharedSummary, UnitEntry
from twinrun.storage.store import STORE_FORMAT


@dataclass
class Plan:
    """What a kind's planning hands back: the run's units (index, label, gate, the kind's own fields;
    stores are added by planning) and the store size it printed, for the disk check."""

    units: list[dict]
    store_bytes: int


class Session(Protocol):
    """One job's measurement of a run, built where the job runs (after determinism is applied)."""

    compile_mode: str | None  # the torch.compile mode the job runs (None: eager); joins the fingerprint
    # What is measured (digests of the model as built and of the data): a resume may not change it.
    identity: dict

    def arithmetic(self) -> dict:
        """Settings that change the arithmetic of a store, not what it measures: they join the kernel path."""

    def sentinel(self) -> dict:
        """The kernel-path sentinel, with the measured model's own op (twinrun.provenance.record)."""

    def begin_unit(self, u: UnitEntry) -> None:
        """Before the unit's first arm (e.g. draw the noise every arm of the unit consumes)."""

    def measure(self, u: UnitEntry, arm: str, stamp: dict) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, metadata) of one arm's store in this unit; `stamp`: config_hash, env, kernel_path."""

    # A kind whose units continue each other (Measure.sequential_units) also has
    #   restore(u, stores: {arm: (path, sha256)}) -> None
    # called once before a job's first unit when that unit is not the run's first: every arm's state
    # is read back from the stores of `u`, the whole unit before it.


@dataclass(frozen=True)
class Comparison:
    """How `python -m twinrun.compare` compares two arms of a kind that has its own comparison."""

    side: Callable[[Path, str], dict]  # (path, arm) -> {unit: store} of a run, arm directory or store
    compare: Callable[[object, dict, dict], int]  # (args, side A, side B) -> exit code; prints the rows


@dataclass(frozen=True)
class Measure:
    """One measurement kind, as MEASURES lists it."""

    name: str  # `measure=NAME` in the config; the key of each unit's own fields in run.json
    settings_key: str  # the config node of its settings (probe: `probe`)
    unit_noun: str  # what its units are called in messages (bin, segment)
    # (cfg, intervention) -> what plan needs (e.g. the built data): the kind's own keys, before the
    # arms are derived, so a bad setting is refused before anything else is built.
    validate: Callable[[DictConfig, object], object]
    # (cfg, intervention, arms, dir, validated)
    plan: Callable[[DictConfig, object, list, Path | None, object], Plan]
    protocol_keys: tuple[str, ...]  # config keys two runs must share to measure the same thing
    open_session: Callable[[dict, list, torch.device], Session]  # (config, arms, device), in the job
    device: Callable[[dict], str]  # the config's device setting (`auto`, `cpu`, `cuda:N`)
    # (run_dir, estimands, gate_rule, signal_alpha, family_alpha) -> Reduction: the kind's analysis
    # (writes nothing); None for a setting means the registered one
    reduce: Callable
    report: Callable  # (out_dir, summary, index) -> report.md's path: writes the report and its plots
    render: Callable  # summary -> the text the command prints after reducing
    config_keys: tuple[str, ...] = ()  # config nodes only this kind reads: no other kind's arms carry them
    # Each unit continues from the one before (training segments): a job measures every unit from the
    # first pending one on, and restores its arms from the whole unit before it (Session.restore).
    sequential_units: bool = False
    replicate_always: bool = False  # the twin's replicate is an arm of every run (not only arms.replicate)
    # config -> how many chaos arms (the twin with a one-ulp perturbation) every run of the kind has
    chaos_arms: Callable[[DictConfig], int] = lambda cfg: 0
    # intervention -> the no-op setting its machinery arm runs in this kind (None: no machinery arm):
    # its noop(), unless the kind's units lack the gate bins that let an intervention declare none.
    noop: Callable[[object], dict | None] = lambda intervention: intervention.noop()
    store_format: str = STORE_FORMAT  # the format its stores name (twinrun/storage/store.py)
    # Whether the config's job runs torch.compile: its compile caches are then the run's own.
    compiles: Callable[[dict], bool] = lambda config: False
    twin_first: bool = False  # each unit measures the twin before its other arms (the probe's pairing blocks)
    # What the kind-neutral rooms ask of a kind (they name none): how run.json, summary.json, the table,
    # the trackers, a sweep and the launcher rules read a run of this kind.
    unit_fields: type = KindFields  # its own fields in every unit of run.json (a TypedDict)
    increasing: str | None = None  # its unit field that runs strictly upward through the units (σ)
    summary_type: type = SharedSummary  # summary.json's type (a TypedDict), checked when read
    unit_key: str = "unit"  # how its summary's effects and gates name a unit (sigma; step)
    unit_own: str = "unit"  # the unit's own field in run.json that holds the same value (sigma; to_step)
    # (index, summary) -> (the comparison's rows, the twin's own[, the intervention's own]): what a tracker
    # logs per unit; each arm's own quantities under the same keys, so the tracker overlays the two runs
    tracker_rows: Callable = lambda index, summary: ([], [])
    tracker_step: str | None = None  # the row field that is a tracker's step axis (None: the row's index)
    # summary -> the fields a sweep's summary keeps of one reduced point (publish/sweep.py)
    sweep_point: Callable[[dict], dict] = lambda summary: {"effects": summary.get("effects", [])}
    sweep_protocol: str | None = None  # the config node a sweep's summary names as its points' protocol
    # config -> (key, value) of the setting that makes its job compile (split=bins refuses a compiled job),
    # None when the kind never compiles
    compile_setting: Callable[[dict], tuple[str, object] | None] = lambda config: None
    # (method or None, device type) -> the arithmetic settings a default run of the kind adds to the
    # kernel path (`python -m twinrun.env` prints them as a run records them)
    default_arithmetic: Callable[[str | None, str], dict] = lambda method, device_type: {}
    # (path, tensors, meta) -> sha256: writes one store of the kind (None: storage/store.py's write_store
    # with `store_format`)
    write_store: Callable | None = None
    # (path, sha256, payload_bytes=...) -> metadata: reads one store of the kind whole and checks it
    # (None: storage/store.py's verify_store); a resume and status judge its stores by it
    verify_store: Callable | None = None
    methods: tuple[str, ...] = ()  # the values its `method` may resolve to (`twinrun.env --method`)
    # How `python -m twinrun.compare` compares two of its arms: None, bin by bin as stores of the default
    # format (STORE_FORMAT) are; a Comparison, its own way. `not_comparable`: why its arms cannot be
    # compared there and what to use instead (one line; the command refuses with exit 2).
    comparison: Comparison | None = None
    not_comparable: str | None = None


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def parse_device(key: str, name) -> tuple[str, int | None]:
    """A device setting as (auto | cpu | cuda, GPU index or None), or a one-line error naming the key.

    Only the spelling is judged here: whether the GPU exists is the job's to say, on the node that
    runs it (a SLURM login node that plans the run has none)."""
    text = str(name)
    kind, _, index = text.partition(":")
    if kind in ("auto", "cpu") and not index and ":" not in text:
        return kind, None
    if kind == "cuda" and (":" not in text or index.isdigit()):
        return "cuda", int(index) if index else None
    if kind in ("auto", "cpu") and index.isdigit():
        raise ConfigError(key, name, f"{kind} takes no index; use {DEVICE_CHOICES}")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise ConfigError(key, name, f"not a torch device; use {DEVICE_CHOICES}") from None
    raise ConfigError(key, name, f"twinrun measures on cpu or cuda[:N] only ({device.type} is neither); "
                      f"use {DEVICE_CHOICES}")


def resolve_device(name: str, gpus: int | None = None, *, key: str) -> torch.device:
    """The device a job measures on, judged where it runs: `auto` is the GPU when this process has one
    (cuda:0 of the GPUs it sees, e.g. the one CUDA_VISIBLE_DEVICES gives it), else the CPU.

    `gpus`: how many GPUs the launcher requested for this job (None: in this process, whatever it
    sees). `auto` with none requested is the CPU; a GPU asked for (cuda[:N], or `auto` with GPUs
    requested) that this process does not see is a DeviceError (exit 5), before any unit. `key`: the
    setting's name in messages (the kind's `<settings_key>.device`)."""
    kind, index = parse_device(key, name)
    if kind == "cpu" or (kind == "auto" and gpus == 0):
        return torch.device("cpu")
    if kind == "auto" and gpus is None and not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        asked = f"{key}={name}" if kind == "cuda" else f"{key}=auto with launcher.gpus_per_node={gpus}"
        raise DeviceError(f"{asked} asks for a GPU, but this process sees none ({_visible()}): run it "
                          f"where torch sees a GPU, or measure again with {key}=cpu into a new run "
                          "directory (the setting is part of the run's config)")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise DeviceError(f"{key}={name}: this process sees {count} GPU{'s' * (count != 1)} ({_visible()}), "
                          f"numbered from cuda:0 to cuda:{count - 1}; use {key}=cuda (or auto)")
    return torch.device("cuda", index or 0)


def describe_device(device: torch.device) -> str:
    """The device a job measures on, in words: recorded in run.json's job record and printed."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}; {_visible()})"


def _visible() -> str:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"{count} visible, CUDA_VISIBLE_DEVICES={'unset' if where is None else repr(where)}, "
            f"torch built with CUDA {torch.version.cuda}")
