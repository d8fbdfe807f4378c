"""The embedded default denoiser: a small DiT-style transformer with EDM preconditioning.

The noise level reaches the network only through the conditioning pathway (c_noise -> Fourier
features -> MLP -> per-block adaLN modulation). `forward` takes the noising sigma and the
conditioning sigma separately, so an intervention can pin the latter alone.
"""

from __future__ import annotations

import json
import math
from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import nn

from twinrun.files import atomic_write

# Kwargs of the committed model (sigma_data comes from the data and is stored beside them).
# mlp_ratio 2 keeps P near 49k: the probe stores F x P float32 per arm and bin.
DEFAULT_ARCH: dict = {
    "img_resolution": 8, "img_channels": 1, "patch_size": 2, "width": 32, "depth": 3, "heads": 4,
    "mlp_ratio": 2,
}  # fmt: skip

DEFAULT_WEIGHTS_PATH = Path(__file__).resolve().parent / "weights" / "dit_digits.safetensors"
TRAIN_COMMAND = "python -m twinrun.train"

# fnmatch patterns over named_parameters() that select the conditioning pathway: the sigma
# embedding MLP and every adaLN modulation linear (blocks' and the final layer's).
COND_PARAM_PATTERNS: tuple[str, ...] = ("cond_embed.*", "*.adaln.*")

# Fourier frequencies for c_noise, in cycles per unit of c_noise. c_noise = ln(sigma)/4 spans about
# [-1.6, 1.1] for sigma in [0.002, 80]; the lowest frequency's period (4) covers that span once.
FOURIER_MIN_CYCLES = 0.25
FOURIER_MAX_CYCLES = 16.0


def is_cond_param(name: str) -> bool:
    """True when a named_parameters() name belongs to the conditioning pathway."""
    return any(fnmatch(name, pattern) for pattern in COND_PARAM_PATTERNS)


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Per-sample affine after a parameter-free LayerNorm; (1 + scale) makes zero modulation the identity.
    return h * (1.0 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class FourierEmbedding(nn.Module):
    """Fixed sinusoidal features of a scalar per sample: [B] -> [B, dim]."""

    def __init__(self, dim: int):
        super().__init__()
        assert dim % 2 == 0, f"Fourier embedding dim must be even, got {dim}"
        cycles = torch.logspace(math.log10(FOURIER_MIN_CYCLES), math.log10(FOURIER_MAX_CYCLES), dim // 2)
        # Non-persistent: derived from the architecture, so it never enters the weights file or the probe.
        self.register_buffer("angular_freqs", 2.0 * math.pi * cycles, persistent=False)

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        phase = c_noise.unsqueeze(-1) * self.angular_freqs
        return torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)


class CondEmbed(nn.Module):
    """c_noise -> conditioning vector [B, width] shared by every adaLN modulation."""

    def __init__(self, width: int):
        super().__init__()
        self.fourier = FourierEmbedding(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(self.fourier(c_noise))))


class AdaLNModulation(nn.Module):
    """Conditioning vector -> n_chunks modulation vectors (shift/scale/gate), zero at init (adaLN-Zero)."""

    def __init__(self, width: int, n_chunks: int):
        super().__init__()
        self.n_chunks = n_chunks
        self.linear = nn.Linear(width, n_chunks * width)

    def forward(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(cond)).chunk(self.n_chunks, dim=-1)


