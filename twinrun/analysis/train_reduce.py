"""Reduce a training run: validity checks → the machinery gate → the chaos floor → effects. Writes nothing.

Every store is read through its checks (read_train_store), unit by unit: the arms of one stored step
are held together, the twin's start weights throughout. Per stored step and estimand (a parameter
group of the registry) each arm is read against the twin in weight space, with θ_start the start
checkpoint: the cosine and norm ratio of the updates (θ_arm − θ_start vs θ_twin − θ_start) and the
relative distance |θ_arm − θ_twin| / |θ_twin − θ_start|. The largest of the chaos arms' and the
replicates' distances is the floor; the intervention is "above the floor" only where its distance exceeds
it by train.floor_margin × the chaos arms' spread (analysis/train_effects.py).
Bit identity is read from the digests every store carries of each weight after every step.
"""

import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from twinrun import arms as arms_mod
from twinrun.analysis.estimands import ESTIMANDS, SHIFT_VIEW, check_estimands, registry
from twinrun.analysis.gates import decide, wobble_bound
from twinrun.analysis.reduction import (
    Reduction,
    check,
    provenance_checks,
    registered,
    used_settings,
    view_name,
)
from twinrun.analysis.train_effects import EMA, effect_rows, ema_rows, verdict
from twinrun.analysis.train_losses import loss_rows, loss_sentence, paired
from twinrun.analysis.vouch import TWIN, StoreRules, Voucher, check_step_digests
from twinrun.config import TrainConfig
from twinrun.errors import ConfigError, StoreError, TwinrunError
from twinrun.instantiate import typed
from twinrun.storage.rundir import RunIndex
from twinrun.storage.train_records import TrainSummary
from twinrun.storage.train_store import TrainStore, read_train_store


@dataclass
class Run:
    """A training run as the reducer reads it: its index, roles, the arms' weight layout and settings."""

    index: RunIndex
    roles: dict  # role -> arm name
    layout: list[dict]
    margin: float  # train.floor_margin, registered with the config at plan time
    stored: list  # per unit: {arm: TrainStore metadata and digests}, payload dropped once read
    chaos_param: str  # train.chaos.param: the weight the chaos arm starts one ulp off (weights=one)
    chaos_moved: dict  # at the start, per chaos arm: weight -> its elements held off the twin's
    by_role: dict = field(default_factory=dict)  # role -> every arm of it (replicates: several)
    chaos_weights: str = "one"  # train.chaos.weights: one element of chaos_param, or every nonzero element
    nonzero: dict = field(default_factory=dict)  # at the start: trained weight -> its nonzero elements
    floor_scope: str = "estimand"  # train.floor_scope: an estimand's own floor, or its own or the model's

    def all_of(self, role: str) -> list[str]:
        return self.by_role.get(role) or ([self.roles[role]] if role in self.roles else [])


# What each training store must agree with (analysis/vouch.py): its segment's steps, its arm's seed, the
# first store's held-out ids (as many as train.heldout_images), twinrun's own data set's ids.
TRAIN_STORE_RULES = StoreRules("unit_index", {"from_step": "from_step", "to_step": "to_step"},
                               {"seed": "seed"}, ("heldout_ids",), {"heldout_ids": "train.heldout_images"},
                               ("heldout_ids", "train.heldout_images"))


def _store(index: RunIndex, u: dict, arm: str, voucher: Voucher) -> TrainStore:
    """One store read through its checks, then held to the run (its config, unit, kernel path, data)."""
    entry = u["stores"][arm]
    path = index.store_path(u, arm)
    if entry["status"] != "done":
        raise StoreError(path, f"{u['label']} of arm {arm} is {entry['status']}: resume the run, then reduce")
    store = read_train_store(path, entry["sha256"])
    voucher.store(u, arm, path, store.meta)
    return store


def selections(layout: list[dict], names: list[str], groups: dict) -> dict[str, list[str]]:
    """estimand -> the weights it reads (registry selections over the layout)."""
    known = registry(groups)
    return {n: [g["name"] for g in layout if known[n].selects(g)] for n in names}


