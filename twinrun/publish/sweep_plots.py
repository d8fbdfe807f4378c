"""sweep_effect.png: a sweep's heatmap, one panel per estimand, rows the swept points, columns the σ
bins, on a fixed, documented colour scale (EFFECT_SCALE) with value ± SE in each cell that has a number;
below-noise, failed and unmeasured cells each their own mark; legend swatches coloured as the cells they
name (tests/publish/test_sweep.py reads the artists to hold it to that); a gate bin's cell is marked
"gate", never coloured as an effect of 0. Reads no files; the only write
is save_figure's atomic PNG.
"""

from pathlib import Path
from typing import NamedTuple

import numpy as np
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.patches import Rectangle

from twinrun.publish.figures import save_figure
from twinrun.publish.probe_plots import describe_protocol

# One panel per estimand; in each, one row per sweep point, labelled by the variables the sweep
# changed (whatever they are: an intervention knob, the grid, the experiment), one column per
# noising σ. Each cell is in exactly one state, drawn and captioned its own way, so a blank never
# has to be guessed at; a cell with a number writes it, ± its SE.
#
# The colour scale is fixed, the same for every sweep, panel and estimand, so a colour means one
# effect wherever it is seen (an autoscaled map would paint 0.77 and 0.88 as the two extremes):
EFFECT_SCALE = (0.0, 2.0)  # 1 − cos: 0 the twin's direction, 1 orthogonal, 2 opposite; clipped beyond
EFFECT_GAMMA = 0.5  # square-root scale: the common small effects (≤ 0.3) get about 40% of the colours
EFFECT_CMAP = "viridis"
SCALE_TICKS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0)
SCALE_WORDS = {0.0: "0 same direction", 1.0: "1 orthogonal", 2.0: "2 opposite"}
SCALE_NOTE = ("fixed square-root colour scale from 0 (the twin's direction) through 1 (orthogonal) to 2 "
              "(opposite), clipped beyond")
SWATCH_VALUES = (0.0, 0.1, 0.5, 1.0, 2.0)  # the scale's colours a value state's legend swatch shows
GATE_EDGE = "tab:orange"


class CellStyle(NamedTuple):
    legend: str  # its legend and caption text
    fill: str | None  # None: the effect's colour on the fixed scale
    hatch: str
    mark: str  # drawn in the cell instead of a number
    mark_color: str


CELL_STYLES = {
    "effect": CellStyle("coloured: 1 − cos more than 2 SE from 0", None, "", "", ""),
    "within_2se": CellStyle("hatched: |1 − cos| ≤ 2 SE, no effect resolved", None, "///", "", ""),
    "no_se": CellStyle("dotted: no SE (a leave-one-fold-out replicate below noise)", None, "..", "", ""),
    "below_noise": CellStyle("grey 'n': below noise, no cosine defined (not 'no effect'); under it, where "
                             "recorded, each arm's debiased |μ|² ± SE", "0.82", "", "n", "0.25"),
    "gate": CellStyle("orange 'gate': no-op gate bin, arms equal by construction (no effect value)",
                      "#fde3c8", "", "gate", "0.25"),
    "failed": CellStyle("red × on pink: the point's checks or gates failed, numbers withheld", "#e7b9b9", "",
                        "×", "#a01010"),
    "unfinished": CellStyle("'?': the point has no verdict (not measured or not reduced)", "0.95", "", "?",
                            "0.25"),
    "not_measured": CellStyle("white: σ not in this point's grid", "white", "", "", ""),
}
VALUE_STATES = ("effect", "within_2se", "no_se")  # the cells that write value ± SE


def effect_norm() -> PowerNorm:
    """The heatmap's colour normalisation: fixed (EFFECT_SCALE, EFFECT_GAMMA), never fitted to data."""
    return PowerNorm(EFFECT_GAMMA, vmin=EFFECT_SCALE[0], vmax=EFFECT_SCALE[1], clip=False)


