"""SD3's MMDiT (diffusers' SD3Transformer2DModel) under twinrun: rectified flow, pooled and sequence text.

    python -m twinrun +experiment=sd3_pin_t      # the tiny random network on a conditioning cache

The network is trained as SD3 is: x_t = (1 − t)·x + t·ε, and it predicts the velocity ε − x
(`objective=flow`). Its timestep is 1000·t (diffusers' FlowMatchEulerDiscreteScheduler: timesteps =
sigmas · num_train_timesteps). Per image it reads the text encoders' sequence embeddings
(`encoder_hidden_states` [M, L, joint_attention_dim]) and their pooled embedding (`pooled_projections`
[M, pooled_projection_dim]): a conditioning cache holds them under exactly those names.
"""

import torch
from diffusers import SD3Transformer2DModel

from twinrun.models.networks import Adapted, network

# diffusers' flow scheduler feeds the transformer t · num_train_timesteps (1000 for SD3 and Flux).
TIMESTEP_SCALE = 1000.0

# The conditioning pathway (the `cond` estimand): the timestep-and-pooled-text embedding and every adaLN
# modulation it drives (each block's image and context stream, and the output norm). fnmatch's `*` crosses
# dots, so a LoRA layer injected into any of them (`….lora_A.default.weight`) belongs to it as well.
COND_PARAM_PATTERNS = ("net.time_text_embed.*", "net.transformer_blocks.*.norm1.*",
                       "net.transformer_blocks.*.norm1_context.*", "net.norm_out.*")
# The text pathway, for `reduce.groups` (docs/models.md): the sequence embeddings' projection and the
# context stream of every joint-attention block, and the pooled text's projection.
TEXT_PARAM_PATTERNS = ("net.context_embedder.*", "net.time_text_embed.text_embedder.*",
                       "net.transformer_blocks.*.attn.add_*", "net.transformer_blocks.*.attn.to_add_out.*",
                       "net.transformer_blocks.*.ff_context.*")
# Where a LoRA adapter usually goes on SD3 (diffusers' DreamBooth-LoRA script's default targets).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


class SD3Flow(Adapted):
    """forward(x_t [B, C, H, W], t [B], t_cond [B], encoder_hidden_states, pooled_projections) -> velocity.
    `t` itself is not read: the noisy input carries it; `t_cond` reaches the network as its timestep."""

    COND_PARAM_PATTERNS = COND_PARAM_PATTERNS

    def forward(self, x: torch.Tensor, t: torch.Tensor, t_cond: torch.Tensor,
                encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor) -> torch.Tensor:
        timestep = TIMESTEP_SCALE * self.per_sample(t_cond, x)
        return self.net(hidden_states=x, encoder_hidden_states=encoder_hidden_states,
                        pooled_projections=pooled_projections, timestep=timestep).sample


def sd3(resolution: int = 8, channels: int = 4, patch_size: int = 2, depth: int = 2, heads: int = 2,
        head_dim: int = 8, text_dim: int = 16, pooled_dim: int = 16, seed: int = 0,
        pretrained: str | None = None, subfolder: str | None = None, adapter: str | None = None,
        vmap_attention: bool = True) -> SD3Flow:
    """A small SD3Transformer2DModel (MMDiT: joint attention over image and text tokens, adaLN-Zero), drawn
    under `seed`; or `pretrained`, a local directory (e.g. an SD3 checkpoint's, subfolder=transformer).
    `adapter`: a LoRA adapter directory (peft's layout) loaded onto it. `vmap_attention`: see Adapted."""
    assert resolution % patch_size == 0, f"patch_size={patch_size} must divide resolution={resolution}"
    config = {"sample_size": resolution, "patch_size": patch_size, "in_channels": channels,
              "out_channels": channels, "num_layers": depth, "attention_head_dim": head_dim,
              "num_attention_heads": heads, "joint_attention_dim": text_dim,
              "caption_projection_dim": heads * head_dim, "pooled_projection_dim": pooled_dim,
              "pos_embed_max_size": resolution // patch_size}
    net = network(SD3Transformer2DModel, config, seed, pretrained, subfolder)
    return SD3Flow(net, adapter, vmap_attention).eval()
