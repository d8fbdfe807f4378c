"""The training run in one job (`measure=train`'s session): every arm's model and optimizer on the job's
device, each segment's samples and noise drawn once and consumed by every arm, the stores' tensors and
metadata, and a resume's restore from the last whole segment. docs/training.md.
"""

import copy
import json
from contextlib import contextmanager

import torch

from twinrun import caches, conditioning
from twinrun.arms import chaos_number
from twinrun.config import TrainConfig
from twinrun.errors import EXIT_GATE, DeviceMemoryError, StoreError, TwinrunError
from twinrun.instantiate import build, objective_of, typed
from twinrun.interventions import attached
from twinrun.measures import train_loop as loop
from twinrun.measures import train_step as ts
from twinrun.measures import trial
from twinrun.measures.failures import as_model_error, first_line, is_out_of_memory
from twinrun.measures.train_offload import Parking
from twinrun.measures.train_override import arm_train
from twinrun.measures.train_state import (
    ArmState,
    build_arm,
    build_start,
    chaos_seed,
    model_names,
    optimizer_record,
    perturb,
    perturb_every,
    restore_optimizer,
    weight_layout,
)
from twinrun.measures.train_streams import Segment, draw_segment, dropout_seed, heldout_draws
from twinrun.measures.train_validate import split_data
from twinrun.provenance.record import model_sha256, read_sentinel, tensors_sha256
from twinrun.storage.records import UnitEntry
from twinrun.storage.train_store import read_train_store


