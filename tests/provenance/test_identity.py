"""What the model is, on the record: every store carries the digests of the model as built and of the
probed data; a resume after the weights changed is refused, and a reference is named dead for the
model's sake before any environment field, whatever path the weights were read from."""

import json
import shutil

import pytest
import torch
from conftest import TINY, run_twinrun
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from twinrun.model import DEFAULT_WEIGHTS_PATH, load_pretrained
from twinrun.provenance.record import model_sha256
from twinrun.storage.store import read_store

pytestmark = pytest.mark.slow


def nudged_weights(path, relative=1e-7):
    """A copy of the committed weights with one tensor moved by `relative` (in place at `path`)."""
    tensors = load_file(str(DEFAULT_WEIGHTS_PATH))
    with safe_open(str(DEFAULT_WEIGHTS_PATH), "pt") as h:  # keep the metadata (arch) as it is
        meta = h.metadata()
    name = min(tensors)
    tensors[name] = tensors[name] * (1 + relative)
    save_file(tensors, str(path), metadata=meta)


def run(tmp_path, name, *extra, env=None):
    run_dir = tmp_path / name
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={run_dir}", *extra], cwd=tmp_path,
                       env=env)
    return proc, run_dir


def test_the_digest_moves_with_one_weight_and_not_with_eval_mode(tmp_path):
    model = load_pretrained()
    digest = model_sha256(model)
    assert model_sha256(model.train()) == digest  # the mode is not the model
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] *= 1 + 1e-7
    assert model_sha256(model) != digest


def test_stores_record_the_model_and_data(tmp_path):
    proc, run_dir = run(tmp_path, "a")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metas = [read_store(p).meta for p in sorted(run_dir.glob("arms/*/*.safetensors"))]
    assert {m["model_sha256"] for m in metas} == {model_sha256(load_pretrained())}
    assert len({m["data_sha256"] for m in metas}) == 1
    index = json.loads((run_dir / "run.json").read_text())
    assert len({e["identity_sha256"] for u in index["units"] for e in u["stores"].values()}) == 1


def test_a_resume_after_the_weights_changed_in_place_is_refused(tmp_path):
    weights = tmp_path / "w.safetensors"
    shutil.copy(DEFAULT_WEIGHTS_PATH, weights)
    proc, run_dir = run(tmp_path, "a", f"model.path={weights}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Half the run is lost, the weights file changes under the same path and config: the resume must
    # not mix the two models' stores.
    index = json.loads((run_dir / "run.json").read_text())
    for entry in index["units"][-1]["stores"].values():
        entry["status"] = "pending"
    (run_dir / "run.json").write_text(json.dumps(index))
    nudged_weights(weights)
    again = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.resume")
    assert again.returncode == 2, again.stderr[-2000:]
    assert "the model or the probed data differ from what its finished units measured" in again.stderr
    assert "Traceback" not in again.stderr


def test_a_reference_whose_weights_changed_is_dead_for_the_model(tmp_path):
    """The issue's case: the same path, the same config, the weights moved by 1e-7: the cause named is
    the model, not the environment (an extra environment variable does not change that)."""
    weights = tmp_path / "w.safetensors"
    shutil.copy(DEFAULT_WEIGHTS_PATH, weights)
    proc, ref = run(tmp_path, "ref", f"model.path={weights}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    nudged_weights(weights)
    # MKL_CBWR is read by the kernel-path fingerprint: the environment's record differs too.
    proc, now = run(tmp_path, "now", f"model.path={weights}", f"reference={ref}",
                    env={"MKL_CBWR": "COMPATIBLE"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    reference = json.loads((now / "summary.json").read_text())["reference"]
    assert reference["status"] == "dead"
    assert reference["measured_differs_in"] == ["model_sha256"]
    assert "env.MKL_CBWR" in reference["kernel_path_differs_in"]
    detail = reference["detail"]
    assert "the model as built" in detail and "this gap is the environment's" not in detail
    assert detail.index("the model as built") < detail.index("Kernel-path fields")
