"""Test-side: a model whose only matmul is a bmm, and an Inductor autotuner made to crown the winner the
test names (TWINRUN_TEST_CROWN=aten|cpp), because this machine's own timings may well be stable.

Imported by the model builder, so in a local run it patches the job's process before anything compiles.
Timing is replaced, not the choice rule: Inductor still crowns the fastest candidate, the counter it
keeps (`select_algorithm_autotune`) still moves, and its feedback savers still see every timing."""

import os

import torch
from torch import nn

K = 1024  # the bmm's inner dimension


class BmmNet(nn.Module):
    """An 8×8 image, its rows repeated to 1024 columns, times a 1024×8 weight as a batched matmul
    (max-autotune times a C++ GEMM template against ATen for every bmm on the CPU), plus a bias: a
    small model whose winner changes its bits (at K = 64 the two sum alike; at 1024 they do not)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(0.03 * torch.randn(K, 8, generator=gen))
        self.b = nn.Parameter(0.1 * torch.randn(1, generator=gen))
        self.sigma_data = 0.5  # the EDM weighting the probe reads

    def forward(self, x, sigma, cond):
        h = x.reshape(x.shape[0], 8, 8).repeat(1, 1, K // 8)
        return (torch.bmm(h, self.w.expand(x.shape[0], K, 8)) + self.b).reshape(x.shape)


def bmm_net(path=None):
    crown(os.environ.get("TWINRUN_TEST_CROWN"))
    return BmmNet()


def crown(winner: str | None) -> None:
    """Every autotune in this process times `winner`'s candidates at 1 ms and the others at 2 ms."""
    if winner is None:
        return
    from torch._dynamo.utils import counters
    from torch._inductor import select_algorithm

    def timed(self, choices, *args, **kwargs):
        counters["inductor"]["select_algorithm_autotune"] += 1
        return {c: 1.0 if _is_aten(c) == (winner == "aten") else 2.0 for c in choices}

    select_algorithm.AlgorithmSelectorCache.benchmark = timed


def _is_aten(choice) -> bool:
    return type(choice).__name__ == "ExternKernelCaller"
