"""Per-image conditioning: every method's fold sums equal a per-sample loop in which each sample gets its
own image's conditioning, under every objective; bad conditioning is one line before compute; the
conditioning joins the data's digest; a conditional model runs pin_sigma and a training twin end to end."""

import json
import math
from pathlib import Path

import pytest
import torch
from cond_models import bad_cond_data, cond_data, tiny
from conftest import TINY, run_twinrun

from twinrun import conditioning
from twinrun.errors import ConfigError
from twinrun.measures import fold_sums as fs
from twinrun.measures import train_step as ts
from twinrun.objectives import EDM, VP, Flow
from twinrun.provenance.record import tensors_sha256

TESTS = Path(__file__).resolve().parent


def by_hand(name, model, x, e, level):
    """(noisy input, target, weight) of one sample, written out per objective (not twinrun's code)."""
    if name == "edm":
        sd = model.sigma_data
        return x + level * e, x, (level**2 + sd**2) / (level * sd) ** 2
    if name == "flow":
        return (1 - level) * x + level * e, e - x, 1.0
    abar = float(model.alphas_cumprod.double()[int(level)])
    return math.sqrt(abar) * x + math.sqrt(1 - abar) * e, e, 1.0


def loop_sums(name, model, names, images, eps, level, level_cond, folds, cond):
    """One forward and backward per (image, draw), each with its own image's conditioning rows."""
    params = dict(model.named_parameters())
    out = torch.zeros(max(folds) + 1, sum(params[n].numel() for n in names), dtype=torch.float64)
    for i, fold in enumerate(folds):
        for d in range(eps.shape[1]):
            model.zero_grad(set_to_none=True)
            x, e = images[i : i + 1], eps[i, d : d + 1]
            noisy, target, lam = by_hand(name, model, x, e, level)
            own = {k: v[i : i + 1] for k, v in cond.items()}
            pred = model(noisy, torch.tensor([level]), torch.tensor([level_cond]), **own)
            (lam * ((pred - target) ** 2).mean()).backward()
            out[fold] += torch.cat([params[n].grad.flatten() for n in names]).double()
    model.zero_grad(set_to_none=True)
    return out.float()


OBJECTIVES = {"edm": (EDM(), 0.5, 1.2), "flow": (Flow(), 0.4, 0.5), "vp": (VP(), 300.0, 500.0)}


@pytest.mark.parametrize("method", ["vmap", "folds", "compiled"])
@pytest.mark.parametrize("objective", ["edm", "flow", "vp"])
def test_fold_sums_equal_a_loop_with_each_images_own_conditioning(method, objective):
    if method == "compiled" and objective != "flow":
        pytest.skip("one compiled case (aot_eager) is enough: the method is folds")
    model = tiny()
    names = [n for n, _ in model.named_parameters()]
    images, _, cond = cond_data(7)
    eps = torch.randn((7, 3, 1, 8, 8), generator=torch.Generator().manual_seed(5))
    folds = [0, 0, 1, 1, 1, 2, 2]
    obj, level, level_cond = OBJECTIVES[objective]
    want = loop_sums(objective, model, names, images, eps, level, level_cond, folds, cond)
    forward = torch.compile(model, backend="aot_eager") if method == "compiled" else None
    for p in model.parameters():
        p.requires_grad_(True)
    got = fs.fold_sums(model, names, images, eps, level, torch.tensor(level_cond), torch.tensor(folds), 3,
                       chunk_images=2, chunk_draws=2, method="folds" if method == "compiled" else method,
                       forward=forward, objective=obj, cond=cond)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (got - want).abs().max()
    # The conditioning is what makes the sums: another image's rows give other sums.
    shuffled = {k: v.roll(1, 0) for k, v in cond.items()}
    other = fs.fold_sums(model, names, images, eps, level, torch.tensor(level_cond), torch.tensor(folds), 3,
                         chunk_images=2, chunk_draws=2, method="folds" if method == "compiled" else method,
                         forward=forward, objective=obj, cond=shuffled)
    assert not torch.allclose(other, want, rtol=1e-3)


