"""Probe speed and memory, side by side in one run on the same model and inputs.

    python benchmarks/bench_probe.py [--threads 2] [--reps 5] [--chunks] [--no-e2e]
    python benchmarks/bench_probe.py --width 128 --depth 4 [--folds 40] --speed-only   # P ≈ 10⁶
    python benchmarks/bench_probe.py --smoke     # every section at toy sizes, one repetition (a test runs it)

Prints: the per-sample loop, twinrun's probe and the plain batched backward (the floor: it gives only
the overall mean gradient, not fold sums) with the ratios between them; the pair/arm ratio; peak RSS
at 12, 48 and 192 draws per image (each in a fresh subprocess); the probe's achieved fraction of this
machine's measured float32 matmul throughput; and the whole default `python -m twinrun
+experiment=pin_sigma` run, end to end. `--chunks` adds the chunk sweep that chose the default.

Timings interleave the methods repetition by repetition and report medians (and the median of the
per-repetition ratios), because the machine is shared and its load drifts.
"""

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from twinrun import draws
from twinrun.config import ProbeConfig
from twinrun.data import load_heldout_images
from twinrun.interventions import Native, PinSigma
from twinrun.measures import fold_sums as probe
from twinrun.measures.probe import fold_sizes
from twinrun.model import DEFAULT_ARCH, DEFAULT_WEIGHTS_PATH, DiTDenoiser, load_pretrained
from twinrun.objectives import EDM

N_IMAGES, N_DRAWS, N_FOLDS = 40, 12, 10  # the first default probe (today: conf/probe/default.yaml)
SIGMA, SIGMA_PIN, SEED = 0.5, 1.2, 0  # a bin of the default grid; σ_pin off the gate, so the arms differ
RSS_DRAWS = (12, 48, 192)
CHUNK_DRAWS = (12, 48)  # draws of the chunk sweep
# (images, draws) per call of the chunk sweep
CHUNK_SETTINGS = [(-1, -1), (-1, 12), (-1, 6), (-1, 3), (20, 12), (8, 12), (4, 12)]
RSS_CHUNKS = ((40, 12), (40, 6), (40, 3))
STRADDLING_CHUNK_DRAWS = 6  # the former default: at 8 draws its chunks straddle the receipt's halves (k1 = 4)
JOB_REPS = 2  # repetitions of the job section per --reps
MATMUL_N = 2048
RUN_OVERRIDES = ["+experiment=pin_sigma"]  # the job and end-to-end sections: the default run
# --smoke: every section at toy sizes, so the benchmark cannot rot between full runs (figures meaningless).
SMOKE = {"N_IMAGES": 8, "N_DRAWS": 2, "N_FOLDS": 4, "RSS_DRAWS": (2, 4), "CHUNK_DRAWS": (2,), "JOB_REPS": 1,
         "CHUNK_SETTINGS": [(-1, -1), (4, 12)], "RSS_CHUNKS": ((40, 6),),
         "MATMUL_N": 256, "RUN_OVERRIDES": ["+experiment=pin_sigma", "probe.n_images=8", "probe.n_draws=2",
                                            "probe.n_folds=4", "sigma_grid.sigmas=[0.2,0.5,1.2]"]}
_SYNC = {"fn": lambda: None}  # torch.cuda.synchronize when timing on a GPU (--device cuda)


# ----------------------------------------------------------------------------- setup