def pair_stats(theta: dict, twin: dict, start: dict, names: list[str]) -> dict:
    """Weight-space comparison of one arm with the twin over some weights, float64: the updates'
    cosine and norm ratio, and the relative distance."""
    dot = na = nt = dd = 0.0
    for n in names:
        a, t, s = theta[n].double(), twin[n].double(), start[n].double()
        da, dt = a - s, t - s
        dot += float((da * dt).sum())
        na += float((da * da).sum())
        nt += float((dt * dt).sum())
        dd += float(((a - t) ** 2).sum())
    ok = na > 0 and nt > 0
    return {"cos": dot / math.sqrt(na * nt) if ok else None, "norm_ratio": math.sqrt(na / nt) if ok else None,
            "distance": math.sqrt(dd / nt) if nt > 0 else None, "update_norm": math.sqrt(na),
            "twin_update_norm": math.sqrt(nt), "abs_distance": math.sqrt(dd)}


def first_difference(stores: list[dict], arm: str, layout: list[dict]) -> dict:
    """The first step at which an arm's weights leave the twin's bits, and the first weight (in the model's
    order) that differs there: from the start stores' tensor digests (step 0), then every step's."""
    names = [g["name"] for g in layout]
    through = None  # the last step measured, where the arm stops before the run does
    for per in stores:
        if arm not in per:  # a replicate measured in the first segments only (arms.replicate_segments)
            return {"arm": arm, "step": None, "first_tensor": None, "n_differ": 0, "n_tensors": len(names),
                    "measured_through": through}
        through = per[TWIN]["to_step"]
        mine, twin = per[arm], per[TWIN]
        if per is stores[0]:
            steps = [(0, [mine["digests"][f"weight/{n}"] for n in names],
                      [twin["digests"][f"weight/{n}"] for n in names])]
        else:
            steps = [(mine["from_step"] + k + 1, a, b)
                     for k, (a, b) in enumerate(zip(mine["step_digests"], twin["step_digests"], strict=True))]
        for step, a, b in steps:
            differ = [n for n, x, y in zip(names, a, b, strict=True) if x[:len(y)] != y[:len(x)]]
            if differ:
                return {"arm": arm, "step": step, "first_tensor": differ[0], "n_differ": len(differ),
                        "n_tensors": len(names)}
    return {"arm": arm, "step": None, "first_tensor": None, "n_differ": 0, "n_tensors": len(names)}


def check_without(index: RunIndex, replicates: list[str], twin_config: dict) -> None:
    """The units that leave the replicates out are exactly those after arms.replicate_segments (the twin's
    config.yaml, held to its hash): a `without` edited into run.json would drop the replicates from the
    floor, which is the larger of the chaos arms' and the replicates' distances."""
    k = (twin_config.get("arms") or {}).get("replicate_segments")
    for u in index.units:
        expected = set(replicates) if k is not None and u["index"] > k else set()
        left_out = set(u.get("without", ()))
        if left_out != expected:
            raise StoreError(index.run_dir.run_json, f"{u['label']} leaves out {sorted(left_out)} "
                             f"but the run's arms.replicate_segments={k} leaves out {sorted(expected)}: "
                             "run.json was edited; use the run directory as twinrun wrote it")


