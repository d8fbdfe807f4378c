"""Small models that misbehave the way real ones do, built through `model._target_` in subprocess tests."""

import os
import signal

import torch
from torch import nn

from twinrun.model import DiTDenoiser


def tiny_dit(seed: int = 0) -> DiTDenoiser:
    """A random DiT for 8x8 digits, every parameter drawn from `seed` (the same model in every process;
    none left at adaLN-Zero's zero init, so every parameter has a gradient)."""
    model = DiTDenoiser(width=16, depth=1, heads=2, mlp_ratio=2, sigma_data=0.5)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


class ChannelsLastQuery(nn.Module):
    """Asks whether its input is channels-last, as diffusers' UNet2DModel does before GroupNorm:
    vmap has no rule for that query (NYI), a plain forward does."""

    COND_PARAM_PATTERNS = DiTDenoiser.COND_PARAM_PATTERNS

    def __init__(self):
        super().__init__()
        self.net = tiny_dit()
        self.sigma_data = self.net.sigma_data

    def forward(self, x, sigma, sigma_cond):
        if x.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous()
        return self.net(x, sigma, sigma_cond)


class FailsAboveSigma(ChannelsLastQuery):
    """Raises inside its forward for σ > 1: a model error mid-run, after earlier bins succeeded."""

    def forward(self, x, sigma, sigma_cond):
        if float(sigma.reshape(-1)[0]) > 1.0:
            raise FloatingPointError("overflow in my custom layer")
        return self.net(x, sigma, sigma_cond)


class AlwaysFails(ChannelsLastQuery):
    def forward(self, x, sigma, sigma_cond):
        raise NotImplementedError("this model was never finished")


# Builders for `model._target_`; `path` is the default model schema's key, unused here.
def tiny(path=None):
    return tiny_dit()


def channels_last_query(path=None):
    return ChannelsLastQuery()


def fails_above_sigma(path=None):
    return FailsAboveSigma()


def always_fails(path=None):
    return AlwaysFails()


def half_done_cleanup() -> None:
    """A library call that SIGTERM interrupts and whose cleanup then fails on its half-done state, as
    OmegaConf's does when a signal lands inside a merge: its AttributeError takes the signal's place."""
    flags = None
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the job's handler raises Interrupted at the next bytecode
        flags = {}
    finally:
        flags["cache"] = None  # TypeError: the signal's Interrupted is now only this error's __context__


class SignalUnwindsAboveSigma(ChannelsLastQuery):
    """For σ > 1, SIGTERM arrives inside a library call whose cleanup then fails (`half_done_cleanup`)."""

    def forward(self, x, sigma, sigma_cond):
        if float(sigma.reshape(-1)[0]) > 1.0:
            half_done_cleanup()
        return self.net(x, sigma, sigma_cond)


def signal_unwinds_above_sigma(path=None):
    return SignalUnwindsAboveSigma()


class NotDeterministicAboveSigma(ChannelsLastQuery):
    """For σ > 1 calls Tensor.put_, which has no deterministic implementation: with deterministic
    algorithms on (determinism.enabled=true) torch refuses it on the CPU too, with its own message."""

    def forward(self, x, sigma, sigma_cond):
        if float(sigma.reshape(-1)[0]) > 1.0:
            x = x.clone().put_(torch.tensor([0], device=x.device), x.new_zeros(1)).view_as(x)
        return self.net(x, sigma, sigma_cond)


class OutOfMemoryAboveSigma(ChannelsLastQuery):
    """Runs out of (device) memory for σ > 1, as CUDA's allocator says it."""

    def forward(self, x, sigma, sigma_cond):
        if float(sigma.reshape(-1)[0]) > 1.0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a "
                                              "total capacity of 79.19 GiB of which 3.12 GiB is free.")
        return self.net(x, sigma, sigma_cond)


class OutOfMemoryUnderVmap(ChannelsLastQuery):
    """Runs out of memory under vmap only (its groups of folds batched at once), not under folds."""

    def forward(self, x, sigma, sigma_cond):
        if torch._C._functorch.is_batchedtensor(x):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.")
        return self.net(x, sigma, sigma_cond)


def not_deterministic_above_sigma(path=None):
    return NotDeterministicAboveSigma()


def out_of_memory_above_sigma(path=None):
    return OutOfMemoryAboveSigma()


def flips_switches(path=None):
    """A builder that turns cuDNN benchmarking and TF32 matmuls on, as some model code does on import."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    return tiny_dit()
