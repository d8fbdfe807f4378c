"""One arm's training arithmetic: the objective's per-sample loss, the held-out loss, the weights' digests
(one optimizer step of an arm, with its schedule, clipping, accumulation and autocast, is
train_loop.loop_step's).

The loss is the run's objective's (twinrun/objectives.py; edm, the default, is the one
`python -m twinrun.train` trained the committed model with: Karras et al. 2022, Eq. 2 with Table 1's
λ(σ) and log-normal p(σ)), written per sample so that a batch cut into chunks
sums the same terms. An arm's intervention acts where it declares (twinrun/interventions.py): the
σ fed to the conditioning pathway, forward hooks, a per-sample loss weight, its learning rate.
"""

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from twinrun import conditioning
from twinrun.errors import EXIT_GATE, TwinrunError
from twinrun.interventions import Intervention, attached
from twinrun.objectives import EDM, EDM_P_MEAN, EDM_P_STD, Objective

# Log-normal training σ distribution (Karras et al. 2022, Table 1: P_mean, P_std): objective=edm's.
P_MEAN = EDM_P_MEAN
P_STD = EDM_P_STD
DIGEST_HEX = 16  # hex digits kept of each weight's per-step sha256 (64 bits: no collision in practice)
# One thread hashes a step's weights while the next step's forward and backward run (hashlib lets go of
# the GIL on large buffers); one is enough: each step waits for the last step's digests.
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinrun-digests")


class NonFiniteLoss(TwinrunError):
    """The training itself failed (a NaN or inf loss or weight): the run stops there (exit 1)."""

    exit_code = EXIT_GATE


def sigma_of(normal: torch.Tensor) -> torch.Tensor:
    """σ = exp(P_mean + P_std·n): the log-normal training noise level of each sample's normal draw."""
    return torch.exp(P_MEAN + P_STD * normal)


def per_sample_loss(model: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor,
                    sigma_cond: torch.Tensor, objective: Objective | None = None,
                    cond: dict | None = None) -> torch.Tensor:
    """[B]: λ(σ)·mean over pixels of (F(x_σ; σ, σ_cond, **cond) − target)², one term per sample, in the
    objective's terms (edm, the default: F denoises x + σε, the target is x); cond: each sample's rows."""
    objective = EDM() if objective is None else objective
    out = model(objective.noisy(model, x, eps, sigma), sigma, sigma_cond, **(cond or {}))
    return objective.per_sample_loss(model, out, x, eps, sigma)


@torch.no_grad()
def heldout_losses(model: torch.nn.Module, intervention: Intervention, images: torch.Tensor,
                   normal: torch.Tensor, eps: torch.Tensor, chunk: int, objective: Objective | None = None,
                   cond: dict | None = None) -> torch.Tensor:
    """[N] float32 on the CPU: each held-out image's loss under the arm's model as it trains (its
    hooks and σ_cond; no loss weight, which changes the objective, not the model), on fixed draws."""
    model.eval()
    objective = EDM() if objective is None else objective
    sigma = objective.train_level(model, normal)
    out = []
    with attached(intervention, model):
        for lo in range(0, images.shape[0], chunk):
            part = slice(lo, lo + chunk)
            out.append(per_sample_loss(model, images[part], sigma[part], eps[part],
                                       intervention.sigma_cond(sigma[part]), objective,
                                       conditioning.take(cond or {}, part)))
    model.train()
    return torch.cat(out).float().cpu()


def weight_digests(model: torch.nn.Module) -> list[str]:
    """A sha256 prefix of every parameter's bytes, in named_parameters() order: which tensors two arms
    share bit for bit after a step, and so the first step at which an arm leaves the twin."""
    return _digests_of([_host(p) for p in model.parameters()])


def _host(p: torch.Tensor):
    """A parameter's bytes on the host: its own memory on the CPU (no copy), a copy from a GPU."""
    t = p.detach() if p.device.type == "cpu" else p.detach().cpu()
    if t.dtype == torch.bfloat16 or not t.is_contiguous():  # numpy has no bfloat16: its bytes instead
        t = t.contiguous().reshape(-1).view(torch.uint8)
    return t.numpy()


def weight_versions(model: torch.nn.Module) -> list[int]:
    """Each parameter's version counter: torch bumps it at every in-place write, under no_grad too."""
    return [p._version for p in model.parameters()]


