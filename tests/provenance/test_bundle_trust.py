"""A compile bundle is code (Inductor's cache entries in it are pickles, unpickled on lookup), so a replay
loads only one a job of this user wrote on this machine, or one the user vouches for
(determinism.trust_bundle=true, `twinrun.env --cold-check --run RUN --trust-bundle`)."""

import os
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from twinrun import cold_check
from twinrun.errors import ConfigError, TwinrunError
from twinrun.job import open_pin
from twinrun.plan import check_pin_source
from twinrun.provenance import kernel_pin

SHA = "ab" * 32


@pytest.fixture()
def own_cache(tmp_path, monkeypatch):
    """This user's cache home, fresh: no bundle listed yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def a_record(sha=SHA) -> dict:
    return {"bundle": {"file": "env/compile-x.bundle", "sha256": sha},
            "capability": kernel_pin.capability(None)}


def test_a_bundle_a_job_wrote_here_is_listed_and_nothing_else_is(own_cache):
    assert not kernel_pin.written_here(SHA)
    kernel_pin.remember_written(SHA)
    assert kernel_pin.written_here(SHA)
    assert oct(os.stat(kernel_pin.written_bundles_dir()).st_mode & 0o777) == "0o700"
    for forged in ("../" + SHA[3:], SHA.upper(), SHA[:-1], None, 7, ""):
        assert not kernel_pin.written_here(forged)


def test_a_list_someone_else_may_write_vouches_for_nothing(own_cache):
    kernel_pin.remember_written(SHA)
    folder = kernel_pin.written_bundles_dir()
    folder.chmod(0o770)  # a group could have planted the entry
    assert not kernel_pin.written_here(SHA)
    folder.chmod(0o700)
    other = "cd" * 32
    (folder / other).symlink_to(folder / SHA)  # an entry that is a link is not one of ours
    assert kernel_pin.written_here(SHA) and not kernel_pin.written_here(other)


def test_a_named_run_whose_bundle_is_not_ours_is_refused_at_plan_in_one_line(own_cache, monkeypatch):
    monkeypatch.setattr(kernel_pin, "recorded_pin", lambda run_dir: a_record())
    cfg = OmegaConf.create({"determinism": {"kernel_path_from": "RUN"}})
    with pytest.raises(ConfigError) as err:
        check_pin_source(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith("determinism.kernel_path_from='RUN': ")
    assert "pickles" in line and "determinism.trust_bundle=true" in line
    check_pin_source(OmegaConf.create({"determinism": {"kernel_path_from": "RUN", "trust_bundle": True}}))
    kernel_pin.remember_written(SHA)
    check_pin_source(cfg)  # written by a job of ours here: no vouching needed


def test_the_job_replays_only_a_bundle_it_may_trust(own_cache, monkeypatch, capsys):
    monkeypatch.setattr(kernel_pin, "recorded_pin", lambda run_dir: a_record())
    loaded = []
    monkeypatch.setattr(kernel_pin, "read_bundle", lambda run_dir, record: b"bytes")
    monkeypatch.setattr(kernel_pin, "load_bundle", lambda data: loaded.append(data) or {"fx": ["k"]})
    index, cpu = SimpleNamespace(doc={"reference": "REF"}), torch.device("cpu")
    # a reference's bundle not ours: compared as today, not replayed, and the line says why
    assert open_pin(index, {"determinism": {}}, True, cpu)["from"] is None and not loaded
    assert "not replayed: reference='REF': its compile bundle was not written" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="determinism.kernel_path_from='RUN'"):
        open_pin(index, {"determinism": {"kernel_path_from": "RUN"}}, True, cpu)
    assert not loaded
    vouched = {"determinism": {"kernel_path_from": "RUN", "trust_bundle": True}}
    assert open_pin(index, vouched, True, cpu)["from"] == "RUN" and loaded == [b"bytes"]
    kernel_pin.remember_written(SHA)
    assert open_pin(index, {"determinism": {}}, True, cpu)["from"] == "REF" and len(loaded) == 2


def test_the_cold_check_of_a_run_whose_bundle_is_not_ours_asks_to_vouch(own_cache, monkeypatch, tmp_path):
    monkeypatch.setattr(kernel_pin, "recorded_pin", lambda run_dir: a_record())
    with pytest.raises(TwinrunError, match="add --trust-bundle"):
        cold_check.cold_check(tmp_path, "default", True)
