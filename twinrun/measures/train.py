"""Twin training runs, twinrun's second measurement kind (`measure=train`): every arm trains from one
start checkpoint on the same samples and noise, segment by segment in one process.

    python -m twinrun +experiment=train_scale_lr

Its units are a start unit (step 0) and training segments of `train.segment_steps` steps. Every arm
advances one segment before any arm starts the next, and each segment boundary stores each arm's
weights, optimizer state and losses atomically, so a kill leaves all arms at one boundary and a
resume continues from it bit for bit (`TrainSession.restore`). The arms: the intervention, the native
twin, the twin's replicate, the machinery arm (the intervention's code at its no-op setting: the
gate) and the chaos arms (the twin with every trained weight moved by one ulp: the floor). docs/training.md.
"""

import copy
import json
import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from twinrun import caches, conditioning, objectives
from twinrun.analysis.estimands import check_estimands, declared_groups
from twinrun.analysis.train_compare import compare_training, train_side
from twinrun.analysis.train_reduce import reduce_train, refuse_derived
from twinrun.arms import chaos_number
from twinrun.config import TrainConfig, build, objective_of, typed
from twinrun.errors import ConfigError, DeviceMemoryError, StoreError, TwinrunError
from twinrun.files import memory_bytes
from twinrun.interventions import Intervention, attached
from twinrun.measures import train_loop as loop
from twinrun.measures import train_step as ts
from twinrun.measures.failures import as_model_error, failing_frame, first_line, is_out_of_memory
from twinrun.measures.kind import Comparison, Measure, Plan, parse_device
from twinrun.measures.train_offload import OFFLOADS, Parking, layout_line
from twinrun.measures.train_override import arm_train, check_override, validate_arm_settings
from twinrun.measures.train_state import (
    ArmState,
    build_arm,
    build_start,
    chaos_seed,
    check_chaos,
    model_names,
    optimizer_record,
    perturb,
    perturb_every,
    restore_optimizer,
    validate_optimizer,
    weight_layout,
)
from twinrun.measures.train_streams import Segment, draw_segment, dropout_seed, heldout_draws
from twinrun.provenance.record import model_sha256, read_sentinel, tensors_sha256
from twinrun.publish import train_rows
from twinrun.publish.train_report import render_train, write_train_report
from twinrun.storage.records import TrainUnit, UnitEntry
from twinrun.storage.train_records import TrainSummary
from twinrun.storage.train_store import TRAIN_STORE_FORMAT, read_train_store, write_train_store

# What two training runs must share to have trained on the same thing (a comparison's check).
TRAIN_PROTOCOL_KEYS = ("data", "seed", "train.steps", "train.segment_steps", "train.batch_size",
                       "train.heldout_images")
# Where an intervention can act in training; one that overrides none of these acts nowhere.
# Where the chaos arms' ulps land (train.chaos.weights): every weight, or one element of one.
CHAOS_WEIGHTS = ("every", "one")
TRAINING_HOOKS = ("sigma_cond", "attach", "train_lr", "loss_weight", "train_settings")


def store_name(unit_index: int, to_step: int) -> str:
    """The start unit's store, or a segment's: named by the step it holds."""
    return f"seg{unit_index:03d}_step{to_step:06d}.safetensors" if unit_index else "step000000.safetensors"


def unit_label(unit_index: int, from_step: int, to_step: int) -> str:
    return "start (step 0)" if unit_index == 0 else f"segment {unit_index} (steps {from_step + 1}–{to_step})"


# ----------------------------------------------------------------------------- validation


