r"""Your own text-to-image model under twinrun: caches written from an encoder, and a LoRA adapter.

    python examples/text_to_image/t2i.py encode --out caches        # latent and text-embedding caches
    python examples/text_to_image/t2i.py adapter --out adapters/lora  # a LoRA adapter for the network

The encoder here stands in for yours: a small AutoencoderKL (the VAE) and a CLIP text encoder with
projection (sequence and pooled embeddings, as SD3 reads them), both diffusers/transformers classes,
random-initialised and seeded so that the example needs no download. Swap in your own with
`AutoencoderKL.from_pretrained(...)`, `CLIPTextModelWithProjection.from_pretrained(...)` and its
tokenizer: what twinrun reads is only the caches' tensors (docs/bring-your-own.md).
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from sklearn.datasets import load_digits
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from twinrun import lora
from twinrun.caches import LATENTS, write_cache
from twinrun.data import heldout_indices, load_digits_images, train_indices
from twinrun.models.sd3 import LORA_TARGETS, sd3

ENCODER_SEED = 0  # the stand-in encoders' weights
IMAGE_SIDE = 16  # the digits, upsampled: the VAE halves it to latents of 8x8
LATENT_CHANNELS = 4
TEXT_TOKENS = 16  # padded prompt length
TEXT_DIM = 16  # the text encoder's width = the network's joint_attention_dim and pooled_projection_dim
WORDS = ["<pad>", "<bos>", "<eos>", "a", "photo", "of", "handwritten", "digit", "zero", "one", "two", "three",
         "four", "five", "six", "seven", "eight", "nine"]
NUMBERS = WORDS[8:]
# The network's own keyword arguments: the caches name their tensors exactly so.
SEQUENCE, POOLED = "encoder_hidden_states", "pooled_projections"


def encoders() -> tuple[AutoencoderKL, CLIPTextModelWithProjection]:
    """The stand-in VAE and text encoder, drawn under ENCODER_SEED (the global generators restored)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ENCODER_SEED)
        vae = AutoencoderKL(in_channels=1, out_channels=1, latent_channels=LATENT_CHANNELS,
                            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
                            block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1,
                            sample_size=IMAGE_SIDE)
        text = CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(WORDS), hidden_size=TEXT_DIM, intermediate_size=2 * TEXT_DIM, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=TEXT_TOKENS, projection_dim=TEXT_DIM,
            pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return vae.eval(), text.eval()


def tokenize(prompt: str) -> list[int]:
    """Word-level ids, <bos> … <eos>, padded to TEXT_TOKENS (your tokenizer does this for real)."""
    ids = [1, *(WORDS.index(w) for w in prompt.split()), 2]
    return ids + [0] * (TEXT_TOKENS - len(ids))


@torch.no_grad()
def encode(images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(latents [M, 4, 8, 8], {encoder_hidden_states [M, L, D], pooled_projections [M, D]}): the VAE's
    posterior mean times its scaling factor, and the text encoder's last hidden state and projection."""
    vae, text = encoders()
    pixels = F.interpolate(images, size=(IMAGE_SIDE, IMAGE_SIDE), mode="bilinear", align_corners=False)
    latents = vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor
    out = text(input_ids=torch.tensor([tokenize(p) for p in prompts]))
    return latents.contiguous(), {SEQUENCE: out.last_hidden_state.contiguous(), POOLED: out.text_embeds}


def digits_with_prompts(indices: torch.Tensor) -> tuple[torch.Tensor, list[int], list[str]]:
    images, labels = load_digits_images(), load_digits().target
    prompts = [f"a photo of handwritten digit {NUMBERS[int(labels[i])]}" for i in indices]
    return images[indices], [int(i) for i in indices], prompts


def encode_split(out: Path, split: str, indices: torch.Tensor) -> None:
    images, ids, prompts = digits_with_prompts(indices)
    latents, cond = encode(images, prompts)
    # twinrun's cache format: the tensors by name and the ids, the same ids in the same order in both files.
    write_cache(out / f"{split}_latents.safetensors", {LATENTS: latents}, ids)
    write_cache(out / f"{split}_text.safetensors", cond, ids)
    print(f"t2i: {split}: {len(ids)} latents {tuple(latents.shape[1:])} and text embeddings "
          f"{ {k: tuple(v.shape[1:]) for k, v in cond.items()} } -> {out}/{split}_*.safetensors")


def main_encode(out: Path) -> None:
    n_total = load_digits_images().shape[0]
    encode_split(out, "train", train_indices(n_total))
    encode_split(out, "heldout", heldout_indices(n_total))


def main_adapter(out: Path, rank: int, seed: int) -> None:
    """A LoRA adapter on the example network's attention projections, both factors drawn (as if trained:
    a fresh adapter's lora_B = 0 would make its probe's A-gradients zero)."""
    model = sd3(**EXAMPLE_NETWORK)
    lora.new_adapter(model.net, list(LORA_TARGETS), rank=rank, alpha=float(rank), seed=seed, zero_init=False)
    digest = lora.save_adapter(model.net, out)
    print(f"t2i: LoRA adapter rank {rank} on {', '.join(LORA_TARGETS)} -> {out} (sha256 {digest[:16]}…)")


# The network of conf/model/sd3_example.yaml (the adapter must be written for the same shapes).
EXAMPLE_NETWORK = {"resolution": 8, "channels": LATENT_CHANNELS, "patch_size": 2, "depth": 2, "heads": 2,
                   "head_dim": 16, "text_dim": TEXT_DIM, "pooled_dim": TEXT_DIM, "seed": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    enc = sub.add_parser("encode", help="write the latent and text-embedding caches of both splits")
    enc.add_argument("--out", type=Path, default=Path("caches"))
    ada = sub.add_parser("adapter", help="write a LoRA adapter for the example network")
    ada.add_argument("--out", type=Path, default=Path("adapters/lora"))
    ada.add_argument("--rank", type=int, default=4)
    ada.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.command == "encode":
        main_encode(args.out)
    else:
        main_adapter(args.out, args.rank, args.seed)


if __name__ == "__main__":
    main()