def scan(run_dir: Path, names: list[str]) -> tuple[Run, list[dict], dict, list[dict]]:
    """Read every store once, unit by unit (the arms of one stored step held together, the twin's start
    weights throughout): the run, the per-unit records (metadata and digests), every arm against the
    twin {(unit, arm, estimand): pair_stats} for the estimands `names`, and each unit's losses."""
    index = RunIndex.load(run_dir)
    if index.measure != "train":
        raise StoreError(index.run_dir.run_json, f"measures {index.measure}, not training")
    by_role: dict = {}
    for a in index.arms:
        by_role.setdefault(a["role"], []).append(a["name"])
    roles = {role: names[0] for role, names in by_role.items()}
    voucher = Voucher(index, TRAIN_STORE_RULES)  # every config.yaml held to its hash before it is read
    t = typed(TrainConfig, voucher.configs[TWIN]["train"], index.run_dir.arm_config(TWIN))
    chaos, moved, nonzero = by_role.get("chaos", []), {}, {}
    # a run planned before train.chaos.weights existed had the one-element chaos arm
    chaos_weights = voucher.configs[TWIN]["train"]["chaos"].get("weights", "one")
    groups = index.registered.get("groups") or {}
    check_without(index, by_role.get("replicate", []), voucher.configs[TWIN])
    records, found, losses, start, sel = [], {}, [], None, None
    for u in index.units:
        stores = {arm: _store(index, u, arm, voucher) for arm in u["stores"]}
        for arm in (a for a in stores if a != TWIN):
            check_step_digests(stores[arm].path, stores[arm].meta, stores[TWIN].meta, stores[arm].digests,
                               stores[TWIN].digests, stores[TWIN].path)
        weights = {arm: _weights(s) for arm, s in stores.items()}
        if start is None:
            start, layout = weights[TWIN], stores[TWIN].meta["layout"]
            check_estimands(names, groups, layout, "estimands", params_key=None)
            sel = selections(layout, names, groups)
            # what a chaos arm over every weight moves: the trained weights' nonzero elements
            trained = [n for n in start if any(fnmatch.fnmatchcase(n, q) for q in t.params)]
            nonzero = {n: int(start[n].count_nonzero()) for n in trained}
            for c in chaos:
                off = {n: int((w != weights[c][n]).sum()) for n, w in start.items()}
                moved[c] = {n: k for n, k in off.items() if k}
        emas = {arm: _weights(s, "ema/") for arm, s in stores.items()}
        for arm in (a for a in weights if a != TWIN):
            for name, selected in sel.items():
                found[u["index"], arm, name] = pair_stats(weights[arm], weights[TWIN], start, selected)
            if emas[TWIN] and emas[arm]:  # train.ema: the averaged weights, read as their own estimand
                found[u["index"], arm, EMA] = pair_stats(emas[arm], emas[TWIN], start, sorted(emas[TWIN]))
        records.append({arm: {**s.meta, "digests": s.digests, "path": str(s.path)}
                        for arm, s in stores.items()})
        losses.append({arm: {k: s.tensors[k] for k in ("train_loss", "heldout_loss", "train_loss_common")
                             if k in s.tensors} for arm, s in stores.items()})
    # a run planned before train.floor_scope existed read every estimand against its own floor
    scope = voucher.configs[TWIN]["train"].get("floor_scope", "estimand")
    run = Run(index, roles, layout, t.floor_margin, records, t.chaos.param, moved, by_role, chaos_weights,
              {n: k for n, k in nonzero.items() if k}, scope)
    return run, records, found, losses


def validity_checks(run: Run, records: list[dict]) -> list[dict]:
    index = run.index
    names = index.arm_names
    configs = {n: index.arm_config(n) for n in names}
    bad = {n: d for n in names
           if (d := arms_mod.outside_intervention(arms_mod.config_diff(configs[TWIN], configs[n])))}
    out = [check("configs_differ_only_in_intervention", not bad,
                 "ok" if not bad else f"arms differ outside `intervention` at {bad}")]
    unequal = [u["label"] for u, per in zip(index.units, records, strict=True)
               if len({m["data_digest"] for m in per.values()}) > 1]
    held = {m["heldout_digest"] for per in records for m in per.values()}
    caches = {tuple(sorted((m.get("data_files") or {}).items())) for per in records for m in per.values()}
    same = not unequal and len(held) == 1 and len(caches) == 1
    out.append(check("identical_samples_and_noise", same,
                     f"every arm trained on the same samples and noise in all {len(records)} units and "
                     "read the held-out loss on the same images and draws" if same else
                     f"sample or noise digests differ between arms in {unequal or 'the held-out draws'}"
                     f"{'' if len(caches) == 1 else ' (or the stores name other data caches)'}"))
    mismatched = sorted({m["path"] for u, per in zip(index.units, records, strict=True) for m in per.values()
                         if m["layout"] != run.layout or m["from_step"] != u["train"]["from_step"]
                         or m["to_step"] != u["train"]["to_step"]})
    out.append(check("same_protocol", not mismatched,
                     "every store holds the same weights and the steps of its unit" if not mismatched
                     else f"layout or steps differ in {mismatched}"))
    if "chaos" in run.roles:
        out.append(chaos_landed(run))
    metas = {(arm, i): _Meta(m) for i, per in enumerate(records) for arm, m in per.items()}
    return out + provenance_checks(index, metas, "segment")


