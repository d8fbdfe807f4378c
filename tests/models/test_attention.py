"""Attention that vmap batches (twinrun/models/attention.py): under the probe's vmap, diffusers' SDPA
runs as one call over every fold group instead of torch's per-group fallback loop, with the same bits
on the CPU, forward and backward, for any mix of batched and shared inputs and masks."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

pytest.importorskip("diffusers")

from twinrun.measures import fold_sums as fs
from twinrun.models import pixart, sd3
from twinrun.models.attention import BatchedSDPA, VmapAttention, _SDPAUnderVmap
from twinrun.objectives import OBJECTIVES

G, B, H, LQ, LK, D = 3, 2, 2, 5, 4, 8  # fold groups, batch per group, heads, query/key lengths, head dim
FALLBACK = "There is a performance drop because we have not yet implemented the batching rule"


def batched(q, k, v, mask):
    return BatchedSDPA.apply(q, k, v, mask, 0.0, False, None, False)


def routed(q, k, v, mask):
    """As a diffusers processor calls it inside VmapAttention: under vmap, folded without BatchedSDPA."""
    with _SDPAUnderVmap():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


ENTRIES = {"autograd.Function": batched, "the processor's call": routed}


def tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(G, B, H, LQ, D, generator=gen)
    k, v = (torch.randn(G, B, H, LK, D, generator=gen) for _ in range(2))
    mask = torch.randn(G, B, 1, LQ, LK, generator=gen)
    return q, k, v, mask


# (q, k, v, mask) vmapped (0) or shared by every group (None, its group 0 taken); a mask of None, a
# shared one with batch 1 or without a batch dimension, a batched one with batch 1.
CASES = {
    "all batched": ((0, 0, 0, 0), lambda m: m),
    "no mask": ((0, 0, 0, None), None),
    "shared keys and values": ((0, None, None, 0), lambda m: m),
    "shared mask of the full batch": ((0, 0, 0, None), lambda m: m),
    "shared mask of batch 1": ((0, 0, 0, None), lambda m: m[:, :1]),
    "shared mask without a batch dimension": ((0, 0, 0, None), lambda m: m[:, 0, 0]),
    "batched mask of batch 1": ((0, 0, 0, 0), lambda m: m[:, :1]),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", CASES)
def test_vmapped_sdpa_has_the_per_group_loops_bits_forward_and_backward(case, entry, monkeypatch):
    if entry != "autograd.Function":  # vmap the innermost transform: the direct path, never the Function
        monkeypatch.setattr(BatchedSDPA, "apply", lambda *a: pytest.fail("BatchedSDPA under plain vmap"))
    dims, shape_mask = CASES[case]
    q, k, v, m = tensors(1)
    mask = None if shape_mask is None else shape_mask(m)
    args = [t if d == 0 or t is None else t[0] for t, d in zip((q, k, v, mask), dims)]
    leaves = [a.clone().requires_grad_() for a in args[:3]]
    got = vmap(ENTRIES[entry], in_dims=dims)(*leaves, args[3])
    grads = torch.autograd.grad(got.square().sum(), leaves)

    ref_leaves = [a.clone().requires_grad_() for a in args[:3]]
    with warnings.catch_warnings():  # torch's own fallback: a loop over the groups, with this warning
        warnings.filterwarnings("ignore", message=FALLBACK)
        want = vmap(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                    in_dims=dims)(*ref_leaves, args[3])
        want_grads = torch.autograd.grad(want.square().sum(), ref_leaves)
    assert torch.equal(got, want)
    for a, b, d in zip(grads, want_grads, dims):
        if d is None:  # a shared input's gradient sums its groups' in another order: equal to rounding
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:  # (the probe's inputs are all vmapped: every image and its conditioning is a group's own)
            assert torch.equal(a, b)


def test_outside_vmap_its_backward_recomputes_sdpas_own_gradient():
    q, k, v, m = (t[0].requires_grad_() for t in tensors(2))
    got = torch.autograd.grad(batched(q, k, v, m).sum(), (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=m).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_under_another_transform_the_processors_call_goes_through_batched_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(BatchedSDPA, "apply", lambda *a: calls.append(1) or F.scaled_dot_product_attention(
        *a[:3], attn_mask=a[3]))
    q, k, v, m = (t[0] for t in tensors(4))
    torch.func.grad(lambda q: routed(q, k, v, m).sum())(q)  # grad innermost: not vmap's level to fold
    assert calls == [1]
    vmap(routed)(*tensors(4))
    assert calls == [1]


def sums_and_warnings(kind: str, vmap_attention: bool):
    """The vmap probe's fold sums of a tiny adapter, and the messages of the warnings it raised."""
    model = {"sd3": sd3.sd3, "pixart": pixart.pixart}[kind](vmap_attention=vmap_attention)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 8, 8, generator=gen)
    eps = torch.randn(6, 3, 4, 8, 8, generator=gen)
    cond = {"encoder_hidden_states": torch.randn(6, 5, 16, generator=gen)}
    if kind == "sd3":
        cond["pooled_projections"] = torch.randn(6, 16, generator=gen)
    else:
        cond["encoder_attention_mask"] = torch.tensor([[1] * 5, [1] * 3 + [0] * 2] * 3)  # padded prompts
    level, level_cond = (0.4, 0.7) if kind == "sd3" else (300.0, 600.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sums = fs.fold_sums(model, fs.select_params(model, ["*"]), x, eps, level, torch.tensor(level_cond),
                            torch.tensor([0, 1, 2, 0, 1, 2]), 3, chunk_draws=2, method="vmap",
                            objective=OBJECTIVES["flow" if kind == "sd3" else "vp"](), cond=cond)
    return sums, [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_the_adapters_vmap_probe_keeps_its_bits_without_the_per_group_loop(kind):
    model = {"sd3": sd3.sd3, "pixart": pixart.pixart}[kind]()
    assert all(isinstance(m.processor, VmapAttention) for m in model.net.modules() if hasattr(m, "processor"))
    looped, loop_warnings = sums_and_warnings(kind, vmap_attention=False)
    folded, fold_warnings = sums_and_warnings(kind, vmap_attention=True)
    assert any(FALLBACK in w and "scaled_dot_product" in w for w in loop_warnings)  # the loop it replaces
    assert not any(FALLBACK in w for w in fold_warnings)
    assert (looped.abs().sum(1) > 0).all() and torch.equal(folded, looped)
