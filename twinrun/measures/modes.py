"""Train mode and eval mode: which modules of a model would make a probe store something else than a
sum of per-sample gradients, or make two arms see different randomness.

Two behaviours matter. A module that **couples samples** (batch statistics: BatchNorm) makes each
sample's gradient depend on the others in its chunk, so a fold's sum is not a sum of per-sample
gradients. A module that **draws randomness** (dropout and friends) would draw different masks
in each arm unless both draw from one stream. Both are found by module type (to name them) and by
behaviour (a model may call `F.dropout` or compute batch statistics itself): the forward run twice
on the same batch, and one sample beside two different companions.
"""

import hashlib
import struct
from contextlib import contextmanager

import torch
from torch import nn

from twinrun.errors import ConfigError

# Batch statistics in train mode (BatchNorm1d/2d/3d, SyncBatchNorm).
COUPLING = (nn.modules.batchnorm._BatchNorm,)
RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_STREAM = b"twinrun/probe-train-mode/v1"


def named(model: nn.Module, kinds: tuple) -> list[str]:
    """'Type at name' of every module of these kinds (the model itself is named 'the model')."""
    return [f"{type(m).__name__} at {n or 'the model'}" for n, m in model.named_modules()
            if isinstance(m, kinds)]


@torch.no_grad()
def behaviour(model: nn.Module, images: torch.Tensor, sigma: float) -> tuple[bool, bool]:
    """(draws randomness, couples samples) of the model's forward as it is now (train or eval mode),
    on three of the probe's images at noising σ. Randomness: the same batch twice from two states of
    the generators. Coupling: the first image beside two different companions, both from one seeded
    state (so dropout alone cannot look like coupling). On one kernel path a forward with neither
    repeats bit for bit."""
    x = images[:3]
    if x.shape[0] < 3:
        return False, False
    sig = torch.full((2,), float(sigma), dtype=x.dtype, device=x.device)
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # a probe of behaviour leaves the user's streams as they are
        outputs = []
        for batch, seed in ((x[:2], 0), (x[:2], 1), (x[[0, 2]], 0)):
            torch.manual_seed(seed)
            outputs.append(model(batch, sig, sig))
    first, again, other = outputs
    return not torch.equal(first, again), not torch.equal(first[0], other[0])


def set_mode(model: nn.Module, images: torch.Tensor, sigma: float, train_mode: bool, announce: bool) -> None:
    """Put the model in the mode the probe measures it in (eval unless probe.train_mode), refusing what
    train mode cannot measure; with `announce`, say so when the model was built in train mode and that
    changed its behaviour (planning announces; the job repeats it silently)."""
    built_training = any(m.training for m in model.modules())
    if train_mode:
        model.train()
        _refuse_coupling(model, images, sigma)
        return
    changed = named(model, COUPLING + RANDOM) if built_training else []
    if built_training and not changed:
        changed = ["its forward"] if any(behaviour(model, images, sigma)) else []
    model.eval()
    if behaviour(model, images, sigma)[1]:  # a batch statistic computed by hand holds in eval mode too
        raise ConfigError("probe.train_mode", False, "the model's forward couples samples in eval mode "
                          "too (a sample's output depends on the other samples of its batch, e.g. a batch "
                          "statistic computed by hand), so a fold's sum would not be a sum of per-sample "
                          "gradients; compute the statistic per sample, or use GroupNorm or LayerNorm")
    if announce and changed:
        print(f"twinrun: the model was built in train mode ({', '.join(changed[:4])}"
              f"{' …' if len(changed) > 4 else ''}); the probe measures it in eval mode "
              "(probe.train_mode=false: no batch statistics, no dropout)", flush=True)


def _refuse_coupling(model: nn.Module, images: torch.Tensor, sigma: float) -> None:
    coupled = named(model, COUPLING)
    if not coupled and behaviour(model, images, sigma)[1]:
        coupled = ["its forward (a sample's output depends on the other samples of its batch)"]
    if coupled:
        raise ConfigError("probe.train_mode", True, f"{', '.join(coupled[:3])} couples a fold's samples "
                          "through batch statistics in train mode, so a fold's sum would not be a sum of "
                          "per-sample gradients; set probe.train_mode=false (eval mode), or use GroupNorm or "
                          "LayerNorm")


def draws_randomness(model: nn.Module, images: torch.Tensor, sigma: float) -> bool:
    """Whether the model's forward, in its current mode, draws randomness (by type or by behaviour)."""
    return bool(named(model, RANDOM) and model.training) or behaviour(model, images, sigma)[0]


def stream_seed(seed: int, sigma: float, group: int, draw: int) -> int:
    """The seed of the randomness one probe call draws in train mode, keyed like the noise (seed, bin σ,
    fold group, first draw of the chunk): the same in every arm, so both arms see the same masks."""
    digest = hashlib.sha256(_STREAM + struct.pack("<qdqq", seed, float(sigma), group, draw)).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@contextmanager
def shared_stream(seed: int | None, device: torch.device):
    """Inside the block torch's generators (the CPU's, and the probe's GPU) start from `seed`; after it
    they are as before. seed None: nothing is changed (eval mode draws nothing)."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield
