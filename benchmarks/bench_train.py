"""Twin training runs' speed and memory, side by side in one run, against plain training outside twinrun.

    python benchmarks/bench_train.py                       # per-step, whole-run and memory sections
    python benchmarks/bench_train.py --steps 80 --reps 5   # longer runs, more repetitions
    python benchmarks/bench_train.py --smoke               # every section on a tiny run, in seconds
    python benchmarks/bench_train.py --only offload        # the offloaded layout against plain alone

Each section also runs with what a real loop has (a warmup+cosine schedule, clipping by norm, two
micro-batches accumulated, bf16 autocast) on both sides, and with the arms not training parked
(train.offload=disk: one arm's memory at a time), side by side with the plain run.

Per step: one arm's optimizer step inside twinrun (the keyed samples and noise gathered, the step's
own dropout seed, the loss per sample, the weights' digests) against a plain step of the same model
and batch the way `python -m twinrun.train` trains (torch.randint / torch.randn from a generator).
Whole run: a twin run (plan_run + run_job: five arms, every segment stored, fingerprint, sentinel)
against one plain run of the same steps that also reads its held-out loss at the same steps; the
amortised cost of one arm's step is the twin run over arms × steps, against the plain run's step.
Memory: peak RSS above the RSS after imports and data, each in a fresh process, a plain run against
a twin run, on a model large enough (--mem-width) that its state dwarfs the allocator's noise.

Timings interleave the two sides repetition by repetition and report medians and the median of
the per-repetition ratios: the machine is shared and its load drifts.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from twinrun.app import CONF_DIR
from twinrun.config import TrainConfig, register_configs
from twinrun.data import load_train_and_heldout
from twinrun.interventions import Native
from twinrun.job import run_job
from twinrun.measures import train_loop as loop
from twinrun.measures import train_step as ts
from twinrun.measures.train_session import seed_generators
from twinrun.measures.train_state import ArmState
from twinrun.measures.train_streams import draw_segment, dropout_seed
from twinrun.model import DEFAULT_ARCH, DiTDenoiser, load_pretrained
from twinrun.plan import plan_run, trusted_targets
from twinrun.train import edm_loss, stream_generator

ARMS = 6  # intervention, twin, replicate, machinery and two chaos arms (train.chaos.arms, its default)
COMPANIONS = 4  # the arms besides the chaos arms


def med(xs) -> float:
    return statistics.median(xs)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def model_for(width: int | None, depth: int | None) -> torch.nn.Module:
    """The committed model, or a random DiT of another size (for the memory section)."""
    if width is None:
        return load_pretrained().train()
    torch.manual_seed(0)
    return DiTDenoiser(**{**DEFAULT_ARCH, "width": width, "depth": depth}, sigma_data=0.6).train()


def optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


def config(a, run_overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+experiment=train_scale_lr", f"train.steps={a.steps}", f"train.segment_steps={a.segment}",
            f"train.batch_size={a.batch}", f"train.heldout_images={a.heldout}",
            f"train.chaos.arms={a.chaos_arms}", *run_overrides])
    if a.width is not None:  # a random DiT of another size: the model node replaced whole
        OmegaConf.set_struct(cfg, False)
        cfg.model = {"_target_": "twinrun.model.DiTDenoiser", **DEFAULT_ARCH, "width": a.width,
                     "depth": a.depth, "sigma_data": 0.6}
    return cfg


# ----------------------------------------------------------------------------- the two sides


# What a real loop has, on both sides of the loop sections.
LOOP = {"schedule": {"_target_": "twinrun.measures.train_loop.warmup_cosine", "warmup_steps": 4,
                     "total_steps": 400}, "clip_norm": 1.0, "accumulate": 2, "amp": "bf16"}


def plain_run(a, data, model=None) -> float:
    """Plain training outside twinrun: `steps` steps, the held-out loss at every segment end. Seconds."""
    (train_x, _), (held_x, _) = data
    model = model if model is not None else model_for(a.width, a.depth)
    opt = optimizer(model)
    batches, noise = stream_generator(0, "train_batches"), stream_generator(0, "train_noise")
    held = held_x[: a.heldout]
    normal, eps = torch.randn(held.shape[0], generator=noise), torch.randn(held.shape, generator=noise)
    t0 = time.perf_counter()
    ts.heldout_losses(model, Native(), held, normal, eps, a.batch)  # at the start, as every arm reads it
    for step in range(a.steps):
        batch = train_x[torch.randint(len(train_x), (a.batch,), generator=batches)]
        loss = edm_loss(model, batch, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % a.segment == 0:
            ts.heldout_losses(model, Native(), held, normal, eps, a.batch)
    return time.perf_counter() - t0


def twin_run(a, root: Path, overrides=()) -> float:
    """A whole twin run: plan (validation, the smoke step) and the job (five arms, every store). Seconds."""
    cfg = config(a, overrides)
    run_dir = Path(tempfile.mkdtemp(dir=root))
    t0 = time.perf_counter()
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    return time.perf_counter() - t0


def step_pair(a, data, n_steps: int, settings: dict | None = None) -> tuple[float, float]:
    """(plain, twinrun) seconds per step over n_steps each, on two copies of one model; `settings`: the
    loop's (schedule, clipping, accumulation, AMP) on both sides."""
    (train_x, train_ids), _ = data
    plain, mine = model_for(None, None), model_for(None, None)
    opt_plain, opt_mine = optimizer(plain), optimizer(mine)
    t = TrainConfig(batch_size=a.batch, **(settings or {}))
    sched_plain = loop.build_schedule(t.schedule, opt_plain)
    arm = ArmState(mine, opt_mine, Native(), 0, t, loop.build_schedule(t.schedule, opt_mine), None,
                   loop.twinrun_step)
    batches, noise = stream_generator(0, "train_batches"), stream_generator(0, "train_noise")
    n = loop.step_samples(t)
    seg = draw_segment(0, list(range(1, n_steps + 1)), train_ids, n, tuple(train_x.shape[1:]))
    ids = [[train_ids[p] for p in row] for row in seg.positions.tolist()]
    t0 = time.perf_counter()
    for _ in range(n_steps):  # a plain loop with the same settings
        opt_plain.zero_grad(set_to_none=True)
        for _ in range(t.accumulate):
            batch = train_x[torch.randint(len(train_x), (a.batch,), generator=batches)]
            with loop.autocast(t, batch.device):
                loss = edm_loss(plain, batch, noise) / t.accumulate
            loss.backward()
        if t.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), t.clip_norm)
        opt_plain.step()
        if sched_plain is not None:
            sched_plain.step()
    t1 = time.perf_counter()
    for k, step in enumerate(seg.steps):  # what TrainSession._train does for one arm's step
        x, sigma = train_x[seg.positions[k]], ts.sigma_of(seg.normal[k])
        with torch.random.fork_rng(devices=[]):
            seed_generators(dropout_seed(0, step), [])
            loop.loop_step(arm, arm.step_fn, x, ids[k], sigma, seg.eps[k], 0, step)
        ts.weight_digests(mine)
    t2 = time.perf_counter()
    return (t1 - t0) / n_steps, (t2 - t1) / n_steps