def _overrides_by_key(overrides: list[str]) -> dict[str, str]:
    return dict(o.lstrip("+~").partition("=")[::2] for o in overrides)


def swept_variables(points: list[dict]) -> list[str]:
    """The override keys whose values differ between the points: the sweep's axes."""
    by_point = [_overrides_by_key(p["overrides"]) for p in points]
    keys = dict.fromkeys(k for o in by_point for k in o)
    return [k for k in keys if len({o.get(k) for o in by_point}) > 1]


def _point_state(point: dict) -> str | None:
    if point["checks_passed"] is None:
        return "unfinished"
    return None if point["checks_passed"] and point["gates_passed"] else "failed"


def _cell(effect: dict | None, point_state: str | None) -> tuple[str, float, float]:
    """A cell's state, the effect 1 − cos it shows and its SE (nan when it shows none)."""
    if point_state is not None:
        return point_state, np.nan, np.nan
    if effect is None:
        return "not_measured", np.nan, np.nan
    if effect["cos"] is None:
        return "below_noise", np.nan, np.nan
    value = 1 - effect["cos"]
    if effect.get("se") is None:
        return "no_se", value, np.nan
    return ("within_2se" if abs(value) <= 2 * effect["se"] else "effect"), value, effect["se"]


def _gate_cell(effect: dict | None, point_state: str | None) -> tuple[str, float, float]:
    """A gate bin's cell: marked as the gate, no value (its 0 is by construction, the gate's test, and on
    the colour scale would read as the strongest "same direction"), unless the point shows no numbers."""
    if point_state is not None or effect is None:
        return _cell(effect, point_state)
    return "gate", np.nan, np.nan


def sweep_estimands(sweep_summary: dict) -> list[str]:
    """The estimands any point has effects for, in the order the reducer wrote them."""
    return list(dict.fromkeys(e["estimand"] for p in sweep_summary["points"] for e in p["effects"]))


def sweep_grid(sweep_summary: dict, estimand: str = "all") -> dict:
    """One estimand's panel: rows (points), columns (noising σ), each cell's state, effect and SE, the
    gate cells, the labels, the intervention and the settings every point shares."""
    points = sweep_summary["points"]
    swept, values = _rows(points)
    if len(swept) == 1 and all(_is_number(v[0]) for v in values):  # one numeric knob: in its order
        order = sorted(range(len(points)), key=lambda i: float(values[i][0]))
    else:
        order = list(range(len(points)))
    effects = [{e["sigma"]: e for e in points[i]["effects"] if e["estimand"] == estimand} for i in order]
    # Columns are the union of every point's σ bins (points may differ in their grid), so a missing cell shows
    # as missing.
    sigmas = sorted({s for row in effects for s in row})
    shape = (len(order), len(sigmas))
    states, grid, se = [], np.full(shape, np.nan), np.full(shape, np.nan)
    for r, i in enumerate(order):
        # A gate cell is a no-op check, not an effect: drawn as a gate whatever its value, so a passed gate
        # never reads as no effect.
        gate_sigmas = set(points[i].get("gate_sigmas", []))
        cells = [_gate_cell(effects[r].get(s), _point_state(points[i])) if s in gate_sigmas
                 else _cell(effects[r].get(s), _point_state(points[i])) for s in sigmas]
        states.append([state for state, _, _ in cells])
        grid[r] = [value for _, value, _ in cells]
        se[r] = [err for _, _, err in cells]
    # The signal each arm carried, for cells below noise: the heatmap tells too little signal from no effect.
    noise = [[noise_text(effects[r].get(s)) if states[r][c] == "below_noise" else None
              for c, s in enumerate(sigmas)] for r in range(len(order))]
    gates = {(r, sigmas.index(s)) for r, i in enumerate(order) for s in points[i].get("gate_sigmas", [])
             if s in sigmas}
    labels = [_row_label(swept, values[i], points[i]) for i in order]
    row_axis = swept[0] if len(swept) == 1 else "sweep point"
    return {"rows": labels, "row_axis": row_axis, "sigmas": sigmas, "effect": grid, "se": se,
            "states": states, "noise": noise, "gates": gates, "estimand": estimand,
            "intervention": _intervention_names(points),
            "setting": _shared_setting(points, row_axis)}


