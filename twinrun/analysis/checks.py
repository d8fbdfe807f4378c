"""Loading a probe run for the reducer, and the validity checks that come before any verdict.

`load_run` is the one place the reducer side reads run.json and the stores it lists; everything
read is checked (format, sha256, arm, bin, config hash) and cross-checked against what the run says
it measured (each arm's config.yaml, hash-checked; σ, σ_cond, seed, images and sizes of every store,
the fields the probe declares in twinrun.analysis.vouch; each unit's gate flag), and any problem is a
StoreError naming the file and the field (exit 2), never a number.
"""

import math
from pathlib import Path
from typing import NamedTuple

import torch

from twinrun import arms as arms_mod
from twinrun import data as data_mod
from twinrun.analysis.estimands import check_estimands, check_groups
from twinrun.analysis.reduction import check, provenance_checks
from twinrun.analysis.scan import Scan, scan
from twinrun.analysis.vouch import StoreRules, Voucher
from twinrun.config import DigitsDataConfig, ProbeConfig
from twinrun.errors import StoreError, TwinrunError
from twinrun.files import ensure_descriptors
from twinrun.instantiate import typed
from twinrun.intervention_nodes import rebuild
from twinrun.protocol import STORE_IDENTITY_KEYS, STORE_PROTOCOL_KEYS
from twinrun.provenance.record import tensors_sha256
from twinrun.storage.records import GATE_REPLICATE, ProbeUnit
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.store import StoreReader

TWIN, REPLICATE = "native", GATE_REPLICATE


class Bin(NamedTuple):
    """A probe unit as the reducer reads it."""

    index: int
    sigma: float
    gate: bool
    stores: dict  # arm -> its run.json store entry


# What each of the probe's stores must agree with (analysis/vouch.py): its bin's σ, its arm's seed and
# protocol, the first store's image ids and fold sizes, and twinrun's own data set's ids.
PROBE_STORE_RULES = StoreRules("bin_index", {"sigma": "sigma"},
                               {"seed": "seed", "n_images": "probe.n_images", "n_draws": "probe.n_draws"},
                               ("image_ids", "fold_sizes"),
                               {"image_ids": "probe.n_images", "fold_sizes": "probe.n_folds"},
                               ("image_ids", "probe.n_images"))


def bins_of(index: RunIndex) -> list[Bin]:
    return [Bin(u["index"], u["probe"]["sigma"], u["gate"], u["stores"]) for u in index.units]


def _wanted(index: RunIndex) -> dict:
    """{(arm, bin index): (path, sha256, config hash, payload bytes)} of every store the reducer needs."""
    wanted = {}
    hashes = {a["name"]: a.get("config_hash") for a in index.arms}
    for b in bins_of(index):
        names = [*index.arm_names,
                 *([REPLICATE] if REPLICATE in b.stores and REPLICATE not in hashes else [])]
        for name in names:
            entry = b.stores[name]
            path = index.run_dir.store(name, entry["file"])  # validated and contained by RunIndex.load
            if entry["status"] != "done":
                raise StoreError(path, f"bin {b.index} (σ={b.sigma:g}) of arm {name} is "
                                 f"{entry['status']}: resume the run, then reduce")
            wanted[name, b.index] = (path, entry.get("sha256"), hashes.get(name, hashes.get(TWIN)),
                                     entry.get("payload_bytes"))
    return wanted


