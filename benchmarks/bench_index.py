"""The cost of one run.json update as a run grows: 10³, 10⁴, 10⁵ units, side by side in one run.

    python benchmarks/bench_index.py [--units 1000,10000,100000] [--updates 5]
    python benchmarks/bench_index.py --smoke      # 10² and 10³ units, 2 updates: seconds (a test runs it)

Every change of run.json (a store marked done, a job added) is one read-modify-write of the whole file
under its lock (twinrun.storage.rundir.RunIndex._update): read, validate field by field, change, write
atomically (fsync, rename). Its cost grows with the number of units, and a run makes one per store, so
a whole run costs O(units² x arms). This builds run.json of a probe run with U units (two arms, the gate
replicate at one unit) through RunIndex.create, then times `mark_done` on it, the way the job calls it,
split into its parts (read and parse, validate, write); and prints the file's size.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from twinrun.arms import Arm
from twinrun.files import read_json, write_json
from twinrun.measures.probe import bin_label, store_name
from twinrun.plan import unit_entry
from twinrun.storage.records import RUN_FORMAT, validate_run
from twinrun.storage.rundir import RunIndex

ARMS = [Arm("pin_sigma", {}, "intervention"), Arm("native", {}, "twin")]
DIGEST = "c" * 64


def run_doc(n_units: int) -> dict:
    """run.json of a probe run planned with n_units σ bins (the first a gate unit), every store pending."""
    units = [unit_entry({"index": i, "label": bin_label(i, 0.01 * (i + 1)), "gate": i == 0,
                         "probe": {"sigma": 0.01 * (i + 1)}, "file": store_name(i, 0.01 * (i + 1)),
                         "payload_bytes": 3_942_720}, ARMS) for i in range(n_units)]
    arms = [{"name": a.name, "role": a.role, "config_hash": f"{k + 1:016x}"} for k, a in enumerate(ARMS)]
    registered = {"estimands": ["all"], "gate_rule": "replicate", "signal_alpha": 0.05}
    return {"format": RUN_FORMAT, "measure": "probe", "status": "running", "command": None, "reference": None,
            "arms": arms, "registered": registered, "units": units}


def time_updates(root: Path, n_units: int, n_updates: int) -> dict:
    """Median seconds of one mark_done on a run of n_units, and of its parts; the file's size."""
    run_dir = root / f"run{n_units}"
    run_dir.mkdir()
    index = RunIndex.create(run_dir, run_doc(n_units))
    def never(others, mine) -> None:  # the straddling rule, out of the way
        pass

    whole, read, check, write = [], [], [], []
    for k in range(n_updates):
        u = index.units[(k * 7919) % n_units]
        t0 = time.perf_counter()
        index.mark_done(u, "native", DIGEST, DIGEST, never)
        whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        doc = read_json(index.run_dir.run_json)
        t1 = time.perf_counter()
        validate_run(index.run_dir.run_json, doc)
        t2 = time.perf_counter()
        write_json(index.run_dir.run_json, doc)
        t3 = time.perf_counter()
        read.append(t1 - t0)
        check.append(t2 - t1)
        write.append(t3 - t2)
    med = statistics.median
    return {"units": n_units, "bytes": index.run_dir.run_json.stat().st_size, "update_s": med(whole),
            "read_s": med(read), "validate_s": med(check), "write_s": med(write)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", default="1000,10000,100000", help="comma-separated unit counts")
    ap.add_argument("--updates", type=int, default=5, help="updates timed per size (median reported)")
    ap.add_argument("--smoke", action="store_true", help="10² and 10³ units, 2 updates (seconds)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    sizes = [100, 1000] if args.smoke else [int(n) for n in args.units.split(",")]
    updates = 2 if args.smoke else args.updates
    print(f"twinrun run.json update benchmark  {time.strftime('%Y-%m-%d %H:%M')}  {os.cpu_count()} CPUs  "
          f"load avg {os.getloadavg()[0]:.1f}; median of {updates} updates per size")
    rows = []
    with tempfile.TemporaryDirectory(prefix="twinrun-bench-index-") as tmp:
        for n in sizes:
            r = time_updates(Path(tmp), n, updates)
            rows.append(r)
            n_updates = n * (len(ARMS) + 1)  # about one update per store of the run
            ms = {k: r[k] * 1e3 for k in ("update_s", "read_s", "validate_s", "write_s")}
            print(f"  {n:>7,} units  run.json {r['bytes'] / 1e6:8.2f} MB  one update {ms['update_s']:9.1f} "
                  f"ms (read {ms['read_s']:.1f}, validate {ms['validate_s']:.1f}, write {ms['write_s']:.1f}) "
                  f"its {n_updates:,} updates: {r['update_s'] * n_updates / 3600:,.2f} h", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