def _rows(points: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The sweep's axes and each point's values on them: the intervention's declared sweep axis when
    every point declares the same one with a value of its own, else the override keys that differ."""
    axes = [p.get("axis") or {} for p in points]
    keys = {a.get("key") for a in axes}
    values = [str(a.get("value")) for a in axes]
    if len(keys) == 1 and None not in keys and len(set(values)) == len(points) > 1:
        return [keys.pop()], [[v] for v in values]
    swept = swept_variables(points)
    return swept, [[_overrides_by_key(p["overrides"]).get(k, "–") for k in swept] for p in points]


def _row_label(swept: list[str], values: list[str], point: dict) -> str:
    if not swept:  # one point, or points that differ in nothing they were told: name the job
        return Path(point["run_dir"]).name
    return values[0] if len(swept) == 1 else ", ".join(f"{k}={v}" for k, v in zip(swept, values))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _intervention_names(points: list[dict]) -> str:
    names = dict.fromkeys(str(p["intervention"].get("_target_", "?")).rsplit(".", 1)[-1] for p in points
                          if p.get("intervention"))
    return " / ".join(names) or "?"


def _shared_setting(points: list[dict], row_axis: str) -> str:
    """`module=blocks.1.attn`: the intervention settings every point has alike (what varies is the rows')."""
    nodes = [p["intervention"] for p in points if p.get("intervention")]
    if not nodes:
        return ""
    keys = [k for k in nodes[0] if not str(k).startswith("_") and f"intervention.{k}" != row_axis]
    return ", ".join(f"{k}={nodes[0][k]}" for k in keys if all(n.get(k) == nodes[0][k] for n in nodes))


def cell_text(value: float, se: float) -> str:
    """`0.37\n±0.04`: the value to the SE's second significant digit (nan SE: said to be missing)."""
    if np.isnan(se):
        return f"{_unsigned_zero(f'{value:.2f}')}\n± no SE"
    decimals = 2 if se == 0 or se >= 0.01 else min(4, 1 - int(np.floor(np.log10(se))))
    return f"{_unsigned_zero(f'{value:.{decimals}f}')}\n±{se:.{decimals}f}"


def noise_text(effect: dict | None) -> str | None:
    """`arm 105±5.8 / twin 0.14±0.65`, each arm's debiased |μ|² ± SE on two lines: what made a cell below
    noise (None where the effect row does not carry them)."""
    keys = ("norm2", "norm2_se", "norm2_base", "norm2_base_se")
    if effect is None or any(effect.get(k) is None for k in keys):
        return None
    a, a_se, b, b_se = (_short(effect[k]) for k in keys)
    return f"arm {a}±{a_se}\ntwin {b}±{b_se}"


def _short(x: float) -> str:
    """A |μ|² in at most 7 characters, two significant digits where it is small."""
    if abs(x) >= 1000:
        return f"{x:.1e}"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.2g}"


def _unsigned_zero(text: str) -> str:
    """`-0.00` reads as a negative effect; a value that rounds to zero is written without a sign."""
    return text.lstrip("-") if float(text) == 0 else text


def sweep_figure(sweep_summary: dict, estimands: list[str] | None = None,
                 protocol: dict | None = None) -> Figure | None:
    """The figure plot_sweep saves (its arguments there); None when no point has effects to show."""
    names = list(estimands or sweep_estimands(sweep_summary))
    panels = [g for g in (sweep_grid(sweep_summary, n) for n in names) if g["sigmas"]]
    if not panels:  # no point has effects to show: the report's table says why
        return None
    n_rows, n_cols = len(panels[0]["rows"]), max(len(g["sigmas"]) for g in panels)
    states = dict.fromkeys(s for g in panels for row in g["states"] for s in row)
    gates = any(g["gates"] for g in panels)
    legend_rows = len(states) + gates
    # at least 3 inches of panels, so the colour bar's ticks do not collide on a one-row sweep
    panels_in = max(3.0, len(panels) * (0.9 + 0.42 * n_rows))
    fig = Figure(figsize=(max(6.4, 2.6 + 0.85 * n_cols), 0.9 + panels_in + 0.17 * legend_rows), dpi=110,
                 layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    norm, cmap = effect_norm(), colormaps[EFFECT_CMAP]
    for ax, g in zip(axes, panels):
        _heatmap_panel(ax, g, norm, cmap)
    if all(g["sigmas"] == panels[-1]["sigmas"] for g in panels):  # one σ axis: label it once, at the bottom
        for ax in axes[:-1]:
            ax.set_xlabel("")
    g = panels[0]
    setting = f"({g['setting']})" if g["setting"] else ""
    fig.suptitle(f"{g['intervention']}{setting} vs native twin, rows: {g['row_axis']} — "
                 f"{describe_protocol(protocol)}", fontsize=10)
    # One fixed colour scale for every panel and every sweep: a colour means the same effect in every heatmap.
    bar = fig.colorbar(ScalarMappable(norm, cmap), ax=list(axes), extend="both")
    bar.set_ticks(SCALE_TICKS, labels=[SCALE_WORDS.get(v, f"{v:g}") for v in SCALE_TICKS], fontsize=8)
    bar.set_label("1 − debiased cos to twin (fixed scale)", fontsize=8)
    _sweep_legend(fig, states, gates, norm, cmap)
    return fig


def plot_sweep(sweep_summary: dict, path: Path, estimand: str | list[str] | None = None, *,
               protocol: dict | None = None) -> Path | None:
    """sweep_effect.png: one heatmap panel per estimand of 1 − debiased cos over (sweep point, noising σ),
    on the fixed colour scale EFFECT_SCALE; each cell writes value ± SE or shows its state; gate bins boxed.

    sweep_summary: sweep_summary.json as write_sweep_summary writes it.
    estimand: one estimand's name, a list of them, or None for every estimand any point has (the default).
    protocol: the `probe` config node the points share (n_images, n_draws, n_folds), e.g. from the first
        point's arms/<intervention arm>/config.yaml; None says "protocol not given" (as it should when the
        protocol is itself swept: the rows then name it).
    Returns None (and writes nothing) when no point has effects to show.
    """
    estimands = [estimand] if isinstance(estimand, str) else estimand
    fig = sweep_figure(sweep_summary, estimands, protocol)
    if fig is None:
        return None
    save_figure(fig, path)
    return path


def _heatmap_panel(ax, g: dict, norm, cmap) -> None:
    """One estimand's cells, gate boxes and axes."""
    ax.imshow(g["effect"], origin="lower", aspect="auto", cmap=cmap, norm=norm)
    for r, row in enumerate(g["states"]):
        for c, state in enumerate(row):
            _draw_cell(ax, r, c, state, _cell_words(g, r, c), cmap(norm(g["effect"][r, c])), g["noise"][r][c])
    for r, c in g["gates"]:
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec=GATE_EDGE, lw=2.5))
    ax.set_xticks(range(len(g["sigmas"])), [f"{s:g}" for s in g["sigmas"]])
    ax.set_yticks(range(len(g["rows"])), g["rows"])
    ax.set_xlabel("noising σ (bin)", fontsize=9)
    ax.set_ylabel(g["row_axis"], fontsize=9)
    ax.set_title(f"estimand `{g['estimand']}`", fontsize=10)


