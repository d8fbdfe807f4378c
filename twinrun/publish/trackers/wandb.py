"""tracker=wandb: offline W&B runs (WANDB_MODE=offline), two per twinrun run in one group: the
intervention arm (config and verdict in its summary; its own quantities, the effects with SEs and the
gates in its history; the plots as images, report and summary as files) and the native twin (job_type
baseline). Both log their own quantities under the same keys (`norm2/<estimand>`, `loss/train`,
`loss/heldout`), so W&B's group view overlays them; a probe's history is plotted against `sigma`
(define_metric), a training run's against its optimizer step.

W&B writes nothing outside DIR: its config, cache, data and artifact directories are put there, and a
run that lands elsewhere (W&B falls back to /tmp/wandb when DIR cannot be written, and says nothing)
is refused. Upload later with `wandb sync DIR/wandb/offline-run-*`.
"""

import os
import shutil
from pathlib import Path

import wandb

SETTINGS = {"x_disable_stats": True, "x_disable_meta": True, "x_disable_machine_info": True,
            "x_save_requirements": False}


def _environment(store: Path) -> None:
    os.environ["WANDB_MODE"] = "offline"
    for key, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_ARTIFACT_DIR", "artifacts")):
        os.environ[key] = str(store / sub)


def _run(store: Path, project: str, group: str, job_type: str, name: str, config: dict):
    run = wandb.init(dir=str(store), project=project, group=group, job_type=job_type, name=name,
                     config=config, settings=wandb.Settings(**SETTINGS), reinit="create_new")
    if not Path(run.dir).resolve().is_relative_to(store.resolve()):
        run.finish()
        raise OSError(f"W&B wrote its run to {run.dir}, not under {store}")
    return run


def _axis(run, p) -> None:
    """Every metric plotted against the payload's step field: σ (a probe), the optimizer step (training)."""
    if p.step_key is not None:
        run.define_metric(p.step_key)
        run.define_metric("*", step_metric=p.step_key)


def log(p, store: Path, project: str) -> str:
    """Log the payload; returns where (the two offline run directories)."""
    _environment(store)
    tags = {k.removeprefix("twinrun."): v for k, v in p.tags.items()}
    where = []
    # Two offline runs in one group, the baseline and the intervention, so W&B's group view overlays them; the
    # verdict goes on the intervention's summary.
    base = _run(store, project, p.name, "baseline", f"{p.name}/{p.baseline}",
                {"twinrun": {**tags, "role": "baseline"}})
    _axis(base, p)
    for step, row in p.logged(p.baseline_steps):
        base.log(row, step=step)
    where.append(str(Path(base.dir).parent))
    base.finish()
    run = _run(store, project, p.name, "intervention", f"{p.name}/{p.arm}",
               {**p.config, "twinrun": {**tags, "role": "intervention"}})
    _axis(run, p)
    for step, row in p.logged(p.arm_rows()):
        run.log(row, step=step)
    run.summary.update(p.verdict)
    for f in p.files:
        if f.suffix == ".png":
            run.log({f"plots/{f.stem}": wandb.Image(str(f))}, step=p.after_last_step())
        # A copy inside the store: W&B saves a file outside its run folder as a link to it, a link out of
        # the store that the next publish would refuse (twinrun.files.refuse_links_under).
        kept = Path(run.dir) / f.name
        shutil.copyfile(f, kept)
        run.save(str(kept), base_path=run.dir, policy="now")
    where.append(str(Path(run.dir).parent))
    run.finish()
    return ", ".join(where)
