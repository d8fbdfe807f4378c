"""Tied weights under the vmap method: one Parameter registered under two names must carry every group's
copy under both, or the second name's use never reaches the probed gradient. The probe finds the ties
once per call of fold_sums (fold_sums.aliases) instead of letting functional_call look them up per chunk."""

import torch
from per_sample import loop_sums
from torch import nn

from twinrun.measures import fold_sums as fs

FOLDS = [0, 1, 0, 1]


class TiedDenoiser(nn.Module):
    """EDM-style forward(x, σ, σ_cond) -> denoised, with `b.weight` the very Parameter `a.weight` is."""

    sigma_data = 0.5

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x, sigma, sigma_cond):
        h = torch.tanh(self.a(x.flatten(1))) * sigma_cond.view(-1, 1)
        return (x.flatten(1) + self.b(h)).view_as(x)


def test_aliases_name_each_second_registration_of_a_tensor():
    model = TiedDenoiser()
    assert [n for n, _ in model.named_parameters()] == ["a.weight", "a.bias"]
    assert fs.aliases(model) == [("b.weight", "a.weight")]
    assert fs.aliases(nn.Linear(2, 2)) == []


def test_a_tied_weight_gets_the_gradient_of_both_its_uses():
    model = TiedDenoiser()
    gen = torch.Generator().manual_seed(1)
    images, eps = torch.rand(4, 1, 4, 4, generator=gen) * 2 - 1, torch.randn(4, 3, 1, 4, 4, generator=gen)
    names = fs.select_params(model, ["*"])
    got = fs.fold_sums(model, names, images, eps, 0.5, torch.tensor(1.2), torch.tensor(FOLDS), 2, -1, 2,
                       method="vmap")
    want = loop_sums(model, names, images, eps, 0.5, 1.2, FOLDS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
