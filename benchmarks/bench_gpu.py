"""GPU pace of the probe as twinrun runs it: probe / plain backward at the probe's own call size, eager and
compiled, peak GPU memory beside twinrun's estimate, and every method checked against the others.

    python benchmarks/bench_gpu.py --json gpu.json       # on a GPU: DiT-B/2 (P ≈ 1.3e8, 256 tokens) and
                                                         # the P = 7.6 M / 16-token DiT
    python benchmarks/bench_gpu.py --device cpu --cpu-sizes --reps 3   # the CPU-sized variant
    python benchmarks/bench_gpu.py --smoke --json out.json             # seconds, on the CPU (tests run it)

Protocol of issue 13: 40 images x 12 draws, 10 folds, float32, determinism on as a run has it (TF32 off,
deterministic algorithms, and with them Inductor's deterministic mode). What twinrun runs, not a stand-in:
the forward is compiled as the job compiles it (`trial.prepare`: torch.compile with its default dynamic
shapes, so a smaller last chunk recompiles as in a run), the probe is `fold_sums` with its chunking,
and the floor — the plain batched backward over all 480 samples, which gives only the mean gradient —
runs in calls of the probe method's own size (`fold_sums.call_sizes`), through the same forward, with
torch.autograd.grad like the probe (no `.grad` buffers left behind to count as the next one's memory).

Per size and mode it times, interleaved repetition by repetition, the floor and the probe; ratios are
medians of per-repetition ratios. Peak memory is torch's max_memory_allocated above what was allocated
before the call (the model and data), beside the plan-time estimate of that part
(`measures.probe_cost.device_memory`). Every result is checked: folds against vmap (eager), compiled
against eager; a disagreement beyond float32 rounding fails the run (exit 1), after writing the JSON.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from twinrun.config import ProbeConfig
from twinrun.measures import fold_sums as fs
from twinrun.measures import trial
from twinrun.measures.probe import fold_sizes
from twinrun.measures.probe_cost import device_memory
from twinrun.model import DiTDenoiser
from twinrun.objectives import EDM
from twinrun.provenance.determinism import apply_determinism

N_IMAGES, N_DRAWS, N_FOLDS, SIGMA = 40, 12, 10, 0.5
# name -> (architecture, chunk_images, chunk_draws). The chunk bounds one call's batch (memory).
SIZES = {
    "dit_b2_256tok": ({"img_resolution": 32, "img_channels": 4, "patch_size": 2, "width": 768, "depth": 12,
                       "heads": 12, "mlp_ratio": 4}, 8, 6),
    "dit_7.6M_16tok": ({"img_resolution": 8, "img_channels": 1, "patch_size": 2, "width": 256, "depth": 8,
                        "heads": 4, "mlp_ratio": 2}, 40, 6),
}
CPU_SIZES = {  # the same token counts at sizes a shared 2-core CPU finishes in minutes
    "cpu_256tok": ({"img_resolution": 16, "img_channels": 1, "patch_size": 1, "width": 32, "depth": 1,
                    "heads": 2, "mlp_ratio": 4}, 8, 6),
    "cpu_16tok": ({"img_resolution": 8, "img_channels": 1, "patch_size": 2, "width": 64, "depth": 4,
                   "heads": 4, "mlp_ratio": 2}, 40, 6),
}
SMOKE = {"smoke_16tok": ({"img_resolution": 8, "img_channels": 1, "patch_size": 2, "width": 16, "depth": 1,
                          "heads": 2, "mlp_ratio": 2}, 8, 4)}
SMOKE_PROTOCOL = (8, 4, 4)  # images, draws, folds
# float32 rounding of sums of N·D/F per-sample gradients in another summation order (kernels, fusion).
RTOL, ATOL_SCALE = 1e-3, 1e-4


def build(arch: dict, device: torch.device) -> DiTDenoiser:
    """A random DiT, perturbed away from adaLN-Zero's zero init so every parameter has a gradient."""
    model = DiTDenoiser(**arch, sigma_data=0.5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model.to(device)


def inputs(arch: dict, protocol: tuple, device: torch.device):
    n_images, n_draws, n_folds = protocol
    gen = torch.Generator().manual_seed(1)
    shape = (arch["img_channels"], arch["img_resolution"], arch["img_resolution"])
    images = torch.rand((n_images, *shape), generator=gen).to(device) * 2 - 1
    eps = torch.randn((n_images, n_draws, *shape), generator=gen).to(device)
    sizes = torch.tensor(fold_sizes(n_images, n_folds))  # twinrun's contiguous folds
    folds = torch.repeat_interleave(torch.arange(n_folds), sizes).to(device)
    return images, eps, folds


def plain_backward(model, forward, names, images, eps, samples_per_call: int) -> tuple[torch.Tensor, int]:
    """The floor: plain forward + backward over all N·D samples, `samples_per_call` at a time, summed
    into one float32 gradient (the mean gradient's numerator) by autograd.grad, as the probe does.
    Returns the sum and the largest batch a call took."""
    params = dict(model.named_parameters())
    leaves = [params[n] for n in names]
    clean = images.repeat_interleave(eps.shape[1], 0)
    noise = eps.flatten(0, 1)
    weight = float(EDM().weight(model, torch.tensor(SIGMA)))
    total = torch.zeros(sum(p.numel() for p in leaves), device=images.device)
    largest = 0
    for start in range(0, clean.shape[0], samples_per_call):
        x = clean[start : start + samples_per_call]
        largest = max(largest, x.shape[0])
        sig = torch.full((x.shape[0],), SIGMA, device=x.device)
        denoised = forward(x + SIGMA * noise[start : start + samples_per_call], sig, sig)
        loss = weight * (denoised - x).square().flatten(1).mean(1).sum()
        total += torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, leaves)])
    return total, largest


