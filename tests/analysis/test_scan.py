"""The reducer's one streaming pass (twinrun.analysis.scan) against a whole-matrix numpy reduction of the
same stores."""

import hashlib
import itertools
import json
import os

import numpy as np
import pytest
import torch
from stores import meta, scan_sums, write_all, write_sums

from twinrun.analysis.estimands import ESTIMANDS, MinusBaseMean, available, check_estimands, registry
from twinrun.analysis.scan import scan
from twinrun.errors import ConfigError, StoreError
from twinrun.storage import store as store_mod
from twinrun.storage.store import StoreReader

N_BINS, N_FOLDS = 4, 5
LAYOUT = [{"name": "blocks.0.a", "offset": 0, "numel": 7, "cond": False},
          {"name": "blocks.0.b", "offset": 7, "numel": 5, "cond": True},
          {"name": "blocks.1.c", "offset": 12, "numel": 9, "cond": False},
          {"name": "head.d", "offset": 21, "numel": 3, "cond": True}]
P = 24
GROUPS = {"block0": ["blocks.0.*"], "heads": ["head.*", "nothing.*"]}
COLUMNS = {"all": list(range(P)), "residual": list(range(P)), "cond": [*range(7, 12), *range(21, 24)],
           "block0": list(range(12)), "heads": list(range(21, 24))}


def random_sums(arms, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sums = {(a, b): (torch.randn(N_FOLDS, P, generator=gen) * 3 + 1).float()
            for a in arms for b in range(N_BINS)}
    sums["native_replicate", 2] = sums["native", 2].clone()  # the gate replicate: one bin, bit-identical
    sums["native_replicate", 3] = sums["native", 3].clone()
    sums["native_replicate", 3][1, 22] = torch.nextafter(sums["native", 3][1, 22],
                                                         torch.tensor(100.0))  # one ulp
    return sums


def numpy_grams(sums, arms, columns, base="native"):
    """Whole-matrix reduction: every store as one float64 numpy [F, P] matrix; the full Gram over rows
    (arm, bin, fold), and of the residual rows S_b − c_b·M: M_f the mean over bins of the base's fold sums
    each divided by c_b', c_b the base's plain mean-gradient norm at bin b (docs/estimator.md)."""
    rows = np.concatenate([sums[a, b].double().numpy()[:, columns] for a in arms for b in range(N_BINS)])
    base_sums = np.stack([sums[base, b].double().numpy()[:, columns] for b in range(N_BINS)])  # [B, F, P]
    n_samples = 4 * N_FOLDS  # stores.meta: 4 images a fold
    scale = np.linalg.norm(base_sums.sum(1), axis=-1) / n_samples  # [B]
    mean = (base_sums / scale[:, None, None]).mean(0)
    c = np.tile(np.repeat(scale, N_FOLDS), len(arms))[:, None]  # each row's bin's c_b
    resid = rows - c * np.tile(mean, (len(arms) * N_BINS, 1))
    return rows @ rows.T, resid @ resid.T


@pytest.mark.parametrize("arms", [["pin_sigma", "native"], ["pin_sigma", "native", "scale_noop"]])
@pytest.mark.parametrize("chunk_params", [1, 4, 1000])
def test_streaming_pass_equals_a_whole_matrix_numpy_reduction(tmp_path, arms, chunk_params):
    sums = random_sums(arms)
    names = [*ESTIMANDS, *GROUPS]
    pairs = [(a, "native") for a in arms if a != "native"] + [("native_replicate", "native")]
    found = scan_sums(tmp_path, sums, LAYOUT, arms, N_BINS, names, pairs, groups=GROUPS,
                      chunk_params=chunk_params)
    for name in names:
        full, resid = numpy_grams(sums, arms, COLUMNS[name])
        derived = ESTIMANDS[name].derive if name in ESTIMANDS else None
        want_full = resid if isinstance(derived, MinusBaseMean) else full
        got = found.gram(name, "native")
        for b in range(N_BINS):
            for i in range(len(arms)):
                for j in range(len(arms)):
                    ri = slice((i * N_BINS + b) * N_FOLDS, (i * N_BINS + b + 1) * N_FOLDS)
                    rj = slice((j * N_BINS + b) * N_FOLDS, (j * N_BINS + b + 1) * N_FOLDS)
                    np.testing.assert_allclose(got[b, i, :, j], want_full[ri, rj], rtol=1e-12, atol=1e-10)
    # bit-identity and max |x − y| / max |y| over each estimand's columns, against numpy on the whole matrices
    for (x, y, b), pair in found.pairs.items():
        xs, ys = sums[x, b].double().numpy(), sums[y, b].double().numpy()
        assert pair.identical == bool((xs == ys).all())
        assert pair.max_abs_diff == np.abs(xs - ys).max()
        for name in names:
            c = COLUMNS[name]
            worst = np.abs(xs[:, c] - ys[:, c]).max()
            assert pair.shift(name) == (0.0 if worst == 0 else worst / np.abs(ys[:, c]).max())
    assert found.pairs["native_replicate", "native", 2].identical
    rep = found.pairs["native_replicate", "native", 3]
    assert not rep.identical and rep.shift("heads") > 0 and rep.shift("block0") == 0.0
    assert ("native_replicate", "native", 0) not in found.pairs  # no replicate store in bin 0


def test_residual_against_two_bases_in_one_pass(tmp_path):
    """References compare against both today's twin and the reference's mean: one pass, two residual bases."""
    arms = ["ref", "native"]
    sums = {k: v for k, v in random_sums(arms, seed=4).items() if k[0] in arms}
    found = scan_sums(tmp_path, sums, LAYOUT, arms, N_BINS, ["residual"], [("ref", "native")], bases=arms)
    for base in arms:
        _, resid = numpy_grams(sums, arms, COLUMNS["residual"], base=base)
        got = found.gram("residual", base)
        np.testing.assert_allclose(got[1, 0, :, 1],
                                   resid[N_FOLDS * 1 : N_FOLDS * 2, N_FOLDS * 5 : N_FOLDS * 6], rtol=1e-12)


def test_every_byte_is_read_once_in_file_order(tmp_path, monkeypatch):
    sums = random_sums(["pin_sigma", "native"])
    readers = write_all(tmp_path, sums, LAYOUT)
    reads = {}
    original = os.pread

    def counting(fd, n, offset):
        reads.setdefault(fd, []).append((offset, n))
        return original(fd, n, offset)

    monkeypatch.setattr(store_mod.os, "pread", counting)
    fds = {r.fd: r for r in readers.values()}
    scan(readers, ["pin_sigma", "native"], N_BINS, ["all"], None, ["native"], [("pin_sigma", "native")],
         chunk_params=3)
    for fd, r in fds.items():
        payload = sorted(reads[fd])
        assert payload == reads[fd], "front to back"
        covered = [(o, n) for o, n in payload if n]
        assert sum(n for _, n in covered) == r.path.stat().st_size - r.tensors[0].start
        assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(covered)), "no byte twice, none skipped"


