"""What a researcher sees: report order and withholding, real plots, bring-your-own end to end."""

import json

import matplotlib.image
import numpy as np
import pytest
from conftest import REPO, TINY, run_twinrun
from stores import write_sums

from twinrun.storage.store import read_store

pytestmark = pytest.mark.slow


def assert_real_png(path, min_px=200):
    img = matplotlib.image.imread(path)
    assert img.shape[0] >= min_px and img.shape[1] >= min_px
    # a plot, not a blank canvas: many distinct colours, and ink on more than a sliver of it
    pixels = img[..., :3].reshape(-1, 3)
    assert len(np.unique(pixels.round(2), axis=0)) > 20
    assert (pixels.mean(1) < 0.9).mean() > 0.02


def sections(report: str) -> list[str]:
    return [line[3:] for line in report.splitlines() if line.startswith("## ")]


def test_report_order_and_plot(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (run_dir / "report.md").read_text()
    # the twin's replicate at the gate bin is always measured: it decides a gate that is not bit-identical
    assert sections(report)[:5] == ["Verdict", "Validity checks", "No-op gates (rule: replicate)",
                                    "Replicate (determinism control)", "Effects"]
    assert "**VALID**" in report and "![effect vs σ](effect.png)" in report
    assert f"python -m twinrun.resume {run_dir}" in report  # the command that resumes it in place
    assert sections(report)[-2:] == ["Environment", "Reproduce"] and "job 0: local process on" in report
    assert_real_png(run_dir / "effect.png")


def test_sweep_summary_report_and_heatmap(tmp_path):
    sweep = tmp_path / "sweep"
    # enough images that effects away from the diagonal are signal, not "below noise"
    proc = run_twinrun(["-m", "+experiment=pin_sigma", *TINY, "probe.n_images=290", "probe.n_draws=1",
                        "probe.n_folds=20", "intervention.sigma_pin=0.2,0.5,1.2",
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # planned twice each (checked dry, then planned), the model's trial ran once: the same model throughout
    assert proc.stdout.count("trial run on cpu before any bin") == 1, proc.stdout
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert summary["n_points"] == 3 and summary["all_valid"]
    pins = {e["sigma_pin"] for e in summary["effects"]}
    assert [p["gate_sigmas"] for p in summary["points"]] == [[0.2], [0.5], [1.2]]  # boxed on the heatmap
    assert pins == {0.2, 0.5, 1.2}
    diagonal = [e for e in summary["effects"] if e["sigma"] == e["sigma_pin"]]
    # the no-op diagonal: no effect (or a cosine undefined because the signal is below noise there)
    assert len(diagonal) == 3 * 3
    assert all(e["effect"] is None or e["effect"] == pytest.approx(0, abs=1e-12) for e in diagonal)
    assert any(e["effect"] is not None and e["effect"] > 0.01 for e in summary["effects"])
    report = (sweep / "sweep_report.md").read_text()
    assert report.count("report.md)") == 3 and "![sweep heatmap]" in report
    assert_real_png(sweep / "sweep_effect.png", min_px=150)


def test_bring_your_own_model_data_and_intervention(tmp_path):
    example = REPO / "examples" / "byo"
    run_dir = tmp_path / "byo"
    proc = run_twinrun(["--config-dir", str(example / "conf"), "+experiment=byo_bars",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, env={"PYTHONPATH": f"{REPO}:{example}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["arms"] == ["scale_cond", "native"]
    assert ([g["sigma"] for g in summary["gates"]] == [0.4] * 3
            and all(g["bit_identical"] for g in summary["gates"]))
    run = json.loads((run_dir / "run.json").read_text())
    store = next((run_dir / "arms" / "native").glob("*.safetensors"))
    layout = read_store(store).meta["layout"]
    assert {e["name"] for e in layout if e["cond"]} == {"film.0.weight", "film.0.bias", "film.2.weight",
                                                        "film.2.bias"}
    assert run["units"][0]["stores"]["scale_cond"]["status"] == "done"


def fresh_meta(store) -> dict:
    """A store's metadata without the payload digest write_store recomputes."""
    return {k: v for k, v in store.meta.items() if k not in ("format", "sums_sha256")}


def test_post_hoc_settings_make_a_labelled_view_and_never_rewrite_the_registered_verdict(tmp_path):
    run_dir = tmp_path / "run"
    # registered: the strict rule; the stores are then edited as a nondeterministic path would move them
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "reduce.gate_rule=bit_identical",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "run.json").read_text())["registered"]["gate_rule"] == "bit_identical"
    run = json.loads((run_dir / "run.json").read_text())
    gate = next(u for u in run["units"] if u["gate"])
    twin = read_store(run_dir / "arms" / "native" / gate["stores"]["native"]["file"])
    for arm, factor in (("pin_sigma", 1 + 1e-7), ("native_replicate", 1 + 1e-6)):
        entry = gate["stores"][arm]
        path = run_dir / "arms" / arm / entry["file"]
        entry["sha256"] = write_sums(path, twin.sums * factor, fresh_meta(read_store(path)))
    (run_dir / "run.json").write_text(json.dumps(run))
    registered = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.reduce")
    assert registered.returncode == 1 and "INSTRUMENT BROKEN" in registered.stdout
    before = {p: (run_dir / p).read_bytes() for p in ("summary.json", "report.md")}
    # post hoc, the lenient rule reads the replicate (one replicate cannot bound a nondeterministic path's
    # wobble, so the row still fails) and in any case cannot turn exit 1 into 0
    view = run_twinrun([str(run_dir), "--gate-rule", "replicate"], cwd=tmp_path, module="twinrun.reduce")
    assert view.returncode == 1 and "POST-HOC VIEW" in view.stdout
    assert {p: (run_dir / p).read_bytes() for p in before} == before
    view_dir = run_dir / "views" / "gate_rule-replicate"
    summary = json.loads((view_dir / "summary.json").read_text())
    assert {g["rule"] for g in summary["gates"]} == {"too few replicates differ to bound the path's wobble"}
    assert summary["post_hoc"]["registered"]["gate_rule"] == "bit_identical"
    assert (summary["post_hoc"]["used"]["gate_rule"] == "replicate"
            and summary["post_hoc"]["registered_passed"] is False)
    assert "POST-HOC VIEW" in (view_dir / "report.md").read_text()
    again = run_twinrun([str(run_dir), "--estimands", "all,curvature"], cwd=tmp_path, module="twinrun.reduce")
    assert again.returncode == 2 and "curvature" in again.stderr and "Traceback" not in again.stderr
