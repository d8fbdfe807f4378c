"""Train the embedded default denoiser on the digits training split.

Run: python -m twinrun.train [--steps N] [--seed S] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from twinrun.data import heldout_indices, load_digits_images, sigma_data_of, train_indices
from twinrun.errors import TwinrunError, fail
from twinrun.measures.train_step import P_MEAN, P_STD
from twinrun.model import DEFAULT_ARCH, DEFAULT_WEIGHTS_PATH, DiTDenoiser, save_pretrained
from twinrun.model import TRAIN_COMMAND as TRAIN_PROG
from twinrun.objectives import EDM

DEFAULT_STEPS = 4000
DEFAULT_SEED = 0
BATCH_SIZE = 128
LR_PEAK = 2e-3
LR_WARMUP_STEPS = 200
# Held-out evaluation: sigmas where the denoiser must clearly beat the identity, and draws per image.
EVAL_SIGMAS = (0.2, 0.5, 1.0, 2.0)
EVAL_DRAWS_PER_IMAGE = 4
EVAL_SEED = 0  # fixed apart from the training seed so figures of different runs are comparable
N_THREADS = 2
LOG_EVERY_STEPS = 500


def stream_generator(seed: int, stream: str) -> torch.Generator:
    """A CPU generator for one named random stream; sha256 rather than hash(), which is salted per process."""
    digest = hashlib.sha256(f"{seed}/{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def lr_at(step: int, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to zero: the decay stands in for weight averaging."""
    if step < LR_WARMUP_STEPS:
        return LR_PEAK * (step + 1) / LR_WARMUP_STEPS
    progress = (step - LR_WARMUP_STEPS) / max(1, total_steps - LR_WARMUP_STEPS)
    return LR_PEAK * 0.5 * (1.0 + math.cos(math.pi * progress))


def edm_loss(model: DiTDenoiser, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """EDM training loss (Karras et al. 2022, Eq. 2 with Table 1's lambda and log-normal p(sigma))."""
    batch = images.shape[0]
    sigma = torch.exp(P_MEAN + P_STD * torch.randn(batch, generator=generator))
    noise = torch.randn(images.shape, generator=generator)
    # lambda(sigma) makes the effective target unit-variance; twin training runs use the same loss
    # (twinrun/measures/train_step.py), written per sample.
    weight = EDM().weight(model, sigma).reshape(batch, 1, 1, 1)  # the edm objective's λ(σ)
    denoised = model(images + sigma.reshape(batch, 1, 1, 1) * noise, sigma)
    return (weight * (denoised - images) ** 2).mean()


@torch.no_grad()
def denoising_figures(model: DiTDenoiser, images: torch.Tensor, sigmas=EVAL_SIGMAS) -> dict[str, dict]:
    """Per sigma: MSE of D(x + sigma*eps) vs x, the identity's MSE (sigma^2), and their ratio.

    mse_skip_only is c_skip * (x + sigma*eps), the denoiser with its network output zeroed: the part of
    the figure owed to preconditioning alone.
    """
    generator = stream_generator(EVAL_SEED, "eval_noise")
    clean = images.repeat(EVAL_DRAWS_PER_IMAGE, 1, 1, 1)
    figures = {}
    for sigma in sigmas:
        noise = torch.randn(clean.shape, generator=generator)
        sigma_batch = torch.full((clean.shape[0],), sigma)
        noisy = clean + sigma * noise
        mse_model = float((model(noisy, sigma_batch) - clean).square().mean())
        c_skip = model.sigma_data**2 / (sigma**2 + model.sigma_data**2)  # Table 1
        mse_skip_only = float((c_skip * noisy - clean).square().mean())
        mse_identity = round(sigma**2, 6)
        figures[f"{sigma:g}"] = {
            "mse_model": round(mse_model, 6),
            "mse_identity": mse_identity,
            "ratio": round(mse_model / mse_identity, 6),
            "mse_skip_only": round(mse_skip_only, 6),
        }
    return figures


def format_figures(figures: dict[str, dict]) -> str:
    return "; ".join(
        f"sigma={s}: mse {f['mse_model']:.4f} vs identity {f['mse_identity']:.4f} (ratio {f['ratio']:.3f})"
        for s, f in figures.items()
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=TRAIN_PROG, description="Train the default digits denoiser (CPU).")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed for init, batches and noise")
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS_PATH, help="weights file to write")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def progress(steps: int):
    """tqdm bar on a terminal; None (plain log lines) otherwise."""
    if not sys.stderr.isatty():
        return None
    return tqdm(total=steps, desc="train", unit="step")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = shlex.join([*TRAIN_PROG.split(), *(sys.argv[1:] if argv is None else argv)])
    torch.set_num_threads(N_THREADS)
    start_s = time.monotonic()

    # Data: the training split only; sigma_data is measured on it.
    images = load_digits_images()
    train_images = images[train_indices(len(images))]
    heldout_images = images[heldout_indices(len(images))]
    sigma_data = sigma_data_of(train_images)

    # Model and optimizer, initialised from the seed.
    torch.manual_seed(args.seed)
    model = DiTDenoiser(**DEFAULT_ARCH, sigma_data=sigma_data).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR_PEAK)
    batch_gen = stream_generator(args.seed, "train_batches")
    noise_gen = stream_generator(args.seed, "train_noise")
    print(f"training {sum(p.numel() for p in model.parameters())} params, sigma_data={sigma_data:.4f}, "
          f"{args.steps} steps x batch {BATCH_SIZE}", flush=True)  # fmt: skip

    # Training loop.
    bar = progress(args.steps)
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps)
        batch = train_images[torch.randint(len(train_images), (BATCH_SIZE,), generator=batch_gen)]
        loss = edm_loss(model, batch, noise_gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        elif (step + 1) % LOG_EVERY_STEPS == 0 or step + 1 == args.steps:
            print(
                f"step {step + 1}/{args.steps} loss {loss.item():.4f} ({time.monotonic() - start_s:.0f} s)",
                flush=True,
            )
    if bar is not None:
        bar.close()

    # Evaluate on the held-out split and write the weights with their provenance.
    model.eval()
    figures = denoising_figures(model, heldout_images)
    train_wall_s = time.monotonic() - start_s
    metadata = {
        "seed": str(args.seed),
        "steps": str(args.steps),
        "command": command,
        "torch_version": torch.__version__,
        "batch_size": str(BATCH_SIZE),
        "train_wall_s": f"{train_wall_s:.1f}",
        "heldout_denoising": json.dumps(figures),
    }
    path = save_pretrained(model, args.out, metadata)
    print(f"held-out denoising: {format_figures(figures)}")
    print(f"wrote {path} ({path.stat().st_size} bytes) in {train_wall_s:.0f} s")
    return figures


if __name__ == "__main__":
    try:
        main()
    except TwinrunError as err:  # e.g. the digits file missing from scikit-learn: one line, exit 2
        fail(err)
