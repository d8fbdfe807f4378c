"""Reducer cost at size: P ≈ 10⁶ parameters, F = 40 folds, 16 bins, 2 arms (5 GB of stores).

    python benchmarks/bench_reduce.py [--params 1000000] [--folds 40] [--threads 2] [--keep DIR]

Plans and measures a real (tiny) 16-bin run with twinrun's own plan_run/run_job, so run.json, the
arm configs and the provenance are genuine; then rewrites every store with twinrun.store.write_store
as a synthetic F x P store (a shared direction per bin, an arm effect off the gate, fold noise; the
gate bin's arms identical) and reduces it with twinrun.reduce.reduce_run. Reports the bytes read per
store (counted at read_store, and by /proc/self/io with the stores evicted from the page cache
first), the time of loading+checking, of the Gram pass and of the whole reduce, peak RSS, and the
probe's time per bin on a DiT of the same P for comparison.
"""

import argparse
import contextlib
import io
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch

from twinrun import probe
from twinrun import reduce as reduce_mod
from twinrun.model import DiTDenoiser
from twinrun.store import read_store, write_json, write_store

SIGMAS = [0.02, 0.03, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0, 5.0, 8.0]  # 16 bins
GATE = 0.5


def proc_io() -> dict:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def synthetic_layout(n_params: int) -> list[dict]:
    """Four blocks, each a conditioning slice (5%) and the rest: the shape of a DiT's layout."""
    out, offset = [], 0
    for i in range(4):
        for name, frac, cond in ((f"blocks.{i}.adaln.linear.weight", 0.05, True), (f"blocks.{i}.rest", 0.20, False)):
            numel = int(n_params * frac) if i < 3 or cond else n_params - offset
            out.append({"name": name, "offset": offset, "numel": numel, "shape": [numel], "cond": cond})
            offset += numel
    assert offset == n_params
    return out


