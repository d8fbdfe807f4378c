"""Plan time for stores: the run's store size (the gate replicate at gate bins only), a file system too
small refused before compute, and per-layer estimands declared in config only."""

import re
from collections import namedtuple

import pytest
from conftest import TINY

from twinrun.errors import ConfigError
from twinrun.plan import plan_run

DISK_USAGE = "twinrun.measures.probe.shutil.disk_usage"  # where planning asks for the free space
DiskUsage = namedtuple("DiskUsage", "total used free")


def size_line(out: str) -> tuple[int, int]:
    m = re.search(r"the stores will take about [\d.,]+ MB \(([\d,]+) bytes: (\d+) stores", out)
    assert m, out
    return int(m.group(1).replace(",", "")), int(m.group(2))


def test_the_store_size_counts_the_gate_replicate_at_gate_bins_only(compose_cfg, tmp_path, capsys):
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), tmp_path / "run", dry_run=True)
    n_stores = size_line(capsys.readouterr().out)[1]
    assert n_stores == 2 * 3 + 1  # 2 arms x 3 bins, + the replicate at the one gate bin (σ = 0.5)
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, "arms.replicate=true"]), tmp_path / "run",
             dry_run=True)
    assert size_line(capsys.readouterr().out)[1] == 3 * 3  # a replicate arm in every bin: no extra one


def test_the_printed_size_is_the_size_on_disk(compose_cfg, tmp_path, capsys):
    from twinrun.job import run_job
    from twinrun.storage.rundir import RunIndex

    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), tmp_path / "run")
    size, _ = size_line(capsys.readouterr().out)
    run_job(tmp_path / "run")
    index = RunIndex.load(tmp_path / "run")
    on_disk = sum(index.store_path(u, a).stat().st_size for u in index.units for a in u["stores"])
    assert abs(size - on_disk) / on_disk < 0.25  # the payload exactly, the header estimated


def test_a_store_header_its_reader_would_refuse_is_refused_at_plan_time(compose_cfg, tmp_path):
    # The pairing blocks grow with F²: at 200 folds of the default model's tensors a header would pass
    # the 64 MiB a reader accepts, so every store of the run would be written and then refused.
    cfg = compose_cfg(["+experiment=pin_sigma", *TINY, "probe.n_images=200", "probe.n_folds=200"])
    with pytest.raises(ConfigError, match=r"^probe.n_folds=200: each store's header would take about .* MiB"):
        plan_run(cfg, tmp_path / "run", dry_run=True)
    assert not (tmp_path / "run").exists()


def test_a_file_system_too_small_is_refused_at_plan_time(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(DISK_USAGE, lambda path: DiskUsage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ConfigError) as err:
        plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), tmp_path / "run")
    text = str(err.value)
    assert err.value.key == "probe.params" and "GiB free at" in text and "file system with room" in text
    assert not (tmp_path / "run").exists(), "nothing written, nothing computed"


def test_resuming_a_run_is_not_refused_for_the_stores_already_on_disk(compose_cfg, tmp_path, monkeypatch):
    """Planning again into an existing run (rerunning the command to resume) writes only the missing
    stores, beside those already there: the whole run's size is not held against the free space."""
    cfg = compose_cfg(["+experiment=pin_sigma", *TINY])
    plan_run(cfg, tmp_path / "run")
    monkeypatch.setattr(DISK_USAGE, lambda path: DiskUsage(10**9, 10**9 - 1000, 1000))
    assert plan_run(cfg, tmp_path / "run")["status"] == "planned"


def test_a_sweep_is_sized_where_it_will_write(compose_cfg, tmp_path, monkeypatch):
    """A sweep's points are checked against the sweep directory's file system, not the one the command
    was started from (a sweep aimed at a large scratch disk from a small home directory)."""
    from hydra import initialize_config_dir

    from twinrun.app import CONF_DIR, check_sweep

    seen = []
    monkeypatch.setattr(DISK_USAGE, lambda path: seen.append(path) or DiskUsage(10**12, 0, 10**12))
    monkeypatch.chdir(tmp_path)
    sweep_dir = tmp_path / "scratch" / "sweep"
    (tmp_path / "scratch").mkdir()
    compose_cfg()  # registers the structured configs
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        check_sweep([["+experiment=pin_sigma", *TINY]], {"experiment", "launcher"}, sweep_dir)
    assert seen and all(path == tmp_path / "scratch" for path in seen)


def test_a_per_layer_estimand_needs_only_config(compose_cfg, tmp_path):
    run = plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, "reduce.groups={block0:[blocks.0.*]}",
                                "reduce.estimands=[all,cond,residual,block0]"]), tmp_path / "run",
                   dry_run=True)
    assert run["registered"]["groups"] == {"block0": ["blocks.0.*"]}
    assert run["registered"]["estimands"] == ["all", "cond", "residual", "block0"]


@pytest.mark.parametrize("overrides, key", [
    (["reduce.estimands=[all,block0]"], "reduce.estimands"),
    (["reduce.groups={none:[decoder.*]}", "reduce.estimands=[all,none]"], "reduce.groups.none"),
    (["reduce.groups={block0:3}"], "reduce.groups.block0"),
    (["reduce.groups={cond:[blocks.*]}"], "reduce.groups.cond"),
])
def test_a_bad_estimand_or_group_is_refused_at_plan_time(compose_cfg, tmp_path, overrides, key):
    with pytest.raises(ConfigError) as err:
        plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, *overrides]), tmp_path / "run", dry_run=True)
    assert err.value.key == key
