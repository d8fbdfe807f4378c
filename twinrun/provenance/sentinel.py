"""Kernel-path sentinel: hashes of a fixed battery of seeded ops, read around each bin's twin pair.

Each kernel path is deterministic, so the hashes repeat exactly on one path and move when the path
moves (thread count, compiled vs eager, library or hardware change) even if the fingerprint
missed the cause. Costs ~30 ms on one idle CPU thread, a third of it drawing the 4M-element input.
"""

import hashlib

import torch
import torch.nn.functional as F

SEED = 20240611  # fixed forever: changing it changes every sentinel hash on record


def sentinel(model_fn=None, device: str | torch.device = "cpu") -> dict:
    """Run the battery on `device`; returns {"ops": {name: sha256hex}, "digest": sha256 over all,
    "skipped": {name: why}} (ops left out because they need not repeat here, so hash nothing useful).

    Inputs are always drawn in the same order, so every op sees the same values whatever is skipped.

    `model_fn`, when given, is called with no arguments and returns a tensor or a tuple of tensors
    (the probed model's own forward+backward on a fixed input); its outputs are hashed as "model".
    """
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    device = torch.device(device)
    # On CUDA two ops here vary run to run unless pinned: a device-wide 1-D cumsum (CUB's
    # decoupled look-back scan, pytorch#75240) and cuDNN's default weight-gradient algorithms
    # (atomics). A sentinel must repeat exactly on one path, so they run only where they do.
    exact_cumsum = device.type == "cpu"
    exact_conv_grad = device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
    skipped = {}
    if not exact_cumsum:
        skipped["cumsum"] = "a device-wide scan on CUDA (decoupled look-back) need not repeat"
    if not exact_conv_grad:
        skipped["conv2d_grad"] = NOT_REPEATED_OFF

    def randn(*shape: int) -> torch.Tensor:
        # Drawn on CPU so inputs are identical on every device; only the ops run on `device`.
        return torch.randn(*shape, generator=gen).to(device)

    outputs = {}
    with torch.no_grad():
        a, b = randn(64, 64), randn(64, 64)
        outputs["matmul_64"] = a @ b
        a, b = randn(33, 100), randn(100, 17)
        outputs["matmul_odd"] = a @ b  # shapes off every block size: edge kernels
        a, b = randn(512, 512), randn(512, 512)
        outputs["matmul_512"] = a @ b  # large enough for blocked, multi-threaded GEMM
        a, b = randn(96, 256), randn(256, 96)
        outputs["matmul_bf16"] = a.bfloat16() @ b.bfloat16()  # reduced-precision (split-K) path
        x, w = randn(4, 16, 32, 32), randn(32, 16, 3, 3)
        outputs["conv2d"] = F.conv2d(x, w, padding=1)
        outputs["softmax"] = torch.softmax(randn(64, 1000), dim=-1)
        q, k, v = randn(2, 4, 64, 32), randn(2, 4, 64, 32), randn(2, 4, 64, 32)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        outputs["attention"] = torch.softmax(scores, dim=-1) @ v
        x = randn(1 << 22)
        # One float32 sum survives a 1 -> 2 thread change for ~1 input in 5 (rounding luck);
        # shifting the start moves every chunk boundary: 8 shifted sums changed for 200/200 seeds.
        outputs["sum_4m"] = torch.stack([x[i:].sum() for i in range(8)])
        outputs["dot_4m"] = torch.dot(x, x)  # BLAS reduction: split per thread
        x = randn(1024, 1024)
        outputs["mean_dim0"] = x.mean(dim=0)
        outputs["mean_dim1"] = x.mean(dim=1)
        x = randn(1 << 16)
        if exact_cumsum:
            outputs["cumsum"] = torch.cumsum(x, dim=0)
    # Parameter gradients reduce over the batch, as the probe's gradients do.
    x, w = randn(4096, 64), randn(64, 64).requires_grad_()
    with torch.enable_grad():
        torch.tanh(x @ w).square().sum().backward()
    outputs["linear_grad"] = w.grad
    x, w, bias = randn(480, 512), randn(512).requires_grad_(), randn(512).requires_grad_()
    with torch.enable_grad():
        y = F.layer_norm(x, (512,), w, bias)
        y.square().sum().backward()
    outputs["layer_norm"] = y.detach()
    outputs["layer_norm_grad"] = (w.grad, bias.grad)
    x, w = randn(64, 16, 8, 8), randn(32, 16, 3, 3).requires_grad_()
    if exact_conv_grad:
        with torch.enable_grad():
            F.conv2d(x, w, padding=1).square().sum().backward()
        outputs["conv2d_grad"] = w.grad
    if model_fn is not None:
        outputs["model"] = model_fn()
    ops = {name: _hash(value) for name, value in outputs.items()}
    digest = hashlib.sha256("".join(f"{name}={h}\n" for name, h in sorted(ops.items())).encode()).hexdigest()
    return {"ops": ops, "digest": digest, "skipped": skipped}


# Why an op is left out on CUDA with deterministic algorithms off (determinism.enabled=false).
NOT_REPEATED_OFF = ("on CUDA with deterministic algorithms off, backward kernels (cuDNN weight gradients, "
                    "memory-efficient attention, atomics) need not repeat run to run")


def repeats_backward(device: torch.device) -> bool:
    """Whether a backward on `device` must repeat bit for bit under this process's determinism setting."""
    return torch.device(device).type == "cpu" or torch.are_deterministic_algorithms_enabled()


def sentinel_changed(a: dict, b: dict) -> list[str]:
    """Names of ops whose hash differs between two sentinel readings (or is present in only one)."""
    ops_a, ops_b = a["ops"], b["ops"]
    return sorted(name for name in ops_a.keys() | ops_b.keys() if ops_a.get(name) != ops_b.get(name))


def _hash(value) -> str:
    """sha256 over dtype, shape and raw bytes of a tensor or a tuple/list of tensors."""
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    h = hashlib.sha256()
    for t in tensors:
        assert isinstance(t, torch.Tensor), f"sentinel outputs must be tensors, got {type(t).__name__}"
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}\n".encode())
        # Viewed as bytes so bfloat16 and friends hash without a numpy dtype.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
