"""The chaos floor of the digits denoiser, measured: the figures of docs/training.md.

    python benchmarks/train_floor.py [--steps 400] [--segment 20] [--threads 1]
    python benchmarks/train_floor.py --smoke    # 4 steps on a tiny batch: seconds (a test runs it)

Trains, in one session as a twin run does, the native twin, several chaos arms (one ulp in one weight
each, different weights) and scale_lr arms of shrinking effect, and prints per stored step each arm's
relative distance from the twin, |θ_arm − θ_twin| / |θ_twin − θ_start|: how a rounding-sized wobble
grows with the steps, how far apart different one-ulp wobbles land (what train.floor_margin must
cover), and at which effect size an intervention can no longer be told from chaos. Nothing is stored.
"""

import argparse
import math
import os
import statistics

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from twinrun.app import CONF_DIR
from twinrun.arms import Arm
from twinrun.config import TrainConfig, register_configs
from twinrun.instantiate import typed
from twinrun.measures.train import TrainSession, plan_units
from twinrun.provenance.record import setup_determinism

# One ulp in one element each: weights at every depth and in both pathways (attention, MLP, conditioning).
CHAOS = [("blocks.0.attn.qkv.weight", 0), ("blocks.2.mlp.fc2.weight", 100), ("cond_embed.fc1.weight", 5),
         ("final.linear.weight", 7), ("pos_embed", 3), ("blocks.1.adaln.linear.weight", 1000)]
FACTORS = [2.0, 1.1, 1.01, 1.001]


def arms_of(cfg) -> list[Arm]:
    base = OmegaConf.to_container(cfg, resolve=True)
    twin = {**base, "intervention": {"_target_": "twinrun.interventions.Native"}}
    arms = [Arm("native", twin, "twin")]
    for param, index in CHAOS:
        chaos = {**twin, "train": {**twin["train"], "chaos": {"param": param, "index": index, "ulps": 1}}}
        arms.append(Arm(f"chaos {param}[{index}]", chaos, "chaos"))
    for factor in FACTORS:
        arms.append(Arm(f"scale_lr {factor:g}", {**base, "intervention": {
            "_target_": "twinrun.interventions.ScaleLR", "factor": factor}}, "intervention"))
    return arms


def norm(a: dict, b: dict) -> float:
    return math.sqrt(sum(float((a[n].double() - b[n].double()).square().sum()) for n in a))


def distance(theta: dict, twin: dict, start: dict) -> float:
    den = norm(twin, start)
    return norm(theta, twin) / den if den > 0 else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--segment", type=int, default=20)
    p.add_argument("--determinism", choices=("on", "off"), default="on")
    p.add_argument("--smoke", action="store_true", help="4 steps, batch 8: every line once, no figure")
    a = p.parse_args()
    small = ["train.batch_size=8", "train.heldout_images=8"] if a.smoke else []
    if a.smoke:
        a.steps, a.segment = 4, 2
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+experiment=train_scale_lr", f"train.steps={a.steps}", f"train.segment_steps={a.segment}",
            f"determinism.enabled={a.determinism == 'on'}", *small])
    arms = arms_of(cfg)
    config = arms[0].config
    setup_determinism(config)
    session = TrainSession(config, arms, torch.device("cpu"))
    print(f"train_floor: torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}, determinism {a.determinism}; {a.steps} steps of batch "
          f"{config['train']['batch_size']}, AdamW lr {config['train']['optimizer']['lr']}")
    names = [arm.name for arm in arms[1:]]
    columns = "  ".join(f"{n:>{max(10, len(n))}}" for n in names)
    print(f"step  |θ_twin − θ_start|  |θ_chaos0 − θ_twin|  {columns}  chaos max/min")
    start = None
    stamp = {"config_hash": "-", "env": {}, "kernel_path": {}}
    for u in plan_units(typed(TrainConfig, config["train"], "train")):
        u = {**u, "stores": {arm.name: None for arm in arms}}  # every arm measured in every segment
        session.begin_unit(u)
        weights = {}
        for arm in arms:
            tensors, _ = session.measure(u, arm.name, stamp)
            weights[arm.name] = {k: v.clone() for k, v in tensors.items() if k.startswith("weight/")}
        if start is None:
            start = weights["native"]
            continue
        d = {n: distance(weights[n], weights["native"], start) for n in names}
        floors = [d[n] for n in names if n.startswith("chaos")]
        spread = max(floors) / min(floors) if min(floors) > 0 else float("inf")
        update, wobble = norm(weights["native"], start), norm(weights[names[0]], weights["native"])
        absolute = f"{update:>18.4e}  {wobble:>19.3e}"
        relative = "  ".join(f"{d[n]:>{max(10, len(n))}.3e}" for n in names)
        print(f"{u['train']['to_step']:>4}  {absolute}  {relative}  {spread:>13.2f}")
    print(f"median chaos floor at the last step: {statistics.median(floors):.3e}")


if __name__ == "__main__":
    main()