def make_run(root: Path, n_folds: int) -> Path:
    """A genuine 16-bin run of the default model (F images, one draw), measured by twinrun itself."""
    from hydra import compose, initialize_config_dir

    from twinrun.app import CONF_DIR
    from twinrun.config import register_configs
    from twinrun.run import plan_run, run_job

    register_configs()
    overrides = ["+experiment=pin_sigma", f"sigma_grid.sigmas=[{','.join(map(str, SIGMAS))}]",
                 f"intervention.sigma_pin={GATE}", f"probe.n_images={n_folds}", f"probe.n_folds={n_folds}",
                 "probe.n_draws=1"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run_dir = root / "run"
    plan_run(cfg, run_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        run_job(run_dir)
    return run_dir


def rewrite_stores(run_dir: Path, n_params: int) -> int:
    """Every store becomes a synthetic [F, n_params] one (metadata kept, layout replaced)."""
    run = json.loads((run_dir / "run.json").read_text())
    layout = synthetic_layout(n_params)
    gen = torch.Generator().manual_seed(0)
    total = 0
    for b in run["bins"]:
        direction = torch.randn(n_params, generator=gen)
        effect = torch.zeros(n_params) if b["gate"] else 0.5 * torch.randn(n_params, generator=gen)
        noise = None
        for arm in run["arms"]:
            entry = b["stores"][arm["name"]]
            path = run_dir / "arms" / arm["name"] / entry["file"]
            meta = read_store(path).meta
            n_folds = len(meta["fold_sizes"])
            if noise is None or not b["gate"]:  # at the gate both arms get the same sums: the no-op
                noise = 3.0 * torch.randn(n_folds, n_params, generator=gen)
            shift = effect if arm["role"] == "intervention" else 0.0
            sums = (direction + shift) + noise
            entry["sha256"] = write_store(path, sums, {**meta, "layout": layout})
            total += path.stat().st_size
    write_json(run_dir / "run.json", run)
    return total


def evict(paths) -> None:
    """Drop the files from the page cache, so that reading them is a real read from storage."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_reduce(run_dir: Path, stores: list[Path]) -> dict:
    """reduce_run with its store reads counted and its two stages (load, Gram) timed."""
    reads, stage = {}, {}
    original_read_store = reduce_mod.read_store
    original_load, original_grams = reduce_mod.load_run, reduce_mod.grams

    def counting_read_store(path, *args, **kwargs):
        store = original_read_store(path, *args, **kwargs)  # reads the whole file once
        reads.setdefault(str(path), []).append(pathlib.Path(path).stat().st_size)
        return store

    def timing(name, f):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            stage[name] = stage.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    reduce_mod.read_store = counting_read_store
    reduce_mod.load_run, reduce_mod.grams = timing("load", original_load), timing("grams", original_grams)
    evict(stores)
    before, t = proc_io(), time.perf_counter()
    try:
        summary, code = reduce_mod.reduce_run(run_dir)
    finally:
        reduce_mod.read_store = original_read_store
        reduce_mod.load_run, reduce_mod.grams = original_load, original_grams
    seconds, after = time.perf_counter() - t, proc_io()
    per_store = [reads.get(str(p), []) for p in stores]
    return {"seconds": seconds, "exit_code": code, "load_s": stage.get("load"), "grams_s": stage.get("grams"),
            "reads_per_store": sorted({len(r) for r in per_store}), "bytes_per_store": [sum(r) for r in per_store],
            "rchar": after["rchar"] - before["rchar"], "read_bytes": after["read_bytes"] - before["read_bytes"],
            "valid": summary["valid"], "n_effects": len(summary["effects"])}


def check_grams() -> float:
    """grams' same-bin blocks against a full Gram written here (residual subtracted directly), on
    a small synthetic run with three arms, uneven layout and a tiny column chunk. Max relative diff."""
    gen = torch.Generator().manual_seed(1)
    names, n_bins, n_folds, n_params = ["pin_sigma", "native", "native_replicate"], 4, 5, 1000
    layout = [{"name": "a", "offset": 0, "numel": 600, "cond": False}, {"name": "b", "offset": 600, "numel": 300,
              "cond": True}, {"name": "c", "offset": 900, "numel": 100, "cond": False}]
    sums = torch.randn(len(names), n_bins, n_folds, n_params, generator=gen, dtype=torch.float64) + 3
    stores = {(n, b): types.SimpleNamespace(sums=sums[a, b].float(), meta={"layout": layout})
              for a, n in enumerate(names) for b in range(n_bins)}
    run = {"arms": [{"name": n} for n in names], "bins": [{"index": b} for b in range(n_bins)]}
    g, _, _ = reduce_mod.grams(run, stores, chunk_params=7)
    s32 = sums.float().double()
    cond = torch.zeros(n_params, dtype=torch.bool)
    cond[600:900] = True
    views = {"all": s32, "cond": s32[..., cond], "residual": s32 - s32[names.index("native")].mean(0)}
    worst = 0.0
    for e, x in views.items():
        for b in range(n_bins):
            for a1 in range(len(names)):
                for a2 in range(len(names)):
                    want = (x[a1, b] @ x[a2, b].T).numpy()
                    got = g[e][b, a1, :, a2]
                    worst = max(worst, float(abs(got - want).max() / abs(want).max()))
    return worst


def probe_time_per_bin(n_folds: int, reps: int = 3) -> tuple[float, int]:
    """One arm's probe for one bin (40 images x 12 draws) on a DiT with about 10⁶ parameters."""
    gen = torch.Generator().manual_seed(0)
    model = DiTDenoiser(width=128, depth=4, heads=4, mlp_ratio=2, sigma_data=0.6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    names = probe.select_params(model, ["*"])
    images = torch.rand(40, 1, 8, 8, generator=gen) * 2 - 1
    eps = torch.randn(40, 12, 1, 8, 8, generator=gen)
    folds = torch.arange(40) % n_folds
    call = lambda: probe.fold_sums(model, names, images, eps, 0.5, torch.tensor(0.5), folds, n_folds)
    call()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times), sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--folds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="build the run here and keep it (default: a temp dir, removed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = args.keep or Path(tempfile.mkdtemp(prefix="twinrun-bench-reduce-"))
    print(f"twinrun reducer benchmark  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  "
          f"{os.cpu_count()} CPUs  threads={args.threads}  load avg {os.getloadavg()[0]:.1f}")
    print(f"grams self-check: same-bin blocks vs a full Gram written here, max relative diff {check_grams():.1e}")
    try:
        t = time.perf_counter()
        run_dir = make_run(root, args.folds)
        total = rewrite_stores(run_dir, args.params)
        run = json.loads((run_dir / "run.json").read_text())
        stores = [run_dir / "arms" / a["name"] / b["stores"][a["name"]]["file"] for b in run["bins"] for a in run["arms"]]
        print(f"stores: {len(stores)} ({len(run['arms'])} arms x {len(run['bins'])} bins), F={args.folds}, "
              f"P={args.params}: {total / 1e9:.2f} GB, {total / len(stores) / 1e6:.1f} MB each "
              f"(built in {time.perf_counter() - t:.0f} s)\n")

        rss0 = peak_rss_mb()
        r = timed_reduce(run_dir, stores)
        size = total / len(stores)
        print(f"reduce_run: {r['seconds']:.1f} s (exit code {r['exit_code']}, valid={r['valid']}, "
              f"{r['n_effects']} effects)")
        print(f"  load + sha256 + checks: {r['load_s']:.1f} s;  Gram pass (grams): {r['grams_s']:.1f} s;  "
              f"the rest (validity, estimator, report): {r['seconds'] - r['load_s'] - r['grams_s']:.1f} s")
        print(f"  reads per store: {r['reads_per_store']} (read_store calls); bytes read per store "
              f"{min(r['bytes_per_store']) / 1e6:.1f}–{max(r['bytes_per_store']) / 1e6:.1f} MB = "
              f"{max(r['bytes_per_store']) / size:.2f} x the file")
        print(f"  /proc/self/io over the reduce: rchar {r['rchar'] / 1e9:.2f} GB, read_bytes (storage, cache evicted "
              f"first) {r['read_bytes'] / 1e9:.2f} GB = {r['read_bytes'] / total:.2f} x the stores")
        print(f"  peak RSS {peak_rss_mb():.0f} MB (before reduce {rss0:.0f} MB; the reducer holds every store's sums, "
              f"{total / 1e9:.2f} GB)\n")

        per_bin, n_probe = probe_time_per_bin(args.folds)
        probe_total = 2 * len(run["bins"]) * per_bin
        print(f"probe at P={n_probe} (DiT width 128, depth 4), F={args.folds}, 40 images x 12 draws: "
              f"{per_bin:.2f} s per arm and bin -> {probe_total:.0f} s for the run's {len(run['bins'])} bins x 2 arms")
        print(f"reduce / probe = {r['seconds'] / probe_total:.3f}  (Gram pass alone {r['grams_s'] / probe_total:.3f})")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