def test_training_loss_feeds_each_sample_its_own_rows():
    model = tiny()
    images, _, cond = cond_data(6)
    eps, sigma = torch.randn(6, 1, 8, 8), torch.full((6,), 0.7)
    with torch.no_grad():
        whole = ts.per_sample_loss(model, images, sigma, eps, sigma, EDM(), cond)
        for i in range(6):
            own = {k: v[i : i + 1] for k, v in cond.items()}
            one = ts.per_sample_loss(model, images[i : i + 1], sigma[i : i + 1], eps[i : i + 1],
                                     sigma[i : i + 1], EDM(), own)
            assert torch.allclose(whole[i], one[0], rtol=1e-5)


@pytest.mark.parametrize(("what", "said"), [
    ("rows", "cond['text']"), ("nan", "NaN"), ("type", "cond['labels']"), ("key", "cond['prompt']")])
def test_bad_conditioning_is_one_line_naming_the_key(what, said):
    images, _, cond = bad_cond_data(what)
    with pytest.raises(ConfigError) as err:
        conditioning.check(cond, images.shape[0], tiny())
    assert said in str(err.value) and "\n" not in str(err.value)


def test_the_conditioning_joins_the_data_digest_and_none_keeps_it():
    images, ids, cond = cond_data(6)
    base = [("images", images), ("image_ids", torch.tensor(ids))]
    assert tensors_sha256(base + conditioning.digest_items({})) == tensors_sha256(base)
    changed = {**cond, "text": cond["text"] + 1e-3}
    assert (tensors_sha256(base + conditioning.digest_items(cond))
            != tensors_sha256(base + conditioning.digest_items(changed)))


def test_a_run_with_bad_conditioning_exits_2_before_compute(tmp_path):
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "model._target_=cond_models.tiny",
                        "data._target_=cond_models.bad_key_data"], cwd=TESTS,
                       env={"TWINRUN_TEST_OUT": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cond['prompt']" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_conditional_model_runs_pin_sigma_and_its_embeddings_are_what_was_measured(tmp_path):
    """pin_sigma end to end on the conditional model under objective=flow (edm with conditioning: the
    fold-sum tests); then its text embeddings change under the same config: a resume is refused and a
    reference measured with the old ones is dead, the data named as the cause."""
    args = ["+experiment=pin_sigma", "probe.n_images=8", "probe.n_draws=2", "probe.n_folds=4",
            "sigma_grid.sigmas=[0.25,0.5,0.8]", "intervention.sigma_pin=0.5", "objective=flow",
            "model._target_=cond_models.tiny", "data._target_=cond_models.cond_data_env"]
    proc = run_twinrun([*args, f"hydra.run.dir={tmp_path}/ref"], cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["checks_passed"] and all(g["passed"] for g in summary["gates"])
    moved = {"COND_TEXT_SHIFT": "1e-3"}
    index = json.loads((tmp_path / "ref" / "run.json").read_text())
    for entry in index["units"][-1]["stores"].values():
        entry["status"] = "pending"
    (tmp_path / "ref" / "run.json").write_text(json.dumps(index))
    again = run_twinrun([str(tmp_path / "ref"), "--trust", "cond_models"], cwd=TESTS, module="twinrun.resume",
                        env=moved)
    assert again.returncode == 2 and "the probed data differ" in again.stderr, again.stderr[-2000:]
    for entry in index["units"][-1]["stores"].values():
        entry["status"] = "done"
    (tmp_path / "ref" / "run.json").write_text(json.dumps(index))
    proc = run_twinrun([*args, f"hydra.run.dir={tmp_path}/now", f"reference={tmp_path}/ref"], cwd=TESTS,
                       env=moved)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = json.loads((tmp_path / "now" / "summary.json").read_text())["reference"]
    assert reference["status"] == "dead" and reference["measured_differs_in"] == ["data_sha256"]
    assert "conditioning" in reference["detail"]


@pytest.mark.slow
def test_a_conditional_model_trains_as_twins(tmp_path):
    proc = run_twinrun(["+experiment=train_scale_lr", "model._target_=cond_models.tiny",
                        "data._target_=cond_models.cond_train_data", "train.steps=4", "train.segment_steps=2",
                        "train.batch_size=4", "train.heldout_images=4",
                        "objective=flow", f"hydra.run.dir={tmp_path}/run"], cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
