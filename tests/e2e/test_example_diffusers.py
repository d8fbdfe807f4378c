"""diffusers' UNet2DModel and DiTTransformer2DModel, EDM-wrapped (examples/diffusers): the probe's
fold sums equal a per-sample loop, and both run end to end. Skipped when diffusers is not installed."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_twinrun
from per_sample import loop_sums

from twinrun.measures import fold_sums as probe
from twinrun.measures import trial

pytest.importorskip("diffusers")
EXAMPLE = REPO / "examples" / "diffusers"
_spec = importlib.util.spec_from_file_location("edm_diffusers", EXAMPLE / "edm_diffusers.py")
edm_diffusers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(edm_diffusers)

SIGMA, SIGMA_COND = 0.5, 1.2
FOLDS = [0, 1, 1, 0]


@pytest.mark.parametrize(("build", "method"), [("unet", "folds"), ("dit", "folds"), ("dit", "vmap")])
def test_fold_sums_equal_the_per_sample_loop(build, method):
    model = getattr(edm_diffusers, build)()
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(len(FOLDS), 1, 8, 8, generator=gen) * 2 - 1
    eps = torch.randn(len(FOLDS), 2, 1, 8, 8, generator=gen)
    names = probe.select_params(model, ["*"])
    want = loop_sums(model, names, images, eps, SIGMA, SIGMA_COND, FOLDS)
    got = probe.fold_sums(model, names, images, eps, SIGMA, torch.tensor(SIGMA_COND), torch.tensor(FOLDS), 2,
                          method=method)
    assert (want.abs().sum(1) > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    layout = probe.layout(model, names, probe.cond_patterns(model))
    assert any(e["cond"] for e in layout) and not all(e["cond"] for e in layout)


def test_auto_takes_folds_for_the_unet_and_vmap_for_the_dit():
    images = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    arms = {"native": torch.tensor(SIGMA)}
    for build, want in (("unet", "folds"), ("dit", "vmap")):
        model = getattr(edm_diffusers, build)()
        method, _ = trial.run_trial(model, probe.select_params(model, ["*"]), images, SIGMA, arms, "auto")
        assert method == want, build


@pytest.mark.slow
@pytest.mark.parametrize(("experiment", "method"), [("unet_pin_sigma", "folds"), ("dit_pin_sigma", "vmap"),
                                                    ("dit_labels_pin_sigma", "vmap")])
def test_end_to_end(tmp_path, experiment, method):
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
    proc = run_twinrun(["--config-dir", str(EXAMPLE / "conf"), f"+experiment={experiment}",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"probe.method=auto chose {method}" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checks_passed"] is True and summary["effects"]
    assert all(g["bit_identical"] for g in summary["gates"])
    kernel_path = json.loads(next(Path(run_dir).glob("env/kernel_path-*.json")).read_text())["kernel_path"]
    assert kernel_path["probe"]["method"] == method and "diffusers" in kernel_path["torch"]["packages"]


@pytest.mark.parametrize("method", ["vmap", "folds"])
def test_the_class_conditional_dit_reads_each_images_own_label(method):
    images, ids, cond = edm_diffusers.labelled_digits()
    images, labels = images[: len(FOLDS)], cond["class_labels"][: len(FOLDS)]
    assert len(set(labels.tolist())) > 1 and len(ids) == len(cond["class_labels"])
    model = edm_diffusers.dit(num_classes=edm_diffusers.N_DIGIT_CLASSES)
    eps = torch.randn(len(FOLDS), 2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    names = probe.select_params(model, ["*"])
    lam = (SIGMA**2 + 0.25) / (SIGMA * 0.5) ** 2  # EDM weight, sigma_data 0.5
    params = dict(model.named_parameters())
    want = torch.zeros(2, sum(params[n].numel() for n in names), dtype=torch.float64)
    for i, fold in enumerate(FOLDS):  # one image and draw at a time, with its own label
        for d in range(2):
            model.zero_grad(set_to_none=True)
            x = images[i : i + 1]
            out = model(x + SIGMA * eps[i, d : d + 1], torch.tensor([SIGMA]), torch.tensor([SIGMA_COND]),
                        class_labels=labels[i : i + 1])
            (lam * ((out - x) ** 2).mean()).backward()
            want[fold] += torch.cat([params[n].grad.flatten() for n in names]).double()
    want = want.float()
    got = probe.fold_sums(model, names, images, eps, SIGMA, torch.tensor(SIGMA_COND), torch.tensor(FOLDS), 2,
                          method=method, cond={"class_labels": labels})
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    unlabelled = probe.fold_sums(model, names, images, eps, SIGMA, torch.tensor(SIGMA_COND),
                                 torch.tensor(FOLDS), 2, method=method)
    assert not torch.allclose(unlabelled, got)  # the labels reach the network
