"""A twin training run on an emulated nondeterministic path, end to end on the CPU: every arm's backward
adds atomic-add-like noise (each element of the gradient at the model's output times 1 + ε·N(0, 1), from
the arm's own generator), so no two arms repeat each other's bits, as on a GPU whose backward adds with
atomics. With determinism off the run measures arms.replicates' default (four) replicates: a true no-op's
machinery arm passes the gate within the bound of their spread, and one whose no-op setting leaks a
learning rate 5 % off fails it; the probe on such a path passes a true no-op.
tests/analysis/test_gates_operating_characteristic.py measures the rule's rates by simulation.
"""

import itertools
import sys
import textwrap

import pytest
import torch

from twinrun.measures import train as train_kind

pytestmark = pytest.mark.slow

SEEDS = itertools.count(12345)  # one generator per arm: differing noise, the same in every test run
EPS = 1e-6  # the size of one rounding error of float32 sums, relative


class _Atomic(torch.autograd.Function):
    """The identity forward; its backward multiplies the incoming gradient by 1 + EPS·N(0, 1)."""

    @staticmethod
    def forward(ctx, x, gen):
        ctx.gen = gen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        noise = torch.randn(grad.shape, generator=ctx.gen, dtype=grad.dtype)
        return grad * (1 + EPS * noise), None


def _noisy_output(gen):
    return lambda module, args, out: _Atomic.apply(out, gen)


@pytest.fixture
def atomic_backward(monkeypatch):
    real = train_kind.TrainSession._arm

    def arm(self, start, spec):
        state = real(self, start, spec)
        state.model.register_forward_hook(_noisy_output(torch.Generator().manual_seed(next(SEEDS))))
        return state

    monkeypatch.setattr(train_kind.TrainSession, "_arm", arm)


LEAKY = textwrap.dedent("""
    from twinrun.interventions import ScaleLR

    class LeakyLr(ScaleLR):
        '''Its no-op setting (factor 1) trains at a learning rate 5 % above the optimizer's.'''
        def train_lr(self, lr):
            return lr * 1.05 if self.factor == 1 else lr * self.factor
""")


def test_a_true_no_op_passes_and_a_leak_fails_on_a_nondeterministic_path(tmp_path, monkeypatch,
                                                                        atomic_backward):
    from train_runs import train_run

    red = train_run(tmp_path / "noop", ["determinism.enabled=false"])
    s = red.summary
    assert not s["replicate"]["deterministic"] and "4 replicates" in s["replicate"]["detail"]
    differing = [g for g in s["gates"] if not g["bit_identical"]]
    assert differing and all(g["passed"] and g["rule"] == "within the path's wobble" for g in differing), \
        [g["detail"] for g in s["gates"]]
    assert all(len(g["replicate_distances"]) == 4 for g in differing) and s["passed"]
    # the floor is the larger of the chaos arm's distance and the replicates'
    for e in s["effects"]:
        assert e["floor"] >= e["replicate_distance"]

    (tmp_path / "leaky.py").write_text(LEAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    red = train_run(tmp_path / "leak", ["determinism.enabled=false", "intervention._target_=leaky.LeakyLr"])
    failed = [g for g in red.summary["gates"] if not g["passed"]]
    assert failed and {g["rule"] for g in failed} == {"beyond the path's wobble"}
    assert not red.summary["passed"] and "INSTRUMENT BROKEN" in red.summary["verdict"]
    sys.modules.pop("leaky", None)


@pytest.fixture
def atomic_probe_backward(monkeypatch):
    """The probe's model, every backward call multiplying the output's gradient by 1 + EPS·N(0, 1)."""
    from twinrun.measures import probe as probe_kind

    real = probe_kind.build_components

    def components(*args, **kwargs):
        c = real(*args, **kwargs)
        c.model.register_forward_hook(_noisy_output(torch.Generator().manual_seed(next(SEEDS))))
        return c

    monkeypatch.setattr(probe_kind, "build_components", components)


def test_a_true_no_op_passes_the_probes_gate_on_a_nondeterministic_path(tmp_path, atomic_probe_backward):
    from conftest import TINY, pin_device
    from train_runs import compose_cfg

    from twinrun.analysis.probe_reduce import reduce_run
    from twinrun.job import run_job
    from twinrun.plan import plan_run, trusted_targets

    cfg = compose_cfg(pin_device(["+experiment=pin_sigma", *TINY, "determinism.enabled=false",
                                  "probe.method=folds"]))
    plan_run(cfg, tmp_path / "run")
    run_job(tmp_path / "run", trusted_targets(cfg))
    s = reduce_run(tmp_path / "run").summary
    differing = [g for g in s["gates"] if not g["bit_identical"]]
    assert differing and all(len(g["replicate_shifts"]) == 4 for g in differing), s["gates"]
    assert all(g["passed"] and g["rule"] == "within the path's wobble" for g in differing), \
        [g["detail"] for g in s["gates"]]
