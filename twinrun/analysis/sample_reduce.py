"""Reduce a twin sampling run (measure=sample): validity checks → no-op gates → the reading (only if
everything passed). Writes nothing.

Every reading is paired over samples: sample i of every arm started from the same noise. Per chunk and
over all samples it reads, for the intervention against the twin,
  distance  each sample's RMS pixel distance to the twin's sample (mean ± SE over samples);
  loss      the held-out denoising loss of the arm's samples minus the twin's (the native model's loss
            under the run's objective at sample.loss_sigmas; mean ± paired SE);
  mmd       MMD² between the arms' sample distributions in the stored features: the unbiased U-statistic
            of the paired feature differences, ± its jackknife SE over samples,
and the same for the twin's replicate (0 on a deterministic path: the floor the reading stands on).
The machinery arm (the intervention at its no-op setting; pin_sigma's follows each step's level) is a
gate, read as the probe's gates are (analysis/gates.py: decide): bit-identical to the twin, or — only
where the replicate proves the path nondeterministic — within the bound of the replicates' spread
(arms.replicates of them).
"""

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from twinrun.analysis.gates import decide
from twinrun.analysis.reduction import (
    Reduction,
    check,
    provenance_checks,
    registered,
    used_settings,
    view_name,
)
from twinrun.analysis.vouch import StoreRules, Voucher
from twinrun.errors import StoreError
from twinrun.storage.rundir import RunIndex
from twinrun.storage.sample_store import read_sample_store

SAMPLE_METRICS = ("distance", "loss", "mmd")


# What each sampling store must agree with (analysis/vouch.py): its chunk's samples, its arm's seed and
# sampler settings, the first store's held-out loss levels.
SAMPLE_STORE_RULES = StoreRules("unit_index", {"first": "first", "count": "count"},
                                {"seed": "seed", "sampler": "sample.sampler", "steps": "sample.steps"},
                                ("loss_sigmas",))


def read_stores(index: RunIndex) -> dict:
    """{(arm, unit index): (tensors, meta)} of every arm's store in every unit, each checked whole and
    held to the run (its config.yaml to run.json's hash, its chunk, seed, sampler and kernel path)."""
    voucher = Voucher(index, SAMPLE_STORE_RULES)
    out = {}
    for u in index.units:
        for arm, entry in u["stores"].items():
            if entry["status"] != "done":
                raise StoreError(index.run_dir.run_json, f"{u['label']} of arm {arm} is not measured: resume "
                                 f"it first (`python -m twinrun.resume {index.run_dir.path}`)")
            path = index.store_path(u, arm)
            tensors, meta = read_sample_store(path, entry["sha256"])
            voucher.store(u, arm, path, meta)
            out[arm, u["index"]] = (tensors, meta)
    return out


def validity_checks(index: RunIndex, stores: dict) -> list[dict]:
    """The arms' configs differ only in `intervention`; every arm consumed the same noise in every
    chunk; one sampler and loss protocol in every store; then the provenance every kind is held to."""
    names = index.arm_names
    configs = {a: {k: v for k, v in index.arm_config(a).items() if k != "intervention"} for a in names}
    differ = [a for a in names if configs[a] != configs[names[0]]]
    out = [check("configs_differ_only_in_intervention", not differ,
                 "ok" if not differ else f"arms {differ} differ outside `intervention`")]
    unequal = sorted({i for (a, i), (_, m) in stores.items() if m["noise_digest"] != stores[names[0], i][1]
                      ["noise_digest"]})
    out.append(check("identical_noise", not unequal, f"noise digests equal in all {len(index.units)} chunks"
                     if not unequal else f"noise digests differ between arms in chunks {unequal}"))
    keys = ("sampler", "steps", "loss_sigmas", "seed")
    first = next(iter(stores.values()))[1]
    mixed = sorted({k for _, m in stores.values() for k in keys if m[k] != first[k]})
    out.append(check("same_protocol", not mixed, "one sampler, schedule, seed and loss protocol in every "
                     "store" if not mixed else f"stores differ in {', '.join(mixed)}"))
    return out + provenance_checks(index, {k: SimpleNamespace(meta=m) for k, (_, m) in stores.items()},
                                   "chunk")


