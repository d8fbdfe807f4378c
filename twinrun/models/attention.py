"""Attention that torch.vmap batches: the probe's `vmap` method on a diffusers network, at the cost of
a plain batched backward instead of a per-group loop.

diffusers' attention processors call F.scaled_dot_product_attention, whose CPU kernel has no vmap
batching rule: under the probe's vmap over fold groups, torch falls back to a loop over the groups,
slicing every query, key and value, and the backward of each slice writes a zero tensor the size of
the whole input (O(groups²) memory traffic). On the worked example's SD3 network that made the probe
3.3x a plain batched backward. Here the vmapped dimension is folded into attention's own batch
dimension instead, so one SDPA call (forward and backward) serves every group.

Bits: SDPA treats each (batch, head) row on its own (the CPU flash kernel splits work by batch, head
and query block, with block sizes set by the sequence lengths alone), so folding the groups into the
batch computes every row exactly as the per-group loop did: fold sums are bit-identical to diffusers'
own processors on the CPU (tests/models/test_attention.py compares them). Outside vmap (the `folds` method,
training, a compiled forward) the processor diffusers chose runs untouched. The code is twinrun's, so
it is on every run's kernel path (`twinrun_sources_sha256`).

When vmap is the innermost transform (the probe), the fold is done at vmap's level directly, with the
private functorch calls torch's own autograd.Function vmap support makes; under any other transform
(or a torch without them) it goes through BatchedSDPA, an autograd.Function with a vmap rule.
"""

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

try:  # torch's private functorch API, the calls its autograd.Function vmap support makes; absent: BatchedSDPA
    from torch._C._functorch import TransformType, _add_batch_dim, _unwrap_batched
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
except ImportError:  # pragma: no cover (torch 2.13 has it)
    retrieve_current_functorch_interpreter = None

SDPA = F.scaled_dot_product_attention


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """SDPA's arguments, in its order, however the processor passed them (Python binds them)."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _fold(t: torch.Tensor, dim: int | None, groups: int) -> torch.Tensor:
    """[groups·b, ...] from a tensor vmapped at `dim` (None: shared by every group, so repeated)."""
    t = t.unsqueeze(0).expand(groups, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(groups * t.shape[1], *t.shape[2:])


def _fold_mask(mask: torch.Tensor | None, dim: int | None, groups: int, batch: int, rank: int):
    """The attention mask against the folded query: a shared mask without a batch dimension (or with 1)
    broadcasts as it is; otherwise its batch dimension is made `batch` and folded like the query's."""
    if mask is None or (dim is None and (mask.dim() < rank or mask.shape[0] == 1)):
        return mask
    m = mask.unsqueeze(0) if dim is None else mask.movedim(dim, 0)
    m = m.reshape(groups if dim is not None else 1, *([1] * (rank + 1 - m.dim())), *m.shape[1:])
    return _fold(m.expand(groups, batch, *m.shape[2:]), 0, groups)


class BatchedSDPA(torch.autograd.Function):
    """SDPA with a vmap rule (`vmap` below). Outside vmap it is never applied (the processor calls SDPA
    itself); under another torch.func transform it is SDPA with a recomputing backward."""

    @staticmethod
    def forward(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
        return SDPA(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:4])
        ctx.options = inputs[4:]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            out = BatchedSDPA.forward(*leaves, mask, *ctx.options)
            needed = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad(out, needed, grad))
        return (*(next(found) if t.requires_grad else None for t in leaves), None, None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
        return _folded_sdpa(info.batch_size, in_dims[:4], q, k, v, mask, dropout_p, is_causal, scale,
                            enable_gqa), 0


def _folded_sdpa(g, dims, q, k, v, mask, *options) -> torch.Tensor:
    """[g, batch, ...]: SDPA over the g groups at once, on tensors unwrapped from vmap's level (each
    batched at its dim in `dims`, or None: shared), so ordinary autograd records SDPA itself."""
    fq, fk, fv = (_fold(t, d, g) for t, d in zip((q, k, v), dims[:3]))
    batch, rank = fq.shape[0] // g, fq.dim()
    m = _fold_mask(mask, dims[3], g, batch, rank)
    dropout_p, is_causal, scale, enable_gqa = options
    out = SDPA(fq, fk, fv, attn_mask=m, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
               enable_gqa=enable_gqa)
    return out.reshape(g, batch, *out.shape[1:])


def _sdpa_at_vmap_level(interpreter, args: tuple) -> torch.Tensor:
    """BatchedSDPA.vmap's arithmetic without autograd.Function's per-call machinery: unwrap the inputs
    at this vmap level, fold, run SDPA with the level lowered, rewrap. It is what torch does for an
    autograd.Function's vmap rule, whose Python (pytree walks, output wrapping, a signature bind) made
    the probe 4-7% slower on the worked example's SD3 network (1 thread); the SDPA call is the same."""
    level = interpreter.level()
    unwrapped = [_unwrap_batched(t, level) if isinstance(t, torch.Tensor) else (t, None) for t in args[:4]]
    with interpreter.lower():
        out = _folded_sdpa(interpreter.batch_size(), [d for _, d in unwrapped], *(t for t, _ in unwrapped),
                           *args[4:])
    return _add_batch_dim(out, 0, level)


class _SDPAUnderVmap(TorchFunctionMode):
    """Routes the processor's F.scaled_dot_product_attention through the folded SDPA, nothing else:
    directly when vmap is the innermost transform (the probe), through BatchedSDPA under any other."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA:
            bound = _sdpa_args(*args, **kwargs)
            if bound[4] == 0.0:  # dropout_p: dropout draws per group, left to vmap's own rules
                found = retrieve_current_functorch_interpreter
                interpreter = found() if found is not None else None
                if interpreter is not None and interpreter.key() == TransformType.Vmap:
                    return _sdpa_at_vmap_level(interpreter, bound)
                return BatchedSDPA.apply(*bound)
        return func(*args, **kwargs)


class VmapAttention:
    """An attention processor: the one diffusers chose (`inner`), with its SDPA batched under vmap.

    diffusers hands a processor only the keywords its __call__ names, so this one shows the inner's
    signature (its own is *args, **kwargs)."""

    def __init__(self, inner):
        self.inner = inner

        def call(*args, **kwargs):
            return self._run(*args, **kwargs)

        call.__signature__ = inspect.signature(inner.__call__)
        self.__call__ = call

    def __call__(self, *args, **kwargs):
        return self._run(*args, **kwargs)

    def __reduce__(self):  # pickle and deepcopy rebuild it (the signature-bearing closure cannot be pickled)
        return VmapAttention, (self.inner,)

    def _run(self, *args, **kwargs):
        # Under vmap (any torch.func transform) only; torch's own autograd.Function.apply asks the same.
        if not torch._C._are_functorch_transforms_active():
            return self.inner(*args, **kwargs)
        with _SDPAUnderVmap():
            return self.inner(*args, **kwargs)


def batch_attention(net: torch.nn.Module) -> torch.nn.Module:
    """Wrap every attention processor of a diffusers network in VmapAttention (idempotent)."""
    for module in net.modules():
        processor = getattr(module, "processor", None)
        if callable(getattr(module, "set_processor", None)) and processor is not None \
                and not isinstance(processor, VmapAttention):
            module.set_processor(VmapAttention(processor))
    return net
