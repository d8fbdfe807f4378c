"""Reducer memory and reads at size: P = 10⁷ parameters, 32 stores (2 arms x 16 bins), F = 10 (12.8 GB).

    python benchmarks/bench_reduce.py [--params 10000000] [--folds 10] [--threads 2] [--keep DIR]
    python benchmarks/bench_reduce.py --smoke     # P = 10⁴, 4 bins, F = 4, every step (a test runs it)

Plans and measures a real (tiny) 16-bin run with twinrun's own plan_run/run_job, so run.json, the
arm configs and the provenance are genuine; then rewrites every store with write_store (of the fold
sums as fold_tensors lays them out) as a synthetic F x P store (a shared direction per bin, an arm
effect off the gate, fold noise; the gate bin's arms and the gate replicate identical), recorded in
run.json through RunIndex.mark_done, evicts the stores from the page cache, and reduces and publishes
the run (twinrun.analysis.probe_reduce.reduce_run, twinrun.publish.publish) in a fresh process. Reports that
process's peak RSS and its bytes read (/proc/self/io: rchar, and read_bytes from storage) against the
bytes of the stores on disk, the time of the reduce and of its one pass, and the streaming pass against
a whole-matrix numpy reduction of a small run (the same scan code) as a self-check.
"""

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from twinrun.files import read_json, write_json
from twinrun.measures.probe import PROBE, fold_tensors
from twinrun.provenance.record import straddling_rule
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.store import read_store, write_store

SIGMAS = [0.02, 0.03, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0, 5.0, 8.0]  # 16 bins
GATE = 0.5
SMOKE_SIGMAS = [0.1, 0.5, 1.0, 2.0]  # --smoke: 4 bins (the gate among them), P = 10⁴, F = 4


def synthetic_layout(n_params: int) -> list[dict]:
    """Four blocks, each a conditioning slice (5%) and the rest: the shape of a DiT's layout."""
    out, offset = [], 0
    for i in range(4):
        for name, frac, cond in ((f"blocks.{i}.adaln.linear.weight", 0.05, True),
                                 (f"blocks.{i}.rest", 0.20, False)):
            numel = int(n_params * frac) if i < 3 or cond else n_params - offset
            out.append({"name": name, "offset": offset, "numel": numel, "shape": [numel], "cond": cond})
            offset += numel
    assert offset == n_params
    return out


