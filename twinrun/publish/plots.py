"""The plots of a report: the effect against noising σ (effect.png) and a sweep's heatmap.

Each takes plain data (a summary, a sweep summary) and writes one PNG atomically; nothing here reads
a run directory.
"""

import io
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from twinrun.files import atomic_write


def _segments(rows: list[dict]) -> list[list[dict]]:
    """Runs of consecutive bins with a number: a line never crosses a below-noise gap."""
    runs, current = [], []
    for row in rows:
        if row["below_noise"]:
            runs, current = runs + [current] if current else runs, []
        else:
            current.append(row)
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


def _panel(ax, rows: list[dict], key: str, se_key: str, color, label: str) -> None:
    """One estimand on one axis: segments with 95% error bars (the printed intervals, asymmetric), a
    side the data do not bound drawn as an open triangle at the value, below-noise bins as x."""
    for i, seg in enumerate(_segments(rows)):
        sigma = np.array([r["sigma"] for r in seg])
        value = np.array([1 - r[key] if key == "cos" else r[key] for r in seg])
        lo, hi = np.array([_bar_ends(r, key, se_key) for r in seg]).T
        yerr = np.nan_to_num(np.stack([value - lo, hi - value]), nan=0.0).clip(min=0.0)
        ax.errorbar(sigma, value, yerr=yerr, marker="o", ms=4, capsize=3, color=color,
                    label=label if i == 0 else None)
        for ends, marker in ((lo, "v"), (hi, "^")):
            open_side = np.isnan(ends)
            if open_side.any():
                ax.plot(sigma[open_side], value[open_side], marker, mfc="none", color=color, ms=8)
    gaps = [r["sigma"] for r in rows if r["below_noise"]]
    if gaps:
        ax.plot(gaps, [0] * len(gaps) if key == "cos" else [1] * len(gaps), "x", color=color, ms=7)


def plot_effect(summary: dict, path: Path) -> Path:
    """1 − debiased cos and the norm ratio (95% intervals given printed) against noising σ per estimand;
    gate bins marked; below-noise bins drawn as x on the no-effect line, never joined by a line."""
    fig = Figure(figsize=(6.4, 6.4), dpi=110)
    ax_cos, ax_ratio = fig.subplots(2, 1, sharex=True)
    names = [n for n in summary["used"]["estimands"] if any(e["estimand"] == n for e in summary["effects"])]
    for k, name in enumerate(names):
        rows = [e for e in summary["effects"] if e["estimand"] == name]
        _panel(ax_cos, rows, "cos", "se", f"C{k}", name)
        _panel(ax_ratio, rows, "norm_ratio", "norm_ratio_se", f"C{k}", name)
    for ax in (ax_cos, ax_ratio):
        for i, g in enumerate(sorted({g["sigma"] for g in summary["gates"]})):
            ax.axvline(g, color="0.5", ls="--", lw=1, label="no-op gate" if i == 0 else None)
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
    ax_cos.set_ylabel("1 − debiased cos to twin")
    ax_ratio.set_ylabel("norm ratio |μ_arm| / |μ_twin|")
    ax_ratio.set_xlabel("noising σ   (bars: 95% given printed; open ▲▼: unbounded side; x: below noise)")
    ax_cos.set_title("intervention vs native twin")
    ax_cos.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def save_figure(fig, path: Path) -> None:
    """PNG bytes written atomically: a full disk or a read-only directory is one StoreError line
    naming the file (exit 2), and a half-written plot never replaces a whole one."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write(Path(path), buf.getvalue())


# ----------------------------------------------------------------------------- the sweep heatmap
# One row per sweep point, labelled by the variables the sweep changed (whatever they are: an
# intervention knob, the grid, the experiment), one column per noising σ. Each cell is in exactly
# one state, drawn and captioned its own way, so a blank never has to be guessed at.
CELL_STYLES = {  # state: (legend text, fill colour or None = the effect's colour, hatch, mark)
    "effect": ("1 − cos, more than 2 SE from 0", None, "", ""),
    "within_2se": ("hatched: |1 − cos| ≤ 2 SE, no effect resolved", None, "///", ""),
    "no_se": ("dotted: no SE (a leave-one-fold-out replicate below noise)", None, "..", ""),
    "below_noise": ("grey 'n': below noise, no cosine defined", "0.82", "", "n"),
    "failed": ("red ×: the point's checks or gates failed, numbers withheld", "#e7b9b9", "", "×"),
    "unfinished": ("'?': the point has no verdict (not measured or not reduced)", "0.95", "", "?"),
    "not_measured": ("white: σ not in this point's grid", "white", "", ""),
}


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


def _cell(effect: dict | None, point_state: str | None) -> tuple[str, float]:
    """A cell's state and the effect 1 − cos it shows (nan when it shows none)."""
    if point_state is not None:
        return point_state, np.nan
    if effect is None:
        return "not_measured", np.nan
    if effect["cos"] is None:
        return "below_noise", np.nan
    value = 1 - effect["cos"]
    if effect["se"] is None:
        return "no_se", value
    return ("within_2se" if abs(value) <= 2 * effect["se"] else "effect"), value


