"""Planning a twin run: validate, derive the arms, write everything the job needs, before any compute.

`plan_run` runs where the user typed the command: it validates what every measurement kind shares
(the registered analysis, determinism, the seed, paths, the reference), derives the native twin
(and replicate, machinery arm), hands the kind's own checks and units to its planner
(twinrun/measures), and writes the arms' configs, the config diff and run.json.

The trust policy lives here too: a run directory is data, so the job instantiates only builders
twinrun ships or the user vouched for (`load_arms`).
"""

import functools
import os
import tempfile
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from twinrun.analysis.estimands import check_estimands, declared_groups
from twinrun.arms import Arm, derive_arms
from twinrun.config import (
    GATE_RULES,
    MAX_REPLICATES,
    PLUGIN_NODE,
    REPLICATES_NONDETERMINISTIC,
    SIGNAL_ALPHA_TEXT,
    replicate_count,
    signal_alpha_ok,
)
from twinrun.errors import ConfigError, StoreError, TwinrunError, signals_held
from twinrun.files import atomic_write, make_dir, write_json
from twinrun.instantiate import build
from twinrun.intervention_nodes import check_protocol
from twinrun.measures.kind import Measure
from twinrun.measures.registry import MEASURES, measure_of
from twinrun.protocol import config_hash, protocol_differences
from twinrun.provenance import kernel_pin
from twinrun.provenance.determinism import MATMUL_PRECISIONS
from twinrun.provenance.version import twinrun_version
from twinrun.publish.trackers import check_tracker
from twinrun.storage.records import GATE_REPLICATE, RUN_FORMAT, RunRecord
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.store import verify_store

# The builders a run directory may name without the user vouching for them: twinrun's own
# model, data and interventions. Anything else must come from a config the user composed (its
# `_target_`s are passed in as `trusted`) or a module named on the command line.
# torch.optim's classes take parameters and numbers only: the built-in training experiment's AdamW.
# twinrun.models: the adapters of diffusers' networks twinrun ships.
BUILTIN_MODULES = ("twinrun.model", "twinrun.data", "twinrun.interventions", "twinrun.objectives",
                   "twinrun.caches", "torch.optim", "torch.optim.lr_scheduler", "twinrun.measures.train_loop",
                   "twinrun.models.sd3", "twinrun.models.pixart")


# ----------------------------------------------------------------------------- validation


def validate_common(cfg: DictConfig) -> None:
    """What every measurement kind shares: the registered analysis, determinism, the seed."""
    validate_reduce(cfg.reduce)
    if cfg.determinism.float32_matmul_precision not in MATMUL_PRECISIONS:
        raise ConfigError("determinism.float32_matmul_precision", cfg.determinism.float32_matmul_precision,
                          f"choose one of {', '.join(MATMUL_PRECISIONS)}")
    n = cfg.arms.get("replicates")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_REPLICATES):
        raise ConfigError("arms.replicates", n, f"must be a whole number in 1 … {MAX_REPLICATES}, or null (1 "
                          f"with determinism on, {REPLICATES_NONDETERMINISTIC} with it off); 3 or more bound "
                          "a nondeterministic path's wobble")
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError("seed", cfg.seed, "must be in [0, 2^63): it keys every noise stream")


def validate_reduce(r: DictConfig) -> None:
    """The analysis registered at plan time: estimands from the registry, a known gate rule."""
    check_estimands(list(r.estimands), declared_groups(r), None)
    if r.gate_rule not in GATE_RULES:
        raise ConfigError("reduce.gate_rule", r.gate_rule, f"choose one of {', '.join(GATE_RULES)}")
    if not signal_alpha_ok(r.signal_alpha):
        raise ConfigError("reduce.signal_alpha", r.signal_alpha, f"must be {SIGNAL_ALPHA_TEXT}, e.g. 0.05")
    if not signal_alpha_ok(r.family_alpha):  # the same rule: a level in (0, 0.5)
        raise ConfigError("reduce.family_alpha", r.family_alpha, f"must be {SIGNAL_ALPHA_TEXT}, e.g. 0.05")