class Attention(nn.Module):
    """Multi-head self-attention written with matmul + softmax so vmap/grad see plain ops."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        assert width % heads == 0, f"width={width} must be divisible by heads={heads}"
        self.heads = heads
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, n_tokens, width = tokens.shape
        qkv = self.qkv(tokens).reshape(batch, n_tokens, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mixed = torch.softmax(scores, dim=-1) @ v
        return self.proj(mixed.transpose(1, 2).reshape(batch, n_tokens, width))


class Mlp(nn.Module):
    def __init__(self, width: int, mlp_ratio: int):
        super().__init__()
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(tokens), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block whose norms are modulated and whose branches are gated by adaLN."""

    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.width = width
        self.attn = Attention(width, heads)
        self.mlp = Mlp(width, mlp_ratio)
        self.adaln = AdaLNModulation(width, n_chunks=6)

    def forward(self, tokens: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaln(cond)
        normed = F.layer_norm(tokens, (self.width,))
        tokens = tokens + gate_a.unsqueeze(1) * self.attn(modulate(normed, shift_a, scale_a))
        normed = F.layer_norm(tokens, (self.width,))
        return tokens + gate_m.unsqueeze(1) * self.mlp(modulate(normed, shift_m, scale_m))


class FinalLayer(nn.Module):
    """Modulated norm + linear map from each token back to its patch of pixels."""

    def __init__(self, width: int, patch_pixels: int):
        super().__init__()
        self.width = width
        self.adaln = AdaLNModulation(width, n_chunks=2)
        self.linear = nn.Linear(width, patch_pixels)

    def forward(self, tokens: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaln(cond)
        return self.linear(modulate(F.layer_norm(tokens, (self.width,)), shift, scale))


class DiTDenoiser(nn.Module):
    """EDM-preconditioned DiT denoiser D(x; sigma, sigma_cond) for small square images."""

    # The probe reads this to lay out the `cond` estimand (subclasses inherit it).
    COND_PARAM_PATTERNS = COND_PARAM_PATTERNS

    def __init__(
        self,
        img_resolution: int = 8,
        img_channels: int = 1,
        patch_size: int = 2,
        width: int = 32,
        depth: int = 3,
        heads: int = 4,
        mlp_ratio: int = 2,
        sigma_data: float = 0.5,
    ):
        super().__init__()
        assert img_resolution % patch_size == 0, f"patch_size={patch_size} must divide {img_resolution}"
        self.arch = {
            "img_resolution": img_resolution, "img_channels": img_channels, "patch_size": patch_size,
            "width": width, "depth": depth, "heads": heads, "mlp_ratio": mlp_ratio,
            "sigma_data": float(sigma_data),
        }  # fmt: skip
        self.img_resolution = img_resolution
        self.img_channels = img_channels
        self.patch_size = patch_size
        self.sigma_data = float(sigma_data)
        self.patches_per_side = img_resolution // patch_size
        patch_pixels = img_channels * patch_size * patch_size

        self.patch_embed = nn.Linear(patch_pixels, width)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patches_per_side**2, width))
        self.cond_embed = CondEmbed(width)
        self.blocks = nn.ModuleList([Block(width, heads, mlp_ratio) for _ in range(depth)])
        self.final = FinalLayer(width, patch_pixels)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.pos_embed, std=0.02)
        # adaLN-Zero: every branch and the output start at zero, so at init D(x) = c_skip * x.
        for module in self.modules():
            if isinstance(module, AdaLNModulation):
                nn.init.zeros_(module.linear.weight)
                nn.init.zeros_(module.linear.bias)
        nn.init.zeros_(self.final.linear.weight)
        nn.init.zeros_(self.final.linear.bias)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, T, C*p*p], tokens in row-major patch order."""
        batch, p, n = x.shape[0], self.patch_size, self.patches_per_side
        x = x.reshape(batch, self.img_channels, n, p, n, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, n * n, self.img_channels * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T, C*p*p] -> [B, C, H, W]; inverse of patchify."""
        batch, p, n = tokens.shape[0], self.patch_size, self.patches_per_side
        x = tokens.reshape(batch, n, n, self.img_channels, p, p)
        return x.permute(0, 3, 1, 4, 2, 5).reshape(batch, self.img_channels, n * p, n * p)

    def raw_net(self, x_in: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        """F_theta(c_in * x; c_noise): the network before preconditioning."""
        cond = self.cond_embed(c_noise)
        tokens = self.patch_embed(self.patchify(x_in)) + self.pos_embed
        for block in self.blocks:
            tokens = block(tokens, cond)
        return self.unpatchify(self.final(tokens, cond))

    def forward(
        self, x: torch.Tensor, sigma: torch.Tensor, sigma_cond: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Denoise x [B, C, H, W] noised at sigma [B]; sigma_cond [B] (default sigma) feeds only c_noise."""
        batch = x.shape[0]
        sigma = sigma.to(x.dtype).reshape(-1).expand(batch)
        sigma_cond = sigma if sigma_cond is None else sigma_cond.to(x.dtype).reshape(-1).expand(batch)
        sigma_img = sigma.reshape(batch, 1, 1, 1)
        sd2 = self.sigma_data**2
        # EDM preconditioning (Karras et al. 2022, Table 1), all from the noising sigma.
        c_skip = sd2 / (sigma_img**2 + sd2)
        c_out = sigma_img * self.sigma_data / torch.sqrt(sigma_img**2 + sd2)
        c_in = 1.0 / torch.sqrt(sigma_img**2 + sd2)
        # c_noise = ln(sigma)/4 (Table 1), from the conditioning sigma: the only place sigma_cond enters.
        c_noise = torch.log(sigma_cond) / 4.0
        return c_skip * x + c_out * self.raw_net(c_in * x, c_noise)


def save_pretrained(model: DiTDenoiser, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Atomically write the model's parameters; metadata gets `arch` (JSON kwargs incl. sigma_data)."""
    path = Path(path)
    tensors = {name: p.detach().to("cpu", torch.float32).contiguous() for name, p in model.named_parameters()}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, save(tensors, metadata={**(metadata or {}), "arch": json.dumps(model.arch)}))
    return path


def _fix_hint(path: Path) -> str:
    out_arg = "" if path == DEFAULT_WEIGHTS_PATH else f" --out {path}"
    return f"regenerate it with `{TRAIN_COMMAND}{out_arg}`"


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def read_weights(path: str | Path | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a weights file; one-line errors naming the path and the fix."""
    path = Path(DEFAULT_WEIGHTS_PATH if path is None else path)
    fix = _fix_hint(path)
    if not path.is_file():
        raise FileNotFoundError(f"denoiser weights not found at {path}; {fix}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"denoiser weights at {path} are unreadable ({_first_line(err)}); {fix}") from err
    if "arch" not in metadata:
        raise ValueError(f"denoiser weights at {path} lack the 'arch' metadata key; {fix}")
    return tensors, metadata


def load_pretrained(path: str | Path | None = None) -> DiTDenoiser:
    """The committed denoiser (or the one at path), float32, eval mode, params requiring grad."""
    path = Path(DEFAULT_WEIGHTS_PATH if path is None else path)
    tensors, metadata = read_weights(path)
    try:
        model = DiTDenoiser(**json.loads(metadata["arch"]))
        model.load_state_dict(tensors, strict=True)
    except (json.JSONDecodeError, TypeError, RuntimeError) as err:
        reason = _first_line(err)
        raise ValueError(
            f"denoiser weights at {path} do not match their arch ({reason}); {_fix_hint(path)}"
        ) from err
    model = model.float().eval()
    model.requires_grad_(True)
    return model