def validate(cfg: DictConfig, intervention: Intervention) -> tuple:
    """The training settings, the intervention and the data, before any compute; each error names the
    key, the value and the fix. Returns the data ((train images, ids), (held-out images, ids))."""
    t = cfg.train
    for key in ("steps", "segment_steps", "batch_size", "heldout_images"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise ConfigError(f"train.{key}", t[key], "must be a positive integer")
    if t.steps % t.segment_steps:
        raise ConfigError("train.segment_steps", t.segment_steps, f"must divide train.steps={t.steps} (every "
                          "segment is as long as the others); e.g. "
                          f"{max(d for d in range(1, t.segment_steps + 1) if t.steps % d == 0)}")
    if t.chunk_samples == 0 or t.chunk_samples < -1:
        raise ConfigError("train.chunk_samples", t.chunk_samples, "must be ≥ 1, or -1 for the whole batch")
    if not (math.isfinite(t.floor_margin) and t.floor_margin >= 1):
        raise ConfigError("train.floor_margin", t.floor_margin, "must be a finite factor ≥ 1 "
                          "(docs/training.md)")
    if t.chaos.ulps == 0:
        raise ConfigError("train.chaos.ulps", t.chaos.ulps, "must be a nonzero number of ulps (the chaos arm "
                          "would be the twin); 1 is the default")
    if t.chaos.weights not in CHAOS_WEIGHTS:
        raise ConfigError("train.chaos.weights", t.chaos.weights,
                          f"must be one of {', '.join(CHAOS_WEIGHTS)} (docs/training.md)")
    if not isinstance(t.chaos.arms, int) or isinstance(t.chaos.arms, bool) or t.chaos.arms < 1:
        raise ConfigError("train.chaos.arms", t.chaos.arms, "must be a positive integer (2 is the default)")
    if t.chaos.weights == "one" and t.chaos.arms > 1:
        raise ConfigError("train.chaos.arms", t.chaos.arms, "with train.chaos.weights=one every chaos arm "
                          "would move the same element: use 1, or train.chaos.weights=every")
    optimizer = OmegaConf.to_container(t.optimizer, resolve=True) if t.optimizer is not None else None
    validate_optimizer(optimizer)
    loop.check_loop(t)
    if t.offload not in OFFLOADS:
        raise ConfigError("train.offload", t.offload, f"must be one of {', '.join(OFFLOADS)} "
                          "(docs/training.md)")
    _validate_device(t.device)
    if cfg.reference is not None:
        raise ConfigError("reference", cfg.reference, "a training run takes no reference: compare two "
                          "training runs with `python -m twinrun.compare RUN_A RUN_B`")
    refuse_derived(cfg.reduce.estimands)
    check_override(cfg, intervention)
    check_training_intervention(intervention)
    train, held = split_data(build(OmegaConf.to_container(cfg.data, resolve=True), "data"))
    (train_x, train_ids, train_cond), (held_x, held_ids, held_cond) = train, held
    if t.batch_size * t.accumulate > train_x.shape[0]:
        raise ConfigError("train.batch_size", t.batch_size, f"the training split has only {train_x.shape[0]} "
                          f"images (a step draws its batch x train.accumulate={t.accumulate} without "
                          "replacement); use at most that")
    if t.heldout_images > held_x.shape[0]:
        raise ConfigError("train.heldout_images", t.heldout_images, f"the held-out split has only "
                          f"{held_x.shape[0]} images; use at most that")
    # The intervention arm's own settings (an override's), after the twin's: a twin's error names its key.
    validate_arm_settings(arm_train({"train": OmegaConf.to_container(t, resolve=True)}, intervention),
                          train_x.shape[0])
    for what, ids in (("training", train_ids), ("held-out", held_ids)):
        if len(set(ids)) != len(ids):
            raise ConfigError("data._target_", cfg.data.get("_target_"), f"the {what} ids repeat: an id keys "
                              "a sample's noise, so each must name one image")
    return (train_x, list(train_ids), train_cond), (held_x, list(held_ids), held_cond)


def split_data(data) -> tuple[tuple, tuple]:
    """((images, ids, cond), (images, ids, cond)) of the training builder's two splits, each given as
    (images, ids) or (images, ids, cond); each split's conditioning checked against its images."""
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise ConfigError("data._target_", type(data).__name__, "a training data builder returns (training "
                          "split, held-out split), each (images, ids) or (images, ids, cond)")
    out = tuple(conditioning.split(part) for part in data)
    for (x, _, cond), what in zip(out, ("training", "held-out")):
        conditioning.check(cond, x.shape[0], key=f"data._target_ ({what} split)")
    if set(out[0][2]) != set(out[1][2]):
        raise ConfigError("data._target_", sorted(set(out[0][2]) ^ set(out[1][2])), "the training and "
                          "held-out splits must carry the same conditioning entries")
    return out


def _validate_device(name: str) -> None:
    """The spelling only: whether the GPU exists is the job's to judge, on the node that trains (the
    host that plans a SLURM run may have none); a job that lacks it fails with exit 5 before any step."""
    parse_device("train.device", name)


def check_training_intervention(intervention: Intervention) -> None:
    """Refuse, before compute, an intervention a training run cannot vouch for: without a no-op setting
    there is no machinery arm, its only gate (no step of training is a no-op of an intervention the way
    a probe's σ bin can be); one that acts nowhere in training, or sits at its no-op setting, measures
    nothing."""
    key = f"intervention({type(intervention).__name__})"
    settings = {k: v for k, v in vars(intervention).items() if not k.startswith("_")}
    noop = intervention.noop()
    if noop is None:
        raise ConfigError(key, settings, "has no no-op setting (`noop()`): a training run's gate is the "
                          "machinery arm, the intervention's own code at its no-op setting, which must be "
                          "bit-identical to the twin at every step; without one nothing vouches for the "
                          "instrument. Declare a no-op setting, or train with an intervention that has one "
                          "(scale_lr: factor=1; weight_sigma: power=0)")
    if not any(getattr(type(intervention), h) is not getattr(Intervention, h) for h in TRAINING_HOOKS):
        raise ConfigError(key, settings, f"acts nowhere in training (it overrides none of "
                          f"{', '.join(TRAINING_HOOKS)}): nothing to measure")
    if all(settings.get(k) == v for k, v in noop.items()):
        raise ConfigError(key, settings, f"is at its no-op setting {noop}: nothing to measure; choose "
                          "settings that change something")
    intervention.check_train()


# ----------------------------------------------------------------------------- plan


def plan_units(t: TrainConfig) -> list[dict]:
    """The start unit (every arm's weights before training) and one unit per segment."""
    k = t.segment_steps
    bounds = [(0, 0)] + [((i - 1) * k, i * k) for i in range(1, t.steps // k + 1)]
    return [{"index": i, "label": unit_label(i, a, b), "gate": False, "train": {"from_step": a, "to_step": b},
             "file": store_name(i, b)} for i, (a, b) in enumerate(bounds)]


def plan(cfg: DictConfig, intervention: Intervention, arms: list, run_dir: Path | None, data: tuple) -> Plan:
    """Build the start model (on the CPU), check it, the chaos weight and the estimands, run one tiny
    training step per arm; the run's units."""
    t = typed(TrainConfig, arms[0].config["train"], "train")
    model = build_start(arms[0].config, t, torch.device("cpu"))
    if t.chaos.weights == "one":  # (every weight: nothing to name)
        check_chaos(model, t.chaos)
    layout = weight_layout(model)
    check_estimands(list(cfg.reduce.estimands), declared_groups(cfg.reduce), layout, params_key=None)
    intervention.check_model(model)
    objective = objective_of(arms[0].config.get("objective"))
    objective.check_model(model)
    conditioning.check(data[0][2], data[0][0].shape[0], model)
    state_bytes = smoke_step(model, arms, t, data, objective)
    units = plan_units(t)
    return Plan(units=units, store_bytes=check_sizes(t, model, state_bytes, len(arms), len(units), run_dir))


def smoke_step(start: torch.nn.Module, arms: list, t: TrainConfig, data: tuple,
               objective: objectives.Objective | None = None) -> int:
    """One optimizer step of two samples per arm on a copy of the model, eagerly on the CPU: a model or
    intervention that cannot train is one line before anything is stored. Returns the optimizer
    state's size in bytes after a step (for the store-size estimate)."""
    (train_x, _, train_cond), (held_x, _, held_cond) = data
    gen = torch.Generator().manual_seed(20251201)
    x = train_x[:2]
    normal, eps = torch.randn(2, generator=gen), torch.randn(x.shape, generator=gen)
    state_bytes, tried = 0, set()
    for arm in arms:
        code = json.dumps(arm.config["intervention"], sort_keys=True)
        if code in tried:  # the twin's replicate and the chaos arm run the twin's code
            continue
        tried.add(code)
        intervention = build(arm.config["intervention"], "intervention")
        s = build_arm(start, arm_train(arm.config, intervention), intervention)
        s.t.batch_size, s.t.accumulate, s.t.chunk_samples = 2, 1, -1
        twin_step = arms[1].config["train"].get("step")  # the common objective's
        optimizer = s.optimizer
        try:
            with attached(intervention, s.model):
                level = (objective or objectives.EDM()).train_level(s.model, normal)
                loop.loop_step(s, s.step_fn, x, [0, 1], level, eps, 0, 1,
                               None if s.t.step == twin_step else loop.build_step(twin_step),
                               conditioning.take(train_cond, slice(0, 2)), objective)
            ts.heldout_losses(s.model, intervention, held_x[:2], normal, eps, 2, objective,
                              conditioning.take(held_cond, slice(0, 2)))
        except TwinrunError:
            raise
        except Exception as err:  # noqa: BLE001 — user code may raise anything: one line, exit 2
            raise ConfigError("model._target_", arm.config["model"].get("_target_"), f"arm {arm.name}: a "
                              f"training step raised {type(err).__name__}: {first_line(err)} (at "
                              f"{failing_frame(err)}); fix the model or the intervention") from None
        state_bytes = max(state_bytes, sum(v.nbytes for s in optimizer.state_dict()["state"].values()
                                           for v in s.values() if isinstance(v, torch.Tensor)))
    return state_bytes


def check_sizes(t: TrainConfig, model: torch.nn.Module, state_bytes: int, n_arms: int, n_units: int,
                run_dir: Path | None) -> int:
    """Print the run's store size and the memory its arms hold at once; refuse stores that cannot fit
    on the run directory's disk. Returns the stores' size in bytes."""
    weights = sum(v.nbytes for v in model.state_dict().values())
    n_tensors = len(model.state_dict())
    per_store = (weights + state_bytes + 4 * (t.segment_steps + t.heldout_images) + 16 * 1024
                 + 400 * n_tensors + 20 * n_tensors * t.segment_steps)
    store_bytes = n_arms * n_units * per_store
    where = Path(run_dir) if run_dir is not None else Path.cwd()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    arm_bytes = 2 * weights + state_bytes  # one arm's weights, gradients and optimizer state
    held = n_arms * arm_bytes if t.offload != "disk" else arm_bytes  # in host memory at once
    print(f"twinrun: the stores will take about {store_bytes / 1e6:,.1f} MB ({n_arms} arms x {n_units} units "
          f"of {per_store / 1e6:,.2f} MB); {layout_line(t.offload, n_arms, arm_bytes)}; "
          f"{free / 1e9:,.1f} GB free at {where}", flush=True)
    if held > memory_bytes() // 2:
        raise ConfigError("train.optimizer", t.optimizer.get("_target_"), f"{n_arms} arms' models and "
                          f"optimizer states ({held / 2**30:.1f} GiB) would take over half this machine's "
                          "memory; train a smaller model here")
    resuming = run_dir is not None and (Path(run_dir) / "run.json").exists()
    if store_bytes > free and not resuming:
        raise ConfigError("train.segment_steps", t.segment_steps, f"the stores would take "
                          f"{store_bytes / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free at "
                          f"{where}; use longer segments (fewer stores) or a run directory with room "
                          "(hydra.run.dir=...)")
    return store_bytes


# ----------------------------------------------------------------------------- the job's session


class TrainSession:
    """The training run in one job: every arm's model and optimizer on this job's device, the held-out
    draws (drawn once), and each segment's samples and noise (drawn once, consumed by every arm)."""

    compile_mode = None  # training runs eagerly

    def __init__(self, config: dict, arms: list, device: torch.device):
        self.t = typed(TrainConfig, config["train"], "train")
        self.seed, self.device = config["seed"], device
        with caches.recording() as data_files:
            train, held = split_data(build(config["data"], "data"))
        (train_x, train_ids, train_cond), (held_x, held_ids, held_cond) = train, held
        self.train_x, self.train_ids = train_x.to(device), list(train_ids)
        n_held = self.t.heldout_images
        self.held_x, self.held_ids = held_x[:n_held].to(device), list(held_ids[:n_held])
        # Per-image conditioning (each sample is fed its own image's rows) and the objective.
        self.train_cond = conditioning.to(train_cond, device)
        self.held_cond = conditioning.to(conditioning.take(held_cond, slice(0, n_held)), device)
        self.objective = objective_of(config.get("objective"))
        self.shape = tuple(train_x.shape[1:])
        normal, eps, self.heldout_digest = heldout_draws(self.seed, self.held_ids, self.shape)
        self.held_normal, self.held_eps = normal.to(device), eps.to(device)
        self.chunk = self.t.batch_size if self.t.chunk_samples == -1 else self.t.chunk_samples
        start = build_start(config, self.t, device)
        # What is trained, on the record: the start checkpoint as built and both splits' images.
        ids = torch.tensor(self.train_ids + self.held_ids)
        self.identity = {"model_sha256": model_sha256(start),
                         "data_sha256": tensors_sha256([("train", self.train_x), ("heldout", self.held_x),
                                                        ("ids", ids)]
                                                       + conditioning.digest_items(self.train_cond)
                                                       + [(f"heldout/{n}", v) for n, v in
                                                          conditioning.digest_items(self.held_cond)])}
        if getattr(start, "adapter_sha256", None) is not None:  # a LoRA adapter's file content
            self.identity["adapter_sha256"] = start.adapter_sha256
        if data_files:  # the caches read, file by file
            self.identity["data_files"] = data_files
        # Never trained: the sentinel reads the same model at the start and the end of every job.
        self.sentinel_model = copy.deepcopy(start)
        self.layout = weight_layout(start)
        # train.offload: every arm parked as soon as it is built; only the arm training is resident.
        self.parking = Parking(self.t.offload, device)
        self.arms = {}
        for a in arms:
            self.arms[a.name] = self._arm(start, a)
            self.parking.park(self.arms[a.name])
        self.rng_devices = [device.index or 0] if device.type == "cuda" else []
        self.segment: Segment | None = None

    def _arm(self, start: torch.nn.Module, arm) -> ArmState:
        model = copy.deepcopy(start)
        if arm.role == "chaos":  # (its config is the twin's: the role and name say what differs)
            c = arm.config["train"]["chaos"]
            # a run planned before train.chaos.weights existed had the one-element chaos arm
            if c.get("weights", "one") == "one":
                perturb(model, c["param"], c["index"], c["ulps"])
            else:
                perturb_every(model, c["ulps"], chaos_seed(self.seed, chaos_number(arm.name)))
        intervention = build(arm.config["intervention"], "intervention")
        # Its own settings (an override's keys set); the chaos arm's EMA starts at its perturbed weights.
        return build_arm(model, arm_train(arm.config, intervention), intervention)

    def arithmetic(self) -> dict:
        # How a step's batch is cut into forward/backward calls changes the summation order.
        amp = {"amp": self.t.amp} if self.t.amp is not None else {}  # the forward's dtype (absent: float32)
        return {"device": self.device.type, "chunk_samples": self.t.chunk_samples, **amp}

    def sentinel(self) -> dict:
        return read_sentinel(conditioning.with_first(self.sentinel_model, self.held_cond), self.device,
                             self.shape)

    def restore(self, u: UnitEntry, stores: dict) -> None:
        """Every arm's weights, buffers and optimizer state as the whole unit `u` stored them."""
        for arm, (path, sha256) in stores.items():
            store = read_train_store(path, sha256)
            if store.meta["arm"] != arm or store.meta["unit_index"] != u["index"]:
                raise StoreError(path, "belongs to another arm or unit than run.json says")
            s = self.arms[arm]
            self.parking.unpark(s)
            with torch.no_grad():
                for name, tensor in s.model.state_dict().items():
                    key = f"weight/{name}" if f"weight/{name}" in store.tensors else f"buffer/{name}"
                    tensor.copy_(store.tensors[key])
            restore_optimizer(s.optimizer, model_names(s.model), store.tensors, store.meta)
            try:
                loop.restore_schedule(s.scheduler, s.optimizer, store.meta.get("schedule"))
                if s.ema is not None:
                    s.ema.restore(store.tensors)
            except (KeyError, ValueError, TypeError) as err:
                raise StoreError(path, f"holds no scheduler or EMA state this arm's settings need "
                                 f"({type(err).__name__}: {err})") from None
            s.step = u["train"]["to_step"]
            self.parking.park(s)
        print(f"twinrun: every arm continues from {u['label']}, read back from its stores", flush=True)

    def begin_unit(self, u: UnitEntry) -> None:
        # This segment's samples and noise, keyed by (seed, step, sample id): the same for every arm.
        a, b = u["train"]["from_step"], u["train"]["to_step"]
        # Drawn at the widest batch any arm takes: an arm's batch is a prefix of it, so the j-th sample of
        # step s and its noise are the same in every arm whatever its batch size (an override's).
        widest = max(loop.step_samples(s.t) for s in self.arms.values())
        seg = draw_segment(self.seed, list(range(a + 1, b + 1)), self.train_ids, widest, self.shape)
        self.segment_ids = [[self.train_ids[p] for p in row] for row in seg.positions.tolist()]
        self.segment = Segment(seg.steps, seg.positions.to(self.device), seg.normal.to(self.device),
                               seg.eps.to(self.device), seg.digest)

    @contextmanager
    def memory_named(self, arm: str, u: UnitEntry):
        """Running out of memory is the device's, never the model's fault: exit 6, naming the knobs."""
        try:
            yield
        except Exception as err:
            if is_out_of_memory(err):
                raise DeviceMemoryError(f"arm {arm}, {u['label']}: {self.device} ran out of memory "
                                        f"({first_line(err)}); park the arms not training "
                                        "(train.offload=cpu or disk), lower train.batch_size or "
                                        "train.chunk_samples (the activations), or train a smaller "
                                        "model") from err
            raise

    def measure(self, u: UnitEntry, arm: str, stamp: dict) -> tuple[dict, dict]:
        """Train this arm through the segment, then its held-out loss; the store's tensors and metadata."""
        s, seg = self.arms[arm], self.segment
        assert s.step == u["train"]["from_step"], (arm, s.step, u["label"])
        self.parking.unpark(s)
        with self.memory_named(arm, u):
            (losses, common), digests, global_steps = as_model_error(arm, u, self._train, s, seg, arm)
            held = as_model_error(arm, u, ts.heldout_losses, s.model, s.intervention, self.held_x,
                                  self.held_normal, self.held_eps, self.chunk, self.objective, self.held_cond)
        loop.check_finite(arm, u, losses, held, s.model, seg.steps)
        s.step = u["train"]["to_step"]
        state = s.model.state_dict()
        params = model_names(s.model).values()
        # Views of the arm's own tensors on the CPU (copies from a GPU): the job writes the store before
        # any arm trains on, so no second copy of the state is ever held.
        tensors = {f"weight/{n}" if n in params else f"buffer/{n}": v.detach().cpu()
                   for n, v in state.items()}
        optim_tensors, optim_meta = optimizer_record(s.optimizer, model_names(s.model))
        # The arm's own training loss, and the same batches' loss under the twin's objective, unweighted:
        # what the report compares across arms (an intervention on the loss weight changes the former).
        tensors.update(optim_tensors, train_loss=losses, heldout_loss=held, train_loss_common=common)
        if s.ema is not None:
            tensors.update(s.ema.record())
        meta = {"arm": arm, "unit_index": u["index"], "from_step": u["train"]["from_step"],
                "to_step": u["train"]["to_step"], "seed": self.seed, "config_hash": stamp["config_hash"],
                "layout": self.layout, "optimizer": optim_meta, "data_digest": seg.digest,
                "heldout_digest": self.heldout_digest, "heldout_ids": self.held_ids, "step_digests": digests,
                "env": stamp["env"], "kernel_path": stamp["kernel_path"]}
        if "data_files" in self.identity:  # the caches the data were read from, each file's sha256
            meta["data_files"] = self.identity["data_files"]
        if s.scheduler is not None:  # (absent without one: a constant-rate store is what it always was)
            meta["schedule"] = loop.schedule_record(s.scheduler)
        self.parking.park(s)  # (the store's tensors above are copies or the parked-from memory, kept alive)
        if global_steps:
            meta["global_generator_steps"] = global_steps
            print(f"twinrun: arm {arm}, {u['label']}: the step drew from torch's global generator at step "
                  f"{global_steps[0]} (train.step._target_={s.t.step.get('_target_')}); it is seeded per "
                  "arm, so those draws pair with no other arm's and the replicate leaves the twin: draw from "
                  "the `noise` twinrun hands the step instead (docs/training.md)", flush=True)
        return tensors, meta

    def _train(self, s: ArmState, seg: Segment, arm: str) -> tuple[tuple, list[list[str]], list[int]]:
        """The segment's steps for one arm: ((its own loss at each step, the same under the twin's
        objective), its weights' digests after each, the steps at which a step of your own drew from
        torch's global generator)."""
        losses, commons, digests, global_steps = [], [], [], []
        batch = loop.step_samples(s.t)
        own = s.step_fn is not loop.twinrun_step
        common_fn = None if s.t.step == self.t.step else loop.build_step(self.t.step)
        with attached(s.intervention, s.model):
            for k, step in enumerate(seg.steps):
                # Step: this step's samples and noise (drawn once for every arm of the segment): the
                # first `batch` of the segment's, so an arm with a smaller batch takes a prefix; each
                # sample is fed its own image's conditioning rows.
                x = self.train_x[seg.positions[k, :batch]]
                sigma = self.objective.train_level(s.model, seg.normal[k, :batch])
                cond = conditioning.take(self.train_cond, seg.positions[k, :batch])
                ids = self.segment_ids[k][:batch]
                # Step: forward, backward and update, a model's own dropout seeded by (seed, step).
                # A step of your own finds the global generator seeded per arm: whatever it draws there
                # pairs with no other arm's, so the replicate catches it (and the store names the step).
                with torch.random.fork_rng(devices=self.rng_devices):
                    seed_generators(dropout_seed(self.seed, step) ^ (loop.arm_salt(arm) if own else 0),
                                    self.rng_devices)
                    before = torch.random.default_generator.get_state() if own else None
                    loss, common = loop.loop_step(s, s.step_fn, x, ids, sigma, seg.eps[k, :batch], self.seed,
                                                  step, common_fn, cond, self.objective)
                    losses.append(loss)
                    commons.append(common)
                    if own and not torch.equal(before, torch.random.default_generator.get_state()):
                        global_steps.append(step)
                # Step: which bits the weights hold now (the first step an arm leaves the twin's).
                digests.append(ts.weight_digests(s.model))
        s.optimizer.zero_grad(set_to_none=True)  # only the arm training now holds gradients
        stacked = [torch.stack(v).float().cpu() if v else torch.zeros(0) for v in (losses, commons)]
        return tuple(stacked), digests, global_steps


def seed_generators(seed: int, cuda_devices: list[int]) -> None:
    """Seed the CPU generator (and the job's GPU's) only: torch.manual_seed would also wake every other
    backend's lazy seeding, a millisecond a step here."""
    torch.random.default_generator.manual_seed(seed)
    for i in cuda_devices:
        torch.cuda.default_generators[i].manual_seed(seed)


TRAIN = Measure(
    name="train",
    settings_key="train",
    unit_noun="segment",
    validate=validate,
    plan=plan,
    protocol_keys=TRAIN_PROTOCOL_KEYS,
    open_session=TrainSession,
    device=lambda config: config["train"]["device"],
    reduce=reduce_train,
    report=write_train_report,
    render=render_train,
    config_keys=("train",),
    sequential_units=True,
    replicate_always=True,
    chaos_arms=lambda cfg: cfg.train.chaos.arms,
    store_format=TRAIN_STORE_FORMAT,
    default_arithmetic=lambda method, device_type: {"device": device_type,  # as TrainSession's
                                                    "chunk_samples": TrainConfig().chunk_samples},
    write_store=write_train_store,
    verify_store=lambda path, sha256=None, payload_bytes=None: read_train_store(path, sha256).meta,
    unit_fields=TrainUnit,
    summary_type=TrainSummary,
    unit_key="step",  # a segment by the step it ends at
    unit_own="to_step",
    tracker_rows=train_rows.tracker_rows,
    tracker_step="step",  # its curves line up with the researcher's own training logs
    sweep_point=train_rows.sweep_point,
    comparison=Comparison(side=train_side, compare=compare_training),  # step by step, not bin by bin
)
