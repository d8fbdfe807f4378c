"""The plots of a training report: every arm's loss curves (loss.png) and each arm's distance from the
twin over steps with the chaos floor beside the intervention (distance.png).

Each takes a training summary (plain data) and writes one PNG atomically; nothing here reads a run
directory.
"""

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator

from twinrun.publish.figures import save_figure

# One colour and style per role, the same in both plots.
ROLE_STYLE = {"intervention": ("C3", "-", "o"), "twin": ("k", "-", ""), "replicate": ("0.6", ":", "x"),
              "machinery": ("C2", "--", "+"), "chaos": ("C0", "-", "s")}


def plot_losses(summary: dict, path: Path) -> Path:
    """Top: each arm's training loss at every step. Bottom: each arm's held-out loss at every stored step,
    95% t-interval of its paired difference from the twin's drawn around the twin's value."""
    fig = Figure(figsize=(6.4, 6.4), dpi=110)
    ax_train, ax_held = fig.subplots(2, 1, sharex=True)
    rows = summary["losses"]
    twin = [r for r in rows if r["role"] == "twin"]
    for arm in summary["arms"]:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        color, ls, marker = ROLE_STYLE.get(mine[0]["role"], ("C7", "-", ""))
        label = f"{arm} ({mine[0]['role']})"
        if mine[0]["role"] != "twin" and _same_losses(mine, twin):  # drawn over the twin: say it, not hide it
            label += ": bit-identical to the twin, on its line"
        width = 3 if mine[0]["role"] == "twin" else 1  # under the arms that match it bit for bit
        steps = [s for r in mine for s in range(r["step"] - len(r["train_loss_steps"]) + 1, r["step"] + 1)]
        losses = [x for r in mine for x in r["train_loss_steps"]]
        ax_train.plot(steps, losses, ls, color=color, lw=width, label=label)
        own = [x for r in mine for x in r.get("train_loss_own_steps", r["train_loss_steps"])]
        if own != losses:  # an arm trained on another objective (a loss weight, its own step): labelled
            ax_train.plot(steps, own, ":", color=color, lw=1, label=f"{arm}: its own objective")
        ax_held.plot([r["step"] for r in mine], [r["heldout_loss"] for r in mine], ls, color=color,
                     marker=marker, ms=5, lw=width, label=label)
    # The intervention's paired interval drawn around the twin: whether the held-out difference is within
    # noise shows here, which two unpaired bands would hide.
    inter = [r for r in rows if r["role"] == "intervention"]
    if inter:
        half = np.array([r["t_crit"] * r["heldout_diff_se"] for r in inter])
        twin = np.array([r["heldout_loss"] - r["heldout_diff"] for r in inter])
        ax_held.fill_between([r["step"] for r in inter], twin - half, twin + half, color="C3", alpha=0.15,
                             label="twin ± 95% paired interval of the intervention's difference")
    ax_train.set_ylabel("training loss, the twin's objective\n(each step's batch)")
    ax_held.set_ylabel("held-out loss (same images, same draws)")
    ax_held.set_xlabel("optimizer step")
    ax_train.set_title("loss of every arm")
    ax_train.legend(fontsize=7)
    ax_held.legend(fontsize=7)
    for ax in (ax_train, ax_held):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def _same_losses(mine: list[dict], twin: list[dict]) -> bool:
    """Whether an arm's losses equal the twin's bit for bit at every stored step (its curves hide under
    the twin's, so its legend entry says so)."""
    def key(r: dict) -> tuple:
        return r["step"], r["heldout_loss"], tuple(r["train_loss_steps"])
    return bool(twin) and [key(r) for r in mine] == [key(r) for r in twin]


EXACT_BAND = 0.08  # the strip at the foot of distance.png (axes fraction) where exact zeros are marked