def load_run(run_dir: Path) -> tuple[RunIndex, dict]:
    """run.json and a StoreReader of every store it lists ({(arm, bin_index): StoreReader}).

    Only the headers are read here (format, metadata, sizes, and that each store is the one run.json
    names: arm, bin, config hash); the payload is read once by twinrun.analysis.scan, which checks
    every tensor's digest and each file's sha256 from run.json.
    """
    index = RunIndex.load(run_dir)  # validates run.json field by field
    run_json = index.run_dir.run_json
    # A run of another kind lists stores this reader would misread as fold sums: refused by name before any is
    # opened.
    if index.measure != "probe":
        raise StoreError(run_json, f"measures {index.measure}, not the σ probe this reducer reads")
    index.check_units(ProbeUnit, "sigma")  # its bins' own fields: each σ positive, strictly increasing
    # A reference is an earlier, independent measurement: a run naming itself would vouch for its own numbers.
    if index.reference is not None and Path(index.reference).resolve() == index.run_dir.path.resolve():
        raise StoreError(run_json, f"field reference: {index.reference!r} is this run itself, which cannot "
                         "vouch for itself; the file is damaged or was edited by hand")
    # run.json may have been edited by anyone, and the groups it registers steer which parameters are read:
    # they meet the plan-time rules again.
    try:
        check_groups(index.registered.get("groups") or {})
    except TwinrunError as err:
        raise StoreError(run_json, f"field registered.groups: {err}") from None
    voucher = Voucher(index, PROBE_STORE_RULES)  # every config.yaml held to its hash, every store to these
    configs = voucher.configs
    wanted = _wanted(index)
    # Every store stays open until the one scan reads it: a run with more stores than this process may open
    # fails here in one line, not halfway through.
    ensure_descriptors(len(wanted), f"reading the {len(wanted)} stores of {index.run_dir.path}")
    # Headers only here (the scan reads each payload once). Whatever fails, the readers opened so far are
    # closed before the error leaves, so a caller that reports it and goes on leaks no file.
    readers = {}
    try:
        for key, (path, sha, _, payload) in wanted.items():
            readers[key] = StoreReader(path, sha, payload)
        cross_check(index, configs, readers, voucher)
        _check_registered(index, readers[TWIN, 0].meta["layout"])
    except BaseException:
        close(readers)
        raise
    return index, readers


def _check_registered(index: RunIndex, layout: list[dict]) -> None:
    """run.json's registered estimands and groups, held to the rules reduce.estimands and reduce.groups
    are held to at plan time, against the stores' parameters."""
    groups = index.registered.get("groups") or {}
    try:
        check_estimands(index.registered["estimands"], groups, layout, "registered.estimands",
                        "registered.groups")
    except TwinrunError as err:
        raise StoreError(index.run_dir.run_json, f"field {err}; the file is damaged or was edited by hand") \
            from None


def cross_check(index: RunIndex, configs: dict, readers: dict, voucher: Voucher) -> None:
    """Everything a verdict depends on, held against what the run says it measured (a StoreError naming the
    file and the field): run.json's σ grid against the configs'; every store's σ, seed, images, draws and
    folds against its arm's config and the twin's first store; σ_cond against the arm's intervention at
    that bin, and each unit's gate flag against the intervention's gate bins, where the intervention can
    be rebuilt without running code from the run directory (`rebuild`: twinrun's own, or imported here).
    What every kind's stores are held to (their arm, unit, config hash, kernel path, and the fields the
    probe declares in vouch.STORE_RULES) is the voucher's."""
    twin_cfg, run_json = configs[TWIN], index.run_dir.run_json
    # The configs are hash-checked and run.json's bin labels are not: a σ grid that disagrees with the configs
    # means run.json was edited.
    grid = [float(s) for s in twin_cfg["sigma_grid"]["sigmas"]]
    sigmas = [b.sigma for b in bins_of(index)]
    if sigmas != grid:
        raise StoreError(run_json, f"field units[].probe.sigma: {sigmas} is not the σ grid {grid} of "
                         "arms/native/config.yaml; the file is damaged or was edited by hand")
    # Rebuilt from the hash-checked configs, the interventions say what run.json and the stores can only claim
    # (gate flags, σ_cond); the gate replicate is the twin measured again, so it shares the twin's.
    interventions = {name: _intervention(index, name, cfg) for name, cfg in configs.items()}
    interventions.setdefault(REPLICATE, interventions[TWIN])
    inter = interventions[index.arm("intervention")["name"]]
    if inter is not None:
        # A gate flag decides whether a bin is read as a no-op gate or as an effect: a flipped flag would turn
        # one into the other.
        gates = set(inter.gate_sigmas(grid))
        for b in bins_of(index):
            if b.gate != (b.sigma in gates):
                noop = "a no-op" if b.sigma in gates else "not a no-op"
                raise StoreError(run_json, f"field units[{b.index}].gate: {b.gate}, but the intervention of "
                                 f"its config is {noop} at σ={b.sigma:g}; the file is damaged or was edited "
                                 "by hand")
    # Recomputing the probed images' ids and digest from twinrun's own data set catches a store measured on
    # other images under the right labels.
    probed = _probed_data(twin_cfg)
    for (arm, i), reader in readers.items():
        voucher.store(index.units[i], arm, reader.path, reader.meta)
        _check_store(reader, configs.get(arm, twin_cfg), interventions[arm], sigmas[i])
        for key, value in (probed or {}).items():
            if reader.meta.get(key) != value:
                raise StoreError(reader.path, f"metadata field {key}: {str(reader.meta.get(key))[:60]} is "
                                 f"not {str(value)[:60]}, what its config's data set holds: damaged, forged")