def chaos_landed(run: Run) -> dict:
    """Every chaos arm starts off the twin's bits where train.chaos.weights says, and only there: one
    element of train.chaos.param, or every nonzero element of every weight."""
    every = run.chaos_weights == "every"
    want = run.nonzero if every else {run.chaos_param: 1}
    wrong = {arm: moved or "no weight" for arm, moved in run.chaos_moved.items() if moved != want}
    chaos = run.all_of("chaos")
    arms = "the chaos arm" if len(chaos) == 1 else f"each of the {len(chaos)} chaos arms"
    where = "every nonzero element of every trained weight" if every else f"one element of {run.chaos_param}"
    detail = (f"{arms} starts off the twin's bits at {where} (only)" if not wrong else
              f"a chaos arm starts off the twin's bits elsewhere than at {where} ({wrong}): the floor would "
              "measure something else")
    return check("chaos_perturbation_landed", not wrong, detail)


@dataclass
class _Meta:
    meta: dict


def gate_rows(run: Run, records: list[dict], found: dict, rule: str) -> list[dict]:
    """The machinery arm against the twin at every stored step: bit-identical (every weight, after every
    step of the unit), or decided by the replicates as the probe's gate rule decides (gates.decide: a bound
    on their spread, all the run's stored steps one family)."""
    machinery, replicates = run.roles.get("machinery"), run.all_of("replicate")
    if machinery is None:
        return []
    rows = []
    for i, per in enumerate(records):
        step = per[TWIN]["to_step"]
        same = _identical(per, machinery)
        dist = 0.0 if same else _distance(found, i, machinery)
        reps = [0.0 if _identical(per, r) else _distance(found, i, r) for r in replicates if r in per]
        passed, decided_by = decide(same, dist, reps, rule, len(records))
        tensor = None if same else _first_tensor(per, machinery, run.layout)
        bound = wobble_bound(reps, len(records)) if reps and not same else None
        if same:
            detail = f"step {step}: bit-identical to the twin at every step of {run.index.units[i]['label']}"
        elif reps and max(reps) == 0.0:
            detail = (f"not a no-op: at step {step} the machinery arm (the intervention's code at its "
                      f"no-op setting) differs from the twin (relative distance {dist:.3e}, first tensor "
                      f"{tensor}); the replicate is bit-identical, so the kernel path is deterministic")
        else:
            told = ("unmeasured" if not reps else ", ".join(f"{r:.3e}" for r in reps) + (
                f"; the bound of the path's wobble {bound:.3e}" if bound is not None else
                "; too few differ to bound the path's wobble (arms.replicates ≥ 3 does)"))
            detail = (f"step {step}: the machinery arm differs (relative distance {dist:.3e}, first tensor "
                      f"{tensor}); the replicates': {told}")
        spread = {} if same or not reps else {"replicate_distances": reps, "wobble_bound": bound}
        rows.append({"step": step, "arm": machinery, "passed": passed, "rule": decided_by,
                     "bit_identical": same, "distance": dist,
                     "replicate_distance": max(reps) if reps else None, **spread, "first_tensor": tensor,
                     "detail": detail})
    return rows


def _identical(per: dict, arm: str) -> bool:
    mine, twin = per[arm], per[TWIN]
    # buffers too: an intervention that moves only BatchNorm's running statistics at its no-op setting
    # leaves every weight alone and still changes what the model computes in eval mode
    ends = all(mine["digests"][k] == twin["digests"][k] for k in twin["digests"]
               if k.startswith(("weight/", "buffer/")))
    return ends and mine["step_digests"] == twin["step_digests"]


def _first_tensor(per: dict, arm: str, layout: list[dict]) -> str | None:
    for k, (a, b) in enumerate(zip(per[arm]["step_digests"], per[TWIN]["step_digests"], strict=True)):
        for g, x, y in zip(layout, a, b, strict=True):
            if x != y:
                return f"{g['name']} (after step {per[TWIN]['from_step'] + k + 1})"
    return next((g["name"] for g in layout if per[arm]["digests"][f"weight/{g['name']}"]
                 != per[TWIN]["digests"][f"weight/{g['name']}"]), None) or next(
        (k for k in per[TWIN]["digests"] if k.startswith("buffer/")
         and per[arm]["digests"].get(k) != per[TWIN]["digests"][k]), None)


def _distance(found: dict, i: int, arm: str) -> float:
    s = found[i, arm, SHIFT_VIEW]
    if s["distance"] is not None:
        return s["distance"]
    return math.inf if s["abs_distance"] > 0 else 0.0


