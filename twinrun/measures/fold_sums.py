"""The probe's arithmetic: per-fold sums of per-sample gradients of the EDM loss, one bin and arm at a time.

A fold's sum of per-sample gradients is the gradient of the fold's summed loss, so no per-sample
gradient is ever formed. Two methods compute it (`probe.method`):

- `vmap`: the forward is vmapped over groups of one fold's images, each group with its own
  stride-0 copy of the parameters; one backward gives every group its gradient. Small folds are
  batched together (about the cost of one plain backward over the same samples), but every op of
  the model needs a vmap batching rule.
- `folds`: one plain forward and backward per fold chunk, on the model's own parameters. No vmap:
  any nn.Module runs (GroupNorm on channels-last views, fused attention, torch.compile), at the
  price of one launch-bound backward per fold chunk when folds are small.

Chunk by chunk, either streams into float64 fold sums (`probe.accumulator_dtype`), so memory is
bounded by the chunk, not by n_images x n_draws.
"""

import fnmatch
import sys

import torch
from torch.func import functional_call, vmap

from twinrun import conditioning
from twinrun.errors import EXIT_GATE, ConfigError, TwinrunError
from twinrun.measures.modes import shared_stream, stream_seed
from twinrun.objectives import EDM, Objective

# The functions' own default chunk, 40 images x 6 draws (chosen for bench_probe.py's first protocol of
# 40 images x 12 draws): one vmapped call takes CHUNK_IMAGES images x CHUNK_DRAWS draws; -1 = no limit.
# A run's chunk is its config's (ProbeConfig, conf/probe/default.yaml), always passed explicitly.
CHUNK_IMAGES = 40
CHUNK_DRAWS = 6
# What probe.method accepts; `auto` is resolved to one of the others before any bin (twinrun.trial).
METHODS = ("auto", "vmap", "folds")
# What probe.accumulator_dtype accepts: the dtype the fold sums are accumulated in (stored as float32).
ACCUMULATORS = {"float64": torch.float64, "float32": torch.float32}


class NonFiniteGradient(TwinrunError):
    """The measurement itself failed: the instrument is broken at this bin (exit 1)."""

    exit_code = EXIT_GATE


