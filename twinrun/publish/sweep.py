"""A sweep's summary: every point's verdict and the effect over (the intervention's sweep axis, noising σ).

Written once every point is reduced, to SWEEP_DIR/sweep_summary.json with sweep_report.md and the
heatmap. A point whose checks or gates failed contributes its verdict, never its numbers; a point
that failed, was interrupted or never ran is marked so, and the sweep is "all valid" only if every
point Hydra's sweep names (multirun.yaml) is.
"""

from pathlib import Path

from twinrun.errors import StoreError
from twinrun.files import atomic_write, write_json
from twinrun.intervention_nodes import sweep_axis
from twinrun.provenance.version import twinrun_version
from twinrun.publish.seeds import TEST_NAME, disagreements, pool_seeds
from twinrun.publish.sweep_plots import plot_sweep, sweep_caption, swept_variables
from twinrun.storage.rundir import RunIndex
from twinrun.storage.sweepdir import SweepDir, point_overrides


def _point(run_dir: Path, load) -> dict:
    index, kind = load(run_dir)
    intervention, protocol, seed = _intervention(index, kind.sweep_protocol)
    point = {"run_dir": str(run_dir), "overrides": point_overrides(run_dir), "intervention": intervention,
             "axis": sweep_axis(intervention), "protocol": protocol, "seed": seed, "status": index.status,
             "checks_passed": None, "gates_passed": None, "effects": []}
    rd = index.run_dir
    if rd.has_summary():
        summary = rd.read_summary(kind.summary_type)
        point["checks_passed"] = summary["checks_passed"]
        # `passed`: every check and gate, the machinery arm's included (an intervention with a no-op
        # setting may have no gate bin at all).
        point["gates_passed"] = summary["passed"]
        point.update(kind.sweep_point(summary))  # what the kind's sweep reads of it (its effects per σ, ...)
        point["status"] = "reduced"
    return point


def _intervention(index: RunIndex, node: str | None) -> tuple[dict, dict | None, int | None]:
    """The intervention arm's `intervention` node (its sweep axis), its kind's protocol `node` (None: the
    kind names none) and its seed."""
    name = index.arm("intervention")["name"]
    config = index.arm_config(name)
    if not isinstance(config.get("intervention"), dict):
        raise StoreError(index.run_dir.arm_config(name), "field intervention: missing or not a config node")
    protocol, seed = config.get(node) if node else None, config.get("seed")
    return (config["intervention"], protocol if isinstance(protocol, dict) else None,
            seed if type(seed) is int else None)


def _missing(sd: SweepDir, number: int, overrides: list[str]) -> dict:
    return {"run_dir": str(sd.point(number)), "overrides": overrides, "intervention": {},
            "axis": None, "protocol": None, "seed": None, "status": "missing", "checks_passed": None,
            "gates_passed": None, "effects": []}


def write_sweep_report(sd: SweepDir, summary: dict) -> Path:
    """sweep_report.md: each point's verdict linked to its run, then the heatmap and what its cells mean."""
    n = summary["n_points"]
    verdict = ("every point valid with its gates passed" if summary["all_valid"]
               else "NOT every point passed its checks and gates")
    swept = swept_variables(summary["points"])
    lines = ["# twinrun sweep report", "", f"{n} {'point' if n == 1 else 'points'}; {verdict}.",
             f"Swept: {', '.join(f'`{k}`' for k in swept) or 'nothing (one point)'}.",
             "", "| point | overrides | status | checks passed | gates passed | report |",
             "|---|---|---|---|---|---|"]
    for p in summary["points"]:
        rel = Path(p["run_dir"]).relative_to(sd.path)
        lines.append(f"| {rel} | `{' '.join(p['overrides'])}` | {p['status']} "
                     f"| {_yes_no(p['checks_passed'])} | {_yes_no(p['gates_passed'])} "
                     f"| [report]({rel}/report.md) |")
    lines += train_lines(summary["points"], sd)
    lines += seed_lines(summary.get("pooled_over_seeds") or [])
    png = plot_sweep(summary, sd.heatmap_png, protocol=_shared_protocol(summary["points"]))
    if png is not None:
        lines += ["", f"![sweep heatmap]({png.name})", "", sweep_caption(summary)]
    atomic_write(sd.report_md, ("\n".join(lines) + "\n").encode())
    return sd.report_md


