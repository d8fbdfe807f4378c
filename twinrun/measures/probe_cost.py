"""What a probe run will cost, known before it runs: its measuring time and peak host memory (printed at
plan time, a run beyond the memory it will have refused), and its device memory per arm and bin (printed
at plan time, checked by the job against its GPU's free memory before the first bin).

`c` below is the probe's built components (`probe.Components`: model, probed names, images, folds, layout).
"""

import math
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from twinrun import conditioning
from twinrun.config import ProbeConfig
from twinrun.errors import ConfigError, DeviceMemoryError
from twinrun.files import memory_bytes
from twinrun.instantiate import typed
from twinrun.measures import failures, trial
from twinrun.measures import fold_sums as fs
from twinrun.measures.kind import parse_device

# ----------------------------------------------------------------------------- the estimate of cost

# What each part of the host-memory estimate grows with: the key a refusal names.
MEMORY_KEYS = {"the process before measuring": "model", "one probe call": "probe.chunk_images",
               "draws of a bin": "probe.n_draws", "fold sums and the store": "probe.n_folds"}
CALIBRATION_MAX_SAMPLES = 1024  # the default chunk (120 x 4) is timed whole; a chunk of -1 on at most this


def host_memory(p: ProbeConfig, image_shape, n_params: int, baseline: int, call: int) -> dict[str, int]:
    """The job's peak host memory by part, in bytes (the CPU side; a GPU's device memory is estimated beside
    it): the process as planning has it now (torch, the model, the data: the job builds the same); one probe
    call, measured (its activations and gradients: the growth of the peak resident set while it ran); a
    bin's draws for every image; the float64 fold sums with their float32 copy, the store's tensors and the
    bytes written."""
    return {"the process before measuring": baseline, "one probe call": call,
            "draws of a bin": 4 * p.n_images * p.n_draws * math.prod(image_shape),
            "fold sums and the store": (8 + 4 + 4 + 4) * p.n_folds * n_params}


