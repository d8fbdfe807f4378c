"""twinrun.models' adapters in whole runs, on the CPU: `pin_sigma` end to end on SD3 (flow) and PixArt (vp)
with each image's own text conditioning, gates bit-identical; a LoRA adapter probed alone (the stores'
columns are its tensors, its digest in every store) and trained alone in a twin training run."""

import fnmatch

import pytest
import torch
from hydra import compose, initialize_config_dir

pytest.importorskip("diffusers")
pytest.importorskip("peft")
from safetensors.torch import load_file

from twinrun import lora
from twinrun.analysis.probe_reduce import reduce_run
from twinrun.analysis.train_reduce import reduce_train
from twinrun.app import CONF_DIR
from twinrun.config import register_configs
from twinrun.job import run_job
from twinrun.models import sd3
from twinrun.plan import plan_run, trusted_targets
from twinrun.storage.store import read_store
from twinrun.storage.train_store import read_train_store

pytestmark = pytest.mark.slow

PROBE = ["probe.n_images=8", "probe.n_draws=2", "probe.n_folds=4"]
RUNS = {
    "sd3": ["model=sd3_tiny", "objective=flow", "data._target_=latent_data.sd3_latents",
            "sigma_grid.sigmas=[0.5,0.8]", "intervention.sigma_pin=0.5"],
    "pixart": ["model=pixart_tiny", "objective=vp", "data._target_=latent_data.pixart_latents",
               "sigma_grid.sigmas=[300,600]", "intervention.sigma_pin=300"],
}


def compose_cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run(run_dir, overrides):
    cfg = compose_cfg(overrides)
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    return cfg


@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_pin_sigma_runs_end_to_end_and_its_gate_is_bit_identical(kind, tmp_path):
    run(tmp_path / "run", ["+experiment=pin_sigma", *RUNS[kind], *PROBE])
    summary = reduce_run(tmp_path / "run").summary
    assert summary["checks_passed"] and summary["passed"], summary["checks"]
    assert summary["gates"] and all(g["bit_identical"] for g in summary["gates"])
    store = read_store(next((tmp_path / "run" / "arms" / "native").glob("*.safetensors")))
    assert any(e["cond"] for e in store.meta["layout"]) and "adapter_sha256" not in store.meta


def write_adapter(path):
    net = sd3.sd3().net
    lora.new_adapter(net, list(sd3.LORA_TARGETS), rank=2, seed=3, zero_init=False)
    return lora.save_adapter(net, path)


def test_a_lora_adapter_is_probed_alone_and_its_digest_is_in_every_store(tmp_path):
    digest = write_adapter(tmp_path / "lora")
    run(tmp_path / "run", ["+experiment=pin_sigma", *RUNS["sd3"], *PROBE,
                           f"model.adapter={tmp_path / 'lora'}", "probe.params=[*lora_*]",
                           "reduce.estimands=[all,residual]"])  # (the adapter is outside the cond pathway)
    adapter = load_file(tmp_path / "lora" / lora.WEIGHTS_FILE)
    stores = list((tmp_path / "run" / "arms").glob("*/*.safetensors"))
    assert stores
    for path in stores:
        store = read_store(path)
        assert store.meta["adapter_sha256"] == digest
        assert len(store.meta["layout"]) == len(adapter)
        assert all(fnmatch.fnmatchcase(e["name"], "*lora_*") for e in store.meta["layout"])
        assert store.sums.numel() == 4 * sum(v.numel() for v in adapter.values())  # 4 folds
    assert reduce_run(tmp_path / "run").summary["passed"]


def test_a_twin_training_run_trains_the_adapter_alone(tmp_path):
    write_adapter(tmp_path / "lora")
    run(tmp_path / "run", ["+experiment=train_scale_lr", "model=sd3_tiny", "objective=flow",
                           f"model.adapter={tmp_path / 'lora'}",
                           "data._target_=latent_data.sd3_train_and_heldout",
                           "train.params=[*lora_*]", "train.steps=4",
                           "train.segment_steps=2", "train.batch_size=8", "train.heldout_images=8"])
    reduction = reduce_train(tmp_path / "run")
    assert reduction.summary["passed"], reduction.summary["checks"]
    first = read_train_store(tmp_path / "run" / "arms" / "native" / "step000000.safetensors")
    start = {n: t for n, t in first.tensors.items() if n.startswith("weight/")}
    for path in (tmp_path / "run" / "arms").glob("*/seg002_*.safetensors"):
        end = read_train_store(path).tensors
        moved = {n for n, t in start.items() if not torch.equal(end[n], t)}
        assert moved and all("lora_" in n for n in moved), (path, sorted(moved)[:3])