def _probed_data(config: dict) -> dict | None:
    """The probed images' ids and digest as the job records them, recomputed from the config's data when it
    is twinrun's own data set (its builder is twinrun's: reading a run directory runs nobody else's code);
    None for a data builder of the user's."""
    node = config.get("data") or {}
    if node != {"_target_": DigitsDataConfig._target_}:
        return None
    n_images = typed(ProbeConfig, config["probe"], "probe").n_images
    images, ids = data_mod.load_heldout_images()
    ids = [int(i) for i in ids[:n_images]]
    return {"image_ids": ids,
            "data_sha256": tensors_sha256([("images", images[:n_images]), ("image_ids", torch.tensor(ids))])}


def _intervention(index: RunIndex, arm: str, config: dict):
    try:
        return rebuild(config["intervention"])
    except (TypeError, ValueError, TwinrunError) as err:
        raise StoreError(index.run_dir.arm_config(arm), f"field intervention: {str(err)[:200]}") from None


def _check_store(reader: StoreReader, config: dict, intervention, sigma: float) -> None:
    """σ_cond against what the arm's intervention feeds at this σ (the rest: the voucher's)."""
    meta, path = reader.meta, reader.path
    if len(meta.get("image_ids") or []) != typed(ProbeConfig, config["probe"], path).n_images:
        raise StoreError(path, "metadata field image_ids: missing or not one id per probed image, as its "
                         "config says")
    if intervention is not None:
        cond = float(intervention.sigma_cond(torch.tensor(sigma, dtype=torch.float32)))
        # a few float32 ulps: another torch (or CPU) may round exp∘log differently; a forgery is far off
        if not math.isclose(meta["sigma_cond"], cond, rel_tol=1e-6):
            raise StoreError(path, f"metadata field sigma_cond: {meta['sigma_cond']!r} is not {cond!r}, what "
                             f"its arm's intervention feeds at σ={sigma:g}: damaged or forged")


def unverified_interventions(index: RunIndex) -> list[str]:
    """Arms whose intervention class the reducer could not rebuild (a user's class not imported here):
    their σ_cond and gate bins were not recomputed, only compared across stores."""
    out = []
    for entry in index.arms:
        node = index.run_dir.read_arm_config(entry["name"])["intervention"]
        if rebuild(node) is None:
            out.append(f"{entry['name']} ({node.get('_target_')})")
    return out


def scan_run(index: RunIndex, readers: dict, names: list[str], groups: dict | None,
             chunk_params: int = 1_000_000) -> Scan:
    """The run's one pass (twinrun.analysis.scan): every store read once; Grams of every estimand in
    `names` (residual against the twin), and every arm and the gate replicate against the twin, bin by bin."""
    arm_names = index.arm_names
    pairs = [(a, TWIN) for a in arm_names if a != TWIN] + [(REPLICATE, TWIN)] * (REPLICATE not in arm_names)
    return scan(readers, arm_names, len(index.units), names, groups, [TWIN], pairs, chunk_params)


def close(readers: dict) -> None:
    for r in readers.values():
        r.close()


