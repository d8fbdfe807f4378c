"""Interventions beyond σ: module hooks and input-side, their no-op settings and the machinery arm."""

import textwrap

import pytest
import torch
from conftest import TINY, run_twinrun

from twinrun.interventions import PinSigma, ScaleCond, ScaleInput, ScaleModule, attached
from twinrun.measures import fold_sums as probe
from twinrun.model import DiTDenoiser


@pytest.fixture(scope="module")
def model():
    gen = torch.Generator().manual_seed(0)
    m = DiTDenoiser(width=16, depth=2, heads=2, mlp_ratio=2, sigma_data=0.6)
    with torch.no_grad():  # away from adaLN-Zero's zero init, so every block matters
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return m.eval()


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(3, 1, 8, 8, generator=gen), torch.full((3,), 0.5)


def test_scale_module_scales_exactly_that_modules_output(model):
    x, sigma = _inputs()
    seen = {}
    handle = model.blocks[1].attn.register_forward_hook(lambda m, a, out: seen.setdefault("plain", out))
    with torch.no_grad():
        model(x, sigma)
    handle.remove()
    handle = model.blocks[1].attn.register_forward_hook(lambda m, a, out: seen.setdefault("hooked", out))
    with attached(ScaleModule("blocks.1.attn", 0.5), model), torch.no_grad():
        model(x, sigma)
    handle.remove()  # registered first, so it saw the module's own output; rescale to compare
    assert torch.equal(seen["hooked"], seen["plain"])
    with attached(ScaleModule("blocks.1.attn", 0.0), model), torch.no_grad():
        ablated = model(x, sigma)
    with torch.no_grad():
        saved = [p.detach().clone() for p in model.blocks[1].attn.parameters()]
        for p in model.blocks[1].attn.proj.parameters():
            p.zero_()  # attention's output projection zeroed: the same ablation by hand
        by_hand = model(x, sigma)
        for p, s in zip(model.blocks[1].attn.parameters(), saved):
            p.copy_(s)
    torch.testing.assert_close(ablated, by_hand)


def test_hooks_are_removed_after_the_block_even_on_error(model):
    x, sigma = _inputs()
    with torch.no_grad():
        before = model(x, sigma)
    with pytest.raises(RuntimeError), attached(ScaleModule("blocks.0.mlp", 0.0), model):
        raise RuntimeError("model failed mid-arm")
    with torch.no_grad():
        assert torch.equal(model(x, sigma), before)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_scale_input_is_the_model_at_a_scaled_input(model):
    x, sigma = _inputs()
    with attached(ScaleInput(0.9), model), torch.no_grad():
        hooked = model(x, sigma)
    with torch.no_grad():
        assert torch.equal(hooked, model(x * 0.9, sigma))


@pytest.mark.parametrize("intervention", [ScaleModule("blocks.1.attn", 1.0),
                                          ScaleModule("blocks.0.adaln", 1.0), ScaleInput(1.0)])
def test_no_op_settings_give_bit_identical_probe_sums(model, intervention):
    # The machinery arm's premise: the hook at its no-op setting leaves the probe's sums bit for bit.
    gen = torch.Generator().manual_seed(2)
    images = torch.rand(4, 1, 8, 8, generator=gen) * 2 - 1
    eps = torch.randn(4, 2, 1, 8, 8, generator=gen)
    names = probe.select_params(model, ["*"])
    args = (model, names, images, eps, 0.5, torch.tensor(0.5), torch.tensor([0, 0, 1, 1]), 2)
    plain = probe.fold_sums(*args)
    with attached(intervention, model):
        hooked = probe.fold_sums(*args)
    assert torch.equal(plain, hooked)
    with attached(type(intervention)(*((intervention.module,) if hasattr(intervention, "module") else ()),
                                     0.5), model):
        assert not torch.equal(plain, probe.fold_sums(*args))  # and the setting does reach the probe


def test_no_op_setting_is_declared():
    assert ScaleModule("blocks.1.attn", 0.5).noop() == {"factor": 1.0}
    assert ScaleInput(0.9).noop() == {"factor": 1.0}
    assert ScaleModule("blocks.1.attn", 0.5).gate_sigmas([0.2, 0.5]) == []


# An intervention whose no-op setting is not one (its hook moves the output by a relative 1e-6 even at
# factor 1), and one with neither a gate bin nor a no-op setting.
USER_INTERVENTIONS = textwrap.dedent("""
    from twinrun.interventions import Intervention, ScaleModule

    class LeakyScale(ScaleModule):
        name = "leaky_scale"

        def attach(self, model):
            target = dict(model.named_modules())[self.module]
            return [target.register_forward_hook(lambda m, a, out: out * self.factor * (1 + 1e-6))]

    class Unchecked(Intervention):
        name = "unchecked"

        def __init__(self, **settings):  # takes scale_module's keys, acts on none of them
            pass
""")


