"""Data builders of random latents with per-image text embeddings, for runs of twinrun.models' adapters
made in tests (`data._target_=latent_data.…`): every image its own sequence and pooled embedding, and for
PixArt its own padding mask."""

import torch

N_IMAGES, CHANNELS, SIDE, TEXT_LEN, TEXT_DIM = 24, 4, 8, 7, 16


def _latents(n: int, seed: int, offset: int, masked: bool):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn((n, CHANNELS, SIDE, SIDE), generator=gen)
    cond = {"encoder_hidden_states": torch.randn((n, TEXT_LEN, TEXT_DIM), generator=gen)}
    if masked:
        lengths = torch.randint(2, TEXT_LEN + 1, (n,), generator=gen)
        cond["encoder_attention_mask"] = (torch.arange(TEXT_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()
    else:
        cond["pooled_projections"] = torch.randn((n, TEXT_DIM), generator=gen)
    return latents, list(range(offset, offset + n)), cond


def sd3_latents(n: int = N_IMAGES, seed: int = 1):
    """(latents, ids, {encoder_hidden_states, pooled_projections}) for twinrun.models.sd3."""
    return _latents(n, seed, 0, masked=False)


def pixart_latents(n: int = N_IMAGES, seed: int = 1):
    """(latents, ids, {encoder_hidden_states, encoder_attention_mask}) for twinrun.models.pixart."""
    return _latents(n, seed, 0, masked=True)


def sd3_train_and_heldout(n_train: int = 64, n_heldout: int = 16, seed: int = 1):
    """The training measure's ((train latents, ids, cond), (held-out latents, ids, cond))."""
    return _latents(n_train, seed, 0, masked=False), _latents(n_heldout, seed + 1, n_train, masked=False)
