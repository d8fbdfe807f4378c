"""The probe's rows where researchers work: one per σ bin for the experiment trackers, and what a sweep's
summary keeps of a reduced probe point (the kind's `tracker_rows` and `sweep_point`, measures/probe.py)."""

from twinrun.storage.rundir import RunIndex


def tracker_rows(index: RunIndex, summary: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(the comparison's rows, the twin's own, the intervention's own), one per σ bin: each arm's debiased
    |μ|² under one key (`norm2/<estimand>`) in its own rows, so trackers overlay them; the comparison has
    numbers only where the summary has them (a below-noise effect logs below_noise/<estimand> = 1 and no
    cos or ratio, never a 0)."""
    effects = {(e["sigma"], e["estimand"]): e for e in summary["effects"]}
    names = list(dict.fromkeys(e["estimand"] for e in summary["effects"]))
    steps, arm, base = [], [], []
    for u in index.units:
        sigma = index.params(u).get("sigma")
        row, mine, twin = {"sigma": sigma}, {"sigma": sigma}, {"sigma": sigma}
        # Each arm's |μ|² under one key in its own rows, so a tracker overlays the twin and the intervention
        # on one chart; the comparison has numbers only where the summary has them.
        for n in names:
            e = effects.get((sigma, n))
            if e is None:
                continue
            row[f"below_noise/{n}"] = float(e["below_noise"])
            mine[f"norm2/{n}"], mine[f"norm2_se/{n}"] = e["norm2"], e["norm2_se"]
            twin[f"norm2/{n}"], twin[f"norm2_se/{n}"] = e["norm2_base"], e["norm2_base_se"]
            # Below noise logs no cos or ratio: a tracker would draw a 0 there, which reads as no effect.
            if e["cos"] is not None:
                row[f"effect/{n}"], row[f"effect_se/{n}"] = 1 - e["cos"], e["se"]
                row[f"cos/{n}"] = e["cos"]
                row[f"norm_ratio/{n}"], row[f"norm_ratio_se/{n}"] = e["norm_ratio"], e["norm_ratio_se"]
        steps.append(row)
        arm.append(mine)
        base.append(twin)
    return steps, base, arm


def sweep_point(summary: dict) -> dict:
    """A reduced probe point in the sweep's summary: its effects, and its gate σs (boxed on the heatmap)."""
    return {"effects": summary["effects"], "gate_sigmas": sorted({g["sigma"] for g in summary["gates"]})}
