"""Absolute comparison of two arms: `python -m twinrun.compare A B [--force]`.

A kind with its own comparison (its Measure's `comparison`: training runs, step by step) is compared
its own way, and a kind whose arms cannot be compared here (`not_comparable`: twin sampling) is refused
in one line (exit 2), as are two sides of different kinds.

A and B are run directories (their native twin, or `--arm NAME`), arm directories
(RUN/arms/NAME; the gate replicate, RUN/arms/native_replicate, is compared at its gate bins) or
single store files. Prints, per bin and estimand (every estimand of the
registry, residual included), A against B, B being the baseline as the twin is in a report: the
debiased cosine and norm ratio |μ_A| / |μ_B| with their SEs, bit-identity and the max relative
difference of the sums; `residual` removes B's mean over bins from both. So `compare RUN/arms/ARM
RUN/arms/native` prints the report's own effects. If their kernel paths differ
and no same-environment control vouches for B (A's run has B as its reference and, recomputed
from the stores now, today's twin reproduces it), it refuses with exit 3 and lists the differing
fingerprint fields; `--force` prints the numbers anyway, every one marked INVALID, and exits 3.
"""

from twinrun.errors import exit_as_command, exit_on_signals

if __name__ == "__main__":  # as a command: a signal while the imports below load is one line too
    exit_on_signals()

import argparse
import sys
from pathlib import Path

from twinrun.analysis.checks import arm_stores, close, load_run, scan_run
from twinrun.analysis.estimands import SHIFT_VIEW
from twinrun.analysis.reduction import registered
from twinrun.analysis.references import cross_estimates, protocol_mismatch, reference_report
from twinrun.config import ReduceConfig
from twinrun.errors import (
    EXIT_OK,
    EXIT_REFUSED,
    Interrupted,
    StoreError,
    TwinrunError,
    fail,
    raise_on_signals,
)
from twinrun.measures.kind import Measure
from twinrun.measures.registry import MEASURES, kind_of
from twinrun.protocol import STORE_IDENTITY_KEYS
from twinrun.provenance.fingerprint import kernel_path_fields
from twinrun.publish.render import pm
from twinrun.storage.header import store_format
from twinrun.storage.run_paths import ARMS_DIR
from twinrun.storage.rundir import RunDir
from twinrun.storage.store import StoreReader


def resolve(path: Path, arm: str) -> tuple[Path | None, dict]:
    """(run dir or None, {σ: StoreReader}) for a run dir, an arm dir (RUN/arms/NAME, the gate replicate
    included: its gate bins) or one store file."""
    path = Path(path)
    if path.is_file():
        reader = StoreReader(path)
        return None, {reader.meta["sigma"]: reader}
    if RunDir(path).is_run():
        return path, arm_stores(path, arm)[1]
    run = RunDir(path.parent.parent)
    if path.parent.name == ARMS_DIR and run.is_run():
        return run.path, arm_stores(run.path, path.name)[1]
    raise StoreError(path, "not a twinrun run directory, arm directory or store file")


def common_bins(a: dict, b: dict, name_a, name_b) -> tuple[dict, dict]:
    """Where one side has stores at only some of the other's σ (the gate replicate: gate bins only),
    both are compared there; otherwise both as given (protocol_mismatch then names the grids)."""
    for small, large, label in ((a, b, name_a), (b, a, name_b)):
        if set(small) < set(large):
            print(f"twinrun compare: {label} has stores at σ = {', '.join(f'{s:g}' for s in sorted(small))} "
                  "only (the gate replicate is measured at gate bins): comparing there", file=sys.stderr)
            kept = {s: large.pop(s) for s in sorted(small)}
            close(large)
            large.clear()
            large.update(kept)
    return a, b


def side_kind(path: Path) -> Measure | None:
    """The kind of a run, one of its arm directories or a store (by the format it names); None for
    anything else (resolve then says what is wrong with it)."""
    path = Path(path)
    if path.is_file():
        fmt = store_format(path)
        return next((m for m in MEASURES.values() if m.store_format == fmt), None)
    run = path if RunDir(path).is_run() else path.parent.parent
    if run != path and path.parent.name != ARMS_DIR or not RunDir(run).is_run():
        return None
    return kind_of(run)


def comparable_kind(a: Path, b: Path) -> Measure | None:
    """The kind both sides are (None: compared bin by bin as stores of the default format), or a one-line
    refusal: sides of different kinds, or a kind whose arms cannot be compared here."""
    ka, kb = side_kind(a), side_kind(b)
    for path, kind in ((a, ka), (b, kb)):
        if kind is not None and kind.not_comparable is not None:
            raise TwinrunError(f"{path} is {_kind_words(kind)}: {kind.not_comparable}")
    kind = ka or kb
    names = {k.name if k is not None else None for k in (ka, kb)}
    if len(names) > 1 and (None not in names or kind.comparison is not None):
        raise TwinrunError(f"{a} is {_kind_words(ka)} and {b} is {_kind_words(kb)}: compare arms of one kind")
    return kind


def _kind_words(kind: Measure | None) -> str:
    return "no twinrun run, arm or store" if kind is None else f"a measure={kind.name} run, arm or store"


