"""A tiny conditional denoiser built in tests: class labels (an embedding, FiLM) and a text-embedding sequence
(cross-attention with its mask), for every objective (its output is whatever the objective's target is).
Builders for `model._target_` / `data._target_` in runs made from this folder."""

import math

import torch
import torch.nn.functional as F
from torch import nn

COND_PARAM_PATTERNS = ("level.*", "film.*")
N_CLASSES, TEXT_LEN, TEXT_DIM = 10, 5, 6


class CondDenoiser(nn.Module):
    """forward(x [B,1,8,8], level [B], level_cond [B], *, labels [B] int64, text [B,L,D], mask [B,L] bool)."""

    def __init__(self, width: int = 16, sigma_data: float = 0.5, timesteps: int = 1000):
        super().__init__()
        self.sigma_data = sigma_data
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - torch.linspace(1e-4, 0.02, timesteps), 0))
        self.inp = nn.Linear(4, width)  # 2x2 patches of an 8x8 image: 16 tokens of 4 pixels
        self.level = nn.Linear(8, width)
        self.label = nn.Embedding(N_CLASSES, width)
        self.film = nn.Linear(width, 2 * width)
        self.q, self.kv = nn.Linear(width, width), nn.Linear(TEXT_DIM, 2 * width)
        self.out = nn.Linear(width, 4)

    def forward(self, x, sigma, sigma_cond=None, *, labels, text, mask=None):
        b = x.shape[0]
        sigma_cond = sigma if sigma_cond is None else sigma_cond
        c = sigma_cond.to(x.dtype).reshape(-1).expand(b)
        freqs = torch.arange(1, 5, dtype=x.dtype, device=x.device)
        phase = torch.log1p(c).unsqueeze(-1) * freqs
        emb = self.level(torch.cat([phase.cos(), phase.sin()], -1)) + self.label(labels)
        scale, shift = self.film(F.silu(emb)).chunk(2, -1)
        tokens = x.reshape(b, 1, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, 16, 4)
        h = self.inp(tokens) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        k, v = self.kv(text).chunk(2, -1)
        scores = self.q(h) @ k.transpose(1, 2) / math.sqrt(h.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(1), -1e4)
        h = h + torch.softmax(scores, -1) @ v
        out = self.out(F.gelu(h))
        return out.reshape(b, 4, 4, 1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, 1, 8, 8)


def tiny(seed: int = 0, path=None) -> CondDenoiser:
    torch.manual_seed(seed)
    return CondDenoiser().eval()


def cond_data(n: int = 24, seed: int = 1, offset: int = 0, text_shift: float = 0.0):
    """(images [n,1,8,8], ids, {labels, text, mask}): every image its own label, text and mask."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn((n, 1, 8, 8), generator=gen).clamp(-1, 1)
    labels = torch.randint(0, N_CLASSES, (n,), generator=gen)
    text = torch.randn((n, TEXT_LEN, TEXT_DIM), generator=gen) + text_shift
    lengths = torch.randint(1, TEXT_LEN + 1, (n,), generator=gen)
    mask = torch.arange(TEXT_LEN).unsqueeze(0) < lengths.unsqueeze(1)
    return images, list(range(offset, offset + n)), {"labels": labels, "text": text, "mask": mask}


def cond_train_data(n_train: int = 32, n_held: int = 8):
    """The training builder: (training triple, held-out triple), ids disjoint."""
    return cond_data(n_train, seed=2), cond_data(n_held, seed=3, offset=1000)


def bad_cond_data(what: str = "rows"):
    """Conditioning a run must refuse before compute: `rows` (wrong leading dim), `nan`, `type`, `key`."""
    images, ids, cond = cond_data()
    if what == "rows":
        cond["text"] = cond["text"][:-1]
    elif what == "nan":
        cond["text"][3, 1, 2] = float("nan")
    elif what == "type":
        cond["labels"] = cond["labels"].tolist()
    elif what == "key":
        cond["prompt"] = cond["text"]
    return images, ids, cond


def bad_key_data():
    """A conditioning entry the model's forward does not take (`prompt`)."""
    return bad_cond_data("key")


def cond_data_env(n: int = 24):
    """`cond_data` with its text embeddings moved by $COND_TEXT_SHIFT (other embeddings, same images)."""
    import os

    return cond_data(n, text_shift=float(os.environ.get("COND_TEXT_SHIFT", "0")))
