"""What a measurement kind is: the interface twinrun's planning, job and reducer call.

A kind declares its units (σ bins for the probe), which of them are gates, what its stores hold and
how its run is analysed; planning, the job skeleton (locks, run.json, fingerprint, sentinel, job
records, failures, interrupts, progress) and the launchers are the same for every kind.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig

from twinrun.storage.records import UnitEntry
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
    # (run_dir, estimands, gate_rule, signal_alpha) -> Reduction: the kind's analysis (writes nothing)
    reduce: Callable
    report: Callable  # (out_dir, summary, index) -> report.md's path: writes the report and its plots
    render: Callable  # summary -> the text the command prints after reducing
    config_keys: tuple[str, ...] = ()  # config nodes only this kind reads: no other kind's arms carry them
    # Each unit continues from the one before (training segments): a job measures every unit from the
    # first pending one on, and restores its arms from the whole unit before it (Session.restore).
    sequential_units: bool = False
    replicate_always: bool = False  # the twin's replicate is an arm of every run (not only arms.replicate)
    chaos_arm: bool = False  # the twin with a one-ulp perturbation, as an arm of every run
    store_format: str = STORE_FORMAT  # the format its stores name (twinrun/storage/store.py)
    twin_first: bool = False  # each unit measures the twin before its other arms (the probe's pairing blocks)


def resolve_device(name: str) -> torch.device:
    """A device setting as a torch device: `auto` is the GPU when this process has one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
