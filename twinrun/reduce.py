"""Reduce a run: validity checks → no-op gates → effects (only if everything passed).

    python -m twinrun.reduce RUN_DIR

Exit codes: 0 every check and gate passed; 1 a check or gate failed (the instrument is broken:
effects withheld); 2 bad input (missing, damaged or foreign stores).
"""

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import yaml

from twinrun import arms as arms_mod
from twinrun.env import kernel_path_diff
from twinrun.errors import EXIT_GATE, EXIT_OK, StoreError, TwinrunError, fail
from twinrun.estimator import estimate
from twinrun.report import write_report
from twinrun.store import read_json, read_store, require_run_dir, write_json

ESTIMANDS = ("all", "cond", "residual")
# Store metadata that must agree across every store of a run (the protocol).
PROTOCOL_KEYS = ("n_images", "n_draws", "fold_sizes", "layout")


def check(name: str, passed: bool, detail: str) -> dict:
    return {"name": name, "passed": bool(passed), "detail": detail}


def load_run(run_dir: Path) -> tuple[dict, dict]:
    """run.json and every store it lists ({(arm, bin_index): Store}), each checked."""
    run = read_json(run_dir / "run.json")
    if run.get("format") != "twinrun-run/1":
        raise StoreError(run_dir / "run.json", f"not a twinrun run index (format {run.get('format')!r})")
    well_formed = isinstance(run.get("arms"), list) and isinstance(run.get("bins"), list) and all(
        isinstance(b, dict) and isinstance(b.get("stores"), dict) and "index" in b and "sigma" in b
        for b in run["bins"]) and all(isinstance(a, dict) and "name" in a for a in run["arms"])
    if not well_formed:
        raise StoreError(run_dir / "run.json", "malformed run index (arms, bins or stores missing)")
    wanted = {}
    for b in run["bins"]:
        for arm in run["arms"]:
            entry = b["stores"].get(arm["name"], {})
            path = run_dir / "arms" / arm["name"] / entry.get("file", "")
            if entry.get("status") != "done":
                raise StoreError(path, f"bin {b['index']} (σ={b['sigma']:g}) of arm {arm['name']} is "
                                 f"{entry.get('status', 'missing')}: resume the run, then reduce")
            wanted[arm["name"], b["index"]] = (path, entry.get("sha256"), arm["config_hash"])
    # Reading and hashing release the GIL: a few threads overlap disk and sha256 (each store is
    # still read exactly once).
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        loaded = dict(zip(wanted, pool.map(lambda w: read_store(w[0], w[1]), wanted.values())))
    for (name, index), store in loaded.items():
        if store.meta["config_hash"] != wanted[name, index][2]:
            raise StoreError(store.path, "config hash differs from run.json's: a store from another run")
        if store.meta["arm"] != name or store.meta["bin_index"] != index:
            raise StoreError(store.path, "store belongs to another arm or bin than run.json says")
    return run, loaded


def _arm_config(run_dir: Path, arm: str) -> dict:
    path = run_dir / "arms" / arm / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise StoreError(path, f"unreadable arm config ({getattr(err, 'strerror', None) or err})") from None
    if not isinstance(config, dict):
        raise StoreError(path, "not a resolved twinrun config")
    return config


def validity_checks(run_dir: Path, run: dict, stores: dict) -> list[dict]:
    names = [a["name"] for a in run["arms"]]
    configs = {n: _arm_config(run_dir, n) for n in names}
    out = []
    diffs = {n: arms_mod.outside_intervention(arms_mod.config_diff(configs[names[0]], configs[n])) for n in names}
    bad = {n: d for n, d in diffs.items() if d}
    out.append(check("configs_differ_only_in_intervention", not bad,
                     "ok" if not bad else f"arms differ outside `intervention` at {bad}"))
    unequal = [b["index"] for b in run["bins"] if len({stores[n, b["index"]].meta["draws_digest"] for n in names}) > 1]
    out.append(check("identical_draws", not unequal,
                     f"draw digests equal in all {len(run['bins'])} bins" if not unequal
                     else f"draw digests differ between arms in bins {unequal}"))
    ref = next(iter(stores.values())).meta
    mismatched = sorted({str(s.path) for s in stores.values() for k in PROTOCOL_KEYS if s.meta[k] != ref[k]})
    out.append(check("same_protocol", not mismatched,
                     "images, draws, folds and parameter layout equal in every store" if not mismatched
                     else f"protocol differs in {mismatched}"))
    wrong_sigma = [s.path.name for (n, i), s in stores.items() if s.meta["sigma"] != run["bins"][i]["sigma"]]
    out.append(check("stores_match_bins", not wrong_sigma,
                     "every store's σ matches its bin" if not wrong_sigma else f"σ mismatch in {wrong_sigma}"))
    return out + provenance_checks(run, stores, names)