def _ink(rgba) -> str:
    """Black or white, whichever reads on a cell of this colour."""
    r, g, b = rgba[:3]
    return "k" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "w"


def _cell_words(g: dict, r: int, c: int) -> str:
    """What a cell writes: value ± SE, or its state's mark."""
    state = g["states"][r][c]
    if state in VALUE_STATES:
        return cell_text(g["effect"][r, c], g["se"][r, c])
    return CELL_STYLES[state].mark


def _draw_cell(ax, row: int, col: int, state: str, words: str, rgba, note: str | None = None) -> None:
    """One cell: its fill (the effect's colour comes from the image under it), hatch and words; a
    below-noise cell adds the note of each arm's |μ|² ± SE under its mark."""
    style = CELL_STYLES[state]
    if style.fill is not None:
        ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fc=style.fill, ec="none", lw=0))
    ink = _ink(rgba) if style.fill is None else "0.25"
    if style.hatch:  # over the effect's colour, in the colour its text is written in
        ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, hatch=style.hatch, ec=ink, lw=0,
                               alpha=0.5))
    if state in VALUE_STATES:  # on a patch of the cell's own colour, so the hatch never crosses the digits
        ax.text(col, row, words, ha="center", va="center", fontsize=7, color=ink, linespacing=1.1,
                bbox={"fc": rgba, "ec": "none", "pad": 1.0})
    elif words and note:
        ax.text(col, row, words, ha="center", va="bottom", fontsize=10, color=style.mark_color)
        ax.text(col, row, note, ha="center", va="top", fontsize=6, color=style.mark_color, linespacing=1.05)
    elif words:
        ax.text(col, row, words, ha="center", va="center", fontsize=11, color=style.mark_color)


