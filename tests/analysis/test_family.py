"""The family-wise reading: Holm over the effect rows' tests of no effect, measured on simulated whole runs
(6 bins × all / cond / residual, one bin a gate, bins sharing the images, arms sharing the draws)."""

import json

import numpy as np
import pytest
import torch
from rundirs import REGISTERED, planned_run
from sim import run_effect_rows, run_fold_sums
from stores import meta, write_sums

from twinrun.analysis.checks import Bin
from twinrun.analysis.family import family_verdict, holm_adjusted
from twinrun.analysis.probe_reduce import effect_estimates, effect_rows, family_reading
from twinrun.analysis.reduction import registered
from twinrun.analysis.scan import scan
from twinrun.errors import ConfigError, StoreError
from twinrun.plan import validate_reduce
from twinrun.storage.rundir import RunIndex
from twinrun.storage.store import StoreReader

P, COND, BINS, GATE = 200, 40, 6, 2
FEW = np.where(np.arange(P) < 3, 60.0, 0.1)  # 90% of the noise in 3 directions


def test_holm_adjusted_p_values_by_hand():
    # sorted 0.01, 0.02, 0.04, 0.30 (m = 4): 0.04, 0.06, 0.08 (monotone), 0.30
    adj = holm_adjusted(np.array([0.30, 0.01, 0.04, 0.02]))
    np.testing.assert_allclose(adj, [0.30, 0.04, 0.08, 0.06])
    assert holm_adjusted(np.array([0.9, 0.8]))[0] == 1.0  # capped at 1


def _rows(p_all, p_cond, p_residual, gate_p=0.0):
    rows = []
    for k, (a, c, r) in enumerate(zip(p_all, p_cond, p_residual)):
        for name, p in (("all", a), ("cond", c), ("residual", r)):
            rows.append({"sigma": 0.1 * (k + 1), "estimand": name, "gate": k == GATE,
                         "effect_p": gate_p if k == GATE else p})
    return rows


def test_the_family_counts_rows_tests_distinct_hypotheses_and_leaves_gates_out():
    """A gate row's p-value (0 here) never makes an effect; residual rows share all's hypothesis."""
    v = family_verdict(_rows([0.5] * BINS, [0.5] * BINS, [0.0] * BINS), 0.05)
    assert (v.n_rows, v.n_hypotheses, v.effect) == (15, 10, False)
    v = family_verdict(_rows([0.5, 0.5, 0.5, 0.001, 0.5, 0.5], [0.5] * BINS, [0.9] * BINS), 0.05)
    assert v.effect and set(v.rejected) == {(0.4, "all"), (0.4, "residual")}
    assert v.adjusted_p[0.4, "all"] == pytest.approx(0.01)  # 10 hypotheses
    assert "15 effect rows, 10 distinct hypotheses" in v.detail()


def test_a_residual_row_is_its_own_hypothesis_where_all_is_not_read():
    rows = [{"sigma": 0.2, "estimand": "residual", "gate": False, "effect_p": 0.01}]
    assert family_verdict(rows, 0.05).n_hypotheses == 1 and family_verdict(rows, 0.05).effect


def family_error_rate(folds, rho, spectrum, runs, seed, snr=0.0, effect=0.0):
    """(runs reading an effect, runs printing at least one number) out of `runs` simulated runs."""
    rng = np.random.default_rng(seed)
    sizes = [10] * folds
    mu_twin = np.zeros((BINS, P))
    if snr:
        u = rng.standard_normal((BINS, P))
        mu_twin = u / np.linalg.norm(u, axis=1, keepdims=True) * np.sqrt(snr * P / np.sum(sizes))
    mu_arm = mu_twin.copy()
    mu_arm[4] *= 1 + effect
    effects = printed = 0
    for start in range(0, runs, 100):
        sums = run_fold_sums(rng, sizes, mu_arm, mu_twin, rho, min(100, runs - start), spectrum=spectrum)
        for rows in run_effect_rows(sums, sizes, COND, 0.05, GATE):
            effects += family_verdict(rows, 0.05).effect
            printed += any(not r["below_noise"] for r in rows if not r["gate"])
    return effects, printed


def test_pure_noise_with_shared_draws_reads_no_effect_family_wise():
    """At ρ = 0.99 about 7% of pure-noise runs print some number (the test of signal is per row); the
    family-wise verdict reads an effect in far fewer than 5% of them."""
    effects, printed = family_error_rate(10, 0.99, None, 500, seed=1)
    assert effects / 500 <= 0.02
    assert printed > effects  # the per-row test of signal alone would have said more


def test_a_real_effect_is_read_family_wise():
    """Power: the arm's mean gradient 10% larger at one bin of six is found in every run at SNR 3 per bin
    (measured: 100 of 100; at SNR 1 in 23 of 100, and a 20% change in 100 of 100)."""
    effects, _ = family_error_rate(10, 0.99, None, 100, seed=2, snr=3.0, effect=0.1)
    assert effects / 100 >= 0.8


@pytest.mark.slow
@pytest.mark.parametrize("folds", [5, 10, 20])
@pytest.mark.parametrize("rho", [0.0, 0.9, 0.99])
@pytest.mark.parametrize("noise", ["isotropic", "few"])
def test_family_wise_error_on_the_grid(folds, rho, noise):
    """≤ 5% of runs read an effect where there is none, pure noise or signal without effect (2000 runs
    each: a binomial SE of 0.5% at 5%)."""
    spectrum = None if noise == "isotropic" else FEW
    for snr in (0.0, 1.0):
        effects, printed = family_error_rate(folds, rho, spectrum, 2000, seed=folds + int(100 * rho), snr=snr)
        print(f"family-wise: {noise} F={folds} rho={rho} snr={snr}: effect {effects}/2000, "
              f"printed {printed}/2000")
        assert effects / 2000 <= 0.05, (snr, effects)