def select_params(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Names of the parameters matching any fnmatch pattern, in the model's own order."""
    names = [n for n, _ in model.named_parameters() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not names:
        raise ConfigError("probe.params", list(patterns), "matches no parameter of the model; "
                          f"names look like {[n for n, _ in model.named_parameters()][:4]}")
    return names


def layout(model: torch.nn.Module, names: list[str], cond_patterns: list[str]) -> list[dict]:
    """Where each probed parameter lives in a store's columns, and whether it is conditioning."""
    params = dict(model.named_parameters())
    out, offset = [], 0
    for n in names:
        numel = params[n].numel()
        cond = any(fnmatch.fnmatchcase(n, p) for p in cond_patterns)
        out.append({"name": n, "offset": offset, "numel": numel, "shape": list(params[n].shape),
                    "cond": cond})
        offset += numel
    return out


def cond_patterns(model: torch.nn.Module) -> list[str]:
    """The model's own names for its conditioning pathway: `COND_PARAM_PATTERNS` on the model
    (or its class, or its module); none means the `cond` estimand is unavailable."""
    found = getattr(model, "COND_PARAM_PATTERNS", None)
    if found is None:
        found = getattr(sys.modules.get(type(model).__module__), "COND_PARAM_PATTERNS", ())
    return list(found)


def fold_groups(fold_of_image: list[int], n_folds: int, chunk_images: int) -> tuple[int, list]:
    """Pack images into equal-size groups of one fold each: (images per group k, [(fold, image indices)]).

    A group shorter than k is padded later with zero-weight copies of its first image. k is the
    largest group size ≤ chunk_images (and ≤ the largest fold) whose padding stays within a quarter
    of the real images: equal folds give one group per fold and no padding at all.
    """
    members = [[i for i, f in enumerate(fold_of_image) if f == fold] for fold in range(n_folds)]
    sizes = [len(m) for m in members if m]
    n = sum(sizes)
    limit = min(n if chunk_images < 1 else chunk_images, max(sizes))
    k = next(k for k in range(limit, 0, -1) if sum(-(-s // k) * k for s in sizes) <= 1.25 * n)
    groups = [(fold, m[start : start + k]) for fold, m in enumerate(members) for start in range(0, len(m), k)]
    return k, groups


def call_sizes(fold_of_image: list[int], n_folds: int, chunk_images: int, chunk_draws: int, n_draws: int,
               method: str) -> tuple[int, int]:
    """(fold groups, samples) of the probe's largest call: what one forward and backward holds at once.
    vmap takes several groups of k images per call, folds one group; each takes ≤ chunk_draws draws."""
    k, groups = fold_groups(fold_of_image, n_folds, chunk_images)
    d_chunk = n_draws if chunk_draws < 1 else min(chunk_draws, n_draws)
    per_call = 1 if method == "folds" else min(len(groups), max(1, (len(fold_of_image) if chunk_images < 1
                                                                    else chunk_images) // k))
    return per_call, per_call * k * d_chunk


def fold_sums(
    model: torch.nn.Module,
    names: list[str],
    images: torch.Tensor,  # [N, C, H, W] on the device
    eps: torch.Tensor,  # [N, D, C, H, W] on the device
    sigma: float,
    sigma_cond: torch.Tensor,  # 0-d tensor, the σ fed to the conditioning pathway
    fold_of_image: torch.Tensor,  # [N] int64 on the device
    n_folds: int,
    chunk_images: int = CHUNK_IMAGES,
    chunk_draws: int = CHUNK_DRAWS,
    method: str = "vmap",
    forward: torch.nn.Module | None = None,
    train_stream: int | None = None,  # train mode: the run's seed keys the model's randomness (folds only)
    accumulator: torch.dtype = torch.float64,  # the fold sums' dtype while they accumulate
    second_from: int | None = None,  # also sum draws ≥ this one apart (the pairing receipt's halves)
    objective: Objective | None = None,  # noising, target and weight (twinrun.objectives); None = edm
    cond: dict | None = None,  # per-image conditioning {name: [N, ...]} on the device, fed as keywords
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[n_folds, P] float32: Σ over the fold's images and draws of ∇ loss(image, draw).

    The loss is the objective's: λ(σ)·mean((forward(x_σ, σ, σ_cond, **cond) − target)²), σ the bin's level
    in the objective's units; every sample gets its own image's conditioning entries.

    second_from=k1: also return the float64 sums over draws k1.. alone, [n_folds, P] (draw_pieces: the
    fold sums themselves are computed exactly as without it, chunk for chunk).

    A fold's sum is the gradient of the fold's summed loss, so no per-sample gradient is ever
    formed. Images are packed into groups of one fold each (`fold_groups`); each group gets its own
    copy of the probed parameters (a stride-0 expand, no memory), the forward is vmapped over the
    groups and one plain backward gives every copy its group's gradient: the weight gradients are
    batched matmuls with the FLOPs of a plain backward's. Chunks of ≤ chunk_images images x
    ≤ chunk_draws draws stream into float64 fold sums, so memory is bounded by the chunk, not by
    N x D (-1 = no limit).

    method="folds" runs one plain backward per fold chunk instead (`plain_fold_sums`), through
    `forward` (the model itself, or its torch.compile'd module) when given.
    """
    assert method in ("vmap", "folds"), f"method must be resolved before the probe runs, got {method!r}"
    assert train_stream is None or method == "folds", "only the folds method shares the model's randomness"
    if method == "folds":
        return plain_fold_sums(model, names, images, eps, sigma, sigma_cond, fold_of_image, n_folds,
                               chunk_images, chunk_draws, forward, train_stream, accumulator, second_from,
                               objective, cond)
    objective = EDM() if objective is None else objective
    cond = cond or {}
    params = dict(model.named_parameters())
    probed = {n: params[n].detach() for n in names}
    frozen = {n: p.detach() for n, p in params.items() if n not in probed}
    frozen.update(dict(model.named_buffers()))
    n_images, n_draws = eps.shape[0], eps.shape[1]
    k, groups = fold_groups(fold_of_image.tolist(), n_folds, chunk_images)
    per_call = max(1, (n_images if chunk_images < 1 else chunk_images) // k)
    d_chunk = n_draws if chunk_draws < 1 else min(chunk_draws, n_draws)
    weight = bin_weight(objective, model, sigma)

    ties = aliases(model)

    def group_loss(p, x, e, mask, c):  # p per name, x [k,C,H,W], e [k,d,C,H,W], mask [k], c {name: [k, ...]}
        clean = x.unsqueeze(1).expand_as(e).reshape(-1, *x.shape[1:])
        sig = torch.full((clean.shape[0],), float(sigma), dtype=x.dtype, device=x.device)
        flat = e.flatten(0, 1)
        noisy = objective.noisy(model, clean, flat, sig)
        values = {**dict(zip(names, p)), **frozen}
        for alias, name in ties:  # what functional_call's tie_weights would find again on every call
            values[alias] = values[name]
        out = functional_call(model, values, (noisy, sig, sigma_cond.to(x.dtype).expand_as(sig)),
                              conditioning.per_draw(c, e.shape[1]), tie_weights=False)
        per_sample = (out - objective.target(model, clean, flat, sig)).square().flatten(1).mean(1)
        return weight * (per_sample.view(e.shape[:2]) * mask.unsqueeze(1)).sum()

    ends = torch.tensor([probed[n].numel() for n in names]).cumsum(0).tolist()
    columns = list(zip([0, *ends[:-1]], ends))  # each probed parameter's columns in the sums
    sums = torch.zeros(n_folds, ends[-1], dtype=accumulator, device=images.device)
    second = None if second_from is None else torch.zeros_like(sums)
    pieces = draw_pieces(n_draws, d_chunk, second_from)
    copies: dict[int, tuple] = {}  # number of groups -> the probed parameters' expanded leaves
    for start in range(0, len(groups), per_call):
        chunk = groups[start : start + per_call]
        # Pad every group to k images with copies of its first image, weighted 0.
        index = torch.tensor([m + m[:1] * (k - len(m)) for _, m in chunk], device=images.device)
        mask = torch.tensor([[1.0] * len(m) + [0.0] * (k - len(m)) for _, m in chunk],
                            dtype=images.dtype, device=images.device)
        folds = [f for f, _ in chunk]
        # One group per fold, folds in a row (equal folds): add in place, float32 into the accumulator.
        rows = slice(folds[0], folds[-1] + 1) if folds == list(range(folds[0], folds[-1] + 1)) else None
        fold_index = torch.tensor(folds, device=images.device)
        if len(chunk) not in copies:  # leaves outlive a backward: every call of this many groups reuses them
            copies[len(chunk)] = tuple(probed[n].expand(len(chunk), *probed[n].shape).requires_grad_()
                                       for n in names)
        leaves = copies[len(chunk)]  # a tuple, not a dict: vmap flattens its inputs on every call
        for d0, d1, into in pieces:
            loss = vmap(group_loss)(leaves, images[index], eps[index, d0:d1], mask,
                                    conditioning.take(cond, index)).sum()
            grads = torch.autograd.grad(loss, leaves)
            for (lo, hi), g in zip(columns, grads):  # per parameter: no [G, P] temporaries
                # Widened once, before the add: a float32 + float64 add casts element by element
                # (several times slower); the widening is exact, so the sums' bits are the same.
                g = g.to(accumulator)
                for acc in (sums, second)[into[0]:into[1]]:
                    if rows is not None:
                        target = acc[rows, lo:hi].view(g.shape)  # g may be strided: add it as it is
                        target += g
                    else:
                        acc[:, lo:hi].index_add_(0, fold_index, g.reshape(len(chunk), -1))
    return sums.float() if second is None else (sums.float(), second.double())


def aliases(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(alias, name) for every parameter or buffer the model registers under more than one name (tied
    weights): `name` is the one named_parameters / named_buffers give, `alias` another. The same ties
    functional_call(tie_weights=True) looks up on every call, found once."""
    first: dict[int, str] = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        first.setdefault(id(t), name)
    every = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    return [(name, first[id(t)]) for name, t in every if first[id(t)] != name]


def bin_weight(objective: Objective, model: torch.nn.Module, sigma: float) -> float:
    """λ at the bin's level, computed in float64: every sample of a bin shares it, so it scales the sums."""
    return float(objective.weight(model, torch.tensor(float(sigma), dtype=torch.float64)))


def half_draws(n_draws: int) -> list[int] | None:
    """[k1, k2]: the draws an image contributes to each half of its fold's sum (k1 = ⌊D/2⌋), None for one
    draw (no halves: no pairing receipt)."""
    return None if n_draws < 2 else [n_draws // 2, n_draws - n_draws // 2]


def draw_pieces(n_draws: int, d_chunk: int, second_from: int | None) -> list[tuple[int, int, tuple]]:
    """The draw ranges one fold group is differentiated over: (d0, d1, (first, last) of (sums, second)
    they add into). The fold sums' chunks are those of d_chunk, always, so their bits never depend on
    second_from; a chunk that straddles second_from is differentiated once more over its draws from
    second_from on, for the second half's sums alone (at most one extra chunk per group)."""
    out = []
    for d0 in range(0, n_draws, d_chunk):
        d1 = min(d0 + d_chunk, n_draws)
        if second_from is None or d1 <= second_from:
            out.append((d0, d1, (0, 1)))
        elif d0 >= second_from:
            out.append((d0, d1, (0, 2)))
        else:
            out += [(d0, d1, (0, 1)), (second_from, d1, (1, 2))]
    return out


def plain_fold_sums(
    model: torch.nn.Module,
    names: list[str],
    images: torch.Tensor,
    eps: torch.Tensor,
    sigma: float,
    sigma_cond: torch.Tensor,
    fold_of_image: torch.Tensor,
    n_folds: int,
    chunk_images: int = CHUNK_IMAGES,
    chunk_draws: int = CHUNK_DRAWS,
    forward: torch.nn.Module | None = None,
    train_stream: int | None = None,
    accumulator: torch.dtype = torch.float64,
    second_from: int | None = None,
    objective: Objective | None = None,
    cond: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`fold_sums` by one plain forward and backward per (fold group, draw chunk): no vmap.

    Each call sees images of one fold only, so the gradient of its summed loss is that chunk's
    share of the fold's sum; the model's own parameters are the leaves (its compiled module,
    `forward`, shares them), and no group is padded.
    """
    forward = model if forward is None else forward
    objective = EDM() if objective is None else objective
    cond = cond or {}
    params = dict(model.named_parameters())
    leaves = [params[n] for n in names]
    n_draws = eps.shape[1]
    _, groups = fold_groups(fold_of_image.tolist(), n_folds, chunk_images)
    d_chunk = n_draws if chunk_draws < 1 else min(chunk_draws, n_draws)
    weight = bin_weight(objective, model, sigma)
    ends = torch.tensor([p.numel() for p in leaves]).cumsum(0).tolist()
    sums = torch.zeros(n_folds, ends[-1], dtype=accumulator, device=images.device)
    second = None if second_from is None else torch.zeros_like(sums)
    with torch.enable_grad():
        for group, (fold, members) in enumerate(groups):
            index = torch.tensor(members, device=images.device)
            for d0, d1, into in draw_pieces(n_draws, d_chunk, second_from):
                e = eps[index, d0:d1]
                clean = images[index].unsqueeze(1).expand_as(e).reshape(-1, *images.shape[1:])
                sig = torch.full((clean.shape[0],), float(sigma), dtype=images.dtype, device=images.device)
                flat = e.flatten(0, 1)
                noisy = objective.noisy(model, clean, flat, sig)
                extra = conditioning.per_draw(conditioning.take(cond, index), d1 - d0)
                seed = None if train_stream is None else stream_seed(train_stream, sigma, group, d0)
                with shared_stream(seed, images.device):  # train mode: the same masks in every arm
                    out = forward(noisy, sig, sigma_cond.to(images.dtype).expand_as(sig), **extra)
                target = objective.target(model, clean, flat, sig)
                loss = weight * (out - target).square().flatten(1).mean(1).sum()
                grads = torch.autograd.grad(loss, leaves)
                for lo, hi, g in zip([0, *ends[:-1]], ends, grads):
                    for acc in (sums, second)[into[0]:into[1]]:
                        acc[fold, lo:hi] += g.reshape(-1)
    return sums.float() if second is None else (sums.float(), second.double())


def saved_bytes_per_sample(model: torch.nn.Module, images: torch.Tensor, sigma: float) -> int:
    """Bytes autograd keeps for the backward per sample of one forward (the activations), beyond the
    parameters and buffers it also keeps: the slope between batches of 1 and 3 of the probe's images."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def saved(n: int) -> int:
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in own:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        x = images[torch.arange(n, device=images.device) % images.shape[0]]
        sig = torch.full((n,), float(sigma), dtype=x.dtype, device=x.device)
        devices = [x.device] if x.device.type == "cuda" else []
        with (torch.random.fork_rng(devices=devices), torch.enable_grad(),  # (train mode: dropout draws)
              torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            model(x + sig.view(-1, 1, 1, 1) * torch.ones_like(x), sig, sig)
        return sum(kept.values())

    return max(0, (saved(3) - saved(1)) // 2)


def check_finite(sums: torch.Tensor, arm: str, bin_index: int, sigma: float) -> None:
    if not torch.isfinite(sums).all():
        bad = (~torch.isfinite(sums)).sum().item()
        raise NonFiniteGradient(
            f"arm {arm}, bin {bin_index} (σ={sigma:g}): {bad} gradient entries are NaN or inf; "
            "earlier bins are kept. Check the model at this σ (or the probed parameters)"
        )