def _swatch(state: str, norm, cmap):
    """A legend swatch coloured as the state's cells are: its fill, or for a value state a strip of the
    fixed scale's colours, hatched as the cells."""
    style = CELL_STYLES[state]
    if style.fill is not None:
        return Rectangle((0, 0), 1, 1, fc=style.fill, ec="0.3", lw=0.5)
    return tuple(Rectangle((0, 0), 1, 1, fc=cmap(norm(v)), hatch=style.hatch, ec="0.5", lw=0)
                 for v in SWATCH_VALUES)


def _sweep_legend(fig: Figure, states: dict, gates: bool, norm, cmap) -> None:
    handles = [_swatch(s, norm, cmap) for s in states]
    labels = [CELL_STYLES[s].legend for s in states]
    if gates:
        handles.append(Rectangle((0, 0), 1, 1, fill=False, ec=GATE_EDGE, lw=2.5))
        labels.append("orange box: no-op gate bin")
    fig.legend(handles, labels, loc="outside lower center", fontsize=7, frameon=False, handlelength=3,
               handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})


def sweep_caption(sweep_summary: dict, estimand: str | list[str] | None = None) -> str:
    """The report's text under the heatmap: what its panels, axes, colours and the cells present mean."""
    names = [estimand] if isinstance(estimand, str) else (estimand or sweep_estimands(sweep_summary))
    panels = [g for g in (sweep_grid(sweep_summary, n) for n in names) if g["sigmas"]] or \
        [sweep_grid(sweep_summary, names[0] if names else "all")]
    g = panels[0]
    present = dict.fromkeys(s for p in panels for row in p["states"] for s in row)
    parts = [CELL_STYLES[s].legend for s in present]
    if any(p["gates"] for p in panels):
        parts.append("orange box: no-op gate bin")
    which = ", ".join(f"`{p['estimand']}`" for p in panels)
    setting = f"({g['setting']})" if g["setting"] else ""
    return (f"Effect 1 − debiased cos to the native twin of `{g['intervention']}{setting}`, one panel per "
            f"estimand ({which}), over ({g['row_axis']}, noising σ); each cell with a number writes it ± its "
            f"SE; colour on a {SCALE_NOTE}. Cells: " + "; ".join(parts) + ".")
