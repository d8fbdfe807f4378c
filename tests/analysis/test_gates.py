"""The gate rule and the reference rule on stores built by hand: each rule fails for its reason."""

import numpy as np
import pytest
import torch
from rundirs import create, run_doc
from stores import scan_sums

from twinrun.analysis.estimator import estimate
from twinrun.analysis.gates import decide, gates, replicate_report, wobble_bound
from twinrun.analysis.references import reproduced
from twinrun.storage.rundir import RunDir, RunIndex

F, P = 5, 40
LAYOUT = [{"name": "w", "offset": 0, "numel": 30, "cond": False},
          {"name": "c", "offset": 30, "numel": 10, "cond": True}]
SIGMAS, GATE = [0.2, 0.5], 0.5  # bin 1 is the gate bin


def run_index(run_dir, sigmas=SIGMAS) -> RunIndex:
    """run.json of the run these stores belong to (bins at `sigmas`, the gate at σ = GATE), planned once."""
    if RunDir(run_dir).is_run():
        return RunIndex.load(run_dir)
    return create(run_dir, run_doc(sigmas, gates=[GATE]))


PAIRS = [("pin_sigma", "native"), ("native_replicate", "native")]


def found_of(tmp_path, sums: dict):
    """The reducer's pass over real stores of these sums ({(arm, bin): [F, P]})."""
    return scan_sums(tmp_path, sums, LAYOUT, ["pin_sigma", "native"], 2, ["all", "cond"], PAIRS)


def twin_sums(seed=0, signal=0.0):
    gen = torch.Generator().manual_seed(seed)
    return signal + torch.randn(F, P, generator=gen)


def run_gates(tmp_path, inter: torch.Tensor, replicate: torch.Tensor | None, rule="replicate", twin=None):
    twin = twin_sums() if twin is None else twin
    sums = {("pin_sigma", 0): twin * 2, ("native", 0): twin, ("pin_sigma", 1): inter, ("native", 1): twin}
    if replicate is not None:
        sums["native_replicate", 1] = replicate
    estimates = {}
    for (arm, b), s in sums.items():
        if arm == "pin_sigma":
            x, y = s.float().double().numpy(), sums["native", b].float().double().numpy()
            est = estimate(x @ y.T, x @ x.T, y @ y.T, [4] * F, [4] * F, 0.05)
            estimates.update({(b, n): est for n in ("all", "cond")})
    found = found_of(tmp_path, sums)
    return gates(run_index(tmp_path / "run"), found, estimates, "pin_sigma", ["all", "cond"], rule)


def test_bit_identical_gate_passes_even_where_the_signal_is_below_noise(tmp_path):
    twin = twin_sums()  # pure noise: every norm below noise
    rows = run_gates(tmp_path, twin.clone(), None, twin=twin)
    assert [r["passed"] for r in rows] == [True, True] and {r["rule"] for r in rows} == {"bit-identical"}


@pytest.mark.parametrize("signal", [0.0, 3.0])  # below noise, and clear signal where cos ≈ 1
def test_close_is_not_a_no_op_on_a_deterministic_path(tmp_path, signal):
    """1e-3 relative at the gate, the replicate bit-identical: FAIL, naming bin, estimand and size,
    whether or not a cosine could be read (a cosine of 0.99999 would have passed any threshold)."""
    twin = twin_sums(signal=signal)
    rows = run_gates(tmp_path, twin * (1 + 1e-3), twin.clone(), twin=twin)
    assert not any(r["passed"] for r in rows)
    assert {r["rule"] for r in rows} == {"not a no-op on a deterministic path"}
    assert rows[0]["detail"].startswith("not a no-op: the arms differ at a bin where the intervention "
                                        "claims to do nothing")
    assert ("σ=0.5, estimand all" in rows[0]["detail"]
            and "max relative difference of the sums 1.0" in rows[0]["detail"])


def test_an_anti_aligned_gate_fails_whatever_the_replicate(tmp_path):
    """The gate's sign: −S_twin is as far from the twin as anything gets, never a no-op."""
    twin = twin_sums(signal=3.0)
    noisy = twin * (1 + 1e-4 * torch.randn(F, P, generator=torch.Generator().manual_seed(9)))
    rows = run_gates(tmp_path, -twin, noisy, twin=twin)
    assert not any(r["passed"] for r in rows) and rows[0]["max_shift"] == pytest.approx(2.0)


