"""Paths a run writes to fail as one line naming the key or file, never as a traceback."""

from pathlib import Path

import matplotlib
import pytest
from matplotlib.figure import Figure

from twinrun.errors import ConfigError, StoreError
from twinrun.plan import check_paths
from twinrun.publish.figures import save_figure
from twinrun.storage.rundir import RunDir

matplotlib.use("Agg")  # tests only: twinrun itself never switches a backend at import


def test_a_plot_that_cannot_be_written_is_one_store_error(tmp_path):
    (tmp_path / "not_a_dir").write_text("x")
    fig = Figure()
    fig.add_subplot().plot([0, 1])
    with pytest.raises(StoreError, match="effect.png: cannot write"):
        save_figure(fig, tmp_path / "not_a_dir" / "effect.png")
    save_figure(fig, tmp_path / "effect.png")
    assert (tmp_path / "effect.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unwritable_compile_cache_and_a_non_utf8_run_dir_are_refused_at_plan_time(compose_cfg, tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = compose_cfg(["+experiment=pin_sigma",
                       f"determinism.compile_cache_dir={tmp_path / 'file' / 'cache'}"])
    with pytest.raises(ConfigError, match="determinism.compile_cache_dir"):
        check_paths(cfg, tmp_path / "run")
    cfg = compose_cfg(["+experiment=pin_sigma"])
    bad = Path(b"run-\xff".decode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match="hydra.run.dir.*not valid UTF-8"):
        check_paths(cfg, tmp_path / bad)
    check_paths(cfg, tmp_path / "run")  # a plain one passes


def test_a_fifo_in_place_of_an_arm_config_is_refused_not_waited_on(tmp_path):
    import os

    (tmp_path / "arms" / "native").mkdir(parents=True)
    os.mkfifo(tmp_path / "arms" / "native" / "config.yaml")
    with pytest.raises(StoreError, match="config.yaml"):
        RunDir(tmp_path).read_arm_config("native")  # before: path.read_text() blocked forever on the FIFO
