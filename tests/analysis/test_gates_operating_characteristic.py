"""The no-op gate's operating characteristic on a nondeterministic path, by simulation (ground truth written
apart from the rule): the twin, the no-op arm and K replicates each carry their own atomic-add-like noise
(independent Gaussian rounding per element, element scales log-normal), and a gate row reads either the
maximum relative difference (the probe's shift) or the norm of the difference (training's distance).

A true no-op must pass every gate row of a run together in ≥ 95 % of runs; a leak a few times the path's
own wobble must fail. `python tests/analysis/test_gates_operating_characteristic.py` prints the table
docs/estimator.md quotes.
"""

import numpy as np
import pytest

from twinrun.analysis.gates import decide

RUNS = 2000


def distances(rng, runs: int, k: int, p: int, spread: float, stat: str, leak: float = 0.0) -> np.ndarray:
    """[runs, 1 + k]: the no-op arm's and k replicates' distances from the twin at one gate row. `leak`:
    a fixed difference the arm carries, in units of the median wobble's size."""
    scale = rng.lognormal(0.0, spread, p)
    noise = rng.standard_normal((runs, k + 2, p)) * scale
    diff = noise[:, 1:] - noise[:, :1]  # each arm minus the twin: the twin's own noise is shared
    size = (lambda d: np.abs(d).max(-1)) if stat == "max" else (lambda d: np.sqrt((d * d).sum(-1)))
    if leak:
        direction = rng.standard_normal(p) * scale
        direction *= np.median(size(diff[:, 1])) / size(direction[None])[0]
        diff[:, 0] += leak * direction
    return size(diff)


def pass_rate(rule, rng, k: int, rows: int, stat: str, spread: float = 1.0, p: int = 200,
              leak: float = 0.0, runs: int = RUNS) -> float:
    """The share of runs whose every gate row passes."""
    ok = np.ones(runs, bool)
    for _ in range(rows):
        d = distances(rng, runs, k, p, spread, stat, leak)
        ok &= [rule(float(x[0]), [float(r) for r in x[1:]], rows) for x in d]
    return float(ok.mean())


def the_rule(shift, reps, rows):
    return decide(False, shift, reps, "replicate", rows)[0]


def one_replicate_rule(shift, reps, rows):
    """The rule before: pass iff no further than the (first) replicate."""
    return shift <= reps[0]


@pytest.mark.parametrize("stat,k,rows,spread", [("max", 3, 2, 0.0), ("max", 4, 8, 0.0),
                                                ("norm", 4, 5, 1.0), ("norm", 3, 8, 1.0)])
def test_a_true_no_op_passes_every_gate_row_in_95_percent_of_runs(stat, k, rows, spread):
    rng = np.random.default_rng(1000 * k + rows)
    rate = pass_rate(the_rule, rng, k, rows, stat, spread)
    assert rate >= 0.95 - 2 * np.sqrt(0.05 * 0.95 / RUNS), rate  # measured 0.95–0.99 over the grid


def test_the_simulation_catches_the_old_rule():
    """Break the rule on purpose: one replicate as the bound passes a true no-op about (1/2)^rows."""
    rate = pass_rate(one_replicate_rule, np.random.default_rng(5), 1, 4, "norm", runs=500)
    assert rate < 0.2


@pytest.mark.parametrize("stat,leak", [("max", 6.0), ("norm", 3.0)])
def test_a_leak_a_few_times_the_wobble_fails(stat, leak):
    """Four replicates: a leak a few times the path's wobble fails ≥ 90 % of runs at one row alone (the
    maximum over elements of very unequal size wobbles more, so it needs a larger leak); a leak of 0.3×
    is a no-op as far as any rule can tell and passes as one."""
    rng = np.random.default_rng(7)
    assert pass_rate(the_rule, rng, 4, 1, stat, leak=leak, runs=500) <= 0.1
    assert pass_rate(the_rule, rng, 4, 5, stat, leak=0.3, runs=500) >= 0.9


def smallest_leak(k: int, rows: int, stat: str, power: float = 0.9, runs: int = 1000) -> float:
    """The leak (in wobbles) one gate row fails with probability `power`, on a grid."""
    rng = np.random.default_rng(k)
    for leak in np.round(np.arange(1.0, 30.0, 0.25), 2):
        d = distances(rng, runs, k, 200, 1.0, stat, leak)
        fails = np.mean([not the_rule(float(x[0]), [float(r) for r in x[1:]], rows) for x in d])
        if fails >= power:
            return float(leak)
    return float("inf")


if __name__ == "__main__":
    for stat in ("max", "norm"):
        for k in (2, 3, 4, 6, 8):
            rng = np.random.default_rng(k)
            print(stat, k, "no-op passes (5 rows):", round(pass_rate(the_rule, rng, k, 5, stat), 3),
                  "smallest leak at 90 %:", [smallest_leak(k, rows, stat) for rows in (2, 5, 20)])
