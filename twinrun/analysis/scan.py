"""The reducer's one pass over parameters: every store of a comparison read once, front to back, together.

Stores hold one tensor per parameter, parameter-major (twinrun.store), so a column chunk of one
parameter is one contiguous read in every store. For each chunk, across all stores at once, the
pass accumulates everything the reduction needs: the within-bin Gram blocks of every estimand
(residual views against each requested base arm), and per (bin, pair of arms) bit-identity, the
largest |x − y| and the largest |y| over each estimand's columns. Memory is set by the chunk
(≤ 128 MiB of float64 rows), never by the number of parameters.
"""

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import torch

from twinrun.analysis.estimands import SHIFT_VIEW, registry, views
from twinrun.errors import StoreError
from twinrun.storage.store import StoreReader

BUFFER_BYTES = 128 * 2**20  # float64 rows of one chunk, all stores


@dataclass
class Pair:
    """Store x against store y of one bin, over every column."""

    identical: bool = True
    max_abs_diff: float = 0.0  # max |x − y| over all columns
    diff: dict = field(default_factory=dict)  # estimand -> max |x − y| over its columns
    scale: dict = field(default_factory=dict)  # estimand -> max |y| over its columns

    def shift(self, name: str) -> float:
        """Max relative difference over the estimand's columns, max |x − y| / max |y| (0 when equal there).
        For `residual` the difference of the views is the difference of the sums (the same mean is
        removed from both), so it reads the columns of `all`."""
        worst, scale = self.diff.get(name, 0.0), self.scale.get(name, 0.0)
        if worst == 0.0:
            return 0.0
        return worst / scale if scale > 0 else math.inf

    def add(self, x: torch.Tensor, y: torch.Tensor, names: tuple[str, ...]) -> None:
        same = torch.equal(x, y)
        worst = 0.0 if same else float((x.double() - y.double()).abs().max())
        scale = float(y.abs().max())
        self.identical &= same
        self.max_abs_diff = max(self.max_abs_diff, worst)
        for n in names:
            self.diff[n] = max(self.diff.get(n, 0.0), worst)
            self.scale[n] = max(self.scale.get(n, 0.0), scale)


@dataclass
class Scan:
    """What one pass yields. grams[(estimand, base)]: [n_bins, n_arms, F, n_arms, F] within-bin blocks
    (base: the arm whose mean over bins a residual view removes; None for the others)."""

    arms: list[str]
    grams: dict
    pairs: dict  # (x arm, y arm, bin) -> Pair
    sha256: dict  # (arm, bin) -> the file's digest, checked against run.json where it names one

    def gram(self, name: str, base: str) -> np.ndarray:
        return self.grams[name, base] if (name, base) in self.grams else self.grams[name, None]


def _same_shape(readers: dict) -> list[str]:
    """Every store's parameters (file order, sizes) and folds are the first one's; their names."""
    first = next(iter(readers.values()))
    want = [(t.name, t.numel) for t in first.tensors]
    for r in readers.values():
        if [(t.name, t.numel) for t in r.tensors] != want or r.n_folds != first.n_folds:
            raise StoreError(r.path, f"its parameters or folds differ from {first.path.name}'s: stores "
                             "compared together must share one protocol (measure them under one config)")
    return [name for name, _ in want]