def replicate_report(run: Run, records: list[dict], found: dict) -> dict | None:
    """The twin trained twice in one job: "k / N tensors differ" at each stored step."""
    reps = run.all_of("replicate")
    if not reps:
        return None
    names = [f"weight/{g['name']}" for g in run.layout]
    rows = []
    for i, per in enumerate(records):  # per stored step, the replicate furthest from the twin
        each = []
        for rep in (r for r in reps if r in per):  # (arms.replicate_segments: its first segments only)
            differ = [n for n in names if per[rep]["digests"][n] != per[TWIN]["digests"][n]]
            each.append({"step": per[TWIN]["to_step"], "n_differ": len(differ), "n_tensors": len(names),
                         "bit_identical": _identical(per, rep),
                         "distance": 0.0 if not differ else _distance(found, i, rep),
                         "first_tensor": differ[0].removeprefix("weight/") if differ else None})
        if each:
            rows.append(max(each, key=lambda r: (r["n_differ"], r["distance"], not r["bit_identical"])))
    worst = max(rows, key=lambda r: r["n_differ"])
    deterministic = all(r["bit_identical"] for r in rows)
    its = "its replicate" if len(reps) == 1 else f"its {len(reps)} replicates"
    if deterministic:
        detail = (f"0 / {worst['n_tensors']} tensors differ between the native twin and {its} at "
                  "every stored step, and their weights are bit-identical after every step: this kernel path "
                  "is deterministic for this run")
    else:
        first = next(r for r in rows if not r["bit_identical"])
        detail = (f"{worst['n_differ']} / {worst['n_tensors']} tensors differ between the native twin and "
                  f"{its} at worst (step {worst['step']}); they part by step {first['step']} "
                  f"(first tensor {next((r['first_tensor'] for r in rows if r['first_tensor']), '–')}): this "
                  "kernel path is nondeterministic, and the replicates measure its within-environment chaos")
    if rows[-1]["step"] != records[-1][TWIN]["to_step"]:
        detail += f" (measured through step {rows[-1]['step']} only: arms.replicate_segments)"
    return {"deterministic": deterministic, "steps": rows, "detail": detail}


def analyse(run: Run, records: list[dict], losses: list[dict], found: dict, used: dict) -> dict:
    checks = validity_checks(run, records)
    gates = gate_rows(run, records, found, used["gate_rule"])
    if not gates:
        checks.append(check("has_gate", False, "no machinery arm: nothing vouches for the instrument"))
    checks_passed = all(c["passed"] for c in checks)
    ok = checks_passed and all(g["passed"] for g in gates)
    floor, effects = effect_rows(run, records, found, used["estimands"])
    firsts = [first_difference(records, arm, run.layout) for arm in run.index.arm_names if arm != TWIN]
    summary: TrainSummary = {
        "measure": "train", "run_dir": str(run.index.run_dir.path), "arms": run.index.arm_names,
        "registered": registered(run.index), "used": used, "checks_passed": checks_passed, "passed": ok,
        "verdict": (verdict(effects, used["estimands"][0], run.margin) if ok else
                    "INSTRUMENT BROKEN: a validity check or the machinery gate failed; effects are withheld"),
        "checks": checks, "gates": gates, "replicate": replicate_report(run, records, found),
        "first_differing": firsts, "floor": floor if ok else [], "effects": effects if ok else [],
        "losses": loss_rows(run, records, losses, used["signal_alpha"]) if ok else [],
        "floor_scope": run.floor_scope}
    if summary["losses"]:
        summary["verdict"] += loss_sentence(summary["losses"])
    if ok and any(k[2] == EMA for k in found):
        summary["ema"] = ema_rows(run, records, found)
    if records and records[0][TWIN].get("data_files"):  # the caches the data were read from (every store's)
        summary["data_files"] = records[0][TWIN]["data_files"]
    return summary


def refuse_derived(names, key: str = "reduce.estimands") -> None:
    """A training run reads parameter groups only: a derived view (the probe's `residual`, over σ bins)
    would read as a plain selection of the weights and print another estimand's numbers under its name."""
    derived = [n for n in names if n in ESTIMANDS and ESTIMANDS[n].derive is not None]
    if derived:
        raise ConfigError(key, list(names), f"{derived} are views over σ bins of the probe; a training run "
                          "reads parameter groups: all, cond or reduce.groups")


