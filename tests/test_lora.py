"""LoRA adapters through peft (twinrun/lora.py): a checkpoint loads onto the network in place, its
content digest is what its bytes are, the probe selects exactly its tensors, bad adapters are one line
naming the key; and `train.params` freezes every other parameter of a training run."""

import json
import os

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("diffusers")
import peft
from safetensors.torch import load_file, save_file

from twinrun import lora
from twinrun.config import TrainConfig, register_configs
from twinrun.errors import ConfigError
from twinrun.interventions import Native
from twinrun.measures import fold_sums as fs
from twinrun.measures import train_step as ts
from twinrun.measures.train_state import build_optimizer, build_start
from twinrun.models import sd3

ADAPTER_PATTERN = ["*lora_*"]


def write_adapter(path, seed=3, rank=2):
    """A random (as if trained) rank-`rank` adapter of the default tiny SD3 network at `path`."""
    net = sd3.sd3().net
    lora.new_adapter(net, list(sd3.LORA_TARGETS), rank=rank, seed=seed, zero_init=False)
    return lora.save_adapter(net, path), net


def inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=gen)
    cond = {"encoder_hidden_states": torch.randn(3, 7, 16, generator=gen),
            "pooled_projections": torch.randn(3, 16, generator=gen)}
    return x, torch.full((3,), 0.4), cond


def test_a_checkpoint_loads_onto_the_network_and_computes_what_the_adapted_network_did(tmp_path):
    digest, adapted_net = write_adapter(tmp_path / "a")
    model = sd3.sd3(adapter=str(tmp_path / "a"))
    x, t, cond = inputs()
    want = adapted_net(hidden_states=x, timestep=1000 * t, **cond).sample
    torch.testing.assert_close(model(x, t, t, **cond), want, rtol=0, atol=0)
    assert not torch.equal(sd3.sd3()(x, t, t, **cond), want)  # the adapter changes the network
    assert model.adapter_sha256 == digest == lora.adapter_sha256(tmp_path / "a")
    # every parameter stays trainable: the run's probe.params / train.params choose
    assert all(p.requires_grad for p in model.parameters())
    # base weights keep their place under the adapter (base_layer) and the cond patterns still match
    names = [n for n, _ in model.named_parameters()]
    assert "net.transformer_blocks.0.attn.to_q.base_layer.weight" in names


def test_the_digest_is_the_adapters_bytes(tmp_path):
    digest, _ = write_adapter(tmp_path / "a")
    other, _ = write_adapter(tmp_path / "b", seed=4)
    assert other != digest
    config = json.loads((tmp_path / "a" / lora.CONFIG_FILE).read_text())
    (tmp_path / "a" / lora.CONFIG_FILE).write_text(json.dumps({**config, "lora_alpha": 8}))
    assert lora.adapter_sha256(tmp_path / "a") != digest  # same weights, another scaling


def test_probe_params_select_exactly_the_adapters_tensors(tmp_path):
    write_adapter(tmp_path / "a")
    model = sd3.sd3(adapter=str(tmp_path / "a"))
    names = fs.select_params(model, ADAPTER_PATTERN)
    saved = load_file(tmp_path / "a" / lora.WEIGHTS_FILE)
    # the store's columns: one per adapter tensor, nothing of the base network
    assert len(names) == len(saved) and all(".lora_A." in n or ".lora_B." in n for n in names)
    layout = fs.layout(model, names, fs.cond_patterns(model))
    assert sum(e["numel"] for e in layout) == sum(v.numel() for v in saved.values())


def test_a_peft_model_checkpoint_with_its_prefix_loads_too(tmp_path):
    net = sd3.sd3().net
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=list(sd3.LORA_TARGETS),
                             init_lora_weights=False)
    wrapped = peft.get_peft_model(net, config)
    wrapped.save_pretrained(tmp_path / "p")
    assert any(k.startswith(lora.PEFT_MODEL_PREFIX) for k in load_file(tmp_path / "p" / lora.WEIGHTS_FILE))
    model = sd3.sd3(adapter=str(tmp_path / "p"))
    x, t, cond = inputs()
    want = wrapped(hidden_states=x, timestep=1000 * t, **cond).sample
    torch.testing.assert_close(model(x, t, t, **cond), want, rtol=1e-6, atol=1e-6)


def damage(tmp_path, how):
    path = tmp_path / "a"
    write_adapter(path)
    weights, config = path / lora.WEIGHTS_FILE, path / lora.CONFIG_FILE
    if how == "missing":
        return str(tmp_path / "nowhere")
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "fifo":
        weights.unlink()
        os.mkfifo(weights)
    elif how == "not_json":
        config.write_text("{not json")
    elif how == "other_targets":
        config.write_text(json.dumps({**json.loads(config.read_text()), "target_modules": ["no_such_layer"]}))
    elif how == "other_rank":
        config.write_text(json.dumps({**json.loads(config.read_text()), "r": 3}))
    elif how == "missing_tensor":
        tensors = load_file(weights)
        tensors.pop(min(tensors))
        save_file(tensors, weights)
    return str(path)


@pytest.mark.parametrize("how", ["missing", "truncated", "fifo", "not_json", "other_targets", "other_rank",
                                 "missing_tensor"])
def test_a_bad_adapter_is_one_line_naming_the_key(tmp_path, how):
    path = damage(tmp_path, how)
    with pytest.raises(ConfigError) as err:
        lora.load_adapter(sd3.sd3().net, path)
    message = str(err.value)
    assert message.startswith("model.adapter=") and "\n" not in message and path in message, message


# ----------------------------------------------------------------------------- train.params


def start(params):
    register_configs()
    t = TrainConfig(params=params, optimizer={"_target_": "torch.optim.AdamW", "lr": 1e-3})
    return build_start({"model": {"_target_": "twinrun.model.load_pretrained"}}, t, torch.device("cpu")), t


def test_train_params_freeze_every_other_parameter_and_a_step_leaves_them_bit_identical():
    model, t = start(["blocks.0.*"])
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("blocks.0.") for n in trained)
    optimizer = build_optimizer(t.optimizer, model, Native())
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trained)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    x, normal = torch.rand(4, 1, 8, 8, generator=gen) * 2 - 1, torch.randn(4, generator=gen)
    ts.train_step(model, optimizer, Native(), x, ts.sigma_of(normal), torch.randn(x.shape, generator=gen), 4)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in trained), n


def test_train_params_matching_nothing_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as err:
        start(["*lora_*"])
    assert str(err.value).startswith("train.params=['*lora_*']: matches no parameter")