def check_paths(cfg: DictConfig, run_dir: Path | None) -> None:
    """Paths a run will write to: its directory's name must be UTF-8 (it is written into run.json and
    every report), and a compile cache directory the user chose must be writable."""
    if run_dir is not None:
        try:
            str(run_dir).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError("hydra.run.dir", str(run_dir).encode("utf-8", "replace").decode(),
                              "is not valid UTF-8; choose a directory name of UTF-8 characters") from None
    cache = cfg.determinism.compile_cache_dir
    if cache is not None:
        try:
            _try_writing(Path(cache).expanduser())
        except OSError as err:
            raise ConfigError("determinism.compile_cache_dir", cache,
                              f"cannot be created or written here ({err.strerror or err}); choose a writable "
                              "directory (or null for ~/.cache/twinrun/compile)") from None


def check_pin_source(cfg: DictConfig) -> None:
    """determinism.kernel_path_from names a compiled run with a bundle made for this torch, Triton and
    CPU (the job checks the GPU, and the bundle's digest, again before its first compile)."""
    source = cfg.determinism.get("kernel_path_from")
    if not source or source == kernel_pin.COLD:
        return
    try:
        record = kernel_pin.recorded_pin(Path(source).expanduser())
    except TwinrunError as err:
        raise ConfigError("determinism.kernel_path_from", source, f"not a readable run directory ({err}); "
                          "name a compiled run, or cold") from None
    if record is None:
        raise ConfigError("determinism.kernel_path_from", source, "that run recorded no compile bundle "
                          "(eager, or measured before twinrun saved bundles); name a compiled run, or cold")
    here = kernel_pin.capability(None)
    kernel_pin.refuse_other_capability(source, {k: record.get("capability", {}).get(k) for k in here}, here)
    kernel_pin.refuse_untrusted("determinism.kernel_path_from", source, record,
                                bool(cfg.determinism.get("trust_bundle")))


def check_cold_check(cfg: DictConfig, kind) -> None:
    """determinism.cold_check compares two compiles: a run that compiles nothing has none to compare."""
    if cfg.determinism.get("cold_check") and not kind.compiles(OmegaConf.to_container(cfg, resolve=True)):
        raise ConfigError("determinism.cold_check", True, "this run compiles nothing (no torch.compile mode "
                          f"in {kind.settings_key}.compile); set one, or leave the control off")


def _try_writing(path: Path) -> None:
    """Create the directory (the job would) and a file in it, then remove the file: `os.access` trusts
    root, for whom /proc/x or a read-only mount still "allows" writing. An OSError says why not."""
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
        pass


def check_reference(reference: str | None, mine: dict, kind: Measure,
                    run_dir: Path | None = None) -> str | None:
    """A reference must be an earlier run directory (not this one) whose native twin was measured, every
    unit of it, under the same protocol as this run (`mine`: the twin's resolved config), its stores
    intact; checked before any compute, or the run would measure everything and read it "unusable"."""
    if reference is None:
        return None
    path = Path(reference).expanduser().resolve()
    if path.parent.name == "arms":  # given an arm directory itself
        path = path.parent.parent
    if run_dir is not None and path == Path(run_dir).resolve():
        raise ConfigError("reference", reference, "is this run's own directory: a run cannot vouch for "
                          "itself; name an earlier run directory")
    try:
        index = RunIndex.load(path)
        theirs = index.run_dir.read_arm_config(index.arm("twin")["name"])
        _measured_twin(index)
    except StoreError as err:
        raise ConfigError("reference", reference, "must be an earlier, intact twinrun run directory whose "
                          f"native twin is measured ({err})") from None
    if index.measure != kind.name:
        raise ConfigError("reference", reference, f"measured {index.measure}, this run measures {kind.name}")
    differ = protocol_differences(theirs, mine, kind.protocol_keys)
    if differ:
        raise ConfigError("reference", reference, f"was measured under another protocol ({', '.join(differ)} "
                          "differ); a reference must share data, objective, grid, seed, images, draws, "
                          "folds and probed parameters")
    return str(path)