def timed(fns: dict, reps: int, device: torch.device) -> dict:
    """Seconds per call of each function, interleaved, after one warm-up (compiles happen there); peak
    memory above what was allocated before each call; the last call's result."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {k: {"s": [], "peak_gb": None, "warmup_s": None, "result": None} for k in fns}
    for k, f in fns.items():
        sync()
        t = time.perf_counter()
        out[k]["result"] = f()
        sync()
        out[k]["warmup_s"] = time.perf_counter() - t
    for _ in range(reps):
        for k, f in fns.items():
            out[k]["result"] = None  # the previous result is not this call's memory
            if cuda:
                sync()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            sync()
            t = time.perf_counter()
            out[k]["result"] = f()
            sync()
            out[k]["s"].append(time.perf_counter() - t)
            if cuda:
                peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                out[k]["peak_gb"] = max(out[k]["peak_gb"] or 0.0, peak)
    return out


def agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    """How far two fold-sum results are apart, and whether that is float32 rounding."""
    got, want = got.double().cpu(), want.double().cpu()
    scale = want.abs().max().item()
    diff = (got - want).abs()
    ok = bool((diff <= RTOL * want.abs() + ATOL_SCALE * scale).all())
    return {"max_abs_diff_over_max": diff.max().item() / scale, "ok": ok}


def bench_size(name: str, arch: dict, chunk_images: int, chunk_draws: int, device, reps: int, modes,
               protocol: tuple) -> list:
    model = build(arch, device)
    images, eps, folds = inputs(arch, protocol, device)
    n_images, n_draws, n_folds = protocol
    names = fs.select_params(model, ["*"])
    n_params = sum(p.numel() for p in model.parameters())
    tokens = (arch["img_resolution"] // arch["patch_size"]) ** 2
    sigma_cond = torch.tensor(SIGMA, device=device)
    p = ProbeConfig(n_images=n_images, n_draws=n_draws, n_folds=n_folds, chunk_images=chunk_images,
                    chunk_draws=chunk_draws)
    saved = fs.saved_bytes_per_sample(model, images, SIGMA)
    results, rows = {}, []
    for mode in modes:
        compile_mode = None if mode == "eager" else trial.compile_mode(mode)
        for method in (["vmap", "folds"] if mode == "eager" else ["folds"]):  # torch.compile: folds only
            forward = trial.prepare(model, names, method, compile_mode)  # as the job's trial prepares it
            calls, samples = fs.call_sizes(folds.tolist(), n_folds, chunk_images, chunk_draws, n_draws,
                                           method)

            def probe_call(fw=forward, m=method):
                return fs.fold_sums(model, names, images, eps, SIGMA, sigma_cond, folds, n_folds,
                                    chunk_images, chunk_draws, method=m, forward=fw if m == "folds" else None)

            def floor_call(fw=forward, s=samples):
                return plain_backward(model, fw, names, images, eps, s)

            row = {"size": name, "params": n_params, "tokens": tokens, "mode": mode, "method": method,
                   "samples_per_call": samples, "groups_per_call": calls}  # the probe's largest call
            try:
                t = timed({"floor": floor_call, "probe": probe_call}, reps, device)
            except Exception as err:  # noqa: BLE001 — Inductor's deterministic mode may refuse: a run says so
                cause = trial.determinism_cause(err)
                said = cause or f"{type(err).__name__}: {trial.first_line(err)}"
                row.update(refused=said, ok=cause is not None)  # a refusal a run would name is no failure
                rows.append(row)
                verdict = "REFUSED" if cause else "FAILED"
                print(f"{name:>15} {mode:>12} {method:>5}: {verdict}: {said}", flush=True)
                continue
            sums = t["probe"]["result"]
            results[mode, method] = sums
            # Folds against vmap (eager), compiled against eager folds.
            against = ("eager vmap" if (mode, method) == ("eager", "folds")
                       else "eager folds" if mode != "eager" else None)
            want = None if against is None else results.get(tuple(against.split()))
            check = {"max_abs_diff_over_max": None, "ok": True} if want is None else agreement(sums, want)
            estimate = device_memory(p, model, n_params, images, folds.tolist(), method, saved)
            ratios = [a / b for a, b in zip(t["probe"]["s"], t["floor"]["s"])]
            row.update({
                "probe_ms": 1e3 * statistics.median(t["probe"]["s"]),
                "floor_ms": 1e3 * statistics.median(t["floor"]["s"]), "ratio": statistics.median(ratios),
                "floor_samples_per_call": t["floor"]["result"][1],
                "peak_gb_probe": t["probe"]["peak_gb"], "peak_gb_floor": t["floor"]["peak_gb"],
                "estimate_gb": (estimate.total - estimate.model - estimate.data) / 2**30,
                "warmup_s": t["probe"]["warmup_s"], "floor_warmup_s": t["floor"]["warmup_s"],
                "checked_against": None if want is None else against,
                **check,
            })
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    peak = "" if r["peak_gb_probe"] is None else (f", peak {r['peak_gb_probe']:.2f} GB (estimate "
                                                  f"{r['estimate_gb']:.2f}) / floor {r['peak_gb_floor']:.2f}")
    checked = "" if r["checked_against"] is None else (
        f"; vs {r['checked_against']} {r['max_abs_diff_over_max']:.1e} {'ok' if r['ok'] else 'DIFFER'}")
    return (f"{r['size']:>15} P={r['params'] / 1e6:7.2f}M T={r['tokens']:3d} {r['mode']:>12} "
            f"{r['method']:>5} ({r['samples_per_call']} samples/call): probe {r['probe_ms']:9.1f} ms, floor "
            f"{r['floor_ms']:9.1f} ms, ratio {r['ratio']:.2f}x{peak} (first call {r['warmup_s']:.1f} s)"
            f"{checked}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default=None, help="comma-separated names (default: all of the chosen set)")
    ap.add_argument("--cpu-sizes", action="store_true", help="the CPU-sized variant of both sizes")
    ap.add_argument("--modes", default="eager,default", help="eager and/or torch.compile modes")
    ap.add_argument("--determinism", choices=("on", "off"), default="on", help="as a run: on (the default)")
    ap.add_argument("--compile-cache-dir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, eager, one repetition")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.reps, args.modes = "cpu", 1, "eager"
    cache = args.compile_cache_dir or tempfile.mkdtemp(prefix="twinrun-bench-compile-")
    # First, before CUDA work and torch.compile: TF32 off, deterministic algorithms, caches moved.
    apply_determinism(args.determinism == "on", cache)
    device = torch.device(args.device)
    sizes = SMOKE if args.smoke else CPU_SIZES if args.cpu_sizes else SIZES
    protocol = SMOKE_PROTOCOL if args.smoke else (N_IMAGES, N_DRAWS, N_FOLDS)
    chosen = args.sizes.split(",") if args.sizes else list(sizes)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {hardware}, threads "
          f"{torch.get_num_threads()}, determinism {args.determinism}, compile cache {cache}", flush=True)
    rows, t0 = [], time.perf_counter()
    for name in chosen:
        arch, chunk_images, chunk_draws = sizes[name]
        rows += bench_size(name, arch, chunk_images, chunk_draws, device, args.reps, args.modes.split(","),
                           protocol)
        if args.json:  # after each size: a run cut short by its timeout keeps what it measured
            write(args.json, hardware, args, rows)
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"FAILED: {r['size']} {r['mode']} {r['method']}: "
              f"{r.get('refused') or 'differs from ' + str(r['checked_against'])}", file=sys.stderr)
    return 1 if failed else 0


def write(path: str, hardware: str, args, rows: list) -> None:
    with open(path, "w") as f:
        json.dump({"hardware": hardware, "torch": torch.__version__, "cuda": torch.version.cuda,
                   "determinism": args.determinism, "modes": args.modes, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