@pytest.mark.slow
def test_scale_module_runs_with_its_machinery_arm_bit_identical(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=scale_module", *TINY, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (run_dir / "arms").iterdir()) == ["native", "scale_module",
                                                                    "scale_module_noop"]
    assert "[ok] machinery_is_a_no_op" in proc.stdout


@pytest.mark.slow
def test_a_leaky_machinery_arm_fails_the_run(tmp_path):
    (tmp_path / "user_interventions.py").write_text(USER_INTERVENTIONS)
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=scale_module", "intervention._target_=user_interventions.LeakyScale",
                        *TINY, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                       env={"PYTHONPATH": _pythonpath(tmp_path)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("[FAIL] machinery_is_a_no_op" in proc.stdout
            and "effects" not in proc.stdout.split("INSTRUMENT")[-1])


def test_an_unknown_module_and_an_unchecked_intervention_are_refused_before_compute(tmp_path):
    (tmp_path / "user_interventions.py").write_text(USER_INTERVENTIONS)
    env = {"PYTHONPATH": _pythonpath(tmp_path)}
    proc = run_twinrun(["+experiment=scale_module", "intervention.module=blocks.9.attn", *TINY,
                        f"hydra.run.dir={tmp_path / 'a'}"], cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "intervention.module='blocks.9.attn'" in proc.stderr
    assert "blocks.1.attn" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_twinrun(["+experiment=scale_module", "intervention._target_=user_interventions.Unchecked",
                        *TINY, f"hydra.run.dir={tmp_path / 'b'}"],
                       cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "no no-op setting" in proc.stderr, proc.stderr[-2000:]
    assert not list((tmp_path / "b").glob("arms/*/*.safetensors"))


def _pythonpath(tmp_path) -> str:
    import os

    return os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])


def test_compiling_a_hook_intervention_is_refused():
    # A compiled graph does not see forward hooks added after compiling: the arm would silently be
    # the twin. σ-only interventions compile as before.
    from twinrun.errors import ConfigError
    from twinrun.interventions import PinSigma
    from twinrun.measures.trial import refuse_compiled_hooks

    with pytest.raises(ConfigError, match="probe.compile='default'.*forward hooks"):
        refuse_compiled_hooks("default", {"scale_module": ScaleModule("blocks.1.attn", 0.5)})
    refuse_compiled_hooks(None, {"scale_module": ScaleModule("blocks.1.attn", 0.5)})
    refuse_compiled_hooks("default", {"pin_sigma": PinSigma(0.5)})


def test_pin_sigma_at_its_level_noop_is_the_pin_filled_with_each_calls_own_level():
    # Its machinery setting (sampling's: no sampler step is its gate bin) follows every level bit for bit,
    # through the pin's own fill; the probe and training keep noop() None (a gate bin, or no no-op).
    follow = PinSigma(**PinSigma(0.5).level_noop())
    assert PinSigma(0.5).noop() is None and follow.sigma_pin == 0
    edm = [80.0, 3.7, 0.5, 0.0123, 0.002]  # σ, t and timesteps as samplers feed them: one level a call
    for level in [*edm, 0.37, 0.999, 999.0, 499.0, 1.0]:
        sigma = torch.full((3,), level, dtype=torch.float32)
        assert torch.equal(follow.sigma_cond(sigma), sigma), level
        assert torch.equal(PinSigma(0.5).sigma_cond(sigma), torch.full((3,), 0.5))  # the pin itself
    with pytest.raises(ValueError, match="one level per call"):  # a training batch has no such setting
        follow.sigma_cond(torch.tensor([0.5, 1.0]))


def test_scale_cond_at_its_level_noop_anchors_each_call_at_its_own_level():
    # Sampling's machinery arm for scale_cond: every call is its own anchor bin, so the whole scaling runs
    # (log, exp, where) and returns the twin's σ bit for bit; a real anchor still scales the other levels.
    follow = ScaleCond(**ScaleCond(0.5, 0.3).level_noop(), gamma=0.3)
    assert ScaleCond(0.5, 0.3).noop() is None and follow.anchor_sigma == 0
    for level in [80.0, 3.7, 0.5, 0.0123, 0.002, 0.37, 0.999, 999.0, 1.0]:
        sigma = torch.full((3,), level, dtype=torch.float32)
        assert torch.equal(follow.sigma_cond(sigma), sigma), level
        if level != 0.5:
            assert not torch.equal(ScaleCond(0.5, 0.3).sigma_cond(sigma), sigma), level
    with pytest.raises(ValueError, match="one level per call"):
        follow.sigma_cond(torch.tensor([0.5, 1.0]))
