"""Typed schema under the YAML in conf/: a typo'd key fails in Hydra, not deep in a run.

Every dataclass here is registered in Hydra's ConfigStore by `register_configs()` (called by the
entry points, never at import). The YAML files in conf/ select and fill these schemas.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from twinrun.intervention_nodes import schema
from twinrun.interventions import INTERVENTIONS
from twinrun.objectives import OBJECTIVES
from twinrun.objectives import schema as objective_schema
from twinrun.plugins import plugin_interventions, plugin_objectives

# ----------------------------------------------------------------------------- components built
# through one level of `_target_` (model, data, intervention): a user's own config may point
# `_target_` at their own builder; these schemas type-check the built-in options. Each intervention
# class is its own schema (twinrun.interventions.INTERVENTIONS, registered below).


@dataclass
class DiTModelConfig:
    _target_: str = "twinrun.model.load_pretrained"
    # None = the committed weights in twinrun/weights/ (made by `python -m twinrun.train`).
    path: str | None = None


@dataclass
class DigitsDataConfig:
    # scikit-learn's 8x8 digits, held-out split (ships inside the package: no download).
    _target_: str = "twinrun.data.load_heldout_images"


@dataclass
class DigitsTrainDataConfig:
    # The digits' training split (what the committed model was trained on) and held-out split.
    _target_: str = "twinrun.data.load_train_and_heldout"


# ----------------------------------------------------------------------------- plain settings


@dataclass
class CacheDataConfig:
    # A latent cache and an optional conditioning cache (twinrun/caches.py; docs/bring-your-own.md).
    _target_: str = "twinrun.caches.load_cache"
    latents: str = MISSING  # safetensors: `latents` [M, C, H, W], `ids` [M]
    conditioning: str | None = None  # safetensors: `ids` [M] (the latents'), one tensor [M, ...] per entry


@dataclass
class CacheTrainDataConfig:
    # Training's caches: each split's latent cache and optional conditioning cache.
    _target_: str = "twinrun.caches.load_train_cache"
    train_latents: str = MISSING
    heldout_latents: str = MISSING
    train_conditioning: str | None = None
    heldout_conditioning: str | None = None


@dataclass
class ProbeConfig:
    # Images carry the variance here, not draws: on the committed model the twin's mean gradient
    # is small (it sits near its optimum) and varies from image to image, while extra draws of one
    # image barely move it. So the default takes every held-out image (297) and enough draws that
    # no effect of the default run (pin_sigma on the edm6 grid) is below noise: measured
    # (docs/estimator.md), 297 x 8 in 20 folds gives 15 of 15 effects with cos SE ≤ 0.093; 297 x 4
    # leaves one below noise; 8 → 16 draws does not lower the largest SE. A draw costs little
    # beside the run's fixed start-up: 1.6x the CPU time of the old 40 x 12 default.
    n_images: int = 297
    n_draws: int = 8  # noise draws per image and bin
    # Folds are disjoint groups of images; all draws of an image stay in one fold. The store is
    # n_folds x n_params float32 per arm and bin, so n_folds sets disk use linearly. 20 folds leave
    # 19 jackknife degrees of freedom (t_19 = 2.09 vs t_9 = 2.26) and a steadier SE of |μ|², which
    # decides "below noise"; the default run directory stays near 50 MB.
    n_folds: int = 20
    # fnmatch patterns over model.named_parameters() names; the gradient is taken w.r.t. these.
    params: list = field(default_factory=lambda: ["*"])
    # One probe call takes ≤ chunk_images images x ≤ chunk_draws draws (-1 = all): peak memory is set
    # by the chunk, not by n_images x n_draws (120 x 4 = 480 samples a call, 92 MiB of gradients and
    # activations on the default model; the whole run's peak RSS 0.7 GB). At 8 draws, chunks of 4 split
    # the draws where the pairing receipt's halves do (k1 = 4), so the receipt costs no second
    # differentiation: a bin's probe takes 0.75x the time it took in chunks of 6, the receipt +3-4% over
    # the sums alone instead of +29-32% (benchmarks/README.md, "The pairing receipt's price").
    # Chunking changes the arithmetic order, so it is part of the recorded kernel path.
    chunk_images: int = 120
    chunk_draws: int = 4
    # float64 | float32: the dtype the fold sums accumulate in before they are stored as float32. On the
    # device they take 12·n_folds·P bytes in float64 (the accumulator and its float32 copy), 4·n_folds·P
    # in float32: the knob for a large model on a small GPU. It changes the arithmetic (kernel path).
    accumulator_dtype: str = "float64"
    # auto = the GPU when the measuring process has one (a SLURM job's GPU), else the CPU; or cpu, cuda:N.
    device: str = "auto"
    # auto | vmap | folds. vmap batches small folds but needs a vmap rule for every op of the model;
    # folds runs one plain backward per fold chunk (any nn.Module); auto takes vmap when a trial run
    # before the first bin succeeds under it, else folds. The chosen method is in the kernel path.
    method: str = "auto"
    # false | default | max-autotune: torch.compile mode of the model's forward for the probe (folds
    # method only). Caches live in determinism.compile_cache_dir; mode and cache are in the kernel path.
    compile: Any = False
    # false: the probe measures the model in eval mode (model.eval(), and says so when the model was
    # built with train-mode modules): batch statistics would couple a fold's samples, so a store would
    # not be a sum of per-sample gradients, and dropout would draw different masks per arm. true: as
    # built in train mode; modules that couple samples (BatchNorm) are refused at plan time, and random
    # ones (dropout) draw from a stream keyed like the noise, so every arm sees the same masks (folds
    # method only).
    train_mode: bool = False


@dataclass
class ChaosConfig:
    # The chaos arm is the twin with this one weight moved by `ulps` units in the last place
    # (torch.nextafter, towards +inf for ulps > 0): a rounding-sized wobble, whose distance from the
    # twin over the steps is the floor no intervention effect can be read below (docs/training.md).
    param: str = "blocks.0.attn.qkv.weight"  # a name from model.named_parameters()
    index: int = 0  # the element of that parameter, in its flattened (row-major) order
    ulps: int = 1  # how many ulps (± = direction under "one"; > 0 under "every"); 0 is refused
    # Where the ulps land: "every" moves every nonzero element of every parameter by `ulps` ulps, each
    # up or down by a seeded coin (what one nondeterministic reduction of every gradient leaves
    # behind), so the floor is an average over millions of wobbles and its spread per estimand is
    # small; "one" moves the single element `param`[`index`] (the floor of earlier runs, whose reach
    # into a small estimand such as `cond` varies 5x with the seed).
    weights: str = "every"
    # How many chaos arms (each its own coin flips; "every" only): the floor is the largest of them
    # and the replicates', and the reducer reads their spread per estimand (docs/training.md).
    arms: int = 2


@dataclass
class TrainConfig:
    # Twin training runs (measure=train): every arm trains from one start checkpoint on the same
    # sample order and noise draws, segment by segment in one process (docs/training.md).
    steps: int = 40  # optimizer steps of every arm
    # A unit of the run is a segment of this many steps; it must divide `steps` (no ragged last
    # segment). Each segment boundary stores every arm's weights, optimizer state and losses, so a
    # kill loses at most one segment, and the report's curves have one point per segment.
    segment_steps: int = 10
    batch_size: int = 64  # samples per step (drawn without replacement within a step)
    # A step's batch runs forward and backward in chunks of ≤ this many samples, gradients summed
    # (-1 = the whole batch in one call). It changes the arithmetic order (so it joins the kernel
    # path), never which samples or noise a step sees.
    chunk_samples: int = -1
    # The optimizer (config group train/optimizer: adamw, sgd): one level of instantiate with the
    # model's parameters as `params`. Any torch.optim-style class works (its learning rate as `lr`);
    # the rate is constant over the run. Typed Any, not a dict: a dict default would be merged with
    # (and so keep the keys of) whichever optimizer replaces it.
    optimizer: Any = None
    # The trained parameters: fnmatch patterns over model.named_parameters(), the rules of probe.params;
    # every other parameter is frozen (no gradient, not in the optimizer). ['*lora_*'] trains a LoRA
    # adapter alone (docs/models.md); a pattern list matching nothing is refused.
    params: list = field(default_factory=lambda: ["*"])
    # The weights every arm starts from: a safetensors file of the model's parameters; null = the
    # model as its builder returns it (the committed digits denoiser for model=dit_digits).
    start_checkpoint: str | None = None
    heldout_images: int = 297  # held-out images the held-out loss reads (one keyed draw each)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    # An intervention is read as "above the floor" at a step only where its distance from the twin
    # exceeds the chaos arm's by this factor (docs/training.md: the spread of the floor over
    # perturbations measured on this model).
    floor_margin: float = 10.0
    # Which chaos an estimand is read against: "model" (its own floor or the whole model's, every trained
    # weight's, whichever sets the higher bar, floor x margin), so an effect smaller than the wobble the
    # run carries through the model is never called one because it landed where chaos had not reached
    # yet (`cond` at step 40); "estimand" (its own floor alone: what this run's chaos did there by this
    # step; docs/training.md).
    floor_scope: str = "model"
    device: str = "auto"  # auto | cpu | cuda[:N], as probe.device
    # What a real loop has (twinrun/measures/train_loop.py; docs/training.md), each the arm's own setting
    # (an override may set it). The learning-rate schedule: config group train/schedule (constant: none;
    # warmup_cosine, linear, or any torch.optim.lr_scheduler class by _target_), stepped after every
    # optimizer step. Typed Any for the reason `optimizer` is.
    schedule: Any = None
    clip_norm: float | None = None  # clip the gradients' total 2-norm to this before each update (null: none)
    # Micro-batches of `batch_size` per optimizer step, their gradients summed (one update over
    # batch_size x accumulate samples, each its own forward: batch statistics are a micro-batch's).
    accumulate: int = 1
    # null (float32) | bf16 | fp16: the forward under autocast (CPU too); in the kernel path. fp16 scales the
    # loss with a GradScaler of the arm's own, its state stored with every segment and restored on resume.
    amp: str | None = None
    ema: float | None = None  # decay of an EMA of the weights, stored beside them (null: none)
    # Your own step (train.step._target_: a function of (model, batch, noise, step) returning the
    # per-sample losses); null = twinrun's objective (twinrun/measures/train_step.py).
    step: Any = None
    # Where the arms not being trained wait (twinrun/measures/train_offload.py): none (every arm resident on
    # the device), cpu (host memory), disk (a file each): one arm's memory on the device.
    offload: str = "none"
    # false | default | max-autotune: torch.compile mode of every arm's model in its step and held-out loss
    # (static shapes, all compiled before the first segment); the run's own caches, as probe.compile's,
    # and in the kernel path, so it is no intervention (an override of it is refused).
    compile: Any = False


@dataclass
class SigmaGridConfig:
    # Noising σ of each bin, strictly increasing and positive.
    sigmas: list = field(default_factory=lambda: [0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.2, 2.0])


# The rules of the registered analysis, held when a config is planned (twinrun.plan) and again when
# run.json reads it back (twinrun.storage.records): the no-op gate rules the reducer knows
# (twinrun.analysis.gates) and the open interval of the test of signal's level.
GATE_RULES = ("replicate", "bit_identical")
SIGNAL_ALPHA_RANGE = (0.0, 0.5)  # exclusive: α ≥ 0.5 would call a norm² below its SE a signal
SIGNAL_ALPHA_TEXT = f"in ({SIGNAL_ALPHA_RANGE[0]:g}, {SIGNAL_ALPHA_RANGE[1]:g})"


def signal_alpha_ok(alpha) -> bool:
    low, high = SIGNAL_ALPHA_RANGE
    return isinstance(alpha, int | float) and not isinstance(alpha, bool) and low < alpha < high


@dataclass
class ReduceConfig:
    # Registered at plan time (run.json "registered"): `python -m twinrun.reduce` with other
    # settings writes a labelled post-hoc view under RUN/views/, never over the registered report.
    # Linear views of the stored sums, from the registry in twinrun/estimands.py: all (every
    # probed parameter), cond (the conditioning pathway), residual (each bin minus the twin's mean
    # over bins: shared structure removed).
    estimands: list = field(default_factory=lambda: ["all", "cond", "residual"])
    # Named parameter groups, each an estimand of its own: {name: [fnmatch patterns over parameter
    # names]}, e.g. 'reduce.groups={block0:[blocks.0.*]}' reduce.estimands=[all,cond,residual,block0].
    # Checked at plan time (a group matching no probed parameter is refused). Typed Any, not a dict:
    # Hydra merges an override into an existing (struct) dict, which would refuse every new name.
    groups: Any = None
    # No-op gate, at each bin where the intervention claims to do nothing:
    #   replicate      pass if bit-identical to the twin; if not, FAIL unless the twin's replicates
    #                  (measured automatically; arms.replicates) prove the kernel path nondeterministic
    #                  and the arms' max relative difference is within the bound of the replicates'
    #                  spread (docs/estimator.md, "The gate on a nondeterministic path").
    #   bit_identical  pass only if bit-identical (a nondeterministic path fails every gate).
    # Within one process on one deterministic kernel path a true no-op is bit-identical: "close"
    # is not a no-op, so there is no cosine threshold.
    gate_rule: str = "replicate"
    # Test of signal: a debiased norm² counts only if norm²/SE > the one-sided t_{F-1} quantile at
    # this level; otherwise "below noise" and no cosine or ratio is printed (docs/estimator.md).
    signal_alpha: float = 0.05
    # Family-wise reading: Holm over the effect rows' tests of "no effect" at this level, in (0, 0.5); the
    # report and summary.json say whether the run shows any effect at all (docs/estimator.md).
    family_alpha: float = 0.05


@dataclass
class LauncherConfig:
    # local: in this process | submitit_local: submitit's local executor (the same pickled job
    # SLURM runs) | slurm: one SLURM job per pair (a job array for a sweep), both arms inside.
    name: str = "local"
    wait: bool = True  # false: return after submission; `python -m twinrun.status RUN_DIR` later
    # pair: one job per run (every bin in one process) | bins: one job per bin, as a job array (both
    # arms of a bin in one process); pin the GPU type with `constraint` (docs/slurm.md).
    split: str = "pair"
    # Twin runs (sweep points, seeds) per SLURM job: 1 = a job each; N > 1 = N runs in one job on one
    # node, one process per run (each pair still one process), each given one GPU by
    # CUDA_VISIBLE_DEVICES; ask for gpus_per_node = N (or 0 on CPUs). A requeue requeues the pack.
    pack: int = 1
    # SLURM knobs (submitit's names; units in the names). None = the cluster's default.
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    timeout_min: int = 240
    nodes: int = 1  # the twin pair runs in one process: more nodes would only idle
    # Per run (a pack's job asks for pack × each). None (launcher=slurm's default): read from the partition
    # (sinfo): gpus_per_node 1 where its nodes have GPUs (pack where packed), else 0; cpus_per_task
    # DEFAULT_CPUS_PER_RUN, or the largest node's CPUs / pack if fewer.
    gpus_per_node: int | None = 1  # 0 allowed (CPU-only partitions)
    cpus_per_task: int | None = 4
    mem_gb: float | None = None
    # USR2 this long before the time limit: the job checkpoints and requeues itself.
    signal_delay_s: int = 120
    # Requeues allowed on time limits (preemptions do not count): a long probe finishes across
    # several limits; each resume skips finished bins.
    max_num_timeout: int = 10
    array_parallelism: int = 32
    additional_parameters: dict = field(default_factory=dict)  # extra sbatch options
    setup: list = field(default_factory=list)  # shell lines run before the job (module load …)
    # submitit's pickles and logs, relative to the run (or sweep) directory.
    folder: str = "submitit"
    poll_s: float = 2.0  # how often waiting reads the run directory


@dataclass
class TrackerConfig:
    # none | mlflow | wandb | tensorboard: the publish step also logs each reduced run there (the run
    # directory stays the record; a sink that fails is one line and loses nothing). Outside the config
    # hash, like the launcher: adding a tracker to a run never refuses its resume.
    name: str = "none"
    # The tracker's local store (MLflow's SQLite file and artifacts, W&B's offline runs, TensorBoard's
    # event files); null = outputs/<name> under the directory the command ran in.
    dir: str | None = None
    project: str = "twinrun"  # MLflow experiment, W&B project, TensorBoard's top folder


@dataclass
class DeterminismConfig:
    # Pins results *within* one kernel path (deterministic algorithms, cuDNN benchmark off,
    # CUBLAS_WORKSPACE_CONFIG, explicit fp32 matmul precision, no TF32 in cuDNN). It cannot choose
    # which path a fresh environment takes: the twin, not this switch, is the control for that.
    enabled: bool = True
    float32_matmul_precision: str = "highest"  # highest | high | medium (TF32 / bf16 matmuls)
    # Durable home for torch.compile caches (Inductor/Triton default to /tmp and vanish on
    # reboot, taking autotune winners with them). null = ~/.cache/twinrun/compile.
    compile_cache_dir: str | None = None
    # A compiled run whose compile bundle this run replays (loaded before the first compile; a
    # certificate in run.json says whether any kernel was still chosen here). null: none, unless
    # `reference` names a run that saved one (docs/kernel-paths.md, "Pinning a kernel path").
    kernel_path_from: str | None = None
    # Load a replayed run's compile bundle although no job of yours wrote it on this machine: a bundle
    # is code (Inductor's cache entries are pickles), so this vouches for whoever wrote that run.
    trust_bundle: bool = False
    # Run the cold-against-warm control in the job (`python -m twinrun.env --cold-check` with the job's
    # compile mode and determinism): the sentinel with the default model compiled twice in fresh
    # processes, cold and from the cold compile's bundle; run.json's job record says whether the two
    # were bit-identical. A compiled run only; it costs two compiles.
    cold_check: bool = False


@dataclass
class ArmsConfig:
    # Measure the native twin a second time in the same job: the within-environment determinism
    # control (the reducer reports "k / N bins differ", the max difference and the cosine).
    replicate: bool = False
    # How many replicates of the twin a run measures where it measures them (training always; the probe
    # at its gate bins, and at every bin with arms.replicate): on a nondeterministic path the gate is a
    # bound on the spread of their distances from the twin (twinrun/analysis/gates.py). null = 1 with
    # determinism.enabled (a bit-identical replicate decides), REPLICATES_NONDETERMINISTIC without.
    # Recorded in the arms' configs only when set, so runs planned before it keep their config hashes.
    replicates: int | None = None
    # The cheaper protocol of a run whose units continue each other (training): the replicates are
    # measured for the first K segments only. Allowed with determinism.enabled only, and only while they
    # stay bit-identical to the twin there (the job stops, exit 1, at the first step one leaves it).
    # null: every segment (the default). Recorded in the arms' configs only when set.
    replicate_segments: int | None = None


# The replicates a run measures with determinism off and arms.replicates unset: the smallest count whose
# gate catches, at one row of a five-row run, a leak of 2.75× the path's wobble (norms) at 90 % power
# (docs/estimator.md's table; 3 replicates need 6.25×), for 3/5 of a training run's cost more (eight arms
# for five).
REPLICATES_NONDETERMINISTIC = 4
MAX_REPLICATES = 16


def replicate_count(cfg) -> int:
    """arms.replicates as a number: the one set, or the default for this determinism setting."""
    n = cfg.arms.get("replicates")
    if n is None:
        return 1 if cfg.determinism.enabled else REPLICATES_NONDETERMINISTIC
    return n


@dataclass
class SampleConfig:
    # Twin sampling (measure=sample, docs/sampling.md): every arm generates the same samples from the same
    # keyed initial noise and per-step sampler noise; a unit is a chunk of samples, so a kill resumes
    # bit-identically at the first chunk not stored.
    n_samples: int = 32  # samples per arm; the paired SEs are over these
    chunk_samples: int = 8  # samples per unit (one store per arm and chunk); must divide n_samples
    # heun (2nd order) | euler; s_churn > 0 (edm) makes either stochastic. Under objective=vp euler is DDIM
    # (eta > 0: its stochastic variant) and heun DDIM with Heun's correction.
    sampler: str = "heun"
    steps: int = 18  # sampler steps (EDM's schedule: σ_max … σ_min, then 0; vp: timesteps from T − 1 down)
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0  # the schedule's curvature (EDM: 7)
    # EDM's stochastic sampler (Karras et al. 2022, Algorithm 2): noise is added back at steps with σ in
    # [s_tmin, s_tmax], drawn per sample and step from keyed streams (the same in every arm).
    # 0: the deterministic sampler.
    s_churn: float = 0.0
    s_tmin: float = 0.0
    s_tmax: float = 1.0e9
    s_noise: float = 1.0
    # DDIM's η (objective=vp, sampler=euler): 0 the deterministic DDIM, 1 DDPM's posterior variance; the
    # noise it adds is drawn per sample and step from the same keyed streams as EDM's s_churn.
    eta: float = 0.0
    # The held-out denoising loss of each sample: the native model's loss under the run's objective on it
    # at these levels (σ; t under flow; timesteps under vp), on keyed noise (the same for every arm): how
    # far a sample sits from what the twin's model calls data.
    loss_sigmas: list[float] = field(default_factory=lambda: [0.2, 0.5, 1.2])
    # The distribution distance (MMD² between the arms' samples, paired over samples) reads features:
    # null = a fixed random-feature map of this many cosines (seeded), or a `_target_` feature net
    # (a torch.nn.Module mapping [B, C, H, W] to [B, F]; its builder must be trusted as the model's is).
    features: Any = None
    random_features: int = 256
    feature_bandwidth: float = 8.0  # the random features' RBF length scale, in pixel-vector units
    device: str = "auto"  # as probe.device


PLUGIN_NODE = "plugin"  # TwinrunConfig's node for a plugin kind's settings (only its own arms carry it)


@dataclass
class TwinrunConfig:
    # The measurement kind (twinrun/measures: MEASURES): probe = per-fold gradient sums at each σ bin;
    # train = twin training runs, segment by segment (docs/training.md).
    measure: str = "probe"
    model: Any = MISSING
    data: Any = MISSING
    intervention: Any = MISSING
    # The diffusion objective (twinrun/objectives.py, docs/objectives.md): edm | flow | vp | your own.
    objective: Any = MISSING
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # measure=train's settings
    sample: SampleConfig = field(default_factory=SampleConfig)  # measure=sample's settings
    # A plugin kind's own settings (twinrun/plugins.py), free-form: the kind checks them itself.
    plugin: Any = field(default_factory=dict)
    sigma_grid: SigmaGridConfig = field(default_factory=SigmaGridConfig)
    reduce: ReduceConfig = field(default_factory=ReduceConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    arms: ArmsConfig = field(default_factory=ArmsConfig)
    # An earlier run's directory whose native twin is this run's reference (same protocol). The
    # reducer checks whether it is alive in this environment before showing anything against it.
    reference: str | None = None
    # One seed for every random stream (draws are keyed by (seed, bin σ, image, draw)).
    seed: int = 0


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="twinrun_schema", node=TwinrunConfig)
    cs.store(group="schema/model", name="dit", node=DiTModelConfig)
    cs.store(group="schema/data", name="digits", node=DigitsDataConfig)
    for cls in INTERVENTIONS:
        cs.store(group="schema/intervention", name=cls.name, node=schema(cls))
    for cls in OBJECTIVES.values():
        cs.store(group="schema/objective", name=cls.name, node=objective_schema(cls))
    # An installed package's interventions (entry point group twinrun.interventions): selected by name
    # like a built-in, `intervention=NAME`, their schema straight from the class (no YAML needed).
    for name, cls in plugin_interventions(INTERVENTIONS).items():
        cs.store(group="schema/intervention", name=name, node=schema(cls))
        cs.store(group="intervention", name=name, node=schema(cls))
    # ... and objectives (group twinrun.objectives): `objective=NAME`, the schema from the class.
    for name, cls in plugin_objectives(OBJECTIVES).items():
        cs.store(group="schema/objective", name=name, node=objective_schema(cls))
        cs.store(group="objective", name=name, node=objective_schema(cls))
    cs.store(group="schema/probe", name="probe", node=ProbeConfig)
    cs.store(group="schema/sigma_grid", name="sigma_grid", node=SigmaGridConfig)
    cs.store(group="schema/train", name="train", node=TrainConfig)
    cs.store(group="schema/sample", name="sample", node=SampleConfig)
    cs.store(group="schema/data", name="digits_train", node=DigitsTrainDataConfig)
    cs.store(group="schema/data", name="cache", node=CacheDataConfig)
    cs.store(group="schema/data", name="cache_train", node=CacheTrainDataConfig)
    cs.store(group="schema/launcher", name="launcher", node=LauncherConfig)
    cs.store(group="schema/tracker", name="tracker", node=TrackerConfig)
