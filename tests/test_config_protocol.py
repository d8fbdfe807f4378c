"""The protocol and the defaults are defined once, in the typed schema (twinrun.config)."""

from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from twinrun.config import DeterminismConfig, ProbeConfig, TwinrunConfig
from twinrun.errors import StoreError
from twinrun.instantiate import typed
from twinrun.measures.probe import arithmetic
from twinrun.protocol import PROTOCOL_KEYS, protocol_differences
from twinrun.provenance import record as provenance


def test_every_protocol_key_is_a_key_of_the_schema():
    schema = OmegaConf.structured(TwinrunConfig)
    for key in PROTOCOL_KEYS:
        head, _, rest = key.partition(".")
        assert head in {f.name for f in fields(TwinrunConfig)} and (not rest or rest in schema[head]), key


def test_protocol_differences_name_each_differing_key_and_only_those():
    base = {"data": {"_target_": "d"}, "sigma_grid": {"sigmas": [0.5]}, "seed": 0,
            "probe": {"n_images": 8, "n_draws": 2, "n_folds": 4, "params": ["*"], "chunk_images": 4,
                      "device": "cpu"}}
    assert protocol_differences(base, base) == []
    other = {**base, "seed": 1, "probe": {**base["probe"], "n_draws": 3, "chunk_images": 2, "device": "cuda"}}
    assert protocol_differences(base, other) == ["seed", "probe.n_draws"]  # chunks and device: kernel path
    assert protocol_differences(base, {k: v for k, v in base.items() if k != "data"}) == ["data"]


def test_typed_takes_defaults_from_the_schema_and_refuses_a_foreign_key():
    p = typed(ProbeConfig, {"n_images": 8}, "arms/native/config.yaml")
    assert p.n_images == 8 and p.n_draws == ProbeConfig().n_draws and p.compile is False
    with pytest.raises(StoreError, match=r"arms/native/config\.yaml: .*n_imgaes"):
        typed(ProbeConfig, {"n_imgaes": 8}, "arms/native/config.yaml")


def test_determinism_defaults_come_from_the_schema(monkeypatch):
    seen = {}
    monkeypatch.setattr(provenance, "apply_determinism", lambda *args: seen.setdefault("args", args))
    provenance.setup_determinism({"determinism": {}})
    d = DeterminismConfig()
    assert seen["args"] == (d.enabled, provenance.default_compile_cache_dir(), d.float32_matmul_precision)


def test_the_probe_arithmetic_record_reads_every_arithmetic_setting():
    p = ProbeConfig()
    record = arithmetic(p, "folds", "cpu")
    assert record == {"method": "folds", "compile": False, "device": "cpu", "chunk_images": p.chunk_images,
                      "chunk_draws": p.chunk_draws, "accumulator_dtype": p.accumulator_dtype}
    assert {f.name for f in fields(ProbeConfig)} >= set(record) - {"method", "device"}