def plot_distance(summary: dict, path: Path, estimand: str) -> Path:
    """Each arm's relative distance from the twin, |θ_arm − θ_twin| / |θ_twin − θ_start|, over stored
    steps (log scale): the intervention beside the chaos floor and the floor times the margin. A distance
    of exactly 0 (bit-identical to the twin: the machinery arm and the replicate on a deterministic path)
    has no place on a log axis, so it is a mark in a strip below the axis's values labelled
    "bit-identical", never a point at a made-up height."""
    fig = distance_figure(summary, estimand)
    save_figure(fig, path)
    return path


def _floor_label(effects: list[dict]) -> str:
    """The floor's line: the chaos arms' in this estimand, or the whole model's where it read that."""
    models = sorted({e["floor_from"] for e in effects if "floor_from" in e})
    if not models:
        return "chaos floor (the chaos arms)"
    read = sum("floor_from" in e for e in effects)
    return f"chaos floor (`{models[0]}`'s at {read} of {len(effects)} steps)"


def distance_figure(summary: dict, estimand: str) -> Figure:
    """The figure plot_distance saves."""
    fig = Figure(figsize=(8.4, 4.4), dpi=110)
    ax = fig.subplots()
    effects = [e for e in summary["effects"] if e["estimand"] == estimand]
    steps = [e["step"] for e in effects]
    # Only positive distances set the log axis's limits; exact zeros go to the strip below it.
    positive = [v for e in effects for v in (e["distance"], e["floor"], e.get("machinery_distance"),
                                              e.get("replicate_distance")) if v]
    series = [("intervention", "distance"), ("chaos", "floor"), ("machinery", "machinery_distance"),
              ("replicate", "replicate_distance")]
    for role, key in series:
        values = [e.get(key) for e in effects]
        color, ls, marker = ROLE_STYLE[role]
        if any(values):
            label = {"chaos": _floor_label(effects)}.get(role, role)
            shown = [v if v else np.nan for v in values]  # a zero has no place on a log axis: marked below
            ax.plot(steps, shown, ls, color=color, marker=marker, ms=5, label=label)
        zeros = [s for s, v in zip(steps, values, strict=True) if v == 0]
        if zeros:  # x in data, y in axes fraction: in the strip, at no value of the log axis
            rank = [r for r, _ in series].index(role)
            ax.plot(zeros, [EXACT_BAND * (0.2 + 0.2 * rank)] * len(zeros), marker or "v", color=color,
                    ls="none", ms=7, transform=ax.get_xaxis_transform(), clip_on=False,
                    label=f"{role}: bit-identical to the twin (exactly 0)")
    # The floor times the margin is the line an effect must clear to be read as the intervention's, not chaos.
    floor = [e["floor"] * e["margin"] if e["floor"] else np.nan for e in effects]  # each step's own margin
    if any(np.isfinite(floor)):
        ax.plot(steps, floor, ":", color="C0", label="floor × margin (above it: above the floor)")
    ax.set_yscale("log")
    _exact_strip(ax, positive)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"|θ_arm − θ_twin| / |θ_twin − θ_start|  ({estimand})")
    ax.set_title("distance from the native twin")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def _exact_strip(ax, positive: list[float]) -> None:
    """Limits from the positive distances alone, with room below them for the strip of exact zeros: a
    grey band across the axis's foot, labelled "bit-identical (distance exactly 0)"."""
    lo, hi = (min(positive), max(positive)) if positive else (1e-3, 1.0)
    decades = max(np.log10(hi / lo), 1.0)
    ax.set_ylim(lo / 10 ** (decades * EXACT_BAND / (1 - EXACT_BAND) + 0.6), hi * 3)
    # ticks only where values can be: none labels the strip, which holds no value of the axis
    ax.set_yticks([10.0 ** k for k in range(int(np.ceil(np.log10(lo))), int(np.floor(np.log10(hi * 3))) + 1)])
    ax.yaxis.set_minor_locator(FixedLocator([]))
    ax.fill_between([0, 1], 0, EXACT_BAND, transform=ax.transAxes, color="0.92", zorder=0, lw=0)
    ax.text(0.995, EXACT_BAND, "bit-identical (distance exactly 0) ↓", transform=ax.transAxes, ha="right",
            va="bottom", fontsize=7, color="0.3")
    ax.set_autoscaley_on(False)