def _measured_twin(index: RunIndex) -> None:
    """Every unit's twin store recorded done and verifying on disk (a StoreError naming the first that is
    not)."""
    twin = index.arm("twin")["name"]
    for u in index.units:
        entry = u["stores"][twin]
        if entry["status"] != "done":
            raise StoreError(index.store_path(u, twin), f"{u['label']} of its twin is {entry['status']}: "
                             "resume that run first")
        _verified(index.store_path(u, twin), entry["sha256"], entry.get("payload_bytes"))


@functools.lru_cache(maxsize=4096)
def _verified(path: Path, sha256: str, payload_bytes: int | None) -> None:
    """One store read through every check, once per process for one recorded digest (every point of a
    sweep names the same reference; a failure raises and is not cached)."""
    verify_store(path, sha256, payload_bytes=payload_bytes)


# ----------------------------------------------------------------------------- plan


def plan_run(cfg: DictConfig, run_dir: Path | None, command: str | None = None,
             dry_run: bool = False) -> RunRecord:
    """Validate, derive the twin, write configs, diff and run.json. Returns run.json's content.

    dry_run: validate only, write nothing (a sweep checks every point before the first runs).
    """
    kind = measure_of(cfg.measure)
    intervention = build(OmegaConf.to_container(cfg.intervention, resolve=True), "intervention")
    check_protocol(intervention, cfg.intervention.get("_target_"))
    validated = kind.validate(cfg, intervention)
    validate_common(cfg)
    if cfg.arms.get("replicate_segments") is not None and not kind.sequential_units:
        raise ConfigError("arms.replicate_segments", cfg.arms.replicate_segments, "applies to runs whose "
                          f"units continue each other (training segments); measure={kind.name} has none: "
                          "leave it null")
    replicate = bool(cfg.arms.replicate) or kind.replicate_always
    arms, diff = derive_arms(cfg, intervention.name, replicate=replicate, noop=kind.noop(intervention),
                             replicates=replicate_count(cfg),
                             chaos=kind.chaos_arms(cfg), exclude=foreign_keys(kind))
    check_paths(cfg, run_dir)
    check_pin_source(cfg)
    check_cold_check(cfg, kind)
    check_tracker(OmegaConf.to_container(cfg.tracker, resolve=True))  # a sweep's points too, before any runs
    planned = kind.plan(cfg, intervention, arms, run_dir, validated)
    run: RunRecord = {
        "format": RUN_FORMAT,
        "measure": kind.name,
        "status": "planned",
        "command": command,
        "reference": check_reference(cfg.reference, arms[1].config, kind, run_dir),
        "arms": [{"name": a.name, "role": a.role, "config_hash": config_hash(a.config)} for a in arms],
        # The analysis registered before any compute; `reduce` with other settings is a post-hoc view.
        "registered": {"estimands": list(cfg.reduce.estimands), "gate_rule": cfg.reduce.gate_rule,
                       "signal_alpha": float(cfg.reduce.signal_alpha),
                       "family_alpha": float(cfg.reduce.family_alpha),
                       **({"groups": declared_groups(cfg.reduce)} if cfg.reduce.groups else {})},
        "units": [unit_entry(u, arms) for u in planned.units],
        "twinrun": twinrun_version(),  # which twinrun planned it (version, git commit where there is one)
    }
    if dry_run:
        return run
    rd = RunDir(run_dir)
    if rd.is_run():
        return _resume_plan(rd, run)
    # A signal waits until the arms' configs and run.json are all written: a planned run that resumes.
    with signals_held("the plan was not written, so there is nothing to resume"):
        if any(GATE_REPLICATE in u["stores"] for u in run["units"]):
            make_dir(rd.arm_dir(GATE_REPLICATE))
        for arm in arms:
            make_dir(rd.arm_dir(arm.name))
            atomic_write(rd.arm_config(arm.name), yaml.safe_dump(arm.config, sort_keys=False).encode())
        write_json(rd.config_diff_json, diff)
        return RunIndex.create(rd, run).doc