def paired(values: torch.Tensor) -> tuple[float, float | None]:
    """(mean, its SE) of per-sample values (float64; SE None below 2 samples)."""
    v = values.double()
    n = v.shape[0]
    return float(v.mean()), (float(v.std(unbiased=True) / math.sqrt(n)) if n > 1 else None)


def mmd2(delta: torch.Tensor) -> tuple[float, float | None]:
    """(MMD², its jackknife SE) from paired feature differences δ_i = φ(x_arm,i) − φ(x_twin,i) [n, F]:
    the U-statistic mean over i ≠ j of δ_i·δ_j, unbiased for |E φ(X) − E φ(Y)|²; SE None below 3."""
    d = delta.double()
    n = d.shape[0]
    total, squares = d.sum(0), (d * d).sum(1)
    u = float((total @ total - squares.sum()) / (n * (n - 1)))
    if n < 3:
        return u, None
    rest = total.unsqueeze(0) - d  # Σ_{j ≠ i} δ_j
    leave_out = ((rest * rest).sum(1) - (squares.sum() - squares)) / ((n - 1) * (n - 2))
    return u, float(math.sqrt((n - 1) / n * float(((leave_out - leave_out.mean()) ** 2).sum())))


def read_pair(arm: dict, twin: dict) -> dict[str, dict]:
    """Each metric of one arm against the twin over the samples given (tensors of both, same samples)."""
    diff = (arm["samples"] - twin["samples"]).double().flatten(1)
    distance = diff.pow(2).mean(1).sqrt()
    loss_arm, loss_twin = arm["loss"].double().mean(1), twin["loss"].double().mean(1)
    value, se = paired(loss_arm - loss_twin)
    out = {"distance": dict(zip(("value", "se"), paired(distance), strict=True)),
           "loss": {"value": value, "se": se, "arm_loss": float(loss_arm.mean()),
                    "twin_loss": float(loss_twin.mean())},
           "mmd": dict(zip(("value", "se"), mmd2(arm["features"] - twin["features"]), strict=True))}
    out["distance"]["max_abs_diff"] = float(diff.abs().max())
    return out


def _joined(stores: dict, arm: str, units: list[int]) -> dict:
    return {k: torch.cat([stores[arm, i][0][k] for i in units]) for k in ("samples", "loss", "features")}


def machinery_gates(index: RunIndex, stores: dict, replicate_shift: dict, rule: str) -> list[dict]:
    """One gate row per machinery arm and chunk: bit-identical to the twin, or (a nondeterministic path
    only) within the bound of the replicates' largest differences in that chunk (gates.decide, the probe's
    rule; every machinery arm's chunks one family)."""
    twin, kind, rows = index.arm("twin")["name"], index.measure, []
    for arm in index.arms_with_role("machinery"):
        for u in index.units:
            i = u["index"]
            shift = read_pair(stores[arm, i][0], stores[twin, i][0])["distance"]["max_abs_diff"]
            reps = replicate_shift.get(i)  # each replicate's (gates.decide bounds their spread)
            passed, decided = decide(shift == 0.0, shift, reps, rule,
                                     len(index.arms_with_role("machinery")) * len(index.units))
            rows.append({"first": u[kind]["first"], "arm": arm, "passed": passed, "rule": decided,
                         "bit_identical": shift == 0.0, "max_abs_diff": shift,
                         "replicate_max_abs_diff": max(reps) if reps else None,
                         "detail": f"{arm} (the intervention's code at its no-op setting) against the twin, "
                         f"{u['label']}: {decided}"})
    return rows


