"""The chaos floor per estimand across seeds, measured: the figures of docs/training.md's margin table.

    python benchmarks/train_floor_seeds.py [--seeds 0 1 2 3] [--chaos-arms 4] [--steps 40]
    python benchmarks/train_floor_seeds.py --smoke    # 2 steps on a tiny batch: seconds (a test runs it)

Per seed, trains in one session as a twin run does the native twin, the one-ulp-in-one-weight chaos arm
(train.chaos.weights=one, the earlier floor), --chaos-arms arms with one ulp in every weight
(train.chaos.weights=every, each its own coins) and scale_lr arms at 1.0001, 1.001 and 1.1; at the last
step prints per estimand (all, cond) each chaos arm's relative distance from the twin, the spread of the
every-weight arms (max/min) and each scale_lr arm's distance in floors of each kind. Nothing is stored.
"""

import argparse
import os
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from twinrun.analysis.train_effects import effect_rows
from twinrun.analysis.train_reduce import pair_stats, selections
from twinrun.app import CONF_DIR
from twinrun.arms import Arm, chaos_name
from twinrun.config import TrainConfig, register_configs
from twinrun.instantiate import typed
from twinrun.measures.train import TrainSession, plan_units
from twinrun.provenance.record import setup_determinism

FACTORS = [1.0001, 1.001, 1.1]
ESTIMANDS = ["all", "cond"]


def arms_of(cfg, n_every: int) -> list[Arm]:
    base = OmegaConf.to_container(cfg, resolve=True)
    twin = {**base, "intervention": {"_target_": "twinrun.interventions.Native"}}
    one = {**twin, "train": {**twin["train"], "chaos": {**twin["train"]["chaos"], "weights": "one"}}}
    every = {**twin, "train": {**twin["train"], "chaos": {**twin["train"]["chaos"], "weights": "every"}}}
    arms = [Arm("native", twin, "twin"), Arm("chaos one", one, "chaos")]
    arms += [Arm(chaos_name(k), every, "chaos") for k in range(1, n_every + 1)]
    lr = "twinrun.interventions.ScaleLR"
    arms += [Arm(f"scale_lr {f:g}", {**base, "intervention": {"_target_": lr, "factor": f}}, "intervention")
             for f in FACTORS]
    return arms


def one_seed(seed: int, a) -> None:
    small = ["train.batch_size=8", "train.heldout_images=8"] if a.smoke else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+experiment=train_scale_lr", f"seed={seed}", f"train.steps={a.steps}",
            f"train.segment_steps={a.steps}", *small])
    arms = arms_of(cfg, a.chaos_arms)
    config = arms[0].config
    setup_determinism(config)
    session = TrainSession(config, arms, torch.device("cpu"))
    stamp = {"config_hash": "-", "env": {}, "kernel_path": {}}
    weights = {}
    for u in plan_units(typed(TrainConfig, config["train"], "train")):
        u = {**u, "stores": {arm.name: None for arm in arms}}  # every arm measured in every segment
        session.begin_unit(u)
        for arm in arms:
            tensors, _ = session.measure(u, arm.name, stamp)
            weights[u["index"], arm.name] = {k.removeprefix("weight/"): v.clone() for k, v in tensors.items()
                                             if k.startswith("weight/")}
    last = max(i for i, _ in weights)
    sel = selections(session.layout, ESTIMANDS, {})
    start, twin = weights[0, "native"], weights[last, "native"]
    found = {(1, arm.name, name): pair_stats(weights[last, arm.name], twin, start, sel[name])
             for arm in arms[1:] for name in ESTIMANDS}
    for name in ESTIMANDS:
        d = {arm.name: found[1, arm.name, name]["distance"] for arm in arms[1:]}
        every = [d[chaos_name(k)] for k in range(1, a.chaos_arms + 1)]
        lo, hi = min(every), max(every)
        lr = {f: d[f"scale_lr {f:g}"] for f in FACTORS}
        ratios = "  ".join(f"×{f:g}: {lr[f]:.3e} = {lr[f] / d['chaos one']:.3g} one / {lr[f] / hi:.3g} every"
                           for f in FACTORS)
        listed = ", ".join(f"{x:.3e}" for x in every)
        spread = hi / lo if lo > 0 else float("inf")
        print(f"seed {seed}  {name:>4}  one {d['chaos one']:.3e}  every {listed} (max/min {spread:.2f})  "
              f"{ratios}", flush=True)
    # The reducer's reading at the defaults (the first train.chaos.arms every-weight arms), per scope.
    for scope in SCOPES:
        print(f"seed {seed}  floor_scope={scope:<8}  " + "  ".join(
            f"{e['estimand']} ×{f:g} {e['floor_ratio']:.3g}/{e['margin']:.3g} "
            f"{'A' if e['above_floor'] else 'c'}"
            for f in FACTORS for e in read(found, f, scope, cfg, a.chaos_arms)), flush=True)


SCOPES = ("estimand", "model")


def read(found: dict, factor: float, scope: str, cfg, n_arms: int) -> list[dict]:
    """effect_rows over one stored step, the scale_lr arm at `factor` as the intervention."""
    chaos = [chaos_name(k) for k in range(1, min(n_arms, cfg.train.chaos.arms) + 1)]
    run = SimpleNamespace(roles={"intervention": f"scale_lr {factor:g}"}, margin=cfg.train.floor_margin,
                          floor_scope=scope, all_of=lambda role: chaos if role == "chaos" else [])
    return effect_rows(run, [{}, {"native": {"to_step": cfg.train.steps}}], found, ESTIMANDS)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--chaos-arms", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="2 steps, batch 8, one seed: every line once")
    a = p.parse_args()
    if a.smoke:
        a.steps, a.seeds, a.chaos_arms = 2, a.seeds[:1], 2
    register_configs()
    print(f"train_floor_seeds: torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}; {a.steps} steps, {a.chaos_arms} every-weight chaos arms", flush=True)
    for seed in a.seeds:
        one_seed(seed, a)


if __name__ == "__main__":
    main()