LAYOUT = [{"name": "cond.w", "offset": 0, "numel": COND, "cond": True},
          {"name": "body.w", "offset": COND, "numel": P - COND, "cond": False}]
ESTIMANDS = ["all", "cond", "residual"]


def reducer_families(tmp_path, sums, sizes, alpha=0.05):
    """Each simulated run ([reps, B, 2, F, P] fold sums) written as real stores and read by the reducer: its
    one pass (twinrun.analysis.scan), its estimates and rows, its family-wise reading. Returns the
    summaries' `family` entries and rows."""
    out = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    bins = [Bin(k, round(0.1 * (k + 1), 6), k == GATE, {}) for k in range(BINS)]
    for r, run in enumerate(sums):
        readers = {}
        for b in range(BINS):
            for a, arm in enumerate(("pin_sigma", "native")):
                path = tmp_path / f"run{r}-{arm}-{b}.safetensors"
                write_sums(path, torch.from_numpy(run[b, a]).float(),
                           meta(LAYOUT, len(sizes), arm, b, fold_sizes=list(sizes), n_images=int(sum(sizes))))
                readers[arm, b] = StoreReader(path)
        found = scan(readers, ["pin_sigma", "native"], BINS, ESTIMANDS, None, ["native"],
                     [("pin_sigma", "native")])
        for reader in readers.values():
            reader.close()
        estimates = effect_estimates(found, list(range(BINS)), np.asarray(sizes, float), "pin_sigma",
                                     ESTIMANDS, alpha)
        rows = effect_rows(estimates, bins, ESTIMANDS)
        out.append((family_reading(rows, alpha), rows))
    return out


def test_the_reducer_reads_the_simulated_runs_as_the_simulation_does(tmp_path):
    """The grid above runs the family on simulated Grams (fast); here the same runs go through real stores
    and the reducer's own pass, estimates and rows: every row's p-value agrees (float32 stores: 1e-4)."""
    rng = np.random.default_rng(5)
    sizes = [10] * 5
    sums = run_fold_sums(rng, sizes, np.zeros((BINS, P)), np.zeros((BINS, P)), 0.99, 4)
    sums = sums.astype(np.float32).astype(np.float64)  # what the stores hold
    sim_runs = run_effect_rows(sums, sizes, COND, 0.05, GATE)
    for (fam, rows), sim_rows in zip(reducer_families(tmp_path, sums, sizes), sim_runs):
        want = {(round(0.1 * (float(r["sigma"]) + 1), 6), r["estimand"]): r["effect_p"] for r in sim_rows}
        got = {(r["sigma"], r["estimand"]): r["effect_p"] for r in rows}
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-4, atol=1e-6)
        assert fam["n_rows"] == (BINS - 1) * 3 and fam["n_hypotheses"] == (BINS - 1) * 2


@pytest.mark.slow
def test_pure_noise_whole_runs_through_the_reducer_read_no_effect_and_a_real_effect_is_found(tmp_path):
    """Pure noise, shared draws ρ = 0.99, 6 bins × 3 estimands, through real stores and the real reducer:
    a family-wise effect in ≤ 5% of 200 runs; the arm's gradient 20% larger at one bin is found."""
    rng = np.random.default_rng(11)
    sizes = [10] * 10
    noise = run_fold_sums(rng, sizes, np.zeros((BINS, P)), np.zeros((BINS, P)), 0.99, 200)
    families = reducer_families(tmp_path / "noise", noise, sizes)
    false = sum(fam["effect"] for fam, _ in families)
    print(f"family-wise through the reducer, pure noise ρ=0.99: {false}/200 runs read an effect")
    assert false / 200 <= 0.05
    u = rng.standard_normal((BINS, P))
    mu_twin = u / np.linalg.norm(u, axis=1, keepdims=True) * np.sqrt(3.0 * P / np.sum(sizes))
    mu_arm = mu_twin.copy()
    mu_arm[4] *= 1.2
    real = reducer_families(tmp_path / "effect", run_fold_sums(rng, sizes, mu_arm, mu_twin, 0.99, 10), sizes)
    assert all(fam["effect"] and {"sigma": 0.5, "estimand": "all"} in fam["rejected"] for fam, _ in real)


@pytest.mark.parametrize("level", [0.0, 0.5, 0.7, -0.1])
def test_family_alpha_outside_its_rule_is_one_line_naming_the_key(compose_cfg, level):
    with pytest.raises(ConfigError, match=r"reduce.family_alpha.*must be in \(0, 0.5\)"):
        validate_reduce(compose_cfg([f"reduce.family_alpha={level}"]).reduce)
    validate_reduce(compose_cfg(["reduce.family_alpha=0.01"]).reduce)


def test_family_alpha_is_registered_and_held_to_its_rule_on_read_back(tmp_path):
    index = planned_run(tmp_path / "run", registered={**REGISTERED, "family_alpha": 0.01})
    assert registered(index)["family_alpha"] == 0.01
    old = planned_run(tmp_path / "old")  # planned before the family-wise reading: the default
    assert registered(old)["family_alpha"] == 0.05
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    doc["registered"]["family_alpha"] = 0.9
    (tmp_path / "run" / "run.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=r"registered.family_alpha.*0.9 must be in \(0, 0.5\)"):
        RunIndex.load(tmp_path / "run")