def sweep_grid(sweep_summary: dict, estimand: str = "all") -> dict:
    """Rows (points), columns (noising σ), each cell's state and effect, the gate cells, the labels."""
    points = sweep_summary["points"]
    swept, values = _rows(points)
    if len(swept) == 1 and all(_is_number(v[0]) for v in values):  # one numeric knob: in its order
        order = sorted(range(len(points)), key=lambda i: float(values[i][0]))
    else:
        order = list(range(len(points)))
    effects = [{e["sigma"]: e for e in points[i]["effects"] if e["estimand"] == estimand} for i in order]
    sigmas = sorted({s for row in effects for s in row})
    states, grid = [], np.full((len(order), len(sigmas)), np.nan)
    for r, i in enumerate(order):
        cells = [_cell(effects[r].get(s), _point_state(points[i])) for s in sigmas]
        states.append([state for state, _ in cells])
        grid[r] = [value for _, value in cells]
    gates = {(r, sigmas.index(s)) for r, i in enumerate(order) for s in points[i].get("gate_sigmas", [])
             if s in sigmas}
    labels = [_row_label(swept, values[i], points[i]) for i in order]
    return {"rows": labels, "row_axis": swept[0] if len(swept) == 1 else "sweep point", "sigmas": sigmas,
            "effect": grid, "states": states, "gates": gates, "estimand": estimand,
            "intervention": _intervention_names(points)}


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
    names = dict.fromkeys(str(p["intervention"].get("_target_", "?")).rsplit(".", 1)[-1] for p in points)
    return " / ".join(names)


def plot_sweep(sweep_summary: dict, path: Path, estimand: str = "all") -> Path | None:
    """Heatmap of the effect over (sweep point, noising σ): every cell's state visible, gate bins boxed."""
    g = sweep_grid(sweep_summary, estimand)
    if not g["sigmas"]:  # no point has effects to show: the report's table says why
        return None
    n_rows, n_cols = len(g["rows"]), len(g["sigmas"])
    fig, ax = plt.subplots(figsize=(3.2 + 0.7 * n_cols, 2.6 + 0.45 * n_rows), dpi=110)
    im = ax.imshow(g["effect"], origin="lower", aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=ax, label=f"effect 1 − debiased cos ({estimand})")
    for r, row in enumerate(g["states"]):
        for c, state in enumerate(row):
            _draw_cell(ax, r, c, state)
    for r, c in g["gates"]:
        ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec="tab:orange", lw=2.5))
    ax.set_xticks(range(len(g["sigmas"])), [f"{s:g}" for s in g["sigmas"]], rotation=45)
    ax.set_yticks(range(n_rows), g["rows"])
    ax.set_xlabel("noising σ (bin)")
    ax.set_ylabel(g["row_axis"])
    ax.set_title(f"{g['intervention']} vs native twin, estimand `{estimand}`", fontsize=10)
    present = dict.fromkeys(s for row in g["states"] for s in row)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=CELL_STYLES[s][1] or "0.6", hatch=CELL_STYLES[s][2], ec="0.3",
                             label=CELL_STYLES[s][0]) for s in present]
    if g["gates"]:
        handles.append(plt.Rectangle((0, 0), 1, 1, fill=False, ec="tab:orange", lw=2.5,
                                     label="no-op gate bin"))
    fig.legend(handles=handles, loc="lower center", fontsize=7, frameon=False, ncol=1)
    fig.tight_layout(rect=(0, 0.05 + 0.045 * len(handles), 1, 1))
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def _draw_cell(ax, row: int, col: int, state: str) -> None:
    _, fill, hatch, mark = CELL_STYLES[state]
    if fill is not None or hatch:
        ax.add_patch(plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=fill is not None, fc=fill or "none",
                                   hatch=hatch, ec="0.3" if hatch else "none", lw=0))
    if mark:
        ax.text(col, row, mark, ha="center", va="center", fontsize=11, color="0.25")


def sweep_caption(sweep_summary: dict, estimand: str = "all") -> str:
    """One sentence for the report under the heatmap: what its axes and every cell state present mean."""
    g = sweep_grid(sweep_summary, estimand)
    present = dict.fromkeys(s for row in g["states"] for s in row)
    parts = [CELL_STYLES[s][0] for s in present]
    if g["gates"]:
        parts.append("orange box: no-op gate bin")
    return (f"Effect 1 − debiased cos to the native twin of `{g['intervention']}`, estimand `{estimand}`, "
            f"over ({g['row_axis']}, noising σ). Cells: " + "; ".join(parts) + ".")
