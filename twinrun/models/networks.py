"""Building a diffusers network for an adapter: random-initialised from its config under a seed of its
own, or read from a local `from_pretrained` directory (never downloaded), then a LoRA adapter on top."""

from pathlib import Path

import torch
from torch import nn

from twinrun import lora
from twinrun.errors import ConfigError
from twinrun.models.attention import batch_attention


def network(cls: type, config: dict, seed: int, pretrained: str | None, subfolder: str | None) -> nn.Module:
    """`cls(**config)` drawn under `seed` (the global generators left as they were), or with `pretrained`
    the checkpoint in that local directory (`config` then ignored: the checkpoint's own config rules)."""
    if pretrained is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # diffusers draws its init from the global generator
            return cls(**config)
    where = Path(pretrained).expanduser()
    if not (where / (subfolder or "")).is_dir():
        inside = f" with a subfolder {subfolder}" if subfolder else ""
        raise ConfigError("model.pretrained", pretrained, f"is not a local directory{inside}: give the "
                          f"directory {cls.__name__}.save_pretrained wrote (twinrun never downloads)")
    return cls.from_pretrained(str(where), subfolder=subfolder, local_files_only=True,
                               torch_dtype=torch.float32)


class Adapted(nn.Module):
    """The base of every adapter: the network as `net`, and the LoRA adapter's digest when one is loaded
    (the probe and training runs record it in their identity: `adapter_sha256`). `vmap_attention`:
    the network's attention is batched under the probe's vmap (twinrun.models.attention; the same bits
    on the CPU); False leaves diffusers' processors alone, so vmap loops over fold groups there."""

    adapter_sha256: str | None = None

    def __init__(self, net: nn.Module, adapter: str | None, vmap_attention: bool = True):
        super().__init__()
        self.net = batch_attention(net) if vmap_attention else net
        if adapter is not None:
            self.adapter_sha256 = lora.load_adapter(net, adapter)

    @staticmethod
    def per_sample(level: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A level as [B] in x's dtype (a scalar or [1] is repeated over the batch)."""
        return level.to(x.dtype).reshape(-1).expand(x.shape[0])