def train_lines(points: list[dict], sd: SweepDir) -> list[str]:
    """The report's section on training points: each one's verdict and its last stored step's distance
    from the twin against the chaos floor (a point whose checks or gates failed: its verdict only)."""
    trained = [p for p in points if "verdict" in p]
    if not trained:
        return []
    lines = ["", "## Training points", "",
             ("Each point's distance from its twin at its last stored step against the chaos floor (the "
              "chaos arms' distance: how far a one-ulp wobble moves the same run; the whole model's, named, "
              "where train.floor_scope=model read that), for the estimand its verdict reads. A point not "
              "reduced (failed, interrupted, missing) is in the table above only."),
             "",
             "| point | step | estimand | distance | chaos floor | × floor | above floor | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for p in trained:
        rel, e = Path(p["run_dir"]).relative_to(sd.path), p.get("train_effect")
        numbers = ("| – | – | – | – | – | –" if e is None else
                   f"| {e['step']} | {e['estimand']} | {_num(e['distance'])} | {_floor(e)} "
                   f"| {_num(e['floor_ratio'])} | {'yes' if e['above_floor'] else 'no'}")
        lines.append(f"| {rel} {numbers} | {p['verdict']} |")
    return lines


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def _floor(e: dict) -> str:
    """The floor a point was read against; the whole model's (train.floor_scope=model) says whose."""
    return _num(e["floor"]) + (f" (`{e['floor_from']}`'s)" if e.get("floor_from") else "")


def seed_lines(pooled: list[dict]) -> list[str]:
    """The report's section on seeds: each σ × estimand pooled over seeds, and the seeds that disagree."""
    if not pooled:
        return []
    lines = ["", "## Pooled over seeds", "",
             (f"Points alike in everything but `seed`, pooled per σ and estimand: the mean over seeds, its "
              f"between-seed SE (sd / √K) and the SE the seeds' own SEs imply (√Σse² / K); \"disagree\" is "
              f"{TEST_NAME} at p < {pooled[0]['alpha']:g}. Every seed probes the same images (only the draws "
              "change), so the between-seed SE is the draws' share of the noise, not an SE over images."), ""]
    lines += [agreement_sentence(pooled), ""]
    lines += [("| fixed | σ | estimand | seeds | 1 − cos: mean ± between-seed SE (within) | p | "
               "norm ratio: mean ± between-seed SE (within) | p |"), "|---|---|---|---|---|---|---|---|"]
    for c in pooled:
        fixed = " ".join(f"{k}={v}" for k, v in c["fixed"].items()) or "–"
        lines.append(f"| `{fixed}` | {c['sigma']:g} | {c['estimand']} | {_seed_count(c)} | "
                     f"{_pooled_text(c, 'effect')} | {_p_text(c, 'effect')} | "
                     f"{_pooled_text(c, 'norm_ratio')} | {_p_text(c, 'norm_ratio')} |")
    return lines


def agreement_sentence(pooled: list[dict]) -> str:
    """What the seeds' test found, claiming no more than the cells it could test (two or more seeds with a
    number and an SE): disagreement named, agreement only over the cells tested, and said so."""
    bad = disagreements(pooled)
    if bad:
        return f"**Seeds disagree** beyond their within-seed SEs at: {'; '.join(bad)}."
    tested = [c for c in pooled if c["effect_p"] is not None or c["norm_ratio_p"] is not None]
    if not tested:
        return ("No σ and estimand had two seeds with a number and an SE: nothing to pool, nothing tested "
                "(the table says how many seeds each cell had).")
    if len(tested) == len(pooled):
        return "The seeds agree within their SEs at every σ and estimand."
    return (f"The seeds agree within their SEs at the {len(tested)} of {len(pooled)} σ × estimand cells "
            "where two or more seeds had a number and an SE; the others could not be tested.")


def _seed_count(c: dict) -> str:
    extra = [f"{len(c[k])} {w}" for k, w in (("below_noise_seeds", "below noise"),
                                               ("withheld_seeds", "withheld")) if c[k]]
    return f"{c['n_seeds']}" + (f" (+{', '.join(extra)})" if extra else "")


def _pooled_text(c: dict, key: str) -> str:
    if c[f"{key}_mean"] is None:
        return "fewer than 2 seeds with a number"
    return (f"{c[f'{key}_mean']:.4f} ± {c[f'{key}_between_se']:.1e} ({c[f'{key}_within_se']:.1e})")


def _p_text(c: dict, key: str) -> str:
    if c[f"{key}_p"] is None:
        return "–"
    return f"**{c[f'{key}_p']:.3g} disagree**" if c[f"{key}_disagree"] else f"{c[f'{key}_p']:.3g}"


def _shared_protocol(points: list[dict]) -> dict | None:
    """The protocol node every point shares (None when the protocol itself is swept: the rows name it)."""
    nodes = [p.get("protocol") for p in points if p.get("protocol")]
    keys = ("n_images", "n_draws", "n_folds")
    shared = {tuple(n.get(k) for k in keys) for n in nodes}
    return nodes[0] if len(shared) == 1 and len(nodes) == len(points) else None


def _yes_no(flag: bool | None) -> str:
    return "–" if flag is None else ("yes" if flag else "**NO**")


def collect_points(sd: SweepDir, load) -> list[dict]:
    """Every point of the sweep: each run directory's verdict and effects, then the points Hydra's
    sweep names (multirun.yaml) that have none, marked missing. `load`: run_dir -> (its RunIndex, its
    measurement kind), the kind looked up by the caller's registry (measures/registry.py: load_index)."""
    points = [_point(d, load) for d in sd.point_dirs()]
    have = {Path(p["run_dir"]).name for p in points}
    expected = sd.expected_points() or []
    return points + [_missing(sd, n, o) for n, o in enumerate(expected) if str(n) not in have]


def write_sweep_summary(sweep_dir: Path, load) -> dict:
    """Collect the points; lay the effects out as (the intervention's sweep axis, sigma, estimand): each
    entry names its axis ("axis": "sigma_pin") and holds the point's value under that name."""
    sd = SweepDir(sweep_dir)
    points = collect_points(sd, load)
    effect_map = []
    for p in points:
        axis = (p["axis"] or {}).get("key", "intervention.(none)").removeprefix("intervention.")
        for e in p["effects"]:
            value = (p["axis"] or {}).get("value")
            effect_map.append({"axis": axis, axis: value, "sigma": e["sigma"], "estimand": e["estimand"],
                               "effect": None if e["cos"] is None else 1 - e["cos"], "cos": e["cos"],
                               "se": e["se"], "run_dir": p["run_dir"]})
    summary = {"sweep_dir": str(sd.path), "n_points": len(points),
               "all_valid": (all(p["checks_passed"] and p["gates_passed"] for p in points) if points
                             else False),
               "points": points, "effects": effect_map, "pooled_over_seeds": pool_seeds(points),
               "twinrun": twinrun_version()}
    write_json(sd.summary_json, summary)
    write_sweep_report(sd, summary)
    print(f"twinrun: sweep summary of {len(points)} points in {sd.summary_json}", flush=True)
    return summary
