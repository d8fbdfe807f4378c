"""The probe on a text-conditioned network: SD3's MMDiT (twinrun.models.sd3, rectified flow, per-image
sequence and pooled text embeddings) at the worked example's size, side by side in one run.

    python benchmarks/bench_text_probe.py [--threads 2] [--reps 5]
    python benchmarks/bench_text_probe.py --smoke     # toy sizes, one repetition (a test runs it)

Prints, for one bin and arm of N images x D draws: twinrun's probe (fold sums, each sample with its own
image's conditioning) with probe.method=vmap and =folds, against the plain batched backward over the
same N·D samples (the floor: one forward and backward giving only the mean gradient), and their ratio
(target ≤ 1.5x on the CPU, eager). vmap runs twice: with the adapter's default attention, batched
under vmap (twinrun.models.attention), and with diffusers' own (model.vmap_attention=false: torch
loops over the fold groups in every attention, the figure before the batched one), and the two are
checked bit for bit. Then the peak RSS of one probe call at 12, 24 and 48 draws per image (one chunk
of draws, two, four), each in a fresh process, with glibc's allocator as it comes and with its mmap
threshold fixed (ALLOCATORS says why): the conditioning is repeated per draw only within a chunk, so
more draws must cost no more memory than one chunk's beyond the allocator's own.

The network, its inputs and the probe's chunk are the example's (examples/text_to_image/conf/:
the latents, text length and widths of model/sd3_example.yaml, the chunk of experiment/t2i_pin_t.yaml).
Timings interleave the methods repetition by repetition and report medians, because the machine is
shared and its load drifts.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import yaml

from twinrun import draws
from twinrun.config import ProbeConfig
from twinrun.job import SDPA_UNDER_VMAP
from twinrun.measures import fold_sums as probe
from twinrun.measures.probe import fold_sizes
from twinrun.models.sd3 import sd3
from twinrun.objectives import Flow

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_MODEL = REPO / "examples" / "text_to_image" / "conf" / "model" / "sd3_example.yaml"
EXAMPLE_EXPERIMENT = REPO / "examples" / "text_to_image" / "conf" / "experiment" / "t2i_pin_t.yaml"
N_IMAGES, N_DRAWS, N_FOLDS = 40, 12, 10  # the protocol: 40 images x 12 draws per bin
TEXT_TOKENS = 16  # the example encoder's sequence length
T_BIN, T_COND, SEED = 0.5, 0.3, 0  # a flow bin (t) and a pinned t_cond off it: the arm differs from its twin
RSS_DRAWS = (12, 24, 48)  # one chunk of draws, two, four
SMOKE = {"N_IMAGES": 4, "N_DRAWS": 2, "N_FOLDS": 2, "RSS_DRAWS": (2, 4)}
# glibc raises its mmap threshold to the size of a large block once one is freed, so the second chunk's
# buffers (as large as the first's) come from the heap beside the first's freed ones: about +75 MB of
# resident set at two chunks or more that is the allocator's, not the probe's. A fixed threshold (glibc's
# tunable, 128 KiB) keeps every chunk's large buffers mapped and shows what the probe itself holds.
ALLOCATORS = {"glibc default": {}, "glibc, fixed mmap threshold (MALLOC_MMAP_THRESHOLD_=131072)":
              {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def example_kwargs() -> dict:
    """The example's network: its model config's keys that the builder takes (no adapter: the base)."""
    node = yaml.safe_load(EXAMPLE_MODEL.read_text())
    return {k: v for k, v in node.items() if not k.startswith("_") and k not in ("adapter", "pretrained",
                                                                                 "subfolder")}


def example_chunk() -> tuple[int, int]:
    """The example's probe chunk (images, draws per call): what its pin_t run measures with."""
    probe_node = yaml.safe_load(EXAMPLE_EXPERIMENT.read_text())["probe"]
    return probe_node["chunk_images"], probe_node["chunk_draws"]


CHUNK_IMAGES, CHUNK_DRAWS = example_chunk()
DEFAULT_CHUNK = (ProbeConfig.chunk_images, ProbeConfig.chunk_draws)  # the example's before it set its own


def setup(n_draws: int, vmap_attention: bool = True):
    """The network, N latents with their own text embeddings, the bin's draws and the folds."""
    kw = example_kwargs()
    model = sd3(**kw, vmap_attention=vmap_attention)
    gen = torch.Generator().manual_seed(SEED)
    shape = (kw["channels"], kw["resolution"], kw["resolution"])
    latents = torch.randn(N_IMAGES, *shape, generator=gen)
    cond = {"encoder_hidden_states": torch.randn(N_IMAGES, TEXT_TOKENS, kw["text_dim"], generator=gen),
            "pooled_projections": torch.randn(N_IMAGES, kw["pooled_dim"], generator=gen)}
    ids = list(range(N_IMAGES))
    eps = draws.noise(SEED, T_BIN, ids, n_draws, shape)
    sizes = fold_sizes(N_IMAGES, N_FOLDS)
    fold_of_image = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return model, probe.select_params(model, ["*"]), latents, cond, eps, fold_of_image


def twinrun_probe(method, model, names, latents, cond, eps, fold_of_image, chunk=None):
    chunk_images, chunk_draws = chunk or (CHUNK_IMAGES, CHUNK_DRAWS)
    return probe.fold_sums(model, names, latents, eps, T_BIN, torch.tensor(T_COND), fold_of_image, N_FOLDS,
                           chunk_images, chunk_draws, method=method, objective=Flow(), cond=cond)