def make_run(root: Path, n_folds: int, sigmas: list[float]) -> Path:
    """A genuine 16-bin run of the default model (F images, one draw), measured by twinrun itself."""
    from hydra import compose, initialize_config_dir

    from twinrun.app import CONF_DIR
    from twinrun.config import register_configs
    from twinrun.job import run_job
    from twinrun.plan import plan_run

    register_configs()
    overrides = ["+experiment=pin_sigma", f"sigma_grid.sigmas=[{','.join(map(str, sigmas))}]",
                 f"intervention.sigma_pin={GATE}", f"probe.n_images={n_folds}", f"probe.n_folds={n_folds}",
                 "probe.n_draws=1", "reduce.groups={block0:[blocks.0.*]}",
                 "reduce.estimands=[all,cond,residual,block0]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run_dir = root / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        plan_run(cfg, run_dir)
        run_job(run_dir)
    return run_dir


def rewrite_stores(run_dir: Path, n_params: int) -> list[Path]:
    """Every store becomes a synthetic [F, n_params] one (metadata kept, layout replaced), recorded done
    again in run.json with its new sha256 on the kernel path it was measured on."""
    index = RunIndex.load(run_dir)
    rd = index.run_dir
    layout = synthetic_layout(n_params)
    gen = torch.Generator().manual_seed(0)
    paths = []
    for u in index.units:
        direction = torch.randn(n_params, generator=gen)
        effect = torch.zeros(n_params) if u["gate"] else 0.5 * torch.randn(n_params, generator=gen)
        noise = None
        for arm in u["stores"]:
            path = index.store_path(u, arm)
            meta = read_store(path).meta
            if noise is None or not u["gate"]:  # at the gate every arm gets the same sums: the no-op
                noise = 3.0 * torch.randn(len(meta["fold_sizes"]), n_params, generator=gen)
            shift = effect if arm == "pin_sigma" else 0.0
            tensors = fold_tensors((direction + shift) + noise, layout)
            sha = write_store(path, tensors, {**meta, "layout": layout})
            kernel_path = u["stores"][arm]["kernel_path_sha256"]
            refuse = straddling_rule(rd.path, rd.kernel_path_env, read_json(rd.kernel_path_env(kernel_path)))
            index.mark_done(u, arm, sha, kernel_path, refuse)
            paths.append(path)
    # The stores now hold another layout than the one planned: run.json's sizes follow (a reader checks each
    # store's header against them before reading its payload).
    doc = read_json(rd.run_json)
    for u in doc["units"]:
        for entry in u["stores"].values():
            entry["payload_bytes"] = 4 * len(meta["fold_sizes"]) * n_params
    write_json(rd.run_json, doc)
    return paths


def evict(paths) -> None:
    """Drop the files from the page cache, so that reading them is a real read from storage."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def reduce_in_child(run_dir: Path) -> dict:
    """Runs in a fresh process (`--reduce-only`): its peak RSS and reads are the reducer's alone."""
    from twinrun.analysis import checks
    from twinrun.analysis.probe_reduce import reduce_run
    from twinrun.publish import publish

    spent = {}
    original = checks.scan

    def timed_scan(*a, **k):
        t = time.perf_counter()
        out = original(*a, **k)
        spent["scan"] = time.perf_counter() - t
        return out

    checks.scan = timed_scan
    io_before, t = proc_io(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        reduction = reduce_run(run_dir)
        publish(reduction, PROBE)  # summary.json and report.md, as `python -m twinrun.reduce` writes them
    seconds, io_after = time.perf_counter() - t, proc_io()
    summary, code = reduction.summary, reduction.exit_code
    return {"seconds": seconds, "scan_s": spent["scan"], "exit_code": code, "valid": summary["checks_passed"],
            "n_effects": len(summary["effects"]), "peak_rss": peak_rss(),
            "rchar": io_after["rchar"] - io_before["rchar"],
            "read_bytes": io_after["read_bytes"] - io_before["read_bytes"]}


def proc_io() -> dict:
    return {k: int(v)
            for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def self_check(root: Path) -> float:
    """The streaming pass against a whole-matrix numpy Gram of a small three-arm run (max relative diff)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from stores import scan_sums

    gen = torch.Generator().manual_seed(1)
    arms, n_bins, n_folds, n_params = ["pin_sigma", "native", "native_replicate"], 4, 5, 1000
    layout = [{"name": "a", "offset": 0, "numel": 600, "cond": False},
              {"name": "b", "offset": 600, "numel": 300, "cond": True},
              {"name": "c", "offset": 900, "numel": 100, "cond": False}]
    sums = {(a, b): torch.randn(n_folds, n_params, generator=gen) + 3 for a in arms for b in range(n_bins)}
    found = scan_sums(root, sums, layout, arms, n_bins, ["all", "cond", "residual"], [], chunk_params=7)
    s = np.stack([np.stack([sums[a, b].double().numpy() for b in range(n_bins)]) for a in arms])
    views = {"all": s, "cond": s[..., 600:900], "residual": s - s[1].mean(0)}
    worst = 0.0
    for name, x in views.items():
        got = found.gram(name, "native")
        for b in range(n_bins):
            for i in range(len(arms)):
                for j in range(len(arms)):
                    want = x[i, b] @ x[j, b].T
                    worst = max(worst, float(np.abs(got[b, i, :, j] - want).max() / np.abs(want).max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--folds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="build the run here and keep it (default: a temp dir, removed)")
    ap.add_argument("--reduce-only", type=Path, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--smoke", action="store_true", help="P = 10⁴, 4 bins, F = 4: every step, in seconds")
    args = ap.parse_args()
    sigmas = SMOKE_SIGMAS if args.smoke else SIGMAS
    if args.smoke:
        args.params, args.folds = 10_000, 4
    torch.set_num_threads(args.threads)
    if args.reduce_only:
        print(json.dumps(reduce_in_child(args.reduce_only)))
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="twinrun-bench-reduce-"))
    print(f"twinrun reducer benchmark  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  "
          f"{os.cpu_count()} CPUs  threads={args.threads}  load avg {os.getloadavg()[0]:.1f}")
    try:
        print("self-check: streaming pass vs a whole-matrix numpy Gram, max relative diff "
              f"{self_check(root / 'check'):.1e}")
        t = time.perf_counter()
        run_dir = make_run(root, args.folds, sigmas)
        stores = rewrite_stores(run_dir, args.params)
        on_disk = sum(p.stat().st_size for p in stores)
        print(f"stores: {len(stores)} (2 arms x {len(sigmas)} bins + the gate replicate), F={args.folds}, "
              f"P={args.params:,}: {on_disk / 1e9:.2f} GB on disk, {on_disk / len(stores) / 1e6:.0f} MB each "
              f"(built in {time.perf_counter() - t:.0f} s)")
        evict(stores)
        child = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--reduce-only",
                                str(run_dir)], capture_output=True, text=True, check=True)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"reduce_run (fresh process, stores evicted from the page cache): {r['seconds']:.1f} s, "
              f"exit code {r['exit_code']}, valid={r['valid']}, {r['n_effects']} effects; "
              f"the one pass {r['scan_s']:.1f} s")
        print(f"  peak RSS {r['peak_rss'] / 2**20:,.0f} MiB (bound: 2 GiB whatever P; the stores are "
              f"{on_disk / 2**30:.1f} GiB)")
        print(f"  bytes read: rchar {r['rchar']:,} = {r['rchar'] / on_disk:.4f} x the stores' "
              f"{on_disk:,} bytes; from storage (read_bytes) {r['read_bytes']:,} = "
              f"{r['read_bytes'] / on_disk:.4f} x")
        print(f"  summary written: {RunDir(run_dir).summary_json.exists()}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
