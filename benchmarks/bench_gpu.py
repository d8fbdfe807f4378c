"""GPU pace of the probe: probe / plain batched backward, eager and compiled, with peak GPU memory.

    python benchmarks/bench_gpu.py                       # on a GPU: DiT-B/2 (P ≈ 1.3e8, 256 tokens) and the
                                                         # P = 7.6 M / 16-token DiT; < 8 min on an H100/H200
    python benchmarks/bench_gpu.py --device cpu --cpu-sizes --reps 3   # the CPU-sized variant
    python benchmarks/bench_gpu.py --json out.json       # also write the figures as JSON
    python benchmarks/bench_gpu.py --smoke               # a toy DiT on the CPU, eager, one repetition
                                                         # (a test runs it; compiling is not smoked)

Protocol of issue 13: 40 images x 12 draws, 10 folds, float32 (determinism on: TF32 off, deterministic
algorithms). Per size and mode it times, interleaved repetition by repetition, the plain batched
backward over all 480 samples (the floor: it gives only the mean gradient) in calls of the probe's
chunk, and twinrun's probe under each method (`vmap` runs eager only: torch.compile runs under
`folds`). Ratios are medians of per-repetition ratios. Peak GPU memory is torch's
max_memory_allocated over each method's runs.

Imports only torch and twinrun modules that need no Hydra/OmegaConf/submitit, so it runs on a bare
GPU image with `PYTHONPATH=.` from a checkout.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch

from twinrun.measures import fold_sums as probe
from twinrun.model import DiTDenoiser
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
SMOKE_SIZES = {"smoke_16tok": ({"img_resolution": 8, "img_channels": 1, "patch_size": 2, "width": 16,
                                "depth": 1, "heads": 2, "mlp_ratio": 2}, 4, 2)}


def build(arch: dict, device: torch.device) -> DiTDenoiser:
    """A random DiT, perturbed away from adaLN-Zero's zero init so every parameter has a gradient."""
    model = DiTDenoiser(**arch, sigma_data=0.5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model.to(device)


def inputs(arch: dict, device: torch.device):
    gen = torch.Generator().manual_seed(1)
    shape = (arch["img_channels"], arch["img_resolution"], arch["img_resolution"])
    images = torch.rand((N_IMAGES, *shape), generator=gen).to(device) * 2 - 1
    eps = torch.randn((N_IMAGES, N_DRAWS, *shape), generator=gen).to(device)
    folds = torch.arange(N_FOLDS).repeat_interleave(N_IMAGES // N_FOLDS).to(device)
    return images, eps, folds


def plain_backward(model, forward, images, eps, samples_per_call: int) -> None:
    """The floor: plain forward + backward over all N·D samples, `samples_per_call` at a time."""
    clean = images.repeat_interleave(eps.shape[1], 0)
    noise = eps.flatten(0, 1)
    weight = float(probe.edm_weight(torch.tensor(SIGMA), model.sigma_data))
    model.zero_grad(set_to_none=True)
    for start in range(0, clean.shape[0], samples_per_call):
        x = clean[start : start + samples_per_call]
        sig = torch.full((x.shape[0],), SIGMA, device=x.device)
        loss = weight * (forward(x + SIGMA * noise[start : start + samples_per_call], sig, sig) - x).square()
        loss.flatten(1).mean(1).sum().backward()


def timed(fns: dict, reps: int, sync) -> dict:
    """Seconds per call of each function, interleaved, after one warm-up (compiles happen there)."""
    out = {k: {"s": [], "peak_gb": None, "warmup_s": None} for k in fns}
    for k, f in fns.items():
        sync()
        t = time.perf_counter()
        f()
        sync()
        out[k]["warmup_s"] = time.perf_counter() - t
    for _ in range(reps):
        for k, f in fns.items():
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            f()
            sync()
            out[k]["s"].append(time.perf_counter() - t)
            if torch.cuda.is_available():
                out[k]["peak_gb"] = max(out[k]["peak_gb"] or 0, torch.cuda.max_memory_allocated() / 2**30)
    return out


def bench_size(name: str, arch: dict, chunk_images: int, chunk_draws: int, device, reps: int, modes) -> list:
    model = build(arch, device)
    images, eps, folds = inputs(arch, device)
    names = probe.select_params(model, ["*"])
    n_params = sum(p.numel() for p in model.parameters())
    tokens = (arch["img_resolution"] // arch["patch_size"]) ** 2
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sigma_cond = torch.tensor(SIGMA, device=device)
    call = {"chunk_images": chunk_images, "chunk_draws": chunk_draws}
    rows = []
    for mode in modes:
        # Static shapes: the floor's and the probe's calls each get their own specialised graph.
        forward = model if mode == "eager" else torch.compile(model, mode=mode, dynamic=False)
        fns = {
            "floor": lambda fw=forward: plain_backward(model, fw, images, eps, chunk_images * chunk_draws),
            "folds": lambda fw=forward: probe.fold_sums(model, names, images, eps, SIGMA, sigma_cond, folds,
                                                        N_FOLDS, **call, method="folds", forward=fw),
        }
        if mode == "eager":
            fns["vmap"] = lambda: probe.fold_sums(model, names, images, eps, SIGMA, sigma_cond, folds,
                                                  N_FOLDS, **call, method="vmap")
        t = timed(fns, reps, sync)
        for method in [m for m in ("vmap", "folds") if m in t]:
            ratios = [a / b for a, b in zip(t[method]["s"], t["floor"]["s"])]
            rows.append({
                "size": name, "params": n_params, "tokens": tokens, "mode": mode, "method": method,
                "probe_ms": 1e3 * statistics.median(t[method]["s"]),
                "floor_ms": 1e3 * statistics.median(t["floor"]["s"]),
                "ratio": statistics.median(ratios), "peak_gb_probe": t[method]["peak_gb"],
                "peak_gb_floor": t["floor"]["peak_gb"], "warmup_s": t[method]["warmup_s"],
                "floor_warmup_s": t["floor"]["warmup_s"],
            })
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    peak = ("" if r["peak_gb_probe"] is None
            else f", peak {r['peak_gb_probe']:.1f} / {r['peak_gb_floor']:.1f} GB")
    return (f"{r['size']:>15} P={r['params'] / 1e6:7.2f}M T={r['tokens']:3d} {r['mode']:>8} "
            f"{r['method']:>5}: probe {r['probe_ms']:9.1f} ms, floor {r['floor_ms']:9.1f} ms, "
            f"ratio {r['ratio']:.2f}x{peak} (first call {r['warmup_s']:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default=None, help="comma-separated names (default: all of the chosen set)")
    ap.add_argument("--cpu-sizes", action="store_true", help="the CPU-sized variant of both sizes")
    ap.add_argument("--modes", default="eager,default", help="eager and/or torch.compile modes")
    ap.add_argument("--compile-cache-dir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="a toy DiT on the CPU, eager, 8 images x 2 draws")
    args = ap.parse_args()
    if args.smoke:  # every step at toy size, so the script cannot rot between GPU sessions
        global N_IMAGES, N_DRAWS, N_FOLDS
        N_IMAGES, N_DRAWS, N_FOLDS = 8, 2, 4
        args.device, args.reps, args.modes, args.sizes = "cpu", 1, "eager", None
    cache = args.compile_cache_dir or tempfile.mkdtemp(prefix="twinrun-bench-compile-")
    apply_determinism(True, cache)  # first, before CUDA work and torch.compile: TF32 off, caches moved
    device = torch.device(args.device)
    sizes = SMOKE_SIZES if args.smoke else CPU_SIZES if args.cpu_sizes else SIZES
    chosen = args.sizes.split(",") if args.sizes else list(sizes)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {hardware}, "
          f"threads {torch.get_num_threads()}, compile cache {cache}", flush=True)
    rows = []
    t0 = time.perf_counter()
    for name in chosen:
        arch, chunk_images, chunk_draws = sizes[name]
        rows += bench_size(name, arch, chunk_images, chunk_draws, device, args.reps, args.modes.split(","))
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hardware, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
