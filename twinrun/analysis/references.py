"""References: is an earlier run's twin reproduced by today's, and pair estimates across runs.

A reference shares seed, images, draws and folds with today's twin, so the two saw the very same
samples: any difference between them is the kernel path's (or the model's), not sampling noise,
and needs no significance test to exist, only a measure of its size. Alive: bit-identical in
every bin, or, on a kernel path today's replicate proves nondeterministic, no further from the
twin than the replicate is (max relative difference of the sums). Otherwise dead.
"""

import math
from pathlib import Path

import numpy as np

from twinrun.analysis.checks import REPLICATE, TWIN, arm_stores, bins_of, close
from twinrun.analysis.estimands import ESTIMANDS, SHIFT_VIEW, available
from twinrun.analysis.estimator import estimate
from twinrun.analysis.scan import scan
from twinrun.arms import config_diff, for_compute
from twinrun.errors import TwinrunError
from twinrun.files import ensure_descriptors
from twinrun.protocol import STORE_IDENTITY_KEYS, STORE_PROTOCOL_KEYS
from twinrun.provenance.fingerprint import kernel_path_diff
from twinrun.provenance.kernel_pin import decisions_between
from twinrun.storage.rundir import RunDir
from twinrun.storage.store import StoreReader


def json_interval(interval, unbounded: tuple[float, float]) -> list | None:
    """A printed interval as [lo, hi] for summary.json: a side the data do not bound (it reads the search
    limit, e.g. ±1 for a cosine, 0 or inf for a ratio) is null; None where nothing printed."""
    if interval is None:
        return None
    lo, hi = interval
    if lo == hi:  # exact: identical arms or folds that agree exactly; nothing left unbounded
        return [lo, hi]
    return [None if lo <= unbounded[0] else lo, None if hi >= unbounded[1] else hi]


def pair_row(est, **keys) -> dict:
    """One estimate as a summary row: every number beside its SE, norm² always shown; the printed 95%
    intervals (conditional on printing), near_boundary and the row's test of no effect."""
    return {**keys, "cos": est.cos, "se": est.se, "norm_ratio": est.norm_ratio,
            "norm_ratio_se": est.norm_ratio_se, "cos_naive": est.cos_naive, "below_noise": est.below_noise,
            "norm2": est.norm2_a, "norm2_se": est.norm2_a_se, "norm2_base": est.norm2_b,
            "norm2_base_se": est.norm2_b_se, "t_crit": est.t_crit,
            "cos_interval": json_interval(est.cos_interval, (-1.0, 1.0)),
            "norm_ratio_interval": json_interval(est.norm_ratio_interval, (0.0, math.inf)),
            "near_boundary": est.near_boundary, "diff_norm2": est.diff_norm2,
            "diff_norm2_se": est.diff_norm2_se, "effect_p": est.effect_p}


def cross_scan(sides: dict[str, dict], pairs: list[tuple[str, str]], names: list[str] | None,
               chunk_params: int = 1_000_000):
    """One pass over several arms' stores ({label: {σ: StoreReader}}, same protocol and grid): Grams
    for every available estimand (residual views against the mean of each pair's base) and each
    (x, base) pair's bit-identity and differences. Returns (scan, sigmas, names)."""
    sigmas = sorted(next(iter(sides.values())))
    layout = next(iter(sides.values()))[sigmas[0]].meta["layout"]
    names = [n for n in (names or ESTIMANDS) if n in available(layout)]
    if len(sigmas) < 2:  # a derived view removes the mean over bins: of one bin it is zero, its cosine nan
        names = [n for n in names if n not in ESTIMANDS or ESTIMANDS[n].derive is None]
    readers = {(label, i): stores[s] for label, stores in sides.items() for i, s in enumerate(sigmas)}
    bases = list(dict.fromkeys(base for _, base in pairs))
    return scan(readers, list(sides), len(sigmas), names, None, bases, pairs, chunk_params), sigmas, names


def cross_rows(found, sigmas: list[float], names: list[str], other: str, base: str, sizes,
               alpha: float) -> list[dict]:
    """other against base bin by bin: debiased cos, norm ratio |μ_other| / |μ_base|, bit-identity and
    max relative difference. `residual` removes base's mean over bins from both."""
    o, b = found.arms.index(other), found.arms.index(base)
    rows = []
    for i, sigma in enumerate(sigmas):
        pair = found.pairs[other, base, i]
        for n in names:
            g = found.gram(n, base)[i]
            est = estimate(g[o, :, b], g[o, :, o], g[b, :, b], sizes, sizes, alpha)
            rows.append(pair_row(est, sigma=sigma, estimand=n, bit_identical=pair.identical,
                                 max_shift=0.0 if pair.identical else pair.shift(n)))
    return rows