def provenance_checks(run: dict, stores: dict, names: list[str]) -> list[dict]:
    """Validity rule 3: each bin's arms ran in one process/node/boot/GPU/job on one kernel path,
    and the kernel-path sentinel read around the jobs never moved."""
    out = []
    split = {}
    for b in run["bins"]:
        records = [stores[n, b["index"]].meta.get("env") or {} for n in names]
        fields = sorted({k for r in records for k in r if any(r.get(k) != o.get(k) for o in records)})
        if fields or not records[0]:
            split[b["index"]] = fields or ["(no record)"]
    out.append(check("same_allocation_per_bin", not split,
                     "every bin's arms ran back to back in one process (same job, node, boot, GPU)" if not split
                     else "arms of a bin ran apart: " + "; ".join(f"bin {i}: {', '.join(f)}" for i, f in split.items())))
    paths = {(s.meta.get("env") or {}).get("kernel_path_sha256") for s in stores.values()}
    out.append(check("one_kernel_path", len(paths) == 1 and None not in paths,
                     "every store was measured on one kernel path" if len(paths) == 1
                     else f"stores come from {len(paths)} kernel paths"))
    jobs = run.get("jobs", [])
    readings = {j["sentinel_start"] for j in jobs} | {j["sentinel_end"] for j in jobs if j.get("sentinel_end")}
    readings |= {(s.meta.get("env") or {}).get("sentinel") for s in stores.values()}
    unclosed = bool(jobs) and jobs[-1].get("sentinel_end") is None
    ok = len(readings) == 1 and not unclosed
    detail = (f"sentinel identical at the start and end of all {len(jobs)} job(s)" if ok
              else "the last job ended without its closing sentinel reading: resume the run to take it"
              if len(readings) == 1 else
              f"the kernel-path sentinel changed during the run ({len(readings)} distinct readings)")
    out.append(check("sentinel_unchanged", ok, detail))
    return out


def machinery_check(run: dict, stores: dict, arm: str) -> dict:
    """The intervention's own code at its no-op setting must equal the twin bit for bit in every bin:
    otherwise the intervention's machinery perturbs more than the intervention."""
    differ = [b["sigma"] for b in run["bins"] if not torch.equal(stores[arm, b["index"]].sums,
                                                                 stores["native", b["index"]].sums)]
    n = len(run["bins"])
    return check("machinery_is_a_no_op", not differ,
                 f"{arm} (the intervention's code at its no-op setting) is bit-identical to the twin in all {n} bins"
                 if not differ else f"{arm} differs from the twin at σ = {', '.join(f'{s:g}' for s in differ)}: "
                 "the intervention's code perturbs the model even at its no-op setting")


