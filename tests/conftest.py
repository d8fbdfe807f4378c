import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from twinrun.app import CONF_DIR
from twinrun.config import register_configs

REPO = Path(__file__).resolve().parent.parent

# A run small enough for a unit test: 3 bins, 8 images x 2 draws, 4 folds.
TINY = [
    "probe.n_images=8",
    "probe.n_draws=2",
    "probe.n_folds=4",
    "sigma_grid.sigmas=[0.2,0.5,1.2]",
]


@pytest.fixture
def compose_cfg():
    """Compose the real conf/ with overrides, as `python -m twinrun` would."""
    register_configs()

    def _compose(overrides=()):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    return _compose


def run_twinrun(args, cwd, module="twinrun", timeout=600, env=None):
    """`python -m twinrun ...` in a subprocess; returns CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
