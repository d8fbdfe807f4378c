"""The worked example "your own text-to-image model" (examples/text_to_image), every command of its
README in order: caches written from an encoder, a LoRA adapter, the probe with objective=flow and
pin_sigma, and a twin training run of the adapter alone. Skipped without diffusers and peft."""

import importlib.util
import json
import sys

import pytest
import torch
from conftest import REPO, run_twinrun

pytest.importorskip("diffusers")
pytest.importorskip("peft")
from twinrun import caches
from twinrun.storage.store import read_store

pytestmark = pytest.mark.slow
EXAMPLE = REPO / "examples" / "text_to_image"
SMALL_PROBE = ["probe.n_images=8", "probe.n_draws=2", "probe.n_folds=4", "sigma_grid.sigmas=[0.25,0.5]"]
SMALL_TRAIN = ["train.steps=4", "train.segment_steps=2", "train.batch_size=8", "train.heldout_images=8"]


def t2i():
    spec = importlib.util.spec_from_file_location("t2i", EXAMPLE / "t2i.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(module, monkeypatch, *argv):
    """The example's command line, run in this process (its imports paid once)."""
    monkeypatch.setattr(sys, "argv", ["t2i.py", *argv])
    module.main()


def test_every_command_of_the_worked_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = t2i()
    command(module, monkeypatch, "encode", "--out", "caches")
    latents, ids, cond = caches.load_cache("caches/heldout_latents.safetensors",
                                           "caches/heldout_text.safetensors")
    assert latents.shape == (297, 4, 8, 8) and len(ids) == 297
    assert cond["encoder_hidden_states"].shape == (297, 16, 16)
    assert cond["pooled_projections"].shape == (297, 16)
    # each image its own prompt: two digits of another class read other text
    assert not torch.equal(cond["pooled_projections"][0], cond["pooled_projections"][1])
    command(module, monkeypatch, "adapter", "--out", "adapters/lora")
    assert (tmp_path / "adapters" / "lora" / "adapter_model.safetensors").is_file()

    conf = ["--config-dir", str(EXAMPLE / "conf")]
    probe = run_twinrun([*conf, "+experiment=t2i_pin_t", *SMALL_PROBE, f"hydra.run.dir={tmp_path / 'probe'}"],
                        cwd=tmp_path)
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    summary = json.loads((tmp_path / "probe" / "summary.json").read_text())
    assert summary["passed"] and all(g["bit_identical"] for g in summary["gates"])
    store = read_store(next((tmp_path / "probe" / "arms" / "native").glob("*.safetensors")))
    assert store.meta["adapter_sha256"] and all("lora_" in e["name"] for e in store.meta["layout"])

    train = run_twinrun([*conf, "+experiment=t2i_train_lora", *SMALL_TRAIN,
                         f"hydra.run.dir={tmp_path / 'train'}"], cwd=tmp_path)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    assert json.loads((tmp_path / "train" / "summary.json").read_text())["checks_passed"]
