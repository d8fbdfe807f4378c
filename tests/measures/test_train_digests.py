"""A step's weight digests hashed on another thread while the next step's forward and backward run
(train_step.DigestsMeanwhile): each step's are the digests of the weights right after that step, even when
the hasher lags a whole step behind, because the next update waits for them."""

import threading

import torch

from twinrun.config import TrainConfig
from twinrun.interventions import Native
from twinrun.measures import train_loop as loop
from twinrun.measures import train_step as ts
from twinrun.measures.train_state import ArmState


class Tiny(torch.nn.Module):
    sigma_data = 0.5

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x, sigma, sigma_cond):
        return self.lin(x)


def arm_of(model, lr=0.1) -> ArmState:
    t = TrainConfig(batch_size=8)
    return ArmState(model, torch.optim.SGD(model.parameters(), lr=lr), Native(), 0, t, None, None,
                    loop.build_step(t.step))


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.rand(n, generator=g) + 0.2, torch.randn(n, 6, generator=g)


def test_digests_hashed_meanwhile_are_each_steps_weights_even_when_the_hasher_lags():
    arm = arm_of(Tiny(), lr=0.5)
    meanwhile, expected = ts.DigestsMeanwhile(arm.model), []
    gate = threading.Event()

    def before_update():  # the update about to write the weights: let the lagging hasher go, then wait
        gate.set()
        meanwhile.wait()

    for k in range(4):
        x, sigma, eps = batch(8, seed=k)
        loop.loop_step(arm, arm.step_fn, x, list(range(8)), sigma, eps, 7, k + 1, before_update=before_update)
        expected.append(ts.weight_digests(arm.model))
        gate.clear()
        ts._HASHER.submit(gate.wait, 10)  # the hasher busy until the next update is about to run
        meanwhile.after_step()
    gate.set()
    meanwhile.wait()
    assert meanwhile.digests == expected
    assert len({tuple(d) for d in expected}) == 4  # every step moved the weights


def test_a_step_of_your_own_is_hashed_at_once():
    arm = arm_of(Tiny())
    meanwhile = ts.DigestsMeanwhile(arm.model, meanwhile=False)
    meanwhile.after_step()
    assert meanwhile.pending is None and meanwhile.digests == [ts.weight_digests(arm.model)]
    with torch.no_grad():
        arm.model.lin.weight.add_(1.0)
    assert meanwhile.digests != [ts.weight_digests(arm.model)]


def test_digests_follow_a_parameter_to_other_memory_and_copy_a_strided_one_every_step():
    """The parameters' views are made once and reused while each keeps its memory: one whose memory is
    swapped (as parking swaps it) is read where it is now, and a strided one (no view of its bytes) is
    copied afresh at every step, so an in-place update of either is seen."""
    arm = arm_of(Tiny())
    meanwhile, expected = ts.DigestsMeanwhile(arm.model), []
    weight, bias = arm.model.lin.weight, arm.model.lin.bias

    def step(change):
        with torch.no_grad():
            change()
        expected.append(ts.weight_digests(arm.model))
        meanwhile.after_step()
        meanwhile.wait()

    step(lambda: bias.add_(1.0))  # in place: the views made at the first step see it
    step(lambda: bias.add_(1.0))
    step(lambda: setattr(weight, "data", weight.data + 1.0))  # other memory
    step(lambda: weight.add_(1.0))
    step(lambda: setattr(weight, "data", (weight.data + 1.0).t().contiguous().t()))  # strided: no view
    step(lambda: weight.add_(1.0))
    step(lambda: weight.add_(1.0))
    assert not weight.is_contiguous()
    assert meanwhile.digests == expected
    assert len({tuple(d) for d in expected}) == len(expected)  # every change moved a digest


def test_a_frozen_weight_is_hashed_once_after_the_segments_last_step():
    """A frozen weight (requires_grad False) reads FROZEN at every step but the last, where it is the
    weight's digest: a leak written into it at the first step is found there, after the last step. The
    trained weight's digests are every step's, as before. Neither path hashes it per step."""
    for meanwhile_on in (True, False):
        arm = arm_of(Tiny(), lr=0.5)
        arm.model.lin.bias.requires_grad_(False)
        meanwhile, steps = ts.DigestsMeanwhile(arm.model, meanwhile=meanwhile_on), []
        for k in range(3):
            x, sigma, eps = batch(8, seed=k)
            loop.loop_step(arm, arm.step_fn, x, list(range(8)), sigma, eps, 7, k + 1,
                           before_update=meanwhile.wait)
            if k == 0:
                with torch.no_grad():
                    arm.model.lin.bias.mul_(1 + 1e-6)  # a leak into the frozen weight, at the first step
            steps.append(ts.weight_digests(arm.model))
            meanwhile.after_step()
        digests = meanwhile.finish()
        assert [d[0] for d in digests] == [s[0] for s in steps]  # the trained weight: every step
        assert [d[1] for d in digests] == [ts.FROZEN, ts.FROZEN, steps[-1][1]]  # the frozen one: the last
        assert digests[-1] == ts.weight_digests(arm.model)