# Trained in the frozen-base section: the attention output projections alone (7% of the weights of
# the memory section's DiT), as a LoRA adapter or a partial fine-tune trains a small part of a large base.
TRAINED = ".attn.proj."


RULES = ("plain", "segment", "every")


def frozen_pair(a, data, n_steps: int, first: int = 0) -> dict[str, float]:
    """Seconds per step of one arm that trains a small part of a larger DiT (the memory section's size),
    three ways over the same steps: `plain` (no digests), `segment` (twinrun's: the frozen weights hashed
    once a segment, DigestsMeanwhile) and `every` (every weight after every step, as before); `first`
    rotates which runs first."""
    (train_x, train_ids), _ = data
    t = TrainConfig(batch_size=a.batch)
    seg = draw_segment(0, list(range(1, n_steps + 1)), train_ids, a.batch, tuple(train_x.shape[1:]))
    ids = [[train_ids[p] for p in row] for row in seg.positions.tolist()]
    out = {}
    for rule in RULES[first:] + RULES[:first]:
        model = model_for(a.mem_width, a.mem_depth)
        for name, param in model.named_parameters():
            param.requires_grad_(TRAINED in name)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        arm = ArmState(model, opt, Native(), 0, t, None, None, loop.twinrun_step)
        digests = ts.DigestsMeanwhile(model)
        if rule == "every":
            digests.frozen = [False] * len(digests.frozen)
        t0 = time.perf_counter()
        for k, step in enumerate(seg.steps):
            x, sigma = train_x[seg.positions[k]], ts.sigma_of(seg.normal[k])
            before = digests.wait if rule != "plain" else None
            loop.loop_step(arm, arm.step_fn, x, ids[k], sigma, seg.eps[k], 0, step, before_update=before)
            if rule != "plain":
                digests.after_step()
        if rule != "plain":
            digests.finish()
        out[rule] = (time.perf_counter() - t0) / n_steps
    return out