def batched_backward(model, names, latents, cond, eps, fold_of_image) -> None:
    """The floor: one plain forward and backward over all N·D samples (the mean gradient only)."""
    n, d = eps.shape[:2]
    clean = latents.unsqueeze(1).expand_as(eps).reshape(n * d, *latents.shape[1:])
    noise = eps.reshape(n * d, *latents.shape[1:])
    t = torch.full((n * d,), T_BIN)
    objective = Flow()
    repeated = {k: v.repeat_interleave(d, 0) for k, v in cond.items()}
    out = model(objective.noisy(model, clean, noise, t), t, torch.full_like(t, T_COND), **repeated)
    loss = (out - objective.target(model, clean, noise, t)).square().mean()
    params = dict(model.named_parameters())
    torch.autograd.grad(loss, [params[n] for n in names])


def interleaved(fns: dict, reps: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return times


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), not inherited from a parent as ru_maxrss is."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_child(n_draws: int) -> None:
    inputs = setup(n_draws)
    before = peak_rss_mb()
    twinrun_probe("vmap", *inputs)
    print(json.dumps({"n_draws": n_draws, "setup_mb": before, "peak_mb": peak_rss_mb()}))


def rss_row(n_draws: int, args, env: dict) -> dict:
    """One probe call's peak RSS in a fresh process under the allocator settings `env`."""
    cmd = [sys.executable, __file__, "--rss-child", str(n_draws), "--threads", str(args.threads)]
    out = subprocess.run([*cmd, *(["--smoke"] if args.smoke else [])], capture_output=True, text=True,
                         check=True, env={**os.environ, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    global N_IMAGES, N_DRAWS, N_FOLDS, RSS_DRAWS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="toy sizes, one repetition (figures meaningless)")
    ap.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=SDPA_UNDER_VMAP)  # the "before" arm's loop: measured, not news
    if args.smoke:
        N_IMAGES, N_DRAWS, N_FOLDS, RSS_DRAWS = (SMOKE[k] for k in ("N_IMAGES", "N_DRAWS", "N_FOLDS",
                                                                    "RSS_DRAWS"))
        args.reps = 1
    if args.rss_child is not None:
        return rss_child(args.rss_child)

    inputs = setup(N_DRAWS)
    model, latents = inputs[0], inputs[2]
    looped = (sd3(**example_kwargs(), vmap_attention=False), *inputs[1:])  # the same weights (same seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"bench_text_probe: torch {torch.__version__}, {args.threads} threads; SD3 MMDiT {n_params:,} "
          f"parameters, latents {tuple(latents.shape[1:])}, text {TEXT_TOKENS} tokens; {N_IMAGES} images x "
          f"{N_DRAWS} draws, {N_FOLDS} folds, objective=flow; probe chunk {CHUNK_IMAGES} images x "
          f"{CHUNK_DRAWS} draws (the example's t2i_pin_t)")
    fns = {"vmap": lambda: twinrun_probe("vmap", *inputs), "folds": lambda: twinrun_probe("folds", *inputs),
           "vmap_loop": lambda: twinrun_probe("vmap", *looped), "floor": lambda: batched_backward(*inputs),
           "vmap_default_chunk": lambda: twinrun_probe("vmap", *inputs, chunk=DEFAULT_CHUNK)}
    warm = {k: f() for k, f in fns.items()}  # warm-up: first calls pay for allocation and dispatch caches
    same = torch.equal(warm["vmap"], warm["vmap_loop"])
    times = interleaved(fns, args.reps)
    floor = statistics.median(times["floor"])
    print("speed, one bin and arm (median of reps; ratio = median of per-rep ratios to the floor):")
    print(f"  {'plain batched backward':<50} {floor * 1e3:8.1f} ms   (floor: mean gradient only)")
    labels = {"vmap": "probe, method=vmap", "folds": "probe, method=folds",
              "vmap_loop": "probe, method=vmap, diffusers' attention (before)",
              "vmap_default_chunk": "probe, method=vmap, chunk {} x {} (before)".format(*DEFAULT_CHUNK)}
    for method in ("vmap", "folds", "vmap_loop", "vmap_default_chunk"):
        ratio = statistics.median(a / b for a, b in zip(times[method], times["floor"]))
        print(f"  {labels[method]:<50} {statistics.median(times[method]) * 1e3:8.1f} ms   "
              f"{ratio:.2f}x the floor   (target ≤ 1.50x)")
    print(f"  vmap with batched attention vs torch's loop: fold sums bit-identical: {same}")

    print("peak RSS, one probe call in a fresh process (setup = after imports, model, data and draws):")
    for allocator, env in ALLOCATORS.items():
        rows = [rss_row(d, args, env) for d in RSS_DRAWS]
        print(f"  {allocator}:")
        for r in rows:
            print(f"  {r['n_draws']:4d} draws/image: peak {r['peak_mb']:7.1f} MB (setup {r['setup_mb']:.1f} "
                  f"MB; probe {r['peak_mb'] - r['setup_mb']:+.1f} MB)   vs {rows[0]['n_draws']} draws: "
                  f"{100 * (r['peak_mb'] / rows[0]['peak_mb'] - 1):+.1f}%")

if __name__ == "__main__":
    main()
