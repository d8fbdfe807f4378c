"""The Hydra app: `python -m twinrun +experiment=pin_sigma [overrides]`.

Plans the run (validate, derive the twin, write configs), measures both arms bin by bin, then
reduces. The process exits with the reducer's code (0 ok, 1 gate/check failed, 2 bad input).
"""

import functools
import secrets
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from twinrun.config import register_configs
from twinrun.errors import EXIT_USAGE, TwinrunError, fail

# conf/ sits beside the package in a checkout or editable install (`pip install -e .`).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

_state = {"task_started": False, "codes": []}


@functools.lru_cache(maxsize=None)
def _unique() -> str:
    # Hydra's ${now:} has one-second resolution: two runs started in the same second would share
    # a directory (Hydra #2925). A per-process random suffix keeps them apart.
    return secrets.token_hex(3)


def run_point(cfg: DictConfig, run_dir: Path) -> int:
    """Plan, measure and reduce one run (one sweep point); return the reducer's exit code."""
    from twinrun.reduce import reduce_run, render
    from twinrun.run import plan_run, run_job

    plan_run(cfg, run_dir)
    print(f"twinrun: run directory {run_dir}", flush=True)
    run_job(run_dir)
    summary, code = reduce_run(run_dir, chunk_params=cfg.reduce.chunk_params)
    print(render(summary), flush=True)
    return code


def _task(cfg: DictConfig) -> int:
    _state["task_started"] = True
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        code = run_point(cfg, run_dir)
    except TwinrunError as err:
        if hc.mode == RunMode.MULTIRUN:
            print(f"twinrun: error: {err}", file=sys.stderr)
            code = err.exit_code
        else:
            fail(err)
    if hc.mode == RunMode.MULTIRUN:
        _state["codes"].append(code)
        return code
    raise SystemExit(code)


def main() -> None:
    register_configs()
    if not OmegaConf.has_resolver("twinrun.unique"):
        OmegaConf.register_new_resolver("twinrun.unique", _unique)
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_task)
    try:
        app()
    except SystemExit as exc:
        # Hydra reports a config it cannot compose (typo'd key, bad type, unknown option) with
        # exit 1, which twinrun reserves for a failed gate: report it as bad input.
        if exc.code == 1 and not _state["task_started"]:
            raise SystemExit(EXIT_USAGE) from None
        raise
    if _state["codes"]:
        raise SystemExit(max(_state["codes"]))
