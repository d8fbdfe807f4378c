r"""EDM wrappers that let twinrun probe diffusers' UNet2DModel and DiTTransformer2DModel (random init).

    PYTHONPATH=examples/diffusers python -m twinrun --config-dir examples/diffusers/conf \
        +experiment=unet_pin_sigma

Each wrapper has twinrun's model interface: forward(x [B,C,H,W], sigma [B], sigma_cond [B], **cond) ->
denoised x, an attribute `sigma_data`, and COND_PARAM_PATTERNS naming its conditioning pathway (the σ
embedding and every layer it feeds), so the `cond` estimand and σ-pinning interventions work unchanged.
The DiT is class-conditional: each image's own label arrives as `class_labels` (a data builder's
per-image conditioning: `labelled_digits` below); without one every sample is class 0.
"""

import torch
from diffusers import DiTTransformer2DModel, UNet2DModel
from sklearn.datasets import load_digits
from torch import nn

from twinrun.data import load_heldout_images
from twinrun.models.attention import batch_attention

N_DIGIT_CLASSES = 10

# diffusers embeds the timestep with sinusoids sized for t in [0, 1000]; EDM's c_noise = ln(σ)/4
# (Karras et al. 2022, Table 1) spans about ±1.6, so it is scaled to use the same frequencies.
C_NOISE_SCALE = 250.0


class EDMWrapper(nn.Module):
    """EDM preconditioning (Table 1) around a diffusers network F(x_in, t): D = c_skip·x + c_out·F(c_in·x)."""

    def __init__(self, net: nn.Module, sigma_data: float):
        super().__init__()
        self.net = net
        self.sigma_data = float(sigma_data)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, sigma_cond: torch.Tensor) -> torch.Tensor:
        return self.denoise(x, sigma, sigma_cond)

    def denoise(self, x: torch.Tensor, sigma: torch.Tensor, sigma_cond: torch.Tensor, **cond) -> torch.Tensor:
        batch = x.shape[0]
        sigma = sigma.to(x.dtype).reshape(-1).expand(batch)
        sigma_cond = sigma_cond.to(x.dtype).reshape(-1).expand(batch)
        s = sigma.reshape(batch, 1, 1, 1)
        sd2 = self.sigma_data**2
        c_skip = sd2 / (s**2 + sd2)
        c_out = s * self.sigma_data / torch.sqrt(s**2 + sd2)
        c_in = 1.0 / torch.sqrt(s**2 + sd2)
        # The conditioning σ reaches the network only through the timestep: what twinrun intervenes on.
        c_noise = C_NOISE_SCALE * torch.log(sigma_cond) / 4.0
        return c_skip * x + c_out * self.raw(c_in * x, c_noise, **cond)

    def raw(self, x_in: torch.Tensor, c_noise: torch.Tensor, **cond) -> torch.Tensor:
        raise NotImplementedError


class EDMUNet(EDMWrapper):
    # σ embedding MLP and each ResNet block's projection of it (the UNet's conditioning pathway).
    COND_PARAM_PATTERNS = ("net.time_embedding.*", "net.*.time_emb_proj.*")

    def raw(self, x_in, c_noise):  # unconditional: no per-image input beside the image
        return self.net(x_in, c_noise).sample


class EDMDiT(EDMWrapper):
    # adaLN-Zero of every block (its σ/class embedding and modulation linear) and the final modulation.
    COND_PARAM_PATTERNS = ("net.transformer_blocks.*.norm1.*", "net.proj_out_1.*")

    def forward(self, x, sigma, sigma_cond, class_labels: torch.Tensor | None = None):
        return self.denoise(x, sigma, sigma_cond, class_labels=class_labels)

    def raw(self, x_in, c_noise, class_labels: torch.Tensor | None = None):
        # Each sample's own class [B] (int64); none given: class 0 for all (a one-class, unconditional DiT).
        if class_labels is None:
            class_labels = torch.zeros(x_in.shape[0], dtype=torch.long, device=x_in.device)
        return self.net(x_in, timestep=c_noise, class_labels=class_labels.long()).sample


def _seeded(seed: int):
    torch.manual_seed(seed)  # diffusers draws its init from the global generator


def unet(resolution: int = 8, channels: int = 1, widths: tuple = (16, 32), sigma_data: float = 0.5,
         seed: int = 0) -> EDMUNet:
    """A small UNet2DModel (ResNet + attention blocks, GroupNorm): vmap cannot run it, probe.method=auto
    takes folds."""
    _seeded(seed)
    net = UNet2DModel(sample_size=resolution, in_channels=channels, out_channels=channels,
                      block_out_channels=tuple(widths), layers_per_block=1, norm_num_groups=8,
                      down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                      up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8)
    return EDMUNet(net, sigma_data).eval()


def dit(resolution: int = 8, channels: int = 1, heads: int = 2, head_dim: int = 8, depth: int = 2,
        patch_size: int = 2, sigma_data: float = 0.5, seed: int = 0, num_classes: int = 1) -> EDMDiT:
    """A small DiTTransformer2DModel (adaLN-Zero; its class embedding has `num_classes` rows and DiT's
    one extra for classifier-free guidance's null class)."""
    _seeded(seed)
    assert resolution % patch_size == 0, f"patch_size={patch_size} must divide resolution={resolution}"
    net = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=channels,
                                out_channels=channels, num_layers=depth, sample_size=resolution,
                                patch_size=patch_size, num_embeds_ada_norm=num_classes)
    # the probe's vmap batches attention as twinrun's own adapters do (diffusers' SDPA has no CPU
    # batching rule, so vmap would loop over the fold groups); outside vmap diffusers' processor runs
    return EDMDiT(batch_attention(net), sigma_data).eval()


def labelled_digits():
    """The probe's held-out digits with each image's own class: (images, ids, {"class_labels": [M] int64})."""
    images, ids = load_heldout_images()
    labels = torch.as_tensor(load_digits().target, dtype=torch.long)[torch.tensor(ids)]
    return images, ids, {"class_labels": labels}