def readings(index: RunIndex, stores: dict) -> tuple[list[dict], list[dict]]:
    """(per chunk: the intervention against the twin; over every sample: the intervention's and the
    replicate's reading), each metric of SAMPLE_METRICS a row."""
    inter, twin, kind = index.arm("intervention")["name"], index.arm("twin")["name"], index.measure
    replicate = (index.arms_with_role("replicate") or [None])[0]
    per_chunk = []
    for u in index.units:
        reading = read_pair(stores[inter, u["index"]][0], stores[twin, u["index"]][0])
        per_chunk += [{"first": u[kind]["first"], "count": u[kind]["count"], "estimand": m, **reading[m]}
                      for m in SAMPLE_METRICS]
    # Over every sample at once: the SEs over all n pairs, not an average of the chunks' readings
    # (the MMD² U-statistic is not additive over chunks).
    indices, overall = [u["index"] for u in index.units], []
    for arm, role in ((inter, "intervention"), (replicate, "replicate")):
        if arm is not None:
            reading = read_pair(_joined(stores, arm, indices), _joined(stores, twin, indices))
            overall += [{"arm": arm, "role": role, "estimand": m, **reading[m]} for m in SAMPLE_METRICS]
    return per_chunk, overall


def analyse(index: RunIndex, stores: dict, used: dict) -> dict:
    """The summary of one analysis (the registered one, or a post-hoc view's settings)."""
    twin, kind = index.arm("twin")["name"], index.measure
    replicate = (index.arms_with_role("replicate") or [None])[0]
    checks = validity_checks(index, stores)
    # The replicate's largest difference from the twin per chunk: 0 on a deterministic path, where a
    # machinery arm that differs at all is not a no-op.
    rep = {u["index"]: read_pair(stores[replicate, u["index"]][0], stores[twin, u["index"]][0])
           ["distance"]["max_abs_diff"] for u in index.units} if replicate else {}
    every = {u["index"]: [read_pair(stores[r, u["index"]][0], stores[twin, u["index"]][0])["distance"]
                          ["max_abs_diff"] for r in index.arms_with_role("replicate")] for u in index.units}
    gates = machinery_gates(index, stores, every if replicate else {}, used["gate_rule"])
    checks_passed = all(c["passed"] for c in checks)
    passed = checks_passed and all(g["passed"] for g in gates)
    # A broken instrument shows no reading at all: its numbers would be the breakage's.
    effects, overall = readings(index, stores) if passed else ([], [])
    return {"measure": kind, "run_dir": str(index.run_dir.path), "arms": index.arm_names,
            "registered": registered(index), "used": {**used, "estimands": list(SAMPLE_METRICS)},
            "checks_passed": checks_passed, "passed": passed, "checks": checks, "gates": gates,
            "effects": effects, "overall": overall, "n_samples": sum(u[kind]["count"] for u in index.units),
            "replicate": None if not rep else {"arm": replicate, "max_abs_diff": max(rep.values()),
                                               "bit_identical": all(v == 0.0 for v in rep.values())},
            "no_machinery_arm": not index.arms_with_role("machinery")}


def reduce_sample(run_dir: Path, estimands=None, gate_rule=None, signal_alpha=None,
                  family_alpha=None) -> Reduction:
    """The registered analysis and, when any setting differs (the gate rule), a post-hoc view."""
    index = RunIndex.load(run_dir)
    stores = read_stores(index)
    reg = registered(index)
    used = used_settings(reg, estimands, gate_rule, signal_alpha, family_alpha)
    summary = analyse(index, stores, reg)
    if used == reg:
        return Reduction(index, summary)
    view = analyse(index, stores, used)
    name = view_name(reg, used)
    view["post_hoc"] = {"registered": reg, "used": used, "view_dir": str(index.run_dir.view_dir(name)),
                        "registered_passed": summary["passed"]}
    return Reduction(index, summary, view, name)