def grams(run: dict, stores: dict, chunk_params: int) -> tuple[dict, list[str], int]:
    """Same-bin Gram blocks for each parameter view, as arrays [bin, arm, fold, arm, fold].

    Every estimate (gates, effects, the replicate) pairs two arms of one bin, so only the blocks
    within a bin are computed: n_bins x (n_arms·F)² products instead of
    (n_bins·n_arms·F)². One pass over the columns, in chunks of ≤ chunk_params capped so that the
    float64 working copy stays under 128 MiB (no copy of the whole run). `residual` is the Gram of
    R^{arm}_{b,f} = S^{arm}_{b,f} − M_f, M_f = mean_b' S^{twin}_{b',f} (the twin's shared direction
    removed from both arms alike): ⟨R,R'⟩ = ⟨S,S'⟩ − ⟨S,M⟩ − ⟨M,S'⟩ + ⟨M,M⟩, so besides the
    within-bin products it needs only every row against the F rows of M.
    """
    names = [a["name"] for a in run["arms"]]
    n_arms, n_bins = len(names), len(run["bins"])
    first = next(iter(stores.values()))
    layout, n_folds = first.meta["layout"], first.sums.shape[0]
    twin = names.index("native")
    width = n_arms * n_folds  # rows of one bin's block
    # Contiguous column ranges of one kind (conditioning or not), in layout order.
    ranges = []
    for entry in layout:
        lo, hi = entry["offset"], entry["offset"] + entry["numel"]
        if ranges and ranges[-1][2] == entry["cond"] and ranges[-1][1] == lo:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi, entry["cond"]])
    chunk = max(1, min(chunk_params, (128 * 2**20) // (n_bins * width * 8)))
    buffer = torch.empty(n_bins * width * chunk, dtype=torch.float64)  # reused: no page faults per chunk
    g_all, g_cond = (torch.zeros(n_bins, width, width, dtype=torch.float64) for _ in range(2))
    s_m = torch.zeros(n_bins, n_arms, n_folds, n_folds, dtype=torch.float64)  # ⟨S_{b,arm,f}, M_g⟩
    m_m = torch.zeros(n_folds, n_folds, dtype=torch.float64)  # ⟨M_f, M_g⟩
    for lo, hi, cond in ranges:
        for start in range(lo, hi, chunk):
            stop = min(start + chunk, hi)
            x = buffer[: n_bins * width * (stop - start)].view(n_bins, n_arms, n_folds, stop - start)
            for a, name in enumerate(names):
                for b in range(n_bins):
                    x[b, a] = stores[name, b].sums[:, start:stop]
            rows = x.view(n_bins, width, stop - start)
            block = torch.bmm(rows, rows.transpose(1, 2))
            g_all += block
            if cond:
                g_cond += block
            mean = x[:, twin].mean(0)
            s_m += (x.view(-1, stop - start) @ mean.T).view_as(s_m)
            m_m += mean @ mean.T
    # ⟨R_{a,f}, R_{a',g}⟩ = ⟨S_{a,f}, S_{a',g}⟩ − ⟨S_{a,f}, M_g⟩ − ⟨M_f, S_{a',g}⟩ + ⟨M_f, M_g⟩, per bin.
    s_m_rows = s_m.view(n_bins, width, n_folds).repeat(1, 1, n_arms)  # [b, (a,f), (a',g)] = ⟨S_{a,f}, M_g⟩
    g_res = g_all - s_m_rows - s_m_rows.transpose(1, 2) + m_m.repeat(n_arms, n_arms)
    shape = (n_bins, n_arms, n_folds, n_arms, n_folds)
    g = {"all": g_all.view(shape).numpy(), "cond": g_cond.view(shape).numpy(), "residual": g_res.view(shape).numpy()}
    if not any(e["cond"] for e in layout):
        del g["cond"]
    return g, names, n_folds


def pair_estimate(g: np.ndarray, a: int, b: int, bin_index: int, sizes):
    """Estimate between arms a and b in one bin; g is [bin, arm, fold, arm, fold]."""
    blocks = g[bin_index]
    return estimate(blocks[a, :, b], blocks[a, :, a], blocks[b, :, b], sizes, sizes)


def replicate_report(run, stores, g_all, names, sizes, threshold) -> dict:
    """The native twin measured twice in one job: bit-identical, or how far apart."""
    n_bins = len(run["bins"])
    twin, rep = names.index("native"), names.index("native_replicate")
    differ, max_abs, cosines = 0, 0.0, []
    for b in run["bins"]:
        x, y = stores["native", b["index"]].sums, stores["native_replicate", b["index"]].sums
        if not torch.equal(x, y):
            differ += 1
            max_abs = max(max_abs, float((x.double() - y.double()).abs().max()))
        cosines.append(pair_estimate(g_all, twin, rep, b["index"], sizes).cos)
    min_cos = None if any(c is None for c in cosines) else min(cosines)
    detail = f"{differ} / {n_bins} tensors differ between the native twin and its replicate"
    if differ:
        detail += f"; max |Δ| = {max_abs:.3e}, min debiased cos = {_num(min_cos, '{:.9f}')}"
    return {"n_tensors": n_bins, "n_differ": differ, "max_abs_diff": max_abs, "min_cos": min_cos,
            "max_effect": None if min_cos is None else 1 - min_cos, "detail": detail}


def cross_estimates(a: dict, b: dict, chunk_params: int = 1_000_000) -> list[dict]:
    """Debiased cos between two arms' stores bin by bin ({sigma: Store} each, same protocol), for
    `all` and, when conditioning parameters were probed, `cond`."""
    rows = []
    has_cond = any(e["cond"] for e in next(iter(a.values())).meta["layout"])
    estimands = ("all", "cond") if has_cond else ("all",)
    for sigma in sorted(a):
        x, y, layout = a[sigma].sums, b[sigma].sums, a[sigma].meta["layout"]
        sizes = np.asarray(a[sigma].meta["fold_sizes"], dtype=np.float64)
        f = x.shape[0]
        acc = {e: [np.zeros((f, f)) for _ in range(3)] for e in ("all", "cond")}
        for entry in layout:
            for start in range(entry["offset"], entry["offset"] + entry["numel"], chunk_params):
                stop = min(start + chunk_params, entry["offset"] + entry["numel"])
                xs, ys = x[:, start:stop].double(), y[:, start:stop].double()
                blocks = [(xs @ ys.T).numpy(), (xs @ xs.T).numpy(), (ys @ ys.T).numpy()]
                for e in ("all", "cond") if entry["cond"] else ("all",):
                    for i in range(3):
                        acc[e][i] += blocks[i]
        for e in estimands:
            est = estimate(*acc[e], sizes, sizes)
            rows.append({"sigma": sigma, "estimand": e, "cos": est.cos, "se": est.se, "cos_naive": est.cos_naive})
    return rows


def arm_stores(run_dir: Path, arm: str) -> tuple[dict, dict]:
    """{σ: Store} of one arm of a run, each verified against run.json."""
    run, stores = load_run(run_dir)
    arms = [a["name"] for a in run["arms"]]
    if arm not in arms:
        raise StoreError(run_dir, f"has no arm {arm!r} (its arms: {', '.join(arms)})")
    return run, {b["sigma"]: stores[arm, b["index"]] for b in run["bins"]}


def protocol_mismatch(a: dict, b: dict) -> list[str]:
    """Protocol keys that differ between two arms' stores ({σ: Store}); [] when comparable."""
    if sorted(a) != sorted(b):
        return [f"sigma grid {sorted(a)} vs {sorted(b)}"]
    ma, mb = next(iter(a.values())).meta, next(iter(b.values())).meta
    return [k for k in (*PROTOCOL_KEYS, "image_ids", "seed") if ma.get(k) != mb.get(k)]


def reference_report(run, stores, inter_name, ref_dir: Path, threshold, chunk_params, run_ok) -> dict:
    """Is the reference alive in this environment? Its native arm against today's native twin.

    A reference that cannot be read or was measured under another protocol is reported as
    unusable: the run's own verdict, checked against its twin, stands either way.
    """
    mine = {b["sigma"]: stores["native", b["index"]] for b in run["bins"]}
    try:
        _, ref = arm_stores(ref_dir, "native")
        bad = protocol_mismatch(mine, ref)
    except TwinrunError as err:
        bad = [str(err)]
    if bad:
        return {"path": str(ref_dir), "alive": False, "status": "unusable",
                "detail": f"reference UNUSABLE: {'; '.join(bad)}. Read effects against the twin only."}
    vs_twin = cross_estimates(mine, ref, chunk_params=chunk_params)
    for r in vs_twin:
        r["bit_identical"] = torch.equal(mine[r["sigma"]].sums, ref[r["sigma"]].sums)
    # Per bin, as a gate: bit-identical or cos ≥ threshold agrees; a cosine below noise decides
    # nothing (the reference is then undetermined, never dead for lack of signal).
    agree = [r["bit_identical"] or (r["cos"] is not None and r["cos"] >= threshold) for r in vs_twin]
    undecided = [not a and r["cos"] is None for a, r in zip(agree, vs_twin)]
    alive = all(agree)
    status = "alive" if alive else "undetermined" if all(a or u for a, u in zip(agree, undecided)) else "dead"
    fields = kernel_path_diff(next(iter(mine.values())).meta.get("kernel_path", {}),
                              next(iter(ref.values())).meta.get("kernel_path", {}))
    out = {"path": str(ref_dir), "alive": alive, "status": status, "kernel_path_differs_in": fields,
           "native_vs_reference": vs_twin}
    if alive:
        n_identical = sum(r["bit_identical"] for r in vs_twin) // max(1, len({r["estimand"] for r in vs_twin}))
        out["detail"] = (f"reference ALIVE in this environment: today's native twin matches it in every bin "
                         f"({n_identical} / {len(mine)} bins bit-identical, the rest at debiased cos ≥ {threshold}). "
                         "Comparisons against it are labelled 'vs reference'.")
        if run_ok:
            inter = {b["sigma"]: stores[inter_name, b["index"]] for b in run["bins"]}
            out["intervention_vs_reference"] = cross_estimates(inter, ref, chunk_params=chunk_params)
    elif status == "undetermined":
        out["detail"] = (f"reference UNDETERMINED in this environment: in {sum(undecided)} bin(s) the signal is below "
                         "noise, so today's twin can neither confirm nor refute it (raise probe.n_images or "
                         "probe.n_draws). Read effects against the twin only.")
    else:
        worst = min((r["cos"] for r in vs_twin if r["cos"] is not None), default=None)
        out["detail"] = (f"reference DEAD in this environment: today's native twin does not match it (min debiased cos "
                         f"{_num(worst, '{:.6f}')} < {threshold}). Kernel-path fields that differ: "
                         f"{', '.join(fields) or 'none recorded'}. This gap is the environment's, not the "
                         "intervention's: read effects against the twin only.")
    return out


def reduce_run(run_dir: Path, estimands=None, gate_threshold=None, chunk_params=1_000_000) -> tuple[dict, int]:
    run_dir = Path(run_dir)
    run, stores = load_run(run_dir)
    estimands = list(estimands or run.get("estimands") or ESTIMANDS)
    threshold = float(gate_threshold if gate_threshold is not None else run.get("gate_threshold", 0.95))
    checks = validity_checks(run_dir, run, stores)
    g, names, _ = grams(run, stores, chunk_params)
    unknown = [e for e in estimands if e not in g]
    if unknown:
        raise TwinrunError(f"reduce.estimands={estimands}: {unknown} not available here "
                           f"(have {sorted(g)}; `cond` needs conditioning parameters among probe.params)")
    inter = next(i for i, a in enumerate(run["arms"]) if a["role"] == "intervention")
    twin = names.index("native")
    sizes = np.asarray(next(iter(stores.values())).meta["fold_sizes"], dtype=np.float64)

    gates, effects = [], []
    for b in run["bins"]:
        identical = torch.equal(stores[names[inter], b["index"]].sums, stores["native", b["index"]].sums)
        for e in estimands:
            est = pair_estimate(g[e], inter, twin, b["index"], sizes)
            row = {"sigma": b["sigma"], "estimand": e, "cos": est.cos, "se": est.se, "cos_naive": est.cos_naive,
                   "below_noise": est.below_noise}
            if b["gate"]:
                # Bit-identical arms are the strongest no-op evidence, even where the signal is
                # below noise and the cosine therefore undefined.
                passed = identical or (est.cos is not None and est.cos >= threshold)
                gates.append({"sigma": b["sigma"], "estimand": e, "cos": est.cos, "se": est.se,
                              "threshold": threshold, "passed": passed, "bit_identical": identical})
            effects.append(row)
    machinery = [a["name"] for a in run["arms"] if a.get("role") == "machinery"]
    if machinery:
        checks.append(machinery_check(run, stores, machinery[0]))
    elif not gates:
        checks.append(check("has_gate", False, "no bin where the intervention is a no-op and no machinery arm: "
                            "nothing vouches for the instrument"))
    replicate = None
    if "native_replicate" in names:
        replicate = replicate_report(run, stores, g["all"], names, sizes, threshold)
        agrees = replicate["n_differ"] == 0 or (replicate["min_cos"] is not None and replicate["min_cos"] >= threshold)
        checks.append(check("replicate_within_gate", agrees, replicate["detail"]))
    valid = all(c["passed"] for c in checks)
    ok = valid and all(x["passed"] for x in gates)
    summary = {"run_dir": str(run_dir), "arms": names, "valid": valid, "checks": checks, "gates": gates,
               "effects": effects if ok else [], "replicate": replicate}
    if run.get("reference"):
        summary["reference"] = reference_report(run, stores, names[inter], Path(run["reference"]), threshold,
                                                chunk_params, ok)
    write_json(run_dir / "summary.json", summary)
    write_report(run_dir, summary, run)
    return summary, EXIT_OK if ok else EXIT_GATE


def _num(x, fmt="{:.4f}") -> str:
    return "below noise" if x is None else fmt.format(x)


def render(summary: dict) -> str:
    lines = [f"twinrun reduce: {summary['run_dir']}", "", "validity checks:"]
    lines += [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in summary["checks"]]
    lines += ["", "no-op gates (intervention vs native twin where the intervention does nothing):"]
    for x in summary["gates"]:
        se = "" if x["se"] is None else f" ± {x['se']:.1e}"
        lines.append(f"  [{'ok' if x['passed'] else 'FAIL'}] σ={x['sigma']:<6g} {x['estimand']:<9} "
                     f"cos={_num(x['cos'], '{:.6f}')}{se}  (≥ {x['threshold']})  "
                     f"bit-identical: {'yes' if x['bit_identical'] else 'no'}")
    if summary.get("replicate"):
        lines += ["", f"replicate: {summary['replicate']['detail']}"]
    if summary.get("reference"):
        lines += ["", summary["reference"]["detail"]]
    ok = summary["valid"] and all(x["passed"] for x in summary["gates"])
    if not ok:
        lines += ["", ("INSTRUMENT BROKEN: a validity check or no-op gate failed. Effects are withheld; "
                       "nothing else from this run should be read.")]
        return "\n".join(lines)
    lines += ["", "effects (debiased cos to the twin, ± jackknife SE; 1 − cos is the effect):",
              f"  {'σ':>6}  {'estimand':<9} {'cos':>12} {'± se':>9} {'naive cos':>10}"]
    for x in summary["effects"]:
        se = ("–" if x["cos"] is not None else "") if x["se"] is None else f"{x['se']:.4f}"
        lines.append(f"  {x['sigma']:>6g}  {x['estimand']:<9} {_num(x['cos']):>12} {se:>9} {x['cos_naive']:>10.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.reduce", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a twinrun run directory (holds run.json)")
    p.add_argument("--estimands", help=f"comma-separated views, from {', '.join(ESTIMANDS)} (default: the run's)")
    p.add_argument("--gate-threshold", type=float, help="no-op gate threshold in (0, 1] (default: the run's)")
    args = p.parse_args(argv)
    try:
        estimands = None if args.estimands is None else [e.strip() for e in args.estimands.split(",")]
        if estimands is not None and (not estimands or any(e not in ESTIMANDS for e in estimands)):
            raise TwinrunError(f"--estimands={args.estimands!r}: choose from {', '.join(ESTIMANDS)}")
        if args.gate_threshold is not None and not 0 < args.gate_threshold <= 1:
            raise TwinrunError(f"--gate-threshold={args.gate_threshold}: must be in (0, 1]")
        summary, code = reduce_run(require_run_dir(args.run_dir), estimands, args.gate_threshold)
    except TwinrunError as err:
        fail(err)
    print(render(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
