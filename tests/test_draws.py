"""Shared draws: a pure function of (seed, bin σ, image, draw), whatever the arm or layout."""

import torch

from twinrun import draws

SHAPE = (1, 8, 8)


def test_same_coordinates_same_noise_across_calls_and_layouts():
    full = draws.noise(0, 0.5, [10, 11, 12, 13], 3, SHAPE)
    # another "batch layout": images in a different order and split into two calls
    part_a = draws.noise(0, 0.5, [13, 11], 3, SHAPE)
    part_b = draws.noise(0, 0.5, [12, 10], 2, SHAPE)  # fewer draws: a prefix of the same stream
    assert torch.equal(part_a[0], full[3]) and torch.equal(part_a[1], full[1])
    assert torch.equal(part_b[0], full[2, :2]) and torch.equal(part_b[1], full[0, :2])


def test_every_coordinate_changes_the_noise():
    base = draws.noise(0, 0.5, [10], 2, SHAPE)
    others = [
        draws.noise(1, 0.5, [10], 2, SHAPE)[0, 0],  # seed
        draws.noise(0, 0.35, [10], 2, SHAPE)[0, 0],  # bin
        draws.noise(0, 0.5, [11], 2, SHAPE)[0, 0],  # image
        base[0, 1],  # draw
    ]
    for other in others:
        assert not torch.allclose(base[0, 0], other)


def test_noise_is_standard_normal_float32_on_cpu():
    eps = draws.noise(7, 1.0, list(range(50)), 20, SHAPE)
    assert eps.dtype == torch.float32 and eps.device.type == "cpu"
    assert abs(eps.mean().item()) < 0.02 and abs(eps.std().item() - 1) < 0.02


def test_digest_names_exactly_what_was_consumed():
    eps = draws.noise(0, 0.5, [1, 2], 2, SHAPE)
    same = draws.noise(0, 0.5, [1, 2], 2, SHAPE)
    assert draws.digest(eps, 0.5) == draws.digest(same, 0.5)
    assert draws.digest(eps, 0.5) != draws.digest(eps, 0.35)
    flipped = eps.clone()
    flipped.view(-1)[5] = torch.nextafter(flipped.view(-1)[5], torch.tensor(10.0))
    assert draws.digest(flipped, 0.5) != draws.digest(eps, 0.5)