def cross_estimates(base: dict, other: dict, alpha: float, names: list[str] | None = None,
                    chunk_params: int = 1_000_000) -> list[dict]:
    """other against base ({σ: StoreReader} each, same protocol), every available estimand, in one pass."""
    found, sigmas, names = cross_scan({"other": other, "base": base}, [("other", "base")], names,
                                      chunk_params)
    sizes = np.asarray(base[sigmas[0]].meta["fold_sizes"], dtype=np.float64)
    return cross_rows(found, sigmas, names, "other", "base", sizes, alpha)


def protocol_mismatch(a: dict, b: dict) -> list[str]:
    """Protocol keys that differ between two arms' stores ({σ: Store}); [] when comparable."""
    if sorted(a) != sorted(b):
        return [f"sigma grid {sorted(a)} vs {sorted(b)}"]
    ma, mb = next(iter(a.values())).meta, next(iter(b.values())).meta
    return [k for k in (*STORE_PROTOCOL_KEYS, "image_ids", "seed") if ma.get(k) != mb.get(k)]


def replicate_shifts(index, found) -> dict:
    """{σ: max relative difference twin vs replicate (the shift view)} where a replicate was measured."""
    return {b.sigma: found.pairs[REPLICATE, TWIN, b.index].shift(SHIFT_VIEW) for b in bins_of(index)
            if (REPLICATE, TWIN, b.index) in found.pairs}


def reproduced(rows: list[dict], rep: dict) -> tuple[bool, str]:
    """(alive, rule): bit-identical everywhere, or within the replicate where it proves nondeterminism."""
    if all(r["bit_identical"] for r in rows):
        return True, "bit-identical in every bin"
    ok = all(r["bit_identical"] or (rep.get(r["sigma"]) or 0.0) > 0 and r["max_shift"] <= rep[r["sigma"]]
             for r in rows)
    return ((True, "within the replicate's difference where not bit-identical") if ok
            else (False, "not reproduced"))


def cause_fields(run_dir: Path, ref_dir: Path, mine: dict, ref: dict) -> tuple[list, list, list]:
    """(what was measured: model/data digests, kernel-path fields, config fields) that differ between
    today's twin and the reference."""
    ma, mb = next(iter(mine.values())).meta, next(iter(ref.values())).meta
    measured = [k for k in STORE_IDENTITY_KEYS if ma.get(k) != mb.get(k)]
    kp = kernel_path_diff(ma.get("kernel_path") or {}, mb.get("kernel_path") or {})
    try:
        mine_cfg, ref_cfg = (for_compute(RunDir(d).read_arm_config(TWIN)) for d in (run_dir, ref_dir))
        cfg = [d["key"] for d in config_diff(mine_cfg, ref_cfg)]
    except TwinrunError as err:
        cfg = [f"(reference config unreadable: {err})"]
    return measured, kp, cfg


def winners_line(ref_dir: Path, run_dir: Path) -> str:
    """The autotune decisions that differ between the reference's compiled job and this run's."""
    try:
        return decisions_between(ref_dir, run_dir)
    except TwinrunError as err:
        return f"autotune winners: unreadable ({err})"


def _dead_detail(measured: list[str], kp: list[str], cfg: list[str], rows: list[dict],
                 winners: str = "") -> str:
    """Why a reference is dead, the measured thing first: a changed model or data set is named as such
    (whatever path it was read from), before any config or environment field."""
    worst = max(r["max_shift"] for r in rows)
    text = (f"reference DEAD in this environment: today's native twin does not reproduce it (max relative "
            f"difference of the sums {worst:.3e}; per bin and estimand below). ")
    # The measured thing first: a changed model or data set explains the gap before any environment field
    # could, so no one chases a driver when the weights changed.
    model = [k for k in cfg if k.split(".")[0] == "model"]
    what = [{"model_sha256": "the model as built (its parameters and buffers)",
             "data_sha256": "the probed images (with their conditioning, if any)",
             "adapter_sha256": "the LoRA adapter"}[k] for k in measured]
    if what:
        keys = f" ({', '.join(model)} changed)" if model else ""
        text += (f"What was measured changed: {' and '.join(what)} differ{keys}: this gap is not the "
                 "environment's. ")
    elif model:
        text += f"The model changed ({', '.join(model)}): this gap is the model's, not the environment's. "
    if [k for k in cfg if k not in model]:
        text += f"Config fields that differ: {', '.join(k for k in cfg if k not in model)}. "
    if kp:
        blame = ". " if what or model else ": this gap is the environment's. "
        text += f"Kernel-path fields that differ: {', '.join(kp)}{blame}"
    # Autotune winners are not in the kernel-path fingerprint: when they moved, they are a cause to name.
    moved = winners.startswith("autotune winners differ")
    if moved:
        text += f"{winners[0].upper()}{winners[1:]}. "
    # Say so when nothing recorded explains the gap, rather than leave the reader to infer it.
    if not kp and not cfg and not what and not moved:
        text += "No recorded kernel-path, config, model or data field differs: the cause is unrecorded. "
    return text + "Nothing is read against it; read effects against the twin only."


