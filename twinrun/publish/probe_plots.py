"""The plot of one run a researcher reads: effect.png (a sweep's heatmap is twinrun.publish.sweep_plots).

Self-contained: each function takes plain arguments (a summary dict, and keywords for what the
summary does not carry) and reads no files; the only write is save_figure's atomic PNG
(twinrun.publish.figures).

What it promises (issue 21; tests/publish/test_probe_plots.py reads the artists to hold it to it): a bin
without a number (below noise, or withheld) is never drawn on the no-effect value; titles name the
intervention with its setting, the protocol and the estimand; the σ ticks are the run's bins on a
log axis; the norm ratio is on a log axis with a line at 1; a no-op gate bin is a labelled band, never
an effect of zero; nothing warns, whatever is drawn.
"""

from itertools import pairwise
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

from twinrun.publish.figures import save_figure

# ----------------------------------------------------------------------------- effect.png (one run)
# One column per estimand; three rows: the change of direction (1 − debiased cos), the change of
# size (norm ratio, log axis) and the signal each arm carried (debiased |μ|²), which is why a bin
# has a number or not. A bin without a number is a labelled grey band, never a point on the
# no-effect value (0, resp. 1): "below noise" is not "no effect" (an ablation whose every bin is
# below noise must not read as one that does nothing).
EFFECT_COLOR, ARM_COLOR, TWIN_COLOR = "tab:blue", "tab:red", "0.35"
BELOW_NOISE_FILL, BELOW_NOISE_HATCH = "0.9", "////"
GATE_FILL, GATE_HATCH, GATE_EDGE = "#fde3c8", "\\\\", "#f0a050"  # a no-op gate bin's band (orange)
EFFECT_ROWS = ("1 − debiased cos to twin", "norm ratio |μ_arm| / |μ_twin|", "debiased |μ|² of each arm")


def describe_intervention(intervention: dict | None, arm: str | None = None) -> str:
    """`ScaleModule(module=blocks.1.attn, factor=0.5)` from an arm config's `intervention` node; without
    the node, the arm's name, saying the setting is not shown."""
    if not intervention:
        return f"arm `{arm}` (setting not given)" if arm else "intervention (not named)"
    name = str(intervention.get("_target_", "?")).rsplit(".", 1)[-1]
    setting = ", ".join(f"{k}={v}" for k, v in intervention.items() if not str(k).startswith("_"))
    return f"{name}({setting})"


def describe_protocol(protocol: dict | None) -> str:
    """`40 images × 4 draws, 8 folds` from a `probe` config node (or anything with those three keys)."""
    if not protocol:
        return "protocol not given"
    draws = protocol.get("n_draws", "?")
    return (f"{protocol.get('n_images', '?')} images × {draws} draw{'' if draws == 1 else 's'}, "
            f"{protocol.get('n_folds', '?')} folds")


def has_number(row: dict) -> bool:
    """Whether a bin's effect row carries a cosine and ratio (else it is below noise or withheld)."""
    return not row.get("below_noise") and row.get("cos") is not None and row.get("norm_ratio") is not None


def _segments(rows: list[dict], gates: tuple = ()) -> list[list[dict]]:
    """Runs of consecutive bins with a number: a line never crosses a below-noise gap or a gate bin
    (σ in `gates`: the arms equal there by construction, which is the gate's test, not an effect of 0)."""
    runs, current = [], []
    for row in rows:
        if has_number(row) and row["sigma"] not in gates:
            current.append(row)
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


def _bar_ends(row: dict, key: str, se_key: str) -> tuple[float, float]:
    """(lower, upper) of the plotted quantity's 95% interval: the row's printed interval (given that it
    printed; a side the data do not bound is nan), or value ± t·SE for a summary written before them."""
    interval = row.get(f"{'cos' if key == 'cos' else 'norm_ratio'}_interval")
    if interval is None:
        half = row["t_crit"] * row[se_key]
        interval = [row[key] - half, row[key] + half]
    lo, hi = (np.nan if x is None else x for x in interval)
    return (1 - hi, 1 - lo) if key == "cos" else (lo, hi)  # 1 − cos turns the interval over


def _estimand_names(effects: list[dict]) -> list[str]:
    """Estimands in the order the reducer wrote them (the registry's)."""
    return list(dict.fromkeys(e["estimand"] for e in effects))