# ----------------------------------------------------------------------------- sections


def per_step(a, data, settings=None) -> dict:
    step_pair(a, data, 2, settings)  # warm-up: first calls allocate
    pairs = [step_pair(a, data, a.segment, settings) for _ in range(a.reps)]
    return {"plain_ms": 1e3 * med(p for p, _ in pairs), "twinrun_ms": 1e3 * med(m for _, m in pairs),
            "ratio": med(m / p for p, m in pairs)}


def frozen_base(a, data) -> dict:
    frozen_pair(a, data, 2)  # warm-up
    reps = [frozen_pair(a, data, a.segment, i % len(RULES)) for i in range(max(a.reps, len(RULES)))]
    return {"plain_ms": 1e3 * med(r["plain"] for r in reps),
            **{rule: med(r[rule] / r["plain"] for r in reps) for rule in ("segment", "every")}}


def whole_run(a, data, overrides=()) -> dict:
    with tempfile.TemporaryDirectory() as root:
        if not a.smoke:
            twin_run(a, Path(root), overrides)  # warm-up: imports, the data's first read, determinism on
        plain, twin = [], []
        for _ in range(a.reps):
            twin.append(twin_run(a, Path(root), overrides))
            plain.append(plain_run(a, data))
    ratios = [t / p for t, p in zip(twin, plain, strict=True)]
    return {"plain_s": med(plain), "twin_s": med(twin), "ratio": med(ratios),
            "per_arm_step_ratio": med(r / a.arms for r in ratios)}