def measured_fields(a: dict, b: dict) -> list[str]:
    """What was measured that differs between the two sides: the model as built, the probed data."""
    ma, mb = next(iter(a.values())).meta, next(iter(b.values())).meta
    return [k for k in STORE_IDENTITY_KEYS if ma.get(k) != mb.get(k)]


def _difference(measured: list[str], fields: list[str]) -> str:
    """How two sides differ, the measured thing first, then the environment."""
    what = {"model_sha256": "models (their parameters and buffers as built)",
            "data_sha256": "images (with their conditioning, if any)", "adapter_sha256": "LoRA adapters"}
    parts = [f"measured different {' and '.join(what[k] for k in measured)}"] if measured else []
    parts += [f"ran on different kernel paths (differs in {', '.join(fields)})"] if fields else []
    return " and ".join(parts)


def verdict(rows: list[dict], fields: list[str], measured: list[str]) -> str | None:
    """The label of a comparison on its own numbers, or None when only a same-environment check (or
    --force) could let it through: the kernel paths differ and so do the numbers."""
    if all(r["bit_identical"] for r in rows):
        differ = f"; the records differ ({_difference(measured, fields)}), the numbers do not"
        return f"valid: bit-identical in every bin{differ if fields else ''}"
    if not fields:
        return "valid: one kernel path" + (f"; {_difference(measured, [])}" if measured else "")
    return None


def vouched(run_a: Path | None, run_b: Path | None) -> bool:
    """A's own run has B as its reference, and today's twin of A reproduces B: recomputed from the
    stores of both runs now (summary.json is never trusted)."""
    if run_a is None or run_b is None:
        return False
    index, readers = load_run(run_a)
    try:
        if not index.reference or Path(index.reference).resolve() != run_b.resolve():
            return False
        # the replicate's shifts; every store checked
        found = scan_run(index, readers, [SHIFT_VIEW], None, 1_000_000)
        inter = index.arm("intervention")["name"]
        verdict = reference_report(index, readers, found, inter, run_b, registered(index)["signal_alpha"],
                                   run_ok=False)
    finally:
        close(readers)
    return bool(verdict["alive"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m twinrun.compare", description=__doc__.splitlines()[0],
        epilog="exit codes: 0 compared on one kernel path (or across paths, vouched for by A's reference "
        "check); 2 bad input (missing or damaged store, different protocols); 3 kernel paths differ: "
        "refused, or with --force printed with every number marked INVALID "
        "(still 3: the numbers are not valid).")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--arm", default="native", help="arm of a run directory to compare (default: native)")
    p.add_argument("--force", action="store_true",
                   help="compute across kernel paths; every number marked INVALID")
    args = p.parse_args(argv)
    raise_on_signals()
    a, b = {}, {}
    try:
        kind = comparable_kind(args.a, args.b)
        if kind is not None and kind.comparison is not None:
            own = kind.comparison
            return own.compare(args, own.side(args.a, args.arm), own.side(args.b, args.arm))
        run_a, a = resolve(args.a, args.arm)
        run_b, b = resolve(args.b, args.arm)
        a, b = common_bins(a, b, args.a, args.b)
        if len(a) == 1:
            print("twinrun compare: one bin: the residual view (each bin minus the mean over bins) is zero "
                  "there, so it is not shown", file=sys.stderr)
        bad = protocol_mismatch(a, b)
        if bad:
            raise TwinrunError(f"{args.a} and {args.b} were measured under different protocols "
                               f"({', '.join(bad)})")
        fields = kernel_path_fields(a, b)
        measured = measured_fields(a, b)
        # Read first: bit-identical stores are bit-identical whatever their kernel-path records say;
        # the refusal is for numbers that differ.
        rows = cross_estimates(b, a, ReduceConfig().signal_alpha)  # A against the baseline B
        label = verdict(rows, fields, measured)
        if label is None and vouched(run_a, run_b):
            label = f"vouched: {run_a}'s same-environment twin found {run_b} alive"
        elif label is None and not args.force:
            print(f"twinrun: refused: {args.a} and {args.b} {_difference(measured, fields)} and no "
                  f"same-environment control vouches for {args.b}; run `python -m twinrun ... "
                  f"reference={args.b}` here first, or pass --force", file=sys.stderr)
            return EXIT_REFUSED
        elif label is None:
            label = f"INVALID: {_difference(measured, fields)}"
    except (TwinrunError, Interrupted) as err:
        fail(err)
    finally:
        close(a)
        close(b)
    print(f"twinrun compare: {args.a} vs {args.b} [{label}]")
    print(f"  {'σ':>6}  {'estimand':<9} {'bit-identical':>13} {'max rel diff':>12} {'debiased cos ± se':>24} "
          f"{'norm ratio A/B ± se':>24} {'naive cos':>10}")
    mark = "  INVALID" if label.startswith("INVALID") else ""
    for r in rows:
        print(f"  {r['sigma']:>6g}  {r['estimand']:<9} {'yes' if r['bit_identical'] else 'no':>13} "
              f"{r['max_shift']:>12.3e} {pm(r['cos'], r['se'], '.6f'):>24} "
              f"{pm(r['norm_ratio'], r['norm_ratio_se'], '.6f'):>24} {r['cos_naive']:>10.6f}{mark}")
    return EXIT_REFUSED if label.startswith("INVALID") else EXIT_OK


if __name__ == "__main__":
    exit_as_command(main)
