"""How `python -m twinrun.compare` compares two training arms (measure=train): at every step both stored,
how many weight tensors differ (and the first), the largest difference, B's distance from A relative to
A's update, and B's held-out loss minus A's with its paired SE (same images, same draws)."""

import sys
from pathlib import Path

from twinrun.analysis.train_reduce import arm_stores as train_arm_stores
from twinrun.analysis.train_reduce import compare_stores
from twinrun.errors import EXIT_OK, EXIT_REFUSED
from twinrun.provenance.fingerprint import kernel_path_fields
from twinrun.storage.header import store_format
from twinrun.storage.run_paths import ARMS_DIR
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.train_store import TRAIN_STORE_FORMAT, read_train_store


def train_side(path: Path, arm: str) -> dict | None:
    """{stored step: store} when `path` is a training run (its arm `arm`), one of its arm directories or a
    training store; None for anything else (the probe's inputs)."""
    path = Path(path)
    if path.is_file():
        if store_format(path) != TRAIN_STORE_FORMAT:
            return None
        store = read_train_store(path)
        return {store.meta["to_step"]: store}
    run, name = (path, arm) if RunDir(path).is_run() else (path.parent.parent, path.name)
    if run != path and path.parent.name != ARMS_DIR:
        return None
    if not RunDir(run).is_run() or RunIndex.load(run).measure != "train":
        return None
    return train_arm_stores(run, name)


def compare_training(args, a: dict | None, b: dict | None) -> int:
    """Two training arms (runs, arm directories or stores) at every step both stored; refused across
    kernel paths as the probe's comparison is."""
    fields = kernel_path_fields(a, b)
    if fields and not args.force:
        print(f"twinrun: refused: {args.a} and {args.b} ran on different kernel paths (differs in "
              f"{', '.join(fields)}); two training runs on different paths differ by that path's chaos, "
              "not by anything they did: pass --force to see the numbers anyway", file=sys.stderr)
        return EXIT_REFUSED
    rows = compare_stores(a, b)
    label = f"INVALID: kernel paths differ ({', '.join(fields)})" if fields else "valid: one kernel path"
    mark = "  INVALID" if fields else ""
    print(f"twinrun compare (training): {args.a} vs {args.b} [{label}]")
    print(f"  {'step':>6} {'tensors differ':>15} {'first':<28} {'max |Δ|':>10} {'rel. dist':>10} "
          f"{'cos upd':>9} {'held-out B − A ± paired se':>28}")
    for r in rows:
        held = "–" if r["heldout_diff"] is None else f"{r['heldout_diff']:+.3e} ± {r['heldout_diff_se']:.1e}"
        dist = "–" if r["distance"] is None else f"{r['distance']:.3e}"
        cos = "–" if r["cos"] is None else f"{r['cos']:.6f}"
        count = f"{r['n_differ']} / {r['n_tensors']}"
        print(f"  {r['step']:>6} {count:>15} {r['first_tensor'] or '–':<28} "
              f"{r['max_abs_diff']:>10.3e} {dist:>10} {cos:>9} {held:>28}{mark}")
    return EXIT_REFUSED if fields else EXIT_OK
