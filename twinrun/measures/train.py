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

import json
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig

from twinrun import conditioning, objectives
from twinrun.analysis.estimands import check_estimands, declared_groups
from twinrun.analysis.train_compare import compare_training, train_side
from twinrun.analysis.train_reduce import reduce_train
from twinrun.config import TrainConfig
from twinrun.errors import ConfigError, TwinrunError
from twinrun.files import memory_bytes
from twinrun.instantiate import build, objective_of, typed
from twinrun.interventions import Intervention, attached
from twinrun.measures import train_loop as loop
from twinrun.measures import train_step as ts
from twinrun.measures import trial
from twinrun.measures.failures import failing_frame, first_line
from twinrun.measures.kind import Comparison, Measure, Plan
from twinrun.measures.train_offload import layout_line
from twinrun.measures.train_override import arm_train
from twinrun.measures.train_session import TrainSession
from twinrun.measures.train_state import build_arm, build_start, check_chaos, weight_layout
from twinrun.measures.train_validate import validate
from twinrun.publish import train_rows
from twinrun.publish.train_report import render_train, write_train_report
from twinrun.storage.records import TrainUnit
from twinrun.storage.train_records import TrainSummary
from twinrun.storage.train_store import TRAIN_STORE_FORMAT, read_train_store, write_train_store

# What two training runs must share to have trained on the same thing (a comparison's check).
TRAIN_PROTOCOL_KEYS = ("data", "seed", "train.steps", "train.segment_steps", "train.batch_size",
                       "train.heldout_images")



def store_name(unit_index: int, to_step: int) -> str:
    """The start unit's store, or a segment's: named by the step it holds."""
    return f"seg{unit_index:03d}_step{to_step:06d}.safetensors" if unit_index else "step000000.safetensors"


def unit_label(unit_index: int, from_step: int, to_step: int) -> str:
    return "start (step 0)" if unit_index == 0 else f"segment {unit_index} (steps {from_step + 1}–{to_step})"


# ----------------------------------------------------------------------------- plan


def plan_units(t: TrainConfig, replicate_segments: int | None = None, replicates: tuple = ()) -> list[dict]:
    """The start unit (every arm's weights before training) and one unit per segment; with
    arms.replicate_segments=K the `replicates` are not measured in the segments after the K-th."""
    k = t.segment_steps
    bounds = [(0, 0)] + [((i - 1) * k, i * k) for i in range(1, t.steps // k + 1)]
    cut = len(bounds) if replicate_segments is None else replicate_segments
    return [{"index": i, "label": unit_label(i, a, b), "gate": False, "train": {"from_step": a, "to_step": b},
             "file": store_name(i, b), **({"without": list(replicates)} if i > cut else {})}
            for i, (a, b) in enumerate(bounds)]


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
    k = cfg.arms.get("replicate_segments")
    units = plan_units(t, k, tuple(a.name for a in arms if a.role == "replicate"))
    if k is not None:
        print(f"twinrun: arms.replicate_segments={k}: the replicate is measured in the first {k} of "
              f"{len(units) - 1} segments only, and must stay bit-identical to the twin there", flush=True)
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
    compiles=lambda config: trial.compile_mode(config["train"].get("compile"), "train.compile") is not None,
    compile_setting=lambda config: ("train.compile", config["train"].get("compile")),
)
