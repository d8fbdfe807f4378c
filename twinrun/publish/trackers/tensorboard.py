"""tracker=tensorboard: event files under DIR/<project>/<run>/<arm> and DIR/<project>/<run>/<twin> (the
baseline), through torch's SummaryWriter (which needs the tensorboard package).

Both folders log their own quantities under the same tags (`norm2/<estimand>`, `loss/train`,
`loss/heldout`), so TensorBoard draws the twin and the arm as two runs of one chart; the comparison
(effects, distances, `gate/<name>`) is in the arm's folder. Steps are integers: a probe's step is σ in
millionths (σ = 0.5 is step 500000; σ is also a scalar of its own), a training run's its optimizer step.
The config, the verdict and the tags are text; the plots are images. Scalars are stored as float32.
"""

import json
from pathlib import Path

from matplotlib import image as mpimg
from torch.utils.tensorboard import SummaryWriter


def _table(rows: dict) -> str:
    return "| key | value |\n|---|---|\n" + "\n".join(f"| `{k}` | `{v}` |" for k, v in rows.items())


def _scalars(writer, logged: list[tuple[int, dict]]) -> None:
    for step, row in logged:
        for key, value in row.items():
            if value is not None:
                writer.add_scalar(key, value, global_step=step)


def log(p, store: Path, project: str) -> str:
    """Log the payload; returns where (the run's folder of event files)."""
    root = store / project / p.name
    # One folder of event files per arm under the run's name: TensorBoard overlays them as runs.
    base = SummaryWriter(log_dir=str(root / p.baseline))
    try:
        base.add_text("tags", _table({**p.tags, "twinrun.role": "baseline"}), 0)
        _scalars(base, p.logged(p.baseline_steps))
    finally:
        base.close()
    arm = SummaryWriter(log_dir=str(root / p.arm))
    try:
        arm.add_text("config", _table(p.params), 0)
        arm.add_text("verdict", _table(p.verdict), 0)
        arm.add_text("tags", _table({**p.tags, "twinrun.role": "intervention"}), 0)
        arm.add_text("config_json", json.dumps(p.config), 0)
        _scalars(arm, p.logged(p.arm_rows()))
        for key, value in p.verdict.items():
            arm.add_scalar(key, float(value), global_step=0)
        # Plots as images and the report as text, so the run reads in TensorBoard without its run directory.
        for f in p.files:
            if f.suffix == ".png":
                arm.add_image(f"plots/{f.stem}", mpimg.imread(str(f))[..., :3], 0, dataformats="HWC")
            elif f.suffix == ".md":  # the report, as TensorBoard's text dashboard renders markdown
                arm.add_text(f.stem, f.read_text(encoding="utf-8"), 0)
    finally:
        arm.close()
    return str(root)
