"""The family-wise reading of a run: Holm's step-down test over the effect rows' tests of "no effect".

A run prints many effect rows (bins × estimands), each with two 95% intervals; read together, some
interval misses its truth in most runs, and with shared draws several rows can clear the test of signal
by one noise event. The family-wise verdict answers one question at a registered level α
(reduce.family_alpha): does the intervention change anything the run reads?

"No effect" for a row means the intervention arm's mean gradient equals the twin's over the estimand's
columns (μ_arm = μ_twin: cos = 1 and norm ratio = 1 where the twin has signal; a row below noise has a
hypothesis too). Its test is Estimate.effect_p: the one-sided t test of the debiased |μ_arm − μ_twin|²
(twinrun.estimator.effect_test). Gate rows are the gate's business and are left out. A view that
subtracts the same vector from both arms (`residual`) tests the same hypothesis as the view it is taken
from, so it is counted once. Holm rejects the hypotheses whose adjusted p-value is ≤ α; it controls the
probability of any false "effect" at α under any dependence between the rows.
"""

from dataclasses import dataclass, field

import numpy as np

FAMILY_ALPHA = 0.05
# An estimand whose no-effect hypothesis is another's: residual views remove the twin's mean direction
# from both arms, so the arms' difference, and its test, are those of `all`.
SAME_HYPOTHESIS = {"residual": "all"}


def holm_adjusted(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values over the last axis (any leading axes: many families at once).

    With m hypotheses sorted p_(1) ≤ … ≤ p_(m): adj_(i) = max_{j ≤ i} min(1, (m − j + 1)·p_(j))."""
    p = np.asarray(p_values, dtype=np.float64)
    m = p.shape[-1]
    order = np.argsort(p, axis=-1)
    ranked = np.take_along_axis(p, order, axis=-1) * (m - np.arange(m))
    ranked = np.minimum(np.maximum.accumulate(ranked, axis=-1), 1.0)
    out = np.empty_like(ranked)
    np.put_along_axis(out, order, ranked, axis=-1)
    return out


@dataclass
class FamilyVerdict:
    """The registered family-wise reading of one run's effect rows."""

    level: float  # the registered α
    n_rows: int  # non-gate effect rows the run reads
    n_hypotheses: int  # distinct hypotheses of "no effect" among them (the family Holm runs over)
    effect: bool  # Holm rejects "no effect" for at least one hypothesis
    rejected: list = field(default_factory=list)  # (σ, estimand) of every row whose hypothesis is rejected
    adjusted_p: dict = field(default_factory=dict)  # (σ, estimand) -> Holm-adjusted p-value of its hypothesis

    def detail(self) -> str:
        if not self.n_hypotheses:
            return "no effect rows: nothing to read family-wise"
        head = (f"{self.n_rows} effect rows, {self.n_hypotheses} distinct hypotheses of no effect, Holm at "
                f"family-wise level {self.level:g}: ")
        if not self.effect:
            return head + "no row shows an effect"
        rows = ", ".join(f"σ={s:g} {e}" for s, e in self.rejected)
        return head + f"an effect in {len(self.rejected)} rows ({rows})"


def family_verdict(rows: list[dict], level: float = FAMILY_ALPHA,
                   same_hypothesis: dict | None = None) -> FamilyVerdict:
    """Holm over the rows' tests of no effect. rows: summary rows with `sigma`, `estimand`, `gate` and
    `effect_p` (Estimate.effect_p); same_hypothesis: estimand -> the estimand whose hypothesis it shares
    (SAME_HYPOTHESIS by default), used where that estimand's row at the same σ is in the family too."""
    same = SAME_HYPOTHESIS if same_hypothesis is None else same_hypothesis
    effects = [r for r in rows if not r.get("gate")]
    present = {(r["sigma"], r["estimand"]) for r in effects}

    def hypothesis(r) -> tuple:
        base = same.get(r["estimand"])
        if base is not None and (r["sigma"], base) in present:
            return r["sigma"], base
        return r["sigma"], r["estimand"]

    p_of = {}
    for r in effects:
        p_of.setdefault(hypothesis(r), float(r["effect_p"]))
    keys = list(p_of)
    adjusted = dict(zip(keys, holm_adjusted(np.array([p_of[k] for k in keys])))) if keys else {}
    row_p = {(r["sigma"], r["estimand"]): float(adjusted[hypothesis(r)]) for r in effects}
    rejected = [k for k, p in row_p.items() if p <= level]
    return FamilyVerdict(level, len(effects), len(keys), bool(rejected), rejected, row_p)