def reduce_train(run_dir: Path, estimands=None, gate_rule=None, signal_alpha=None,
                 family_alpha=None) -> Reduction:
    """The registered analysis and, when any setting differs, a post-hoc view; every store read once.
    The registered verdict is recomputed from the stores, never read from summary.json."""
    if estimands is not None:
        refuse_derived(estimands, "--estimands")
    if family_alpha is not None:
        raise ConfigError("--family-alpha", family_alpha, "a training run has no family-wise reading (each "
                          "parameter group's distance is read against the chaos floor); drop it")
    reg = registered(RunIndex.load(run_dir))
    used = used_settings(reg, estimands, gate_rule, signal_alpha)
    names = list(dict.fromkeys([SHIFT_VIEW, *reg["estimands"], *used["estimands"]]))
    run, records, found, losses = scan(run_dir, names)
    summary = analyse(run, records, losses, found, reg)
    if used == reg:
        return Reduction(run.index, summary)
    view = analyse(run, records, losses, found, used)
    name = view_name(reg, used)
    view["post_hoc"] = {"registered": reg, "used": used, "view_dir": str(run.index.run_dir.view_dir(name)),
                        "registered_passed": summary["passed"]}
    return Reduction(run.index, summary, view, name)


# ----------------------------------------------------------------------------- two training runs compared


def arm_stores(run_dir: Path, arm: str) -> dict[int, TrainStore]:
    """{stored step: TrainStore} of one arm of a training run, every store checked against run.json."""
    index = RunIndex.load(run_dir)
    if index.measure != "train":
        raise StoreError(index.run_dir.run_json, f"measures {index.measure}, not training")
    if arm not in index.arm_names:
        raise StoreError(run_dir, f"has no arm {arm!r} (its arms: {', '.join(index.arm_names)})")
    voucher = Voucher(index, TRAIN_STORE_RULES)
    return {u["train"]["to_step"]: _store(index, u, arm, voucher) for u in index.units}


def compare_stores(a: dict[int, TrainStore], b: dict[int, TrainStore]) -> list[dict]:
    """B against A at every step both stored: how many weights differ (and the first), the relative
    distance |θ_B − θ_A| / |θ_A − θ_A,start| (A's start: its step-0 store, when it has one), and B's
    held-out loss minus A's ± paired SE where both read the same images and draws. Refuses (a
    TwinrunError naming the step) two runs that trained on other samples or noise at a common step."""
    steps = sorted(set(a) & set(b))
    if not steps:
        raise TwinrunError(f"no stored step in common (A: {sorted(a)}, B: {sorted(b)})")
    start = _weights(a[min(a)]) if min(a) == 0 else None
    rows = []
    for step in steps:
        sa, sb = a[step], b[step]
        if sa.meta["layout"] != sb.meta["layout"]:
            raise TwinrunError(f"step {step}: the two sides hold different weights (another model)")
        if sa.meta["data_digest"] != sb.meta["data_digest"]:
            raise TwinrunError(f"step {step}: the two runs trained on other samples or noise (data digests "
                               "differ): they measure different things")
        wa, wb = _weights(sa), _weights(sb)
        names = [g["name"] for g in sa.meta["layout"]]
        differ = [n for n in names if sa.digests[f"weight/{n}"] != sb.digests[f"weight/{n}"]]
        stats_ = pair_stats(wb, wa, start, names) if start is not None else {"distance": None, "cos": None}
        same_heldout = sa.meta["heldout_digest"] == sb.meta["heldout_digest"]
        diff, se = (paired(sb.tensors["heldout_loss"], sa.tensors["heldout_loss"]) if same_heldout
                    else (None, None))
        rows.append({"step": step, "n_differ": len(differ), "n_tensors": len(names),
                     "first_tensor": differ[0] if differ else None,
                     "max_abs_diff": max((float((wa[n] - wb[n]).abs().max()) for n in differ), default=0.0),
                     "distance": stats_["distance"] if step > 0 else None, "cos": stats_["cos"],
                     "heldout_a": float(sa.tensors["heldout_loss"].double().mean()),
                     "heldout_b": float(sb.tensors["heldout_loss"].double().mean()),
                     "heldout_diff": diff, "heldout_diff_se": se})
    return rows


def _weights(store: TrainStore, prefix: str = "weight/") -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in store.tensors.items() if k.startswith(prefix)}