def effect_figure(summary: dict, *, intervention: dict | None = None, protocol: dict | None = None,
                  sigmas: list[float] | None = None) -> Figure:
    """The figure plot_effect saves (its arguments there); a summary that did not pass shows no numbers."""
    arm = (summary.get("arms") or [None])[0]
    title = f"{describe_intervention(intervention, arm)}\nvs native twin — {describe_protocol(protocol)}"
    effects = _shown_effects(summary)
    names = _estimand_names(effects)
    # A run without effects to show still gets a figure that says why: a missing effect.png is never the
    # message.
    if not names:
        return _no_effects_figure(title, summary)
    fig = Figure(figsize=(max(6.4, 1.0 + 3.4 * len(names)), 8.6), dpi=110, layout="constrained")
    fig.suptitle(title, fontsize=10)
    # The σ ticks are every bin of the run, not only those with effects, so a bin without a number is seen to
    # be absent.
    bins = sorted(set(sigmas or ()) | {e["sigma"] for e in effects})
    gate_sigmas = sorted({g["sigma"] for g in summary.get("gates") or []})
    axes = fig.subplots(3, len(names), sharex=True, sharey="row", squeeze=False)
    for col, name in enumerate(names):
        rows = sorted((e for e in effects if e["estimand"] == name), key=lambda e: e["sigma"])
        _effect_column(axes[:, col], rows, bins, gate_sigmas)
        axes[0, col].set_title(f"estimand `{name}`", fontsize=10)
    # Limits from every column at once: with shared rows, the estimands compare by eye.
    _fit_rows(axes, effects)
    for ax, label in zip(axes[:, 0], EFFECT_ROWS):
        ax.set_ylabel(label)
    for ax in axes[-1]:
        ax.set_xlabel("noising σ (the run's bins)")
    # The legend explains only what is drawn: the below-noise band and the gate band appear only when some bin
    # is one.
    _effect_legend(fig, measured=any(has_number(e) for e in effects),
                   below_noise=not all(has_number(e) for e in effects), gates=bool(gate_sigmas))
    return fig


def _shown_effects(summary: dict) -> list[dict]:
    """The effect rows a plot may show: none from a run whose checks or gates failed (they are withheld)."""
    return (summary.get("effects") or []) if summary.get("passed", True) else []


def _no_effects_figure(title: str, summary: dict) -> Figure:
    """A titled figure that says why it has no axes: nothing on it can be read as a value."""
    fig = Figure(figsize=(6.4, 2.4), dpi=110, layout="constrained")
    fig.suptitle(title, fontsize=10)
    why = ("effects withheld: a validity check or no-op gate failed" if not summary.get("passed", True)
           else "no effects in this summary")
    fig.text(0.5, 0.4, why, ha="center", va="center", fontsize=11)
    return fig


def plot_effect(summary: dict, path: Path, *, intervention: dict | None = None, protocol: dict | None = None,
                sigmas: list[float] | None = None) -> Path:
    """effect.png: per estimand, 1 − debiased cos, the norm ratio and each arm's debiased |μ|² against
    noising σ, with the printed 95% intervals (|μ|²: t-intervals); below-noise bins a labelled grey band,
    gate bins a labelled orange band (no value: equal by construction).

    summary: summary.json as the reducer writes it (effects, gates, arms, passed).
    intervention: the intervention arm's `intervention` config node (`_target_` and its settings), from
        arms/<arm whose role is "intervention" in run.json>/config.yaml; None titles the plot with the
        arm's name only.
    protocol: the `probe` config node of that config (n_images, n_draws, n_folds); None says "not given".
    sigmas: the run's σ bins (run.json `units[*].probe.sigma`), the σ axis's ticks; None uses the effects' σ.
    """
    save_figure(effect_figure(summary, intervention=intervention, protocol=protocol, sigmas=sigmas), path)
    return path


def effect_caption(summary: dict) -> str:
    """The report's text under effect.png: what its rows, bars, bands and lines mean (only those drawn)."""
    effects = _shown_effects(summary)
    if not effects:
        failed = not summary.get("passed", True)
        why = "a validity check or no-op gate failed." if failed else "this summary has none."
        return "No effects are drawn: " + why
    rows = ("One column per estimand. Rows: 1 − debiased cos to the native twin (0: no change of direction), "
            "the norm ratio |μ_arm| / |μ_twin| on a log axis (1: no change of size), and each arm's debiased "
            "|μ|² on a symlog axis; bars are the printed 95% intervals (given that a value prints, so "
            "asymmetric near the noise floor; an open ▲ or ▼ marks a side the data do not bound) and 95% "
            "t-intervals for |μ|²; σ ticks are the run's bins.")
    parts = [rows]
    if not all(has_number(e) for e in effects):
        parts.append("Grey hatched bands: below noise, where an arm's |μ|² is not signal, so no cosine or "
                     "ratio exists; that is not \"no effect\" (the |μ|² row shows which arm lacked signal).")
    if summary.get("gates"):
        parts.append("Orange hatched bands: no-op gate bins, where the intervention does nothing by "
                     "construction; their cosine and ratio are the gate's test (its table), not an effect of "
                     "zero, so no value is drawn there (each arm's |μ|² is).")
    return " ".join(parts)