def scan(readers: dict[tuple[str, int], StoreReader], gram_arms: list[str], n_bins: int, names: list[str],
         groups: dict | None, bases: list[str], pairs: list[tuple[str, str]],
         chunk_params: int = 1_000_000) -> Scan:
    """One pass over every store in `readers` ({(arm, bin): reader}); every byte read and hashed once.

    gram_arms: the arms (present in every bin) whose within-bin Gram blocks are accumulated.
    bases: arms of gram_arms whose mean over bins derived views remove (twinrun.analysis.estimands).
    pairs: (x arm, y arm) compared in every bin where both have a store.
    """
    order = _same_shape(readers)
    first = readers[gram_arms[0], 0]
    n_folds, entry_of = first.n_folds, {g["name"]: g for g in first.layout}
    keys = list(readers)
    # A chunk of parameters is sized so that every store's columns of it fit BUFFER_BYTES together: memory
    # stays bounded whatever the model's size.
    chunk = max(1, min(chunk_params, BUFFER_BYTES // (len(keys) * n_folds * 8)))
    n_samples = float(sum(first.meta["fold_sizes"]))  # residual views scale by the base's plain norm
    acc = _Grams(gram_arms, n_bins, n_folds, chunk, names, groups, bases, n_samples)
    pair_names = list(dict.fromkeys([*names, SHIFT_VIEW]))  # always: the replicate and references read it
    # Pairs only where both arms have a store at the bin: the gate replicate is measured at gate bins only.
    found = {(x, y, b): Pair() for x, y in pairs for b in range(n_bins)
             if (x, b) in readers and (y, b) in readers}
    # reads and sha256 release the GIL
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for i, name in enumerate(order):
            these, compared = views(entry_of[name], names, groups), views(entry_of[name], pair_names, groups)
            numel = entry_of[name]["numel"]
            for lo in range(0, max(numel, 1), chunk):
                hi = min(lo + chunk, numel)
                chunks = dict(zip(keys, pool.map(_columns, [readers[k] for k in keys], repeat(i), repeat(lo),
                                                 repeat(hi))))
                if hi == lo:
                    continue
                for (x, y, b), pair in found.items():
                    pair.add(chunks[x, b], chunks[y, b], compared)
                acc.add(chunks, hi - lo, these)
    # Each store's sha256 is finished after its last byte, so the one pass also proves every file is the one
    # run.json names.
    digests = {k: r.finish() for k, r in readers.items()}
    return Scan(list(gram_arms), acc.result(), found, digests)


def _columns(reader: StoreReader, i: int, lo: int, hi: int) -> torch.Tensor:
    return reader.columns(reader.tensors[i], lo, hi)


class _Grams:
    """Within-bin Gram blocks of every estimand, accumulated chunk by chunk in float64; a derived
    estimand also accumulates its `derive` entry's partial sums against each base arm."""

    def __init__(self, arms, n_bins, n_folds, chunk, names, groups, bases, n_samples):
        self.arms, self.n_bins, self.n_folds, self.n_samples = list(arms), n_bins, n_folds, n_samples
        self.width = len(arms) * n_folds  # rows of one bin's block
        known = registry(groups)
        self.names = list(names)
        self.derived = {n: known[n].derive for n in names if known[n].derive is not None}
        self.bases = list(bases) if self.derived else []
        # reused: no page faults per chunk
        self.buffer = torch.empty(n_bins * self.width * chunk, dtype=torch.float64)
        self.g = {n: torch.zeros(n_bins, self.width, self.width, dtype=torch.float64) for n in names}
        self.partials = {}  # (derived estimand, base arm) -> its derive entry's cross products so far

    def add(self, chunks: dict, width: int, these: tuple[str, ...]) -> None:
        if not these:
            return
        x = self.buffer[: self.n_bins * self.width * width].view(self.n_bins, len(self.arms), self.n_folds,
                                                                 width)
        for a, arm in enumerate(self.arms):
            for b in range(self.n_bins):
                x[b, a] = chunks[arm, b]
        rows = x.view(self.n_bins, self.width, width)
        block = torch.bmm(rows, rows.transpose(1, 2))
        for n in these:
            self.g[n] += block
        for n in (n for n in these if n in self.derived):
            for m in self.bases:
                new = self.derived[n].partials(x, self.arms.index(m))
                old = self.partials.get((n, m))
                self.partials[n, m] = new if old is None else old + new

    def result(self) -> dict:
        shape = (self.n_bins, len(self.arms), self.n_folds, len(self.arms), self.n_folds)
        out = {}
        for n in self.names:
            if n not in self.derived:
                out[n, None] = self.g[n].view(shape).numpy()
                continue
            for m in self.bases:
                out[n, m] = self.derived[n].gram(self.g[n], self.partials[n, m], len(self.arms),
                                                 self.arms.index(m), self.n_samples).view(shape).numpy()
        return out
