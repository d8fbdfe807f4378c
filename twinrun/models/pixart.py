"""PixArt-α (diffusers' PixArtTransformer2DModel) under twinrun: cross-attention to text, DDPM ε-prediction.

The network is trained as PixArt-α is: x_t = √ᾱ_t·x + √(1 − ᾱ_t)·ε over 1000 timesteps, predicting ε
(`objective=vp`; ᾱ is the adapter's `alphas_cumprod`, diffusers' DDPMScheduler's for the same betas).
Per image it reads the text encoder's sequence embeddings (`encoder_hidden_states` [M, L, caption_dim])
and, optionally, their attention mask (`encoder_attention_mask` [M, L], 1 = a real token), by which
padding tokens are masked out of every cross-attention.
"""

import torch
from diffusers import DDPMScheduler, PixArtTransformer2DModel

from twinrun.models.networks import Adapted, network

# The conditioning pathway (the `cond` estimand): adaLN-single, the timestep embedding and its one
# modulation linear, and the per-block and final shift/scale tables it is added to.
COND_PARAM_PATTERNS = ("net.adaln_single.*", "net.transformer_blocks.*.scale_shift_table",
                       "net.scale_shift_table")
# The text pathway, for `reduce.groups`: the caption projection and every block's cross-attention.
TEXT_PARAM_PATTERNS = ("net.caption_projection.*", "net.transformer_blocks.*.attn2.*")
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


class PixArtVP(Adapted):
    """forward(x_t [B, C, H, W], t [B], t_cond [B], encoder_hidden_states, encoder_attention_mask) -> ε.
    `t_cond` reaches the network as its timestep; `t` is not read (the noisy input carries it)."""

    COND_PARAM_PATTERNS = COND_PARAM_PATTERNS

    def __init__(self, net, adapter, alphas_cumprod: torch.Tensor, vmap_attention: bool = True):
        super().__init__(net, adapter, vmap_attention)
        # ᾱ_t of the schedule the network was trained with (objective=vp reads it); float64, never probed.
        self.register_buffer("alphas_cumprod", alphas_cumprod.to(torch.float64), persistent=False)
        self.in_channels = net.config.in_channels

    def forward(self, x: torch.Tensor, t: torch.Tensor, t_cond: torch.Tensor,
                encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None = None,
                resolution: torch.Tensor | None = None,
                aspect_ratio: torch.Tensor | None = None) -> torch.Tensor:
        # resolution and aspect_ratio: the micro-conditions of PixArt-α 1024 checkpoints (per image).
        out = self.net(x, encoder_hidden_states=encoder_hidden_states, timestep=self.per_sample(t_cond, x),
                       encoder_attention_mask=encoder_attention_mask,
                       added_cond_kwargs={"resolution": resolution, "aspect_ratio": aspect_ratio}).sample
        # A checkpoint that learns the variance too returns [ε, v]: the ε half is what is trained on ε.
        return out[:, : self.in_channels]


def pixart(resolution: int = 8, channels: int = 4, patch_size: int = 2, depth: int = 2, heads: int = 2,
           head_dim: int = 8, text_dim: int = 16, seed: int = 0, beta_start: float = 0.0001,
           beta_end: float = 0.02, beta_schedule: str = "linear", timesteps: int = 1000,
           pretrained: str | None = None, subfolder: str | None = None,
           adapter: str | None = None, vmap_attention: bool = True) -> PixArtVP:
    """A small PixArtTransformer2DModel drawn under `seed`, or `pretrained` (a local directory, e.g. a
    PixArt-α checkpoint's with subfolder=transformer); the betas are PixArt-α's (its scheduler_config).
    `adapter`: a LoRA adapter directory (peft's layout) loaded onto it. `vmap_attention`: see Adapted."""
    assert resolution % patch_size == 0, f"patch_size={patch_size} must divide resolution={resolution}"
    config = {"num_attention_heads": heads, "attention_head_dim": head_dim, "in_channels": channels,
              "out_channels": channels, "num_layers": depth, "cross_attention_dim": heads * head_dim,
              "sample_size": resolution, "patch_size": patch_size, "caption_channels": text_dim,
              "norm_num_groups": 1}
    net = network(PixArtTransformer2DModel, config, seed, pretrained, subfolder)
    schedule = DDPMScheduler(num_train_timesteps=timesteps, beta_start=beta_start, beta_end=beta_end,
                             beta_schedule=beta_schedule)
    return PixArtVP(net, adapter, schedule.alphas_cumprod, vmap_attention).eval()