def _effect_column(axes, rows: list[dict], bins: list[float], gate_sigmas: list[float]) -> None:
    """One estimand: its three rows of axes, sharing the σ axis."""
    ax_cos, ax_ratio, ax_signal = axes
    gates = tuple(gate_sigmas)
    _values(ax_cos, rows, "cos", "se", gates)
    _values(ax_ratio, rows, "norm_ratio", "norm_ratio_se", gates)
    _signal(ax_signal, rows)
    ax_cos.axhline(0, color="k", lw=0.8, zorder=1)
    ax_ratio.axhline(1, color="k", lw=0.8, zorder=1)
    _ratio_axis(ax_ratio)
    gaps = [r["sigma"] for r in rows if not has_number(r) and r["sigma"] not in gates]
    for ax in axes:
        _mark_below_noise(ax, gaps, bins, labelled=ax is not ax_signal)
        _mark_gates(ax, [g for g in gates if g in bins], bins, labelled=ax is not ax_signal)
        _sigma_axis(ax, bins)
        ax.grid(alpha=0.3)


def _values(ax, rows: list[dict], key: str, se_key: str, gates: tuple = ()) -> None:
    """Measured bins as points with their printed 95% intervals (conditional on printing, so asymmetric
    near the detection boundary; a side the data do not bound is an open triangle at the value), joined
    only between neighbours with a number; gate bins are not values (_mark_gates). key: "cos" (drawn as
    1 − cos) or "norm_ratio"."""
    for seg in _segments(rows, gates):
        sigma = np.array([r["sigma"] for r in seg])
        value = np.array([1 - r["cos"] if key == "cos" else r[key] for r in seg])
        lo, hi = np.array([_bar_ends(r, key, se_key) for r in seg]).T
        yerr = np.nan_to_num(np.stack([value - lo, hi - value]), nan=0.0).clip(min=0.0)
        ax.errorbar(sigma, value, yerr=yerr, marker="o", ms=4, capsize=3, color=EFFECT_COLOR)
        for ends, marker in ((lo, "v"), (hi, "^")):
            open_side = np.isnan(ends)
            if open_side.any():
                ax.plot(sigma[open_side], value[open_side], marker, mfc="none", color=EFFECT_COLOR, ms=8)


def _signal(ax, rows: list[dict]) -> None:
    """Each arm's debiased |μ|² with its 95% t-interval, nudged apart in σ so both bars show; a symlog
    axis, since a debiased |μ|² of pure noise is often negative."""
    sigma = np.array([r["sigma"] for r in rows])
    for key, color, marker, ls, nudge in (("norm2", ARM_COLOR, "o", "-", 0.97),
                                          ("norm2_base", TWIN_COLOR, "s", "--", 1.03)):
        half = [r["t_crit"] * r[f"{key}_se"] for r in rows]
        bars = ax.errorbar(sigma * nudge, [r[key] for r in rows], yerr=half, marker=marker, ms=3.5, capsize=2,
                           lw=1, ls=ls, color=color)
        bars.lines[0].set_gid(key)  # which arm a line is, for a reader of the artists (the tests)
    ax.axhline(0, color="k", lw=0.8, zorder=1)


def _symlog_threshold(effects: list[dict]) -> float:
    """symlog's linear range: the power of ten at or below the median SE of the |μ|², so what is within
    noise of 0 sits in the linear middle and only signal climbs the log decades."""
    ses = [s for e in effects for s in (e.get("norm2_se"), e.get("norm2_base_se")) if s and s > 0]
    return float(10.0 ** np.floor(np.log10(np.median(ses)))) if ses else 1.0


def _signal_limits(effects: list[dict], linthresh: float) -> tuple[float, float]:
    """The |μ|² row's range: every interval, 0, and half a decade to spare at each end of the data."""
    ends = [e[key] + sign * e["t_crit"] * e[f"{key}_se"] for e in effects for key in ("norm2", "norm2_base")
            for sign in (-1, 1)]
    lo, hi = min(ends), max(ends)
    return (3 * lo if lo < -linthresh else -linthresh), (3 * hi if hi > linthresh else linthresh)