class TrainSession:
    """The training run in one job: every arm's model and optimizer on this job's device, the held-out
    draws (drawn once), and each segment's samples and noise (drawn once, consumed by every arm)."""

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
        # arms.replicate_segments: each replicate held to the twin's bits where it is measured
        self.replicate_segments = (config.get("arms") or {}).get("replicate_segments")
        self.replicates = {a.name for a in arms if a.role == "replicate"}
        self.twin = next(a.name for a in arms if a.role == "twin")
        self.twin_digests: list | None = None
        # train.compile: every arm's step calls its compiled module, and every shape a segment runs is
        # compiled now, before the job reads its fingerprint: the cache digest it records is the one a
        # resume finds (no compile lands mid-run).
        self.compile_mode = trial.compile_mode(self.t.compile, "train.compile")
        if self.compile_mode is not None:
            for s in self.arms.values():
                s.forward = loop.compiled(s.model, self.compile_mode)
            self._warm_up(start, arms)

    def _warm_up(self, start: torch.nn.Module, arms: list) -> None:
        """One step and one held-out pass of a throwaway copy of each distinct arm (its settings and
        intervention), compiled, on a segment's shapes: the arms' own compiled modules then reuse these
        graphs (dynamo guards on the module's type and tensors' shapes, not on which module it is)."""
        tried = set()
        gen = torch.Generator().manual_seed(trial.TRIAL_SEED)
        common_fn = self.t.step
        for a in arms:
            s = self.arms[a.name]
            key = json.dumps([a.config["intervention"], loop.step_samples(s.t), s.t.batch_size,
                              s.t.chunk_samples, s.t.step], sort_keys=True, default=str)
            if key in tried:  # the replicate and the chaos arm run the twin's code on the twin's shapes
                continue
            tried.add(key)
            w = build_arm(start, arm_train(a.config, s.intervention), s.intervention)
            w.forward = loop.compiled(w.model, self.compile_mode)
            n = loop.step_samples(w.t)
            normal = torch.randn(n, generator=gen).to(self.device)
            eps = torch.randn((n, *self.shape), generator=gen).to(self.device)
            with torch.random.fork_rng(devices=self.rng_devices), attached(w.intervention, w.model):
                sigma = self.objective.train_level(w.model, normal)
                loop.loop_step(w, w.step_fn, self.train_x[:n], self.train_ids[:n], sigma, eps, self.seed, 0,
                               None if w.t.step == common_fn else loop.build_step(common_fn),
                               conditioning.take(self.train_cond, slice(0, n)), self.objective)
            ts.heldout_losses(w.forward, w.intervention, self.held_x, self.held_normal, self.held_eps,
                              self.chunk, self.objective, self.held_cond)
            del w

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
        # The copy above is the arm's own: a second deep copy cost 30 ms an arm on the committed model.
        return build_arm(model, arm_train(arm.config, intervention), intervention, own=True)

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
                loop.restore_scaler(s.scaler, store.meta.get("grad_scaler"))
                if s.ema is not None:
                    s.ema.restore(store.tensors)
            except (KeyError, ValueError, TypeError) as err:
                raise StoreError(path, f"holds no scheduler, EMA or grad scaler state this arm's settings "
                                 f"need "
                                 f"({type(err).__name__}: {err})") from None
            s.step = u["train"]["to_step"]
            self.parking.park(s)
        print(f"twinrun: every arm continues from {u['label']}, read back from its stores", flush=True)

    def begin_unit(self, u: UnitEntry) -> None:
        # An arm this unit does not measure is never measured again (units only go forward): its memory goes.
        for gone in [name for name in self.arms if name not in u["stores"]]:
            self.parking.drop(self.arms.pop(gone))
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
            versions = ts.weight_versions(s.model)
            forward = s.model if s.forward is None else s.forward  # its compiled module (train.compile)
            held = as_model_error(arm, u, ts.heldout_losses, forward, s.intervention, self.held_x,
                                  self.held_normal, self.held_eps, self.chunk, self.objective, self.held_cond)
            if digests:  # (the start unit has no step: its store's own digests are read there)
                digests[-1] = ts.rehash_written(s.model, versions, digests[-1])
        loop.check_finite(arm, u, losses, held, s.model, seg.steps)
        self.hold_replicate(arm, u, digests)
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
        if s.scaler is not None:  # fp16's loss scale and growth tracker (absent without one)
            meta["grad_scaler"] = loop.scaler_record(s.scaler)
        self.parking.park(s)  # (the store's tensors above are copies or the parked-from memory, kept alive)
        if global_steps:
            meta["global_generator_steps"] = global_steps
            print(f"twinrun: arm {arm}, {u['label']}: the step drew from torch's global generator at step "
                  f"{global_steps[0]} (train.step._target_={s.t.step.get('_target_')}); it is seeded per "
                  "arm, so those draws pair with no other arm's and the replicate leaves the twin: draw from "
                  "the `noise` twinrun hands the step instead (docs/training.md)", flush=True)
        return tensors, meta

    def hold_replicate(self, arm: str, u: UnitEntry, digests: list) -> None:
        """With arms.replicate_segments, a replicate must repeat the twin's bits at every step it is measured
        (the twin trains first in every unit): the first step one leaves them stops the run, exit 1."""
        if arm == self.twin:
            self.twin_digests = digests
        if self.replicate_segments is None or arm not in self.replicates or digests == self.twin_digests:
            return
        pairs = enumerate(zip(digests, self.twin_digests, strict=True))
        step = next(u["train"]["from_step"] + k + 1 for k, (a, b) in pairs if a != b)
        raise ReplicateLeft(f"arm {arm}, {u['label']}: the replicate left the twin's bits at step {step}, so "
                            f"this kernel path does not repeat and arms.replicate_segments="
                            f"{self.replicate_segments} (the replicate measured in the first segments only) "
                            "is not honest here; earlier segments are kept: start a new run without it (the "
                            "replicate in every segment)")

    def _train(self, s: ArmState, seg: Segment, arm: str) -> tuple[tuple, list[list[str]], list[int]]:
        """The segment's steps for one arm: ((its own loss at each step, the same under the twin's
        objective), its weights' digests after each, the steps at which a step of your own drew from
        torch's global generator)."""
        losses, commons, global_steps = [], [], []
        batch = loop.step_samples(s.t)
        own = s.step_fn is not loop.twinrun_step
        common_fn = None if s.t.step == self.t.step else loop.build_step(self.t.step)
        meanwhile = ts.DigestsMeanwhile(s.model, meanwhile=not own)
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
                                                  step, common_fn, cond, self.objective, meanwhile.wait)
                    losses.append(loss)
                    commons.append(common)
                    if own and not torch.equal(before, torch.random.default_generator.get_state()):
                        global_steps.append(step)
                # Step: which bits the weights hold now (the first step an arm leaves the twin's), hashed
                # while the next step's forward and backward run.
                meanwhile.after_step()
            digests = meanwhile.finish()
        s.optimizer.zero_grad(set_to_none=True)  # only the arm training now holds gradients
        stacked = [torch.stack(v).float().cpu() if v else torch.zeros(0) for v in (losses, commons)]
        return tuple(stacked), digests, global_steps


class ReplicateLeft(TwinrunError):
    """arms.replicate_segments on a path that did not repeat: the cheaper protocol's premise failed."""

    exit_code = EXIT_GATE


def seed_generators(seed: int, cuda_devices: list[int]) -> None:
    """Seed the CPU generator (and the job's GPU's) only: torch.manual_seed would also wake every other
    backend's lazy seeding, a millisecond a step here."""
    torch.random.default_generator.manual_seed(seed)
    for i in cuda_devices:
        torch.cuda.default_generators[i].manual_seed(seed)