def load_model(arch: dict | None = None) -> tuple[torch.nn.Module, str]:
    """The committed default model; or a random one (another size, or until the weights exist),
    perturbed away from adaLN-Zero's zero init so that every parameter has a gradient."""
    arch = {**DEFAULT_ARCH, **(arch or {})}
    if arch == DEFAULT_ARCH and DEFAULT_WEIGHTS_PATH.is_file():
        return load_pretrained(), f"committed weights {DEFAULT_WEIGHTS_PATH.name}"
    gen = torch.Generator().manual_seed(0)
    model = DiTDenoiser(**arch, sigma_data=0.6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model.eval(), "random init, perturbed"


def setup(n_draws: int | None = None, n_folds: int | None = None, model=None):
    n_draws, n_folds = n_draws or N_DRAWS, n_folds or N_FOLDS  # (read at call time: --smoke changes them)
    model = model or load_model()[0]
    images_all, ids_all = load_heldout_images()
    images, ids = images_all[:N_IMAGES], ids_all[:N_IMAGES]
    eps = draws.noise(SEED, SIGMA, ids, n_draws, tuple(images.shape[1:]))
    sizes = fold_sizes(N_IMAGES, n_folds)
    fold_of_image = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    names = probe.select_params(model, ["*"])
    return model, names, images, ids, eps, fold_of_image


# ----------------------------------------------------------------------------- the three methods


def per_sample_loop(model, names, images, eps, fold_of_image) -> torch.Tensor:
    """The loop researchers write first: one forward and backward per (image, draw)."""
    params = dict(model.named_parameters())
    lam = float(EDM().weight(model, torch.tensor(SIGMA)))
    sums = torch.zeros(int(fold_of_image.max()) + 1, sum(params[n].numel() for n in names),
                       dtype=torch.float64, device=images.device)
    sig = torch.tensor([SIGMA], device=images.device)
    for i in range(images.shape[0]):
        for d in range(eps.shape[1]):
            model.zero_grad(set_to_none=True)
            x = images[i : i + 1]
            loss = lam * (model(x + SIGMA * eps[i, d : d + 1], sig, sig) - x).square().mean()
            loss.backward()
            sums[fold_of_image[i]] += torch.cat([params[n].grad.flatten() for n in names]).double()
    return sums.float()


def twinrun_probe(model, names, images, eps, fold_of_image, sigma_cond=SIGMA, **chunks) -> torch.Tensor:
    return probe.fold_sums(model, names, images, eps, SIGMA, torch.tensor(sigma_cond, device=images.device),
                           fold_of_image, int(fold_of_image.max()) + 1, **chunks)


def batched_backward(model, names, images, eps, fold_of_image) -> None:
    """The floor: one plain forward and backward over all N·D samples (overall mean gradient only)."""
    n, d = eps.shape[:2]
    clean = images.repeat_interleave(d, 0)
    sig = torch.full((n * d,), SIGMA, device=images.device)
    loss = (EDM().weight(model, sig)
            * (model(clean + SIGMA * eps.flatten(0, 1), sig, sig) - clean).square().flatten(1).mean(1)).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()


def interleaved(fns: dict, reps: int) -> dict:
    """Wall-clock seconds of each function, repetition by repetition in turn (after one warm-up)."""
    for f in fns.values():
        f()
    out = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            _SYNC["fn"]()
            t = time.perf_counter()
            f()
            _SYNC["fn"]()
            out[k].append(time.perf_counter() - t)
    return out


def med(xs) -> float:
    return statistics.median(xs)


def ratio(a, b) -> float:
    """Median over repetitions of a[i] / b[i]: robust to load drifting between repetitions."""
    return med([x / y for x, y in zip(a, b)])


# ----------------------------------------------------------------------------- sections


def speed(args, model, names, images, ids, eps, fold_of_image) -> dict:
    """The loop alone (it is 20x slower: a few repetitions), then the probe and the floor interleaved
    (many repetitions: their ratio is the tight target)."""
    inputs = (model, names, images, eps, fold_of_image)
    loop = per_sample_loop(*inputs)
    fast = twinrun_probe(*inputs)
    err = float((fast - loop).abs().max() / loop.abs().max())
    loop_t = [_timed(lambda: per_sample_loop(*inputs)) for _ in range(max(2, args.reps // 2))]
    t = interleaved({"probe": lambda: twinrun_probe(*inputs), "floor": lambda: batched_backward(*inputs)},
                    4 * args.reps)
    return {"loop_s": med(loop_t), "probe_s": med(t["probe"]), "floor_s": med(t["floor"]),
            "loop_over_probe": med(loop_t) / med(t["probe"]),
            "probe_over_floor": ratio(t["probe"], t["floor"]),
            "min_probe_over_floor": min(t["probe"]) / min(t["floor"]), "max_rel_err_vs_loop": err}


def pair_vs_arm(args, model, names, images, ids, eps, fold_of_image) -> dict:
    """One bin as the job measures it: draws once, then each arm's probe (and its draws digest)."""
    shape = tuple(images.shape[1:])
    sigma = torch.tensor(SIGMA, dtype=torch.float32)
    native, pinned = Native().sigma_cond(sigma), PinSigma(SIGMA_PIN).sigma_cond(sigma)

    def bin_of(arms):
        e = draws.noise(SEED, SIGMA, ids, N_DRAWS, shape)
        for sigma_cond in arms:
            draws.digest(e, SIGMA)
            probe.fold_sums(model, names, images, e, SIGMA, sigma_cond, fold_of_image,
                            int(fold_of_image.max()) + 1)

    t = interleaved({"arm": lambda: bin_of([native]), "pair": lambda: bin_of([native, pinned]),
                     "draws": lambda: draws.noise(SEED, SIGMA, ids, N_DRAWS, shape)}, args.reps * 2)
    return {"arm_s": med(t["arm"]), "pair_s": med(t["pair"]), "draws_s": med(t["draws"]),
            "pair_over_arm": ratio(t["pair"], t["arm"])}


def pairing_cost(args, model, names) -> dict:
    """The pairing receipt's price at the default protocol (ProbeConfig: its draws and chunking): the fold
    sums alone against the fold sums with the second half of the draws summed apart (second_from=k1, what
    every bin pays for the receipt), interleaved; at the default chunk_draws (it divides k1: no second
    differentiation) and at STRADDLING_CHUNK_DRAWS (a chunk across k1 is differentiated once more)."""
    d = ProbeConfig()
    n_images = d.n_images if not args.smoke else N_IMAGES
    images_all, ids_all = load_heldout_images()
    images, ids = images_all[:n_images], ids_all[:n_images]
    eps = draws.noise(SEED, SIGMA, ids, d.n_draws, tuple(images.shape[1:]))
    sizes = fold_sizes(n_images, d.n_folds if not args.smoke else N_FOLDS)
    fold_of_image = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    k1 = probe.half_draws(d.n_draws)[0]
    out = {"n_images": n_images, "n_draws": d.n_draws, "k1": k1, "rows": []}
    for chunk_draws in dict.fromkeys((d.chunk_draws, STRADDLING_CHUNK_DRAWS)):
        chunks = {"chunk_images": d.chunk_images, "chunk_draws": chunk_draws}

        def sums(second_from, chunks=chunks):
            return probe.fold_sums(model, names, images, eps, SIGMA, torch.tensor(SIGMA), fold_of_image,
                                   len(sizes), second_from=second_from, **chunks)

        t = interleaved({"sums": lambda: sums(None), "receipt": lambda: sums(k1)}, 2 * args.reps)
        out["rows"].append({"chunk_draws": chunk_draws, "default": chunk_draws == d.chunk_draws,
                            "sums_s": med(t["sums"]),
                            "receipt_s": med(t["receipt"]), "ratio": ratio(t["receipt"], t["sums"])})
    return out


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that over from the
    parent across fork and exec, so a child would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_child(n_draws: int, chunks: dict) -> None:
    """In a fresh process: peak RSS (MB) after setup, and after one probe at n_draws per image."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, names, images, _, eps, fold_of_image = setup(n_draws)
    before = peak_rss_mb()
    t = time.perf_counter()
    twinrun_probe(model, names, images, eps, fold_of_image, **chunks)
    seconds = time.perf_counter() - t
    print(json.dumps({"n_draws": n_draws, "setup_mb": before, "peak_mb": peak_rss_mb(), "probe_s": seconds}))


def peak_memory(args, chunks: tuple = ()) -> list[dict]:
    """Peak RSS at each of RSS_DRAWS, each in a fresh process; chunks = (chunk_images, chunk_draws)."""
    rows = []
    extra = ["--chunk-images", str(chunks[0]), "--chunk-draws", str(chunks[1])] if chunks else []
    for d in RSS_DRAWS:
        out = subprocess.run([sys.executable, __file__, "--rss-child", str(d), *extra, *_smoke(args)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "BENCH_THREADS": str(args.threads)})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def job_child(reps: int) -> None:
    """In a fresh process: twinrun's own job (job.run_job: determinism, fingerprint, sentinel, model,
    data, then every bin of the default run) with the native arm alone vs with both arms."""
    from hydra import compose, initialize_config_dir

    from twinrun.app import CONF_DIR
    from twinrun.config import register_configs
    from twinrun.job import _measure, run_job
    from twinrun.plan import load_arms, plan_run
    from twinrun.storage.rundir import RunIndex

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=RUN_OVERRIDES)
    with tempfile.TemporaryDirectory(prefix="twinrun-bench-") as tmp:
        template = Path(tmp) / "template"
        plan_run(cfg, template)
        counter = iter(range(10**6))

        def job(arms: str):
            run_dir = Path(tmp) / f"{arms}{next(counter)}"
            shutil.copytree(template, run_dir)
            with contextlib.redirect_stdout(io.StringIO()):
                if arms == "arm":
                    # The native arm alone: the job's own steps, measuring the twin only. (A run.json
                    # without its intervention arm is no run: the index refuses one without both roles.)
                    index = RunIndex.load(run_dir)
                    _measure(index, [a for a in load_arms(index) if a.role == "twin"], None)
                else:
                    run_job(run_dir)
            shutil.rmtree(run_dir)

        t = interleaved({"arm": lambda: job("arm"), "pair": lambda: job("pair")}, reps)
    print(json.dumps({"arm_s": med(t["arm"]), "pair_s": med(t["pair"]),
                      "pair_over_arm": ratio(t["pair"], t["arm"]), "bins": len(cfg.sigma_grid.sigmas)}))


def job_pair_vs_arm(args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--job-child", str(JOB_REPS * args.reps), *_smoke(args)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "BENCH_THREADS": str(args.threads)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _smoke(args) -> list[str]:
    return ["--smoke"] if args.smoke else []


def matmul_throughput(n: int | None = None, reps: int = 5) -> float:
    """FLOP/s of a large float32 matmul on this machine, best of reps."""
    n = n or MATMUL_N
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best


def _timed(f) -> float:
    _SYNC["fn"]()
    t = time.perf_counter()
    f()
    _SYNC["fn"]()
    return time.perf_counter() - t


def probe_flops(model, names, images, eps, fold_of_image) -> int:
    """Matmul FLOPs of one probe call (torch's flop counter sees the batched matmuls under vmap)."""
    with FlopCounterMode(display=False) as counter:
        twinrun_probe(model, names, images, eps, fold_of_image)
    return counter.get_total_flops()


def chunk_sweep(args, model, names, images, ids, eps, fold_of_image) -> list[dict]:
    """Time per bin and per sample at several chunk shapes (12 and 48 draws), interleaved."""
    settings = CHUNK_SETTINGS
    rows = []
    for d in CHUNK_DRAWS:
        e = draws.noise(SEED, SIGMA, ids, d, tuple(images.shape[1:]))
        fns = {s: (lambda s=s, e=e: twinrun_probe(model, names, images, e, fold_of_image, chunk_images=s[0],
                                                  chunk_draws=s[1])) for s in settings}
        fns["floor"] = lambda e=e: batched_backward(model, names, images, e, fold_of_image)
        t = interleaved(fns, args.reps)
        for s in settings:
            per_call = (images.shape[0] if s[0] < 1 else s[0]) * (d if s[1] < 1 else min(s[1], d))
            rows.append({"n_draws": d, "chunk_images": s[0], "chunk_draws": s[1],
                         "samples_per_call": per_call, "probe_s": med(t[s]),
                         "over_floor": ratio(t[s], t["floor"])})
    return rows


def end_to_end() -> dict:
    """The whole default run, as a user types it, into a temporary run directory."""
    tmp = Path(tempfile.mkdtemp(prefix="twinrun-bench-"))
    run_dir = tmp / "run"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "twinrun", *RUN_OVERRIDES, f"hydra.run.dir={run_dir}"],
                          cwd=tmp, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t
    size = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    bins = [line for line in proc.stdout.splitlines() if line.startswith("bin ")]
    shutil.rmtree(tmp, ignore_errors=True)
    return {"seconds": seconds, "exit_code": proc.returncode, "run_dir_mb": size / 1e6, "bin_lines": bins,
            "stderr_tail": proc.stderr.strip().splitlines()[-3:] if proc.returncode not in (0, 1) else []}


# ----------------------------------------------------------------------------- report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="repetitions per timing (medians reported)")
    ap.add_argument("--chunks", action="store_true", help="also sweep chunk shapes (chose the default)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end default run")
    ap.add_argument("--width", type=int, default=DEFAULT_ARCH["width"],
                    help="model width (default: the default model)")
    ap.add_argument("--depth", type=int, default=DEFAULT_ARCH["depth"])
    ap.add_argument("--folds", type=int, default=N_FOLDS)
    ap.add_argument("--speed-only", action="store_true",
                    help="only the speed section (e.g. for a larger model)")
    ap.add_argument("--device", default="cpu",
                    help="device for the speed section (cuda: implies --speed-only)")
    ap.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-images", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-draws", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--job-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="every section at toy sizes, one repetition")
    args = ap.parse_args()
    if args.smoke:
        globals().update(SMOKE)
        args.reps, args.folds, args.chunks = 1, min(args.folds, SMOKE["N_FOLDS"]), True
    if args.rss_child is not None:
        chunks = {} if args.chunk_images is None else {"chunk_images": args.chunk_images,
                                                        "chunk_draws": args.chunk_draws}
        return rss_child(args.rss_child, chunks)
    if args.job_child is not None:
        return job_child(args.job_child)

    torch.set_num_threads(args.threads)
    model, model_desc = load_model({"width": args.width, "depth": args.depth})
    inputs = setup(n_folds=args.folds, model=model)
    device = torch.device(args.device)
    if device.type != "cpu":  # the other sections measure CPU RSS and the CPU end-to-end run
        args.speed_only = True
        if device.type == "cuda":
            _SYNC["fn"] = torch.cuda.synchronize
        inputs = tuple(x.to(device) if isinstance(x, (torch.Tensor, torch.nn.Module)) else x for x in inputs)
    model, names, images, _, eps, fold_of_image = inputs
    n_params = sum(p.numel() for n, p in model.named_parameters() if n in names)
    print(f"twinrun probe benchmark  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  "
          f"{platform.machine()} {os.cpu_count()} CPUs  threads={args.threads}  "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"model: DiT {model.arch}, {n_params} probed parameters, {model_desc}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"inputs: {N_IMAGES} images x {N_DRAWS} draws = {N_IMAGES * N_DRAWS} samples per bin, "
          f"{args.folds} folds, σ={SIGMA}; medians of interleaved repetitions "
          f"(probe vs floor: {4 * args.reps})\n")

    s = speed(args, *inputs)
    print("speed, one bin and arm:")
    print(f"  per-sample loop            {s['loop_s'] * 1e3:8.1f} ms")
    print(f"  twinrun probe (fold sums)  {s['probe_s'] * 1e3:8.1f} ms   max |Δ| vs loop = "
          f"{s['max_rel_err_vs_loop']:.1e} of max |sum|")
    print(f"  plain batched backward     {s['floor_s'] * 1e3:8.1f} ms   (floor: mean gradient only)")
    print(f"  loop / probe   = {s['loop_over_probe']:6.1f} x   (target ≥ 8)")
    print(f"  probe / floor  = {s['probe_over_floor']:6.2f} x   (target ≤ 1.4; ratio of best times "
          f"{s['min_probe_over_floor']:.2f})\n")
    if args.speed_only:
        return

    p = pair_vs_arm(args, *inputs)
    j = job_pair_vs_arm(args)
    print("twin cost (target: pair ≤ 1.9 x one arm alone):")
    print(f"  one bin: draws once ({p['draws_s'] * 1e3:.1f} ms) + each arm's digest and probe: one arm "
          f"{p['arm_s'] * 1e3:.1f} ms, pair {p['pair_s'] * 1e3:.1f} ms   "
          f"pair / arm = {p['pair_over_arm']:.2f}")
    print(f"  one job (job.run_job, {j['bins']} bins, stores written; model, data, determinism, fingerprint "
          f"and sentinel once): one arm {j['arm_s']:.2f} s, pair {j['pair_s']:.2f} s   pair / arm = "
          f"{j['pair_over_arm']:.2f}\n")

    c = pairing_cost(args, model, names)
    print(f"pairing receipt (the second half of the draws summed apart, k1 = {c['k1']} of {c['n_draws']} "
          f"draws; {c['n_images']} images in chunks of {ProbeConfig().chunk_images}):")
    for r in c["rows"]:
        print(f"  chunk_draws {r['chunk_draws']}{' (default)' if r['default'] else ''}: fold sums "
              f"{r['sums_s'] * 1e3:.1f} ms, with the receipt {r['receipt_s'] * 1e3:.1f} ms   "
              f"receipt / sums = {r['ratio']:.2f}")
    print()

    rows = peak_memory(args)
    base = rows[0]["peak_mb"]
    print("peak RSS, one probe call in a fresh process (setup = after imports, model, data and draws):")
    for r in rows:
        print(f"  {r['n_draws']:4d} draws/image: peak {r['peak_mb']:7.1f} MB  (setup {r['setup_mb']:.1f} MB, "
              f"probe {r['probe_s']:.2f} s)   vs 12 draws: {100 * (r['peak_mb'] / base - 1):+.1f}%   "
              "(target ≤ +10%)")
    print()

    peak = matmul_throughput()
    flops = probe_flops(model, names, images, eps, fold_of_image)
    achieved = flops / s["probe_s"]
    print(f"throughput: float32 matmul 2048² peak {peak / 1e9:.1f} GFLOP/s; probe {flops / 1e9:.2f} GFLOP "
          f"(matmuls) in {s['probe_s'] * 1e3:.1f} ms = {achieved / 1e9:.1f} GFLOP/s = "
          f"{100 * achieved / peak:.0f}% of peak (floor: {100 * flops / s['floor_s'] / peak:.0f}%)\n")

    if args.chunks:
        print("chunk sweep (probe time per bin; over floor = probe / plain backward at the same draws):")
        for r in chunk_sweep(args, *inputs):
            print(f"  draws {r['n_draws']:3d}  chunk_images {r['chunk_images']:3d}  "
                  f"chunk_draws {r['chunk_draws']:3d}  samples/call {r['samples_per_call']:5d}  "
                  f"{r['probe_s'] * 1e3:8.1f} ms  over floor {r['over_floor']:.2f}")
        print("peak RSS by chunk (fresh process, one probe call; MB at " + ", ".join(map(str, RSS_DRAWS))
              + " draws):")
        for chunks in RSS_CHUNKS:
            rows = peak_memory(args, chunks)
            print(f"  chunk {chunks[0]} images x {chunks[1]} draws: "
                  + ", ".join(f"{r['peak_mb']:.0f}" for r in rows)
                  + f"   192 vs 12 draws: {100 * (rows[-1]['peak_mb'] / rows[0]['peak_mb'] - 1):+.1f}%")
        print()

    if not args.no_e2e:
        e = end_to_end()
        print(f"end to end: `python -m twinrun +experiment=pin_sigma` took {e['seconds']:.1f} s "
              f"(target < 30 s), exit code {e['exit_code']}, run directory {e['run_dir_mb']:.1f} MB")
        for line in e["bin_lines"]:
            print(f"  {line}")
        for line in e["stderr_tail"]:
            print(f"  stderr: {line}")


if __name__ == "__main__":
    main()