def _fit_rows(axes, effects: list[dict]) -> None:
    """Row limits that always show the no-effect value (0; ratio 1), also when no bin has a number
    (an axis with nothing on it would otherwise autoscale to an arbitrary range, or warn on log)."""
    ax_cos, ax_ratio, ax_signal = axes[:, 0]
    linthresh = _symlog_threshold(effects)
    ax_signal.set_yscale("symlog", linthresh=linthresh)
    ax_signal.set_ylim(*_signal_limits(effects, linthresh))
    if not any(has_number(e) for e in effects):
        ax_cos.set_ylim(-0.1, 1.1)
        ax_ratio.set_ylim(0.5, 2.0)
        return
    lo, hi = ax_cos.get_ylim()
    ax_cos.set_ylim(min(lo, -0.05), max(hi, 0.05))
    lo, hi = ax_ratio.get_ylim()
    ax_ratio.set_ylim(min(lo, 0.8), max(hi, 1.25))


def _band_factor(bins: list[float]) -> float:
    """Half-width (as a factor on the log σ axis) of a below-noise band: well inside the gap to the
    nearest bin."""
    steps = [b / a for a, b in pairwise(bins) if a > 0]
    return min(1.15, min(steps) ** 0.35) if steps else 1.15


def _mark_below_noise(ax, gaps: list[float], bins: list[float], labelled: bool) -> None:
    """A grey hatched band across the whole axis at each bin without a number, labelled "below noise":
    spanning the axis (axes coordinates in y), it sits on no value, least of all the no-effect one."""
    w = _band_factor(bins)
    for sigma in gaps:
        ax.axvspan(sigma / w, sigma * w, fc=BELOW_NOISE_FILL, hatch=BELOW_NOISE_HATCH, ec="0.75", lw=0,
                   zorder=0)
        if labelled:
            ax.text(sigma, 0.5, "below noise", transform=ax.get_xaxis_transform(), rotation=90, ha="center",
                    va="center", fontsize=7, color="0.3",
                    bbox={"fc": BELOW_NOISE_FILL, "ec": "none", "pad": 1.5})


def _mark_gates(ax, gates: list[float], bins: list[float], labelled: bool) -> None:
    """An orange hatched band across the whole axis at each no-op gate bin, labelled "no-op gate": the
    arms are equal there by construction (the gate tests that), so no effect value is drawn on it."""
    w = _band_factor(bins)
    for sigma in gates:
        ax.axvspan(sigma / w, sigma * w, fc=GATE_FILL, hatch=GATE_HATCH, ec=GATE_EDGE, lw=0, zorder=0)
        if labelled:
            ax.text(sigma, 0.5, "no-op gate", transform=ax.get_xaxis_transform(), rotation=90, ha="center",
                    va="center", fontsize=7, color="0.25", bbox={"fc": GATE_FILL, "ec": "none", "pad": 1.5})


def _ratio_axis(ax) -> None:
    """Log scale read as plain numbers (0.5, 1, 2, 5, …): a ratio of 2 and one of 0.5 are as far from 1."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _sigma_axis(ax, bins: list[float]) -> None:
    """Log σ with exactly the run's bins as ticks (no minor ticks to be mistaken for bins)."""
    ax.set_xscale("log")
    ax.set_xticks(bins, [f"{s:g}" for s in bins], fontsize=8, rotation=45 if len(bins) > 6 else 0)
    ax.xaxis.set_minor_locator(NullLocator())
    pad = 1.3 if len(bins) < 2 else max(1.1, _band_factor(bins) ** 2)
    ax.set_xlim(bins[0] / pad, bins[-1] * pad)


def _effect_legend(fig: Figure, measured: bool, below_noise: bool, gates: bool) -> None:
    """One legend for the figure, of proxies for what is drawn: never empty (the |μ|² of both arms is
    always there), so matplotlib never warns, and nothing in it that the plot lacks."""
    handles = [Line2D([], [], color=EFFECT_COLOR, marker="o", ms=4,
                      label="measured: value, 95% interval given printed (open ▲▼: unbounded side)")]
    handles = handles if measured else []
    handles += [Line2D([], [], color="k", lw=0.8, label="no effect (1 − cos = 0; ratio = 1); |μ|² = 0"),
                Line2D([], [], color=ARM_COLOR, marker="o", ms=3.5,
                       label="intervention arm |μ|² ± 95% t-interval"),
                Line2D([], [], color=TWIN_COLOR, marker="s", ms=3.5, ls="--",
                       label="native twin |μ|² ± 95% t-interval")]
    if below_noise:
        handles.append(Patch(fc=BELOW_NOISE_FILL, hatch=BELOW_NOISE_HATCH, ec="0.75", lw=0,
                             label=("below noise: an arm's |μ|² is not signal, so no cos or ratio "
                                    "(not 'no effect')")))
    if gates:
        handles.append(Patch(fc=GATE_FILL, hatch=GATE_HATCH, ec=GATE_EDGE, lw=0,
                             label="no-op gate bin: equal by construction, no value"))
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7.5, frameon=False)