def test_on_a_nondeterministic_path_one_replicate_cannot_bound_the_wobble(tmp_path):
    """One differing replicate says the path is nondeterministic, not how far its wobble reaches (a true
    no-op beat it half the time): the row fails, naming the setting that measures more."""
    twin = twin_sums(signal=3.0)
    jitter = torch.randn(F, P, generator=torch.Generator().manual_seed(3))
    replicate = twin + 1e-5 * jitter.abs().max() ** -1 * jitter  # the path itself moves results
    rows = run_gates(tmp_path, twin + 0.5e-5 * jitter / jitter.abs().max(), replicate, twin=twin)
    assert not any(r["passed"] for r in rows)
    assert {r["rule"] for r in rows} == {"too few replicates differ to bound the path's wobble"}
    assert "arms.replicates ≥ 3" in rows[0]["detail"] and rows[0]["replicate_shifts"] == [rows[0]
                                                                                             ["replicate_max_shift"]]


def test_a_gate_that_is_not_bit_identical_without_a_replicate_fails(tmp_path):
    twin = twin_sums(signal=3.0)
    rows = run_gates(tmp_path, twin * (1 + 1e-7), None, twin=twin)
    assert not any(r["passed"] for r in rows) and "no replicate" in rows[0]["rule"]


def test_decide_is_the_whole_rule():
    assert decide(True, 0.0, None, "replicate") == (True, "bit-identical")
    assert decide(False, 1e-9, [0.0], "replicate")[0] is False
    assert decide(False, 1e-9, None, "replicate")[0] is False
    assert decide(False, 1e-6, [1e-6], "replicate")[0] is False  # one replicate bounds nothing
    reps = [1e-6, 1.1e-6, 0.9e-6, 1.05e-6]
    assert decide(False, 1e-6, reps, "replicate") == (True, "within the path's wobble")
    assert decide(False, 2e-6, reps, "replicate") == (False, "beyond the path's wobble")
    assert decide(False, 1e-6, reps, "bit_identical")[0] is False
    assert decide(False, 1e-9, [0.0, 0.0, 0.0], "replicate")[1] == "not a no-op on a deterministic path"
    # the bound widens with the family: more gate rows, a higher bar for each
    assert wobble_bound(reps, 40) > wobble_bound(reps, 2) > max(reps)


def test_replicate_report_counts_differing_tensors(tmp_path):
    twin = twin_sums()
    sums = {("pin_sigma", b): twin for b in (0, 1)} | {("native", b): twin for b in (0, 1)}
    index = run_index(tmp_path / "run")
    same = found_of(tmp_path / "a", {**sums, ("native_replicate", 1): twin.clone()})
    assert replicate_report(index, same)["n_differ"] == 0
    moved = twin.clone()
    moved[2, 33] *= 1 + 1e-6  # one number, in the `cond` parameter
    rep = replicate_report(index, found_of(tmp_path / "b", {**sums, ("native_replicate", 1): moved}))
    assert rep["n_differ"] == 1 and "nondeterministic" in rep["detail"]
    assert rep["max_abs_diff"] == pytest.approx(float((moved.float() - twin.float()).abs().max()), rel=1e-12)
    one_bin = run_index(tmp_path / "one_bin", SIGMAS[:1])
    assert replicate_report(one_bin, found_of(tmp_path / "c", sums)) is None


def row(sigma, identical, shift):
    return {"sigma": sigma, "bit_identical": identical, "max_shift": shift}


def test_reference_alive_only_when_reproduced():
    same = [row(0.2, True, 0.0), row(0.5, True, 0.0)]
    assert reproduced(same, {}) == (True, "bit-identical in every bin")
    # A shift of 4e-6 in one bin kills it on a deterministic path, however small.
    shifted = [row(0.2, True, 0.0), row(0.5, False, 4e-6)]
    assert reproduced(shifted, {})[0] is False
    assert reproduced(shifted, {0.5: 0.0})[0] is False  # the replicate is bit-identical: deterministic
    assert reproduced(shifted, {0.5: 1e-5})[0] is True  # nondeterministic path, within the replicate
    assert reproduced(shifted, {0.5: 1e-6})[0] is False  # beyond the replicate
    assert reproduced(shifted, {0.2: 1e-3})[0] is False  # a replicate in another bin proves nothing here


def test_identical_arms_at_every_signal_level_read_cos_one():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((F, P)) + 5.0
    est = estimate(s @ s.T, s @ s.T, s @ s.T, [4] * F, [4] * F, 0.05)
    assert est.cos == 1.0 and est.norm_ratio == 1.0