def rehash_written(model: torch.nn.Module, versions: list[int], last: list[str]) -> list[str]:
    """The last step's digests with every weight written since `versions` were read hashed again: a hook
    that writes a weight during the held-out loss (eval mode) leaves the store holding what it wrote, and
    the step digests must say so, or the store reads as forged (its last step's digest not its weight's)
    instead of as an arm that left the twin (the gate)."""
    params = list(model.parameters())
    written = [i for i, (p, v) in enumerate(zip(params, versions, strict=True)) if p._version != v]
    if not written:
        return last
    fresh = dict(zip(written, _digests_of([_host(params[i]) for i in written]), strict=True))
    return [fresh.get(i, d) for i, d in enumerate(last)]


FROZEN = ""  # a frozen weight's step digest before the segment's last step (DigestsMeanwhile)


def _digests_of(arrays: list) -> list[str]:
    return [FROZEN if a is None else hashlib.sha256(a).hexdigest()[:DIGEST_HEX] for a in arrays]


class DigestsMeanwhile:
    """weight_digests of every step of a segment, each hashed on another thread while the next step's
    forward and backward run (they only read the weights): `after_step()` hands the weights over, and
    `wait()`, called before the next update writes them and at the segment's end, collects the digests.
    The same digests as weight_digests, in the same order; a sha256 of the committed model's weights is
    about 3% of its step on two cores. `meanwhile=False` (a step of your own, which might write a weight
    in its forward): each step's digests are taken at once, as weight_digests does.

    A frozen weight (requires_grad False at the segment's start: outside train.params, a LoRA adapter's
    base) is hashed once, after the segment's last step, and reads FROZEN ("") at the steps before: no
    optimizer writes it, so only a leak can, and a leak stays in the weight, so the segment's end finds
    it (and the trained weights, which it feeds, differ from the step after). Hashing a 2 B-parameter
    base after every step was gigabytes of sha256, and from a GPU a copy to the host, per step and arm."""

    def __init__(self, model: torch.nn.Module, meanwhile: bool = True):
        self.model, self.meanwhile = model, meanwhile
        self.digests: list[list[str]] = []
        self.pending: Future | None = None
        # twinrun's own step: the parameters listed once a segment (its step registers none), and on the
        # CPU their numpy views made once, while each parameter keeps its memory (every update is in
        # place; parking, which swaps it, runs between segments): listing and viewing them every step
        # was a tenth of a millisecond, about 1% of the committed model's step.
        self.params = list(model.parameters()) if meanwhile else None
        self.frozen = [not p.requires_grad for p in model.parameters()]
        self.views: list | None = None
        self.where: list[int] | None = None

    def after_step(self) -> None:
        # The host's bytes now (from a GPU: a copy, so the thread reads no device memory); on the CPU the
        # parameters' own memory, which nothing writes before wait().
        self.pending = _HASHER.submit(_digests_of, self._hosts())
        if not self.meanwhile:
            self.wait()

    def _hosts(self) -> list:
        """The trained weights' host bytes (None for a frozen one: not hashed at this step)."""
        if self.params is None:  # a step of your own: the parameters as they are now
            return self._trained(self.model.parameters())
        where = [p.data_ptr() for p in self.params]
        if where != self.where:  # the first step, or a parameter that moved to other memory
            own = all(p.device.type == "cpu" and p.is_contiguous() for p in self.params)
            self.views, self.where = (self._trained(self.params) if own else None), where
        # elsewhere copies, every step (from a GPU, or of a strided tensor)
        return self.views if self.views is not None else self._trained(self.params)

    def _trained(self, params) -> list:
        return [None if f else _host(p) for p, f in zip(params, self.frozen, strict=True)]

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.digests.append(pending.result())

    def finish(self) -> list[list[str]]:
        """After the segment's last step: every step's digests, the frozen weights' hashed now into the
        last step's (read_train_store holds that step to the weights the store holds)."""
        self.wait()
        if self.digests and any(self.frozen):
            params = self.model.parameters() if self.params is None else self.params
            frozen = [_host(p) for p, f in zip(params, self.frozen, strict=True) if f]
            hashed = iter(_digests_of(frozen))
            self.digests[-1] = [next(hashed) if f else d for d, f in zip(self.digests[-1], self.frozen)]
        return self.digests
