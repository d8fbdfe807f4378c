"""Latent and conditioning caches: written from an encoder, read back exactly, every file's sha256 recorded;
a missing, damaged or mismatched cache is one line naming the file and the key."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_twinrun

from twinrun import caches, conditioning
from twinrun.errors import StoreError

TESTS = Path(__file__).resolve().parent


def written(tmp_path, n=6):
    gen = torch.Generator().manual_seed(0)
    encoder = torch.nn.Conv2d(3, 4, 2, stride=2)  # a stand-in for a VAE's encoder: pixels -> latents
    pixels = torch.randn(n, 3, 16, 16, generator=gen)
    with torch.no_grad():
        latents = encoder(pixels)
    cond = {"text": torch.randn(n, 5, 6, generator=gen), "labels": torch.arange(n) % 3}
    ids = list(range(100, 100 + n))
    lat = caches.write_cache(tmp_path / "latents.safetensors", {"latents": latents}, ids)
    con = caches.write_cache(tmp_path / "cond.safetensors", cond, ids)
    return lat, con, latents, ids, cond


def test_a_cache_reads_back_exactly_with_each_files_digest(tmp_path):
    lat, con, latents, ids, cond = written(tmp_path)
    with caches.recording() as files:
        x, got_ids, got_cond = caches.load_cache(str(lat), str(con))
    assert torch.equal(x, latents) and got_ids == ids
    assert got_cond.keys() == cond.keys() and all(torch.equal(got_cond[k], cond[k]) for k in cond)
    assert files == {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in (lat, con)}
    conditioning.check(got_cond, x.shape[0])  # what the probe then checks against the model


@pytest.mark.parametrize(("damage", "file", "said"), [
    ("missing", "cond", "not found"),
    ("truncated", "latents", "but its header describes"),
    ("fifo", "cond", "not a regular file"),
    ("other_ids", "cond", "key 'ids': disagrees"),
    ("reordered", "cond", "in another order"),
    ("no_latents", "latents", "key 'latents': missing"),
    ("short_entry", "cond", "key 'text'"),
])
def test_a_bad_cache_is_one_line_naming_the_file_and_key(tmp_path, damage, file, said):
    lat, con, latents, ids, cond = written(tmp_path)
    if damage == "missing":
        con.unlink()
    elif damage == "truncated":
        lat.write_bytes(lat.read_bytes()[:-20])
    elif damage == "fifo":  # refused without waiting for a writer (the test would hang otherwise)
        con.unlink()
        os.mkfifo(con)
    elif damage == "other_ids":
        caches.write_cache(con, cond, [i + 1 for i in ids])
    elif damage == "reordered":
        caches.write_cache(con, {k: v.flip(0) for k, v in cond.items()}, ids[::-1])
    elif damage == "no_latents":
        caches.write_cache(lat, {"z": latents}, ids)
    elif damage == "short_entry":
        torch_cond = {**cond, "text": cond["text"][:-1]}
        from safetensors.torch import save_file
        save_file({**torch_cond, "ids": torch.tensor(ids)}, str(con))
    with pytest.raises(StoreError) as err:
        caches.load_cache(str(lat), str(con))
    text = str(err.value)
    assert text.startswith(str(lat if file == "latents" else con)) and said in text and "\n" not in text


def test_a_run_on_a_mismatched_cache_exits_2_naming_it(tmp_path):
    lat, con, _, ids, cond = written(tmp_path)
    caches.write_cache(con, cond, [i + 1 for i in ids])
    proc = run_twinrun(["+experiment=pin_sigma", *TINY,
                        "data=cache", f"data.latents={lat}", f"data.conditioning={con}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert str(con) in proc.stderr and "key 'ids'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_training_run_on_caches_names_each_files_digest_in_its_summary_and_report(tmp_path):
    gen = torch.Generator().manual_seed(0)
    train = caches.write_cache(tmp_path / "train.safetensors",
                               {"latents": torch.rand(24, 1, 8, 8, generator=gen)}, list(range(24)))
    held = caches.write_cache(tmp_path / "held.safetensors",
                              {"latents": torch.rand(8, 1, 8, 8, generator=gen)}, list(range(100, 108)))
    run = tmp_path / "run"
    proc = run_twinrun(["+experiment=train_scale_lr", "data=cache_train", f"data.train_latents={train}",
                        f"data.heldout_latents={held}", "train.steps=2", "train.segment_steps=1",
                        "train.batch_size=8", "train.heldout_images=8", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    digests = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in (train, held)}
    assert json.loads((run / "summary.json").read_text())["data_files"] == digests
    report = (run / "report.md").read_text()
    assert "## Data caches" in report and all(sha in report for sha in digests.values())