def reference_report(index, readers: dict, found, inter: str, ref_dir: Path, alpha: float,
                     run_ok: bool) -> dict:
    """Is the reference alive in this environment? Its native arm against today's native twin.

    A second pass (the run's own pass, `found`, is done): the reference's twin stores, read once,
    beside this run's twin (and, when the run passed, its intervention) read again. A reference that
    cannot be read or was measured under another protocol is reported as unusable: the run's own
    verdict, checked against its twin, stands either way.
    """
    run_dir = index.run_dir.path
    mine = {b.sigma: readers[TWIN, b.index] for b in bins_of(index)}
    ref = {}
    # The reference is another run directory, read as untrusted as this one: unreadable or of another
    # protocol, it is reported unusable, and the run's own verdict (against its twin) stands.
    try:
        _, ref = arm_stores(ref_dir, TWIN)
        bad = protocol_mismatch(mine, ref)
        if not bad:
            rows, inter_rows = _against_reference(index, readers, ref, inter if run_ok else None, alpha)
    except TwinrunError as err:
        bad = [str(err)]
    finally:
        close(ref)
    if bad:
        return {"path": str(ref_dir), "alive": False, "status": "unusable",
                "detail": f"reference UNUSABLE: {'; '.join(bad)}. Read effects against the twin only."}
    # Alive means today's twin reproduces the reference within the kernel path's own wobble, judged by the
    # replicates as the gates are.
    alive, rule = reproduced(rows, replicate_shifts(index, found))
    measured, kp, cfg = cause_fields(run_dir, ref_dir, mine, ref)
    out = {"path": str(ref_dir), "alive": alive, "status": "alive" if alive else "dead", "rule": rule,
           "measured_differs_in": measured, "kernel_path_differs_in": kp, "config_differs_in": cfg,
           "native_vs_reference": rows, "autotune_winners": winners_line(ref_dir, run_dir)}
    # Only a reference alive here may be read against, and the intervention only when the run passed.
    if alive:
        n_identical = len({r["sigma"] for r in rows if r["bit_identical"]})
        out["detail"] = (f"reference ALIVE in this environment ({rule}: {n_identical} / {len(mine)} bins "
                         "bit-identical). Comparisons against it are labelled 'vs reference'.")
        if run_ok:
            out["intervention_vs_reference"] = inter_rows
    else:
        out["detail"] = _dead_detail(measured, kp, cfg, rows, out["autotune_winners"])
    return out


def _against_reference(index, readers: dict, ref: dict, inter: str | None, alpha: float):
    """(today's twin vs the reference, the intervention vs the reference or None), in one pass that
    reopens this run's stores (their sha256 from run.json is checked again)."""
    sides = {"reference": ref, "native": _reopen(index, readers, TWIN)}
    pairs = [("reference", "native")]
    if inter is not None:
        sides["intervention"] = _reopen(index, readers, inter)
        pairs.append(("intervention", "reference"))
    try:
        found, sigmas, names = cross_scan(sides, pairs, None)
    finally:
        for label in ("native", "intervention"):
            close(sides.get(label, {}))
    sizes = np.asarray(ref[sigmas[0]].meta["fold_sizes"], dtype=np.float64)
    rows = cross_rows(found, sigmas, names, "reference", "native", sizes, alpha)
    inter_rows = None if inter is None else cross_rows(found, sigmas, names, "intervention", "reference",
                                                       sizes, alpha)
    return rows, inter_rows


def _reopen(index, readers: dict, arm: str) -> dict:
    ensure_descriptors(len(index.units), f"reading {arm}'s stores of {index.run_dir.path} again")
    return {b.sigma: StoreReader(r.path, r.expected_sha256, r.payload_bytes)
            for b in bins_of(index) for r in [readers[arm, b.index]]}
