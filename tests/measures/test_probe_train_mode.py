"""Train-mode modules are handled before any bin: the probe measures in eval mode and says so; with
probe.train_mode=true, batch statistics are refused and dropout draws one stream for every arm."""

import json
import os
import textwrap

import pytest
import torch
from conftest import REPO, TINY, run_twinrun
from torch import nn

from twinrun.errors import ConfigError
from twinrun.measures import modes

NETS = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        # A small denoiser with one train-mode module in the middle (dropout, batch norm, or a batch
        # statistic computed by hand, which no module type names).
        def __init__(self, kind):
            super().__init__()
            self.sigma_data, self.kind = 0.5, kind
            self.conv = nn.Conv2d(1, 8, 3, padding=1)
            self.mid = {"dropout": nn.Dropout(0.3), "bn": nn.BatchNorm2d(8)}.get(kind, nn.Identity())
            self.out = nn.Conv2d(8, 1, 3, padding=1)

        def forward(self, x, sigma, sigma_cond=None):
            sc = sigma if sigma_cond is None else sigma_cond
            h = torch.tanh(self.conv(x) * (1 + torch.log(sc).view(-1, 1, 1, 1)))
            if self.kind == "batch_mean" and self.training:
                h = h - h.mean(0, keepdim=True)
            return 0.5 * x + self.out(self.mid(h))

    def build(kind="dropout"):
        torch.manual_seed(0)
        return Net(kind).train()
""")


@pytest.fixture
def nets(tmp_path):
    (tmp_path / "nets.py").write_text(NETS)
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "net.yaml").write_text("_target_: nets.build\nkind: dropout\n")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    return tmp_path, env


def probe(nets, name, *extra):
    root, env = nets
    run_dir = root / name
    args = ["--config-dir", str(root / "conf"), "+experiment=pin_sigma", "model=net", *TINY,
            "reduce.estimands=[all,residual]", f"hydra.run.dir={run_dir}", *extra]
    return run_twinrun(args, cwd=root, env=env), run_dir


@pytest.mark.slow
def test_eval_mode_is_the_default_and_is_announced(nets):
    proc, _ = probe(nets, "eval", "model.kind=dropout")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = "the model was built in train mode (Dropout at mid); the probe measures it in eval mode"
    assert said in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind, named", [("bn", "BatchNorm2d at mid"), ("batch_mean", "its forward")])
def test_train_mode_refuses_batch_statistics_naming_them(nets, kind, named):
    proc, run_dir = probe(nets, kind, f"model.kind={kind}", "probe.train_mode=true")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "probe.train_mode=True" in proc.stderr and named in proc.stderr and "couples" in proc.stderr
    assert not (run_dir / "run.json").exists()  # before any compute


@pytest.mark.slow
def test_train_mode_dropout_is_one_stream_for_every_arm(nets):
    """At the gate the arms are bit-identical only because both draw the same masks."""
    proc, run_dir = probe(nets, "shared", "model.kind=dropout", "probe.train_mode=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "probe.method=auto chose folds (the model draws randomness in train mode" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["passed"] and all(g["bit_identical"] for g in summary["gates"])


@pytest.mark.slow
def test_vmap_is_refused_for_train_mode_randomness(nets):
    proc, _ = probe(nets, "vmap", "model.kind=dropout", "probe.train_mode=true", "probe.method=vmap")
    assert proc.returncode == 2 and "only the folds method draws from one stream" in proc.stderr


def test_without_the_shared_stream_the_gate_sees_different_masks():
    """Break the rule on purpose: the same dropout forward, once per arm, without reseeding, differs;
    with the stream keyed by (seed, σ, group, draw) it repeats."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    x = torch.randn(3, 4)
    unshared = [net(x) for _ in range(2)]
    assert not torch.equal(*unshared)
    shared = []
    for _ in range(2):
        with modes.shared_stream(modes.stream_seed(0, 0.5, 0, 0), x.device):
            shared.append(net(x))
    assert torch.equal(*shared)
    assert modes.stream_seed(0, 0.5, 0, 0) != modes.stream_seed(0, 0.5, 1, 0)


def test_behaviour_probe_leaves_the_users_generator_as_it_was():
    net = nn.Sequential(nn.Conv2d(1, 2, 1), nn.Dropout(0.5)).train()
    images = torch.randn(3, 1, 4, 4)

    class Denoiser(nn.Module):
        def forward(self, x, sigma, sigma_cond):
            return net(x)

    state = torch.random.get_rng_state()
    assert modes.behaviour(Denoiser().train(), images, 0.5) == (True, False)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_refusal_is_a_config_error():
    class Coupled(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(1)

        def forward(self, x, sigma, sigma_cond):
            return self.bn(x)

    with pytest.raises(ConfigError, match="BatchNorm2d at bn"):
        modes.set_mode(Coupled(), torch.randn(3, 1, 4, 4), 0.5, train_mode=True, announce=False)


def test_a_batch_statistic_computed_by_hand_is_refused_in_eval_mode_too():
    """Eval mode switches off modules, not a forward that averages over the batch itself: the coupling
    check runs in either mode (it ran with train_mode=true only, and such a model was accepted)."""
    class ByHand(nn.Module):
        def forward(self, x, sigma, sigma_cond):
            return x - x.mean(0, keepdim=True)

    with pytest.raises(ConfigError, match="couples samples in eval mode"):
        modes.set_mode(ByHand(), torch.randn(3, 1, 4, 4), 0.5, train_mode=False, announce=False)

    class PerSample(ByHand):
        def forward(self, x, sigma, sigma_cond):
            return x - x.mean((1, 2, 3), keepdim=True)

    modes.set_mode(PerSample(), torch.randn(3, 1, 4, 4), 0.5, train_mode=False, announce=False)