def test_a_tensor_whose_bytes_do_not_match_its_own_sha256_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    write_sums(path, torch.ones(N_FOLDS, P), meta(LAYOUT, N_FOLDS))
    reader = StoreReader(path)
    target = next(t for t in reader.tensors if t.name == "blocks.1.c")
    reader.close()
    data = bytearray(path.read_bytes())
    data[target.start + 8] ^= 0x01  # one bit of one tensor; the file's sha256 (run.json) updated to match
    path.write_bytes(bytes(data))
    sha = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(StoreError, match="tensor 'blocks.1.c' does not match its sha256"):
        scan({("native", 0): StoreReader(path, sha)}, ["native"], 1, ["all"], None, ["native"], [])


def test_a_file_sha256_mismatch_is_refused_after_the_pass(tmp_path):
    path = tmp_path / "s.safetensors"
    write_sums(path, torch.ones(N_FOLDS, P), meta(LAYOUT, N_FOLDS))
    with pytest.raises(StoreError, match="sha256 does not match run.json"):
        scan({("native", 0): StoreReader(path, "0" * 64)}, ["native"], 1, ["all"], None, ["native"], [])


def test_an_old_format_store_is_one_line_asking_to_measure_again(tmp_path):
    import safetensors.torch

    path = tmp_path / "old.safetensors"
    path.write_bytes(safetensors.torch.save({"sums": torch.ones(3, 4)},
                                            metadata={"format": "twinrun-store/1"}))
    with pytest.raises(StoreError, match="format twinrun-store/1 .* measure the run again"):
        StoreReader(path)


def test_a_store_is_one_tensor_per_parameter_with_its_digest(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "s.safetensors"
    sums = torch.arange(N_FOLDS * P, dtype=torch.float32).reshape(N_FOLDS, P)
    write_sums(path, sums, meta(LAYOUT, N_FOLDS))
    with safe_open(str(path), framework="pt") as f:
        digests = json.loads(f.metadata()["tensor_sha256"])
        for g in LAYOUT:
            t = f.get_tensor(g["name"])
            assert torch.equal(t, sums[:, g["offset"] : g["offset"] + g["numel"]].T)  # [numel, n_folds]
            assert digests[g["name"]] == hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_an_estimand_is_one_registry_entry_and_a_group_needs_only_config():
    assert available(LAYOUT) == list(ESTIMANDS)
    assert available([{**e, "cond": False} for e in LAYOUT]) == ["all", "residual"]
    assert available(LAYOUT, GROUPS) == [*ESTIMANDS, "block0", "heads"]
    assert ([g["name"] for g in LAYOUT if registry(GROUPS)["block0"].selects(g)]
            == ["blocks.0.a", "blocks.0.b"])
    check_estimands(["all", "block0"], GROUPS, LAYOUT)


@pytest.mark.parametrize("names, groups, key", [
    (["all", "block7"], {}, "reduce.estimands"),
    (["all", "none"], {"none": ["decoder.*"]}, "reduce.groups.none"),
    (["all"], {"all": ["x"]}, "reduce.groups.all"),
    (["all"], {"g": []}, "reduce.groups.g"),
    (["cond"], {}, "reduce.estimands"),
])
def test_a_bad_estimand_or_group_is_one_line_naming_the_key(names, groups, key):
    layout = [{**e, "cond": False} for e in LAYOUT]
    with pytest.raises(ConfigError) as err:
        check_estimands(names, groups, layout)
    assert err.value.key == key and "\n" not in str(err.value)


def test_a_reader_refuses_to_skip_or_reread_bytes(tmp_path):
    """The file digest is only a proof when every byte is hashed once, in order: a skipped or
    repeated chunk is a programming error, not a silent number."""
    path = tmp_path / "s.safetensors"
    write_sums(path, torch.ones(N_FOLDS, P), meta(LAYOUT, N_FOLDS))
    with StoreReader(path) as reader:
        first = reader.tensors[0]
        reader.columns(first, 0, 2)
        with pytest.raises(AssertionError, match="out of order"):
            reader.columns(first, 3, 4)  # column 2 skipped
        with pytest.raises(AssertionError, match="out of order"):
            reader.columns(first, 0, 2)  # read again
