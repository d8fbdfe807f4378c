"""Estimands: named linear views of the stored fold sums, and the Gram blocks the reducer needs.

An estimand is one registry entry: which parameter columns it reads (a selection over the store's
layout) and whether the twin's mean over bins is removed (a derived view). Config validation,
the reducer, the report's ordering, references and `compare` all read ESTIMANDS; a new estimand
is one entry here. Since every view is linear in the sums, nothing extra is ever stored.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Estimand:
    name: str
    doc: str
    selects: Callable[[dict], bool]  # layout entry -> are its columns part of this view?
    residual: bool = False  # remove the twin's mean direction over bins (shared structure)


ESTIMANDS = {e.name: e for e in (
    Estimand("all", "every probed parameter", lambda entry: True),
    Estimand("cond", "the conditioning pathway (the model's COND_PARAM_PATTERNS)", lambda entry: bool(entry["cond"])),
    Estimand("residual", "each bin's direction minus the twin's mean direction over bins", lambda entry: True,
             residual=True),
)}


def available(layout: list[dict]) -> list[str]:
    """Estimands that select at least one probed column of this layout, in registry order."""
    return [name for name, e in ESTIMANDS.items() if any(e.selects(entry) for entry in layout)]


def column_ranges(layout: list[dict], names: list[str]) -> list[tuple[int, int, tuple[str, ...]]]:
    """Contiguous column ranges (lo, hi, estimands that read them), merged where the set agrees."""
    ranges = []
    for entry in layout:
        lo, hi = entry["offset"], entry["offset"] + entry["numel"]
        views = tuple(n for n in names if ESTIMANDS[n].selects(entry))
        if ranges and ranges[-1][2] == views and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi, views)
        else:
            ranges.append((lo, hi, views))
    return ranges


def max_shift(x: torch.Tensor, y: torch.Tensor, layout: list[dict], name: str) -> float:
    """Max relative difference of the sums over the estimand's columns: max |x − y| / max |y|.

    Used wherever two arms measured on the same draws are compared for identity (gates, the
    replicate, references). For `residual` the difference of the views is the difference of the
    sums (the same twin mean is removed from both), so it reads the same columns as `all`.
    """
    worst, scale = 0.0, 0.0
    for lo, hi, views in column_ranges(layout, [name]):
        if views:
            worst = max(worst, float((x[:, lo:hi].double() - y[:, lo:hi].double()).abs().max()))
            scale = max(scale, float(y[:, lo:hi].abs().max()))
    if worst == 0.0:
        return 0.0
    return worst / scale if scale > 0 else float("inf")


def grams(arm_names: list[str], n_bins: int, stores: dict, twin: str, names: list[str],
          chunk_params: int = 1_000_000) -> dict[str, np.ndarray]:
    """Same-bin Gram blocks per estimand, as arrays [bin, arm, fold, arm, fold] (float64).

    stores: {(arm, bin): Store}, every arm in every bin, one layout. Every estimate (gates,
    effects, the replicate, a reference) pairs two arms of one bin, so only the blocks within a
    bin are computed: n_bins x (n_arms·F)² products instead of (n_bins·n_arms·F)². One pass over
    the columns, in chunks of ≤ chunk_params capped so that the float64 working copy stays under
    128 MiB. A residual view is the Gram of R^{arm}_{b,f} = S^{arm}_{b,f} − M_f with
    M_f = mean_b' S^{twin}_{b',f}: ⟨R,R'⟩ = ⟨S,S'⟩ − ⟨S,M⟩ − ⟨M,S'⟩ + ⟨M,M⟩, so besides the
    within-bin products it needs only every row against the F rows of M.
    """
    first = next(iter(stores.values()))
    layout, n_folds = first.meta["layout"], first.sums.shape[0]
    n_arms, t = len(arm_names), arm_names.index(twin)
    width = n_arms * n_folds  # rows of one bin's block
    chunk = max(1, min(chunk_params, (128 * 2**20) // (n_bins * width * 8)))
    buffer = torch.empty(n_bins * width * chunk, dtype=torch.float64)  # reused: no page faults per chunk
    g = {n: torch.zeros(n_bins, width, width, dtype=torch.float64) for n in names}
    s_m = {n: torch.zeros(n_bins, n_arms, n_folds, n_folds, dtype=torch.float64) for n in names}  # ⟨S_{b,a,f}, M_g⟩
    m_m = {n: torch.zeros(n_folds, n_folds, dtype=torch.float64) for n in names}  # ⟨M_f, M_g⟩
    for lo, hi, views in column_ranges(layout, names):
        for start in range(lo, hi, chunk) if views else ():
            stop = min(start + chunk, hi)
            x = buffer[: n_bins * width * (stop - start)].view(n_bins, n_arms, n_folds, stop - start)
            for a, arm in enumerate(arm_names):
                for b in range(n_bins):
                    x[b, a] = stores[arm, b].sums[:, start:stop]
            rows = x.view(n_bins, width, stop - start)
            block = torch.bmm(rows, rows.transpose(1, 2))
            mean = x[:, t].mean(0)
            for n in views:
                g[n] += block
                if ESTIMANDS[n].residual:
                    s_m[n] += (x.view(-1, stop - start) @ mean.T).view_as(s_m[n])
                    m_m[n] += mean @ mean.T
    shape = (n_bins, n_arms, n_folds, n_arms, n_folds)
    out = {}
    for n in names:
        if ESTIMANDS[n].residual:
            # ⟨R_{a,f}, R_{a',g}⟩ = ⟨S_{a,f}, S_{a',g}⟩ − ⟨S_{a,f}, M_g⟩ − ⟨M_f, S_{a',g}⟩ + ⟨M_f, M_g⟩, per bin.
            rows_m = s_m[n].view(n_bins, width, n_folds).repeat(1, 1, n_arms)  # [b, (a,f), (a',g)] = ⟨S_{a,f}, M_g⟩
            g[n] = g[n] - rows_m - rows_m.transpose(1, 2) + m_m[n].repeat(n_arms, n_arms)
        out[n] = g[n].view(shape).numpy()
    return out