def resident_bytes() -> tuple[int, int]:
    """(resident set now, its peak so far) of this process, in bytes (Linux; (0, 0) elsewhere)."""
    try:
        now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0, 0
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def time_one_call(c, p: ProbeConfig, method: str, sigma: float) -> tuple[float, int, int, int]:
    """(seconds, images, draws, bytes) of one probe call of the job's chunk shape, timed here, eager, on the
    twin: the per-sample cost the estimate scales, and the call's memory (the growth of the peak resident
    set). Timed twice (the faster kept) when a call is short."""
    images = p.n_images if p.chunk_images < 1 else min(p.chunk_images, p.n_images)
    n_draws = min(p.n_draws if p.chunk_draws < 1 else min(p.chunk_draws, p.n_draws), CALIBRATION_MAX_SAMPLES)
    images = max(1, min(images, CALIBRATION_MAX_SAMPLES // n_draws))
    gen = torch.Generator().manual_seed(trial.TRIAL_SEED)
    eps = torch.randn((images, n_draws, *c.images.shape[1:]), generator=gen)
    sigma_cond = torch.tensor(sigma, dtype=torch.float32)
    best, (_, peak_before) = math.inf, resident_bytes()
    for _ in range(2):
        t0 = time.perf_counter()
        fs.fold_sums(c.model, c.names, c.images[:images], eps, sigma, sigma_cond, c.fold_of_image[:images],
                     len(c.fold_sizes), p.chunk_images, p.chunk_draws, method=method, objective=c.objective,
                     cond=conditioning.take(c.cond, slice(0, images)))
        best = min(best, time.perf_counter() - t0)
        if best > 1.0:
            break
    return best, images, eps.shape[1], max(0, resident_bytes()[1] - peak_before)


def estimate_cost(cfg: DictConfig, c, method: str, sigma: float, n_stores: int,
                  key: str | None = None) -> None:
    """Print, before any compute, the run's measuring time (one call timed here, scaled by samples) and its
    peak host memory; refuse a run whose memory estimate exceeds the memory it will have (launcher.mem_gb,
    else this machine's). With `key` (trial.trial_key), a call this process timed under the same key is
    not timed again (a sweep's later points)."""
    p = typed(ProbeConfig, OmegaConf.to_container(cfg.probe, resolve=True), "probe")
    baseline = resident_bytes()[0]
    if key is None or key not in trial.PLANNED:
        timed_call = time_one_call(c, p, method, sigma)
        if key is None:
            seconds, images, n_draws, call = timed_call
        else:
            trial.PLANNED[key] = timed_call
    if key is not None:
        seconds, images, n_draws, call = trial.PLANNED[key]
    samples = p.n_images * p.n_draws
    total_s = seconds * samples / (images * n_draws) * n_stores
    parts = host_memory(p, c.images.shape[1:], sum(g["numel"] for g in c.layout), baseline, call)
    peak = sum(parts.values())
    mem_gb = cfg.launcher.get("mem_gb")
    limit, whose = ((int(mem_gb * 2**30), f"launcher.mem_gb={mem_gb:g}") if mem_gb
                    else (memory_bytes(), "this machine"))
    device = parse_device("probe.device", p.device)[0]  # the job judges the device on its own node
    timed = (f"one probe call of {images} images x {n_draws} draws took {seconds * 1e3:,.1f} ms here (cpu, "
             f"{torch.get_num_threads()} threads, {method}"
             + ("" if device == "cpu" else f"; with probe.device={p.device} a GPU's will differ") + ")")
    memory = ", ".join(f"{k} {v / 2**30:,.2f}" for k, v in parts.items())
    print(f"twinrun: estimate: {n_stores} stores x {samples:,} samples, {timed} → about {total_s:,.0f} s "
          f"of measuring ({total_s / 3600:,.2f} h) plus start-up; peak host memory about "
          f"{peak / 2**30:,.2f} GiB ({memory} GiB), of the {limit / 2**30:,.1f} GiB of {whose}", flush=True)
    if peak > limit:
        worst = max(parts, key=parts.get)
        key = MEMORY_KEYS[worst]
        raise ConfigError(key, OmegaConf.select(cfg, key) if key != "model" else cfg.model.get("_target_"),
                          f"the job would need about {peak / 2**30:,.1f} GiB of host memory ({worst}: "
                          f"{parts[worst] / 2**30:,.1f} GiB), more than the {limit / 2**30:,.1f} GiB of "
                          f"{whose}; use fewer draws, images, folds or probed parameters")


@dataclass
class DeviceMemory:
    """The probe's device memory at its peak (bytes): one arm of one bin, its largest call in flight."""

    fold_sums: int  # the accumulator and its float32 copy: 12·F·P in float64, 4·F·P in float32
    model: int  # every parameter and buffer (the model lives on the device)
    gradients: int  # one call's parameter gradients, float32: P (folds), groups per call x P (vmap)
    activations: int  # what autograd saves per sample (measured on the model) x samples per call
    data: int  # the probed images and one bin's noise
    samples_per_call: int

    @property
    def call(self) -> int:
        """One call's gradients and activations, with the backward's own workspace on top."""
        return int(BACKWARD_WORKSPACE * (self.gradients + self.activations))

    @property
    def total(self) -> int:
        return self.fold_sums + self.model + self.data + self.call

    def describe(self, p: ProbeConfig) -> str:
        return (f"{_size(self.total)}: fold sums {_size(self.fold_sums)} (probe.n_folds={p.n_folds}, "
                f"probe.accumulator_dtype={p.accumulator_dtype}), model {_size(self.model)}, one call's "
                f"gradients and activations {_size(self.call)} ({self.samples_per_call} samples: "
                f"probe.chunk_images={p.chunk_images} x probe.chunk_draws={p.chunk_draws}), images and "
                f"noise {_size(self.data)}")


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


# A call's peak over its gradients and saved activations: the backward also holds the gradients of the
# activations it is working through. Measured on the CPU (peak RSS growth of one probe call against
# gradients + saved activations, both methods): 1.43-1.51 for vmap. With 1.6 the whole estimate was
# 0.92-1.26 of the measured peak over four shapes and several runs (tests/measures/test_probe_cost.py).
BACKWARD_WORKSPACE = 1.6
# Named in every refusal for memory, in the order they usually help most.
MEMORY_KNOBS = ("lower probe.n_folds or set probe.accumulator_dtype=float32 (the fold sums), lower "
                "probe.chunk_images or probe.chunk_draws (the activations), probe fewer parameters "
                "(probe.params), or use probe.method=folds (one fold group per call)")


def device_memory(p: ProbeConfig, model: torch.nn.Module, n_probed: int, images: torch.Tensor,
                  fold_of_image: list[int], method: str, saved_per_sample: int) -> DeviceMemory:
    """The estimate of `DeviceMemory` for one arm and bin: planning prints it, the job checks it against
    the device's free memory before the first bin (benchmarks show how it compares with measured)."""
    n_folds = max(fold_of_image) + 1
    groups, samples = fs.call_sizes(fold_of_image, n_folds, p.chunk_images, p.chunk_draws, p.n_draws, method)
    per_value = 12 if p.accumulator_dtype == "float64" else 4  # float32 sums: `.float()` is no copy
    image_bytes = images[0].numel() * images.element_size()
    return DeviceMemory(
        fold_sums=per_value * n_folds * n_probed,
        model=sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())),
        gradients=4 * groups * n_probed,
        activations=saved_per_sample * samples,
        data=p.n_images * (1 + p.n_draws) * image_bytes,
        samples_per_call=samples,
    )


def estimate_memory(p: ProbeConfig, c, method: str, sigma: float) -> DeviceMemory:
    """`device_memory` of built components, its activations measured on the model where it is."""
    saved = fs.saved_bytes_per_sample(conditioning.with_first(c.model, c.cond), c.images, sigma)
    n_probed = sum(g["numel"] for g in c.layout)
    return device_memory(p, c.model, n_probed, c.images, c.fold_of_image.tolist(), method, saved)


def check_device_memory(estimate: DeviceMemory, p: ProbeConfig, device: torch.device) -> None:
    """Refuse, before the first bin, a run whose estimate exceeds what this process can hold on its GPU:
    free memory plus what torch already holds (the model, the trial's cached blocks). On the CPU the host
    memory is planning's to judge."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device)
    if estimate.total > available:
        raise DeviceMemoryError(f"the probe needs about {estimate.describe(p)}, more than the "
                                f"{_size(available)} this process can have on {device} ({_size(total)} in "
                                f"all); {MEMORY_KNOBS}")


def out_of_memory(err: BaseException, where: str, estimate: DeviceMemory | None, p: ProbeConfig,
                  device: torch.device) -> DeviceMemoryError:
    """The device ran out of memory (`where`: the trial, or an arm and bin): what was estimated, the knobs."""
    said = f"the estimate was {estimate.describe(p)}" if estimate is not None else "before any estimate"
    return DeviceMemoryError(f"{where}: {device} ran out of memory ({failures.first_line(err)}); {said}; "
                             f"{MEMORY_KNOBS}")
