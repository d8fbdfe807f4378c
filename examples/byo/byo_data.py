"""A researcher's own data: deterministic 12x12 bar images (no download)."""

import torch


def load_bars(n_images: int = 64, size: int = 12, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """The data builder interface: (images [M, C, H, W] float32, stable integer id per image).

    An image's id keys its noise draws, so ids must not depend on how many images are used.
    """
    gen = torch.Generator().manual_seed(seed)
    images = -torch.ones(n_images, 1, size, size)
    for i in range(n_images):
        pos = int(torch.randint(1, size - 2, (1,), generator=gen))
        if i % 2:
            images[i, 0, :, pos : pos + 2] = 1.0
        else:
            images[i, 0, pos : pos + 2, :] = 1.0
    return images, list(range(n_images))
