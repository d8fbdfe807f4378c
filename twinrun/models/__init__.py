"""Adapters that give diffusers' text-conditioned networks twinrun's model interface (docs/models.md).

Each wraps one diffusers network as `net` and maps twinrun's call, forward(x_t, level, level_cond,
**cond), to the network's own conventions, with the per-image conditioning arriving as keyword
arguments named as diffusers names them. Built small and random-initialised from their configs (no
download), or from a local `pretrained` directory; a LoRA adapter checkpoint loads onto either.
They need the `diffusers` extra (and `peft` for an adapter): nothing else in twinrun imports them.
"""
