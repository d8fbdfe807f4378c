"""Absolute comparison of two arms: `python -m twinrun.compare A B [--force]`.

A and B are run directories (their native twin, or `--arm NAME`), arm directories
(RUN/arms/NAME) or single store files. Prints the debiased cosine per bin and estimand.
If their kernel paths differ and no same-environment control vouches for B (A's run found B
alive as its reference), it refuses with exit 3 and lists the differing fingerprint fields;
`--force` prints the numbers anyway, every one marked INVALID, and still exits 3.
"""

import argparse
import sys
from pathlib import Path

from twinrun.env import kernel_path_diff
from twinrun.errors import EXIT_OK, EXIT_REFUSED, StoreError, TwinrunError, fail
from twinrun.reduce import arm_stores, cross_estimates, protocol_mismatch
from twinrun.store import read_json, read_store


def resolve(path: Path, arm: str) -> tuple[Path | None, dict]:
    """(run dir or None, {σ: Store}) for a run dir, an arm dir or one store file."""
    path = Path(path)
    if path.is_file():
        store = read_store(path)
        return None, {store.meta["sigma"]: store}
    if (path / "run.json").is_file():
        return path, arm_stores(path, arm)[1]
    if path.parent.name == "arms" and (path.parent.parent / "run.json").is_file():
        return path.parent.parent, arm_stores(path.parent.parent, path.name)[1]
    raise StoreError(path, "not a twinrun run directory, arm directory or store file")


def kernel_path_fields(a: dict, b: dict) -> list[str]:
    ma, mb = next(iter(a.values())).meta, next(iter(b.values())).meta
    sha_a = (ma.get("env") or {}).get("kernel_path_sha256")
    sha_b = (mb.get("env") or {}).get("kernel_path_sha256")
    if sha_a is not None and sha_a == sha_b and ma.get("kernel_path") == mb.get("kernel_path"):
        return []
    return kernel_path_diff(ma.get("kernel_path") or {}, mb.get("kernel_path") or {}) or ["kernel_path_sha256"]


def vouched(run_a: Path | None, run_b: Path | None) -> bool:
    """A's own run measured B as its reference and found it alive in A's environment."""
    if run_a is None or run_b is None or not (run_a / "summary.json").is_file():
        return False
    ref = read_json(run_a / "summary.json").get("reference") or {}
    return bool(ref.get("alive")) and Path(ref.get("path", "")).resolve() == run_b.resolve()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m twinrun.compare", description=__doc__.splitlines()[0],
        epilog="exit codes: 0 compared on one kernel path (or across paths, vouched for by A's reference check); "
        "2 bad input (missing or damaged store, different protocols); 3 kernel paths differ: refused, or with "
        "--force printed with every number marked INVALID (still 3: the numbers are not valid).")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--arm", default="native", help="arm of a run directory to compare (default: native)")
    p.add_argument("--force", action="store_true", help="compute across kernel paths; every number marked INVALID")
    args = p.parse_args(argv)
    try:
        run_a, a = resolve(args.a, args.arm)
        run_b, b = resolve(args.b, args.arm)
        bad = protocol_mismatch(a, b)
        if bad:
            raise TwinrunError(f"{args.a} and {args.b} were measured under different protocols ({', '.join(bad)})")
        fields = kernel_path_fields(a, b)
        label = "valid: one kernel path"
        if fields and vouched(run_a, run_b):
            label = f"vouched: {run_a}'s same-environment twin found {run_b} alive"
        elif fields and not args.force:
            print(f"twinrun: refused: {args.a} and {args.b} ran on different kernel paths (differs in "
                  f"{', '.join(fields)}) and no same-environment control vouches for {args.b}; run "
                  f"`python -m twinrun ... reference={args.b}` here first, or pass --force", file=sys.stderr)
            return EXIT_REFUSED
        elif fields:
            label = f"INVALID: kernel paths differ ({', '.join(fields)})"
        rows = cross_estimates(a, b)
    except TwinrunError as err:
        fail(err)
    print(f"twinrun compare: {args.a} vs {args.b} [{label}]")
    print(f"  {'σ':>6}  {'estimand':<9} {'debiased cos':>13} {'± se':>9} {'naive cos':>10}")
    for r in rows:
        cos = "below noise" if r["cos"] is None else f"{r['cos']:.6f}"
        se = "" if r["se"] is None else f"{r['se']:.1e}"
        mark = "  INVALID" if label.startswith("INVALID") else ""
        print(f"  {r['sigma']:>6g}  {r['estimand']:<9} {cos:>13} {se:>9} {r['cos_naive']:>10.6f}{mark}")
    return EXIT_REFUSED if label.startswith("INVALID") else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