def arm_stores(run_dir: Path, arm: str) -> tuple[RunIndex, dict]:
    """{σ: StoreReader} of one arm of a run (the gate replicate: its gate bins only), headers checked
    against run.json; the other arms' readers are closed."""
    index, readers = load_run(run_dir)
    arms = index.arm_names + ([REPLICATE] if any(k[0] == REPLICATE for k in readers) else [])
    mine = {b.sigma: readers.pop((arm, b.index)) for b in bins_of(index) if (arm, b.index) in readers}
    close(readers)
    if arm not in arms:
        raise StoreError(run_dir, f"has no arm {arm!r} (its arms: {', '.join(arms)})")
    return index, mine


def validity_checks(index: RunIndex, stores: dict) -> list[dict]:
    names = index.arm_names
    bins = bins_of(index)
    # The twin's claim is that the arms differ only in the intervention: any other difference would be read as
    # its effect.
    configs = {n: index.run_dir.read_arm_config(n) for n in names}
    diffs = {n: arms_mod.outside_intervention(arms_mod.config_diff(configs[names[0]], configs[n]))
             for n in names}
    bad = {n: d for n, d in diffs.items() if d}
    out = [check("configs_differ_only_in_intervention", not bad,
                 "ok" if not bad else f"arms differ outside `intervention` at {bad}")]
    # The shared draws are what cancel the noise between the arms: a bin whose draws differ is not paired, and
    # its SEs would not hold.
    unequal = sorted({i for (n, i), s in stores.items()
                      if s.meta["draws_digest"] != stores[TWIN, i].meta["draws_digest"]})
    out.append(check("identical_draws", not unequal,
                     f"draw digests equal in all {len(bins)} bins" if not unequal
                     else f"draw digests differ between arms in bins {unequal}"))
    # The estimator compares fold sums across stores: that needs the same images, draws, folds and parameter
    # layout in every one.
    ref = next(iter(stores.values())).meta
    mismatched = sorted({str(s.path) for s in stores.values() for k in STORE_PROTOCOL_KEYS
                         if s.meta[k] != ref[k]})
    out.append(check("same_protocol", not mismatched,
                     "images, draws, folds and parameter layout equal in every store" if not mismatched
                     else f"protocol differs in {mismatched}"))
    # A run's jobs may run hours apart on other nodes: a model or data file replaced between them splits the
    # run into two measurements.
    changed = sorted({k for s in stores.values() for k in STORE_IDENTITY_KEYS if s.meta.get(k) != ref.get(k)})
    out.append(check("same_model_and_data", not changed,
                     "every store measured one model (as built, weights loaded) on the same images"
                     if not changed
                     else f"stores measured different {' and '.join(changed)}: the model or the data changed "
                     "between the jobs of this run"))
    # A store filed under the wrong bin would put one σ's effect in another's row. An intervention this
    # reducer cannot rebuild is named, since its σ_cond and gate bins were only compared across stores, not
    # recomputed.
    wrong_sigma = [s.path.name for (n, i), s in stores.items() if s.meta["sigma"] != bins[i].sigma]
    unchecked = unverified_interventions(index)
    matched = "every store's σ, σ_cond, seed, images, draws and folds match its bin and its arm's config"
    if unchecked:
        matched += (f" (σ_cond and gate bins of {', '.join(unchecked)} not recomputed: a class this reducer "
                    "has not imported, and it runs no code from a run directory)")
    out.append(check("stores_match_bins", not wrong_sigma,
                     matched if not wrong_sigma else f"σ mismatch in {wrong_sigma}"))
    return out + provenance_checks(index, stores)


def machinery_check(index: RunIndex, found: Scan, arm: str) -> dict:
    """The intervention's own code at its no-op setting must equal the twin bit for bit in every bin:
    otherwise the intervention's machinery perturbs more than the intervention."""
    differ = [b.sigma for b in bins_of(index) if not found.pairs[arm, TWIN, b.index].identical]
    n = len(index.units)
    return check("machinery_is_a_no_op", not differ,
                 f"{arm} (the intervention's code at its no-op setting) is bit-identical to the twin in all "
                 f"{n} bins" if not differ
                 else f"{arm} differs from the twin at σ = {', '.join(f'{s:g}' for s in differ)}: the "
                 "intervention's code perturbs the model even at its no-op setting")


def read_arm_config(run_dir: Path, arm: str) -> dict:
    return RunDir(run_dir).read_arm_config(arm)