def foreign_keys(kind: Measure) -> tuple[str, ...]:
    """The config nodes of the other measurement kinds: an arm's config holds only its own kind's."""
    own = set(kind.config_keys)
    others = [k for m in MEASURES.values() if m is not kind for k in m.config_keys if k not in own]
    # the plugin kinds' settings node belongs to none of the built-in kinds
    return tuple(dict.fromkeys([*others, *([PLUGIN_NODE] if PLUGIN_NODE not in own else [])]))


def unit_entry(u: dict, arms: list[Arm]) -> dict:
    """A planned unit with a pending store for every arm, in run.json's order of keys. The twin is
    measured again at every gate unit (unless arms.replicate already does so in every unit): without
    it a gate that is not bit-identical could not tell a nondeterministic kernel path from an
    intervention that is not a no-op (twinrun/analysis/gates.py)."""
    own = {k: v for k, v in u.items() if k not in ("file", "payload_bytes")}
    # what each store's tensors hold, from the protocol: a reader checks the header against it first
    size = {"payload_bytes": u["payload_bytes"]} if "payload_bytes" in u else {}
    # `without`: arms the kind does not measure in this unit (training's replicate after its first K
    # segments, arms.replicate_segments)
    stores = {a.name: {"file": u["file"], "status": "pending", **size} for a in arms
              if a.name not in u.get("without", ())}
    if u["gate"] and all(a.name != GATE_REPLICATE for a in arms):
        stores[GATE_REPLICATE] = {"file": u["file"], "status": "pending", **size}
    return {**own, "stores": stores}


def _resume_plan(rd: RunDir, planned: dict) -> RunRecord:
    old = RunIndex.load(rd)
    if [a["config_hash"] for a in old.arms] != [a["config_hash"] for a in planned["arms"]]:
        # The same command line may plan other arms or configs under another twinrun (a key or an arm
        # added since): the run's own record is what resumes it.
        raise StoreError(rd.path, "holds a run of a different config (other settings, or planned by another "
                         f"twinrun version); resume it as planned with `python -m twinrun.resume {rd.path}`, "
                         "or use a new run directory")
    return old.doc


# ----------------------------------------------------------------------------- the trust policy


def targets(tree) -> list[str]:
    """Every `_target_` in a config (Hydra's instantiate follows nested ones too)."""
    if isinstance(tree, dict):
        own = [tree["_target_"]] if "_target_" in tree else []
        return own + [t for v in tree.values() for t in targets(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in targets(v)]
    return []


def trusted_targets(cfg: DictConfig) -> list[str]:
    """The builders of a config the user composed (its model, data, intervention, objective, and what its
    kind's settings name: the training optimizer, a sampling feature net)."""
    own = measure_of(cfg.measure).config_keys
    return sorted({t for key in ("model", "data", "intervention", "objective", *own) if key in cfg
                   for t in targets(OmegaConf.to_container(cfg[key], resolve=True))})


def _allowed(target, trusted) -> bool:
    if not isinstance(target, str):
        return False
    module = target.rpartition(".")[0]
    return any(module == m for m in BUILTIN_MODULES) or any(
        target == t or target.startswith(f"{t}.") for t in trusted)


def load_arms(index: RunIndex, trusted=()) -> list[Arm]:
    """Each arm's config.yaml, only if it is the config run.json hashed and names only builders
    twinrun ships or the user vouched for: a run directory is data and never runs code."""
    arms = []
    for entry in index.arms:
        path = index.run_dir.arm_config(entry["name"])
        config = index.run_dir.read_arm_config(entry["name"])
        if config_hash(config) != entry["config_hash"]:
            raise StoreError(path, f"does not match the config_hash {entry['config_hash']} run.json records "
                             "for it (edited after planning?); restore it or start a new run directory")
        foreign = [t for t in targets(config) if not _allowed(t, trusted)]
        if foreign:
            raise StoreError(path, f"names the builder _target_={foreign[0]!r}, which is neither twinrun's "
                             "nor one you named: rerun your original command (with its --config-dir), or "
                             "`python -m twinrun.resume RUN_DIR --trust MODULE` if you trust that code")
        arms.append(Arm(entry["name"], config, entry["role"]))
    if index.has_gate_replicate():
        arms.append(Arm(GATE_REPLICATE, next(a for a in arms if a.role == "twin").config, "replicate"))
    return arms