def memory(a) -> dict:
    """Peak RSS growth of a plain run and of a twin run, each in a fresh process, same imports."""
    out = {}
    for side in ("plain", "twin", "offload"):
        proc = subprocess.run([sys.executable, __file__, "--memory-side", side, *memory_args(a)],
                              capture_output=True, text=True, check=True, env={**os.environ})
        out[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    model = model_for(a.mem_width, a.mem_depth)
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["param_bytes"] = p_bytes
    out["per_arm_allowed_bytes"] = 3 * p_bytes  # one model and AdamW's two moments
    out["growth_bytes"] = out["twin"]["growth"] - out["plain"]["growth"]
    out["offload_peak_ratio"] = out["offload"]["peak"] / out["plain"]["peak"]
    return out


def memory_args(a) -> list[str]:
    return ["--steps", str(a.segment), "--segment", str(a.segment), "--batch", str(a.batch),
            "--chaos-arms", str(a.chaos_arms), "--heldout",
            str(a.heldout), "--mem-width", str(a.mem_width), "--mem-depth", str(a.mem_depth)]


def memory_side(a, side: str) -> None:
    """In a fresh process: the RSS after imports and data, then the peak after one run of one side."""
    a.width, a.depth = a.mem_width, a.mem_depth
    data = load_train_and_heldout()
    config(a)  # Hydra's and twinrun's configs composed on both sides
    base = rss_bytes()
    if side == "plain":
        plain_run(a, data)
    else:
        with tempfile.TemporaryDirectory() as root:
            twin_run(a, Path(root), ["train.offload=disk"] if side == "offload" else [])
    print(json.dumps({"base": base, "peak": peak_rss_bytes(), "growth": peak_rss_bytes() - base}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Long enough that a twin run's fixed costs (plan, fingerprint, sentinel: about a second) and each
    # store's (two fsyncs for the store, two for run.json) are amortised as in a real training run.
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--segment", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heldout", type=int, default=297)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--chaos-arms", type=int, default=ARMS - COMPANIONS,
                   help="train.chaos.arms (2, the default: six arms; 1: five)")
    p.add_argument("--mem-width", type=int, default=256)
    p.add_argument("--mem-depth", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="every section on a tiny run (seconds)")
    p.add_argument("--only", choices=("all", "offload", "frozen"), default="all",
                   help="offload: only the offloaded whole run and its peak memory, each against a plain "
                   "run; frozen: only the per-step digests of a partly frozen model")
    p.add_argument("--memory-side", choices=("plain", "twin", "offload"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.width = a.depth = None
    a.arms = COMPANIONS + a.chaos_arms
    if a.smoke:
        a.steps, a.segment, a.batch, a.heldout, a.reps, a.mem_width, a.mem_depth = 4, 2, 16, 16, 1, 64, 2
    if a.memory_side:
        memory_side(a, a.memory_side)
        return
    load = os.getloadavg()[0]
    print(f"bench_train: torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{load:.1f}; {a.steps} steps in segments of {a.segment}, batch {a.batch}, {a.heldout} held-out "
          f"images, {a.reps} repetitions")
    if a.smoke:
        print("bench_train: --smoke runs every section on a tiny run: its ratios measure start-up only")
    data = load_train_and_heldout()
    if a.only == "frozen":
        frozen(a, data)
        return
    if a.only == "all":
        in_memory(a, data)
    offloaded(a, data)


def in_memory(a, data) -> None:
    """The sections of the all-resident layout: per step (plain and with the loop's settings), the whole
    run."""
    s = per_step(a, data)
    print(f"per step: plain {s['plain_ms']:.2f} ms, one twinrun arm {s['twinrun_ms']:.2f} ms: "
          f"{s['ratio']:.3f}x (target ≤ 1.05)")
    loop_settings = {**LOOP, "schedule": {**LOOP["schedule"], "total_steps": a.steps}}
    s = per_step(a, data, loop_settings)
    print(f"per step with schedule, clipping, accumulation (2) and bf16 autocast: plain {s['plain_ms']:.2f} "
          f"ms, one twinrun arm {s['twinrun_ms']:.2f} ms: {s['ratio']:.3f}x (target ≤ 1.05)")
    frozen(a, data)
    w = whole_run(a, data)
    print(f"whole run: one plain run {w['plain_s']:.2f} s, the twin run with its four companion arms "
          f"{w['twin_s']:.2f} s: {w['ratio']:.2f}x (target ≤ 5.3); per arm and step, amortised: "
          f"{w['per_arm_step_ratio']:.3f}x")


def frozen(a, data) -> None:
    """Per step, an arm that trains a small part of a larger model: its digests against a plain step."""
    f = frozen_base(a, data)
    print(f"per step, training {TRAINED!r} alone of a DiT width {a.mem_width}, depth {a.mem_depth}: "
          f"plain {f['plain_ms']:.2f} ms; with the weights' digests, frozen ones once a segment: "
          f"{f['segment']:.3f}x; every weight after every step (before): {f['every']:.3f}x")


def offloaded(a, data) -> None:
    """The offloaded layout (train.offload=disk) against a plain run: its whole run, then the memory section
    (which also reads the all-resident twin run's growth)."""
    w = whole_run(a, data, ["train.offload=disk"])
    print(f"whole run offloaded (train.offload=disk): one plain run {w['plain_s']:.2f} s, the twin run "
          f"{w['twin_s']:.2f} s: {w['ratio']:.2f}x with {a.arms} arms (target ≤ {1.1 * a.arms:.1f}: 1.10 per "
          f"arm, the issue's 5.5 for five); per arm and step, amortised: {w['per_arm_step_ratio']:.3f}x")
    m = memory(a)
    print(f"memory (DiT width {a.mem_width}, depth {a.mem_depth}: {m['param_bytes'] / 1e6:.1f} MB of "
          f"weights): peak RSS growth plain {m['plain']['growth'] / 1e6:.1f} MB, twin "
          f"{m['twin']['growth'] / 1e6:.1f} MB; "
          f"the twin run holds {a.arms} arms at once: {m['growth_bytes'] / 1e6:.1f} MB more than plain, "
          f"allowed {a.arms} x (weights + AdamW state) = {a.arms * m['per_arm_allowed_bytes'] / 1e6:.1f} MB")
    print(f"memory offloaded (train.offload=disk): peak RSS {m['offload']['peak'] / 1e6:.1f} MB against a "
          f"plain run's {m['plain']['peak'] / 1e6:.1f} MB: {m['offload_peak_ratio']:.2f}x (target ≤ 1.3); "
          f"growth above imports and data {m['offload']['growth'] / 1e6:.1f} MB against plain's "
          f"{m['plain']['growth'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
