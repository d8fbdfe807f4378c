"""Arms that do not fit on the device together (`train.offload`): only the arm being trained is resident;
every other arm's weights, buffers, optimizer state and EMA wait in host memory (`cpu`) or in a file
of their own (`disk`) between its segments, and come back bit for bit (a copy between devices, or a
safetensors file read back, is exact). docs/training.md ("Arms that do not fit together").
"""

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from safetensors.torch import load_file

from twinrun.files import write_all
from twinrun.measures.train_state import ArmState, model_names, optimizer_record, restore_optimizer
from twinrun.storage.header import bytes_of
from twinrun.storage.train_store import safetensors_header

OFFLOADS = ("none", "cpu", "disk")


class Parking:
    """Where parked arms wait. `park(s)` moves an arm's tensors off the device (its model onto the meta
    device: no memory) and `unpark(s)` brings them back, through the same records a segment's store
    holds (weights and buffers by name, any optimizer's state, the EMA)."""

    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.held: dict[int, tuple[dict, dict]] = {}
        self.dir = Path(tempfile.mkdtemp(prefix="twinrun-parked-")) if mode == "disk" else None
        if self.dir is not None:  # removed when the session goes, whatever ends the job
            weakref.finalize(self, shutil.rmtree, str(self.dir), True)

    def active(self) -> bool:
        # Host memory is where a CPU run's arms already are: parking them there would only copy.
        return self.mode == "disk" or (self.mode == "cpu" and self.device.type != "cpu")

    def park(self, s: ArmState) -> None:
        if not self.active() or id(s) in self.held:
            return
        names = model_names(s.model)
        held = _held_tensors(s.model)
        tensors = {f"m/{n}": t.detach().to("cpu", copy=True) for n, t in held.items()}
        optim, meta = optimizer_record(s.optimizer, names)
        tensors.update({k: v.clone() for k, v in optim.items()})
        if s.ema is not None:
            tensors.update({k: v.clone() for k, v in s.ema.record().items()})
        if self.mode == "disk":
            path = self.dir / f"{len(self.held)}-{id(s)}.safetensors"
            write_parked(path, tensors)
            tensors = {"path": str(path)}
        self.held[id(s)] = (tensors, meta)
        s.optimizer.state.clear()
        # Emptied in place: the Parameter objects stay (the optimizer and the hooks hold them), their
        # memory goes.
        for t in held.values():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if s.ema is not None:
            s.ema.shadow = {}

    def unpark(self, s: ArmState) -> None:
        if id(s) not in self.held:
            return
        tensors, meta = self.held.pop(id(s))
        if "path" in tensors:
            path = tensors["path"]
            tensors = load_file(path)
            Path(path).unlink()
        for n, t in _held_tensors(s.model).items():
            t.data = tensors[f"m/{n}"].to(t.device, copy=True)
        restore_optimizer(s.optimizer, model_names(s.model), tensors, {"optimizer": meta})
        if s.ema is not None:
            s.ema.shadow = {n: torch.empty_like(p) for n, p in s.ema.params.items()}
            s.ema.restore(tensors)

    def drop(self, s: ArmState) -> None:
        """Forget an arm no segment trains again (arms.replicate_segments): its parked copy goes, host
        memory or file, so the rest of the job holds what the arms still training need."""
        held = self.held.pop(id(s), None)
        if held is not None and "path" in held[0]:
            Path(held[0]["path"]).unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the parked files (a job's end; a kill leaves them in the temporary directory)."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def write_parked(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file of the parked tensors, written straight from their memory: safetensors' own
    save_file first looks for tensors sharing storage (a Python pass over every tensor, about 10 ms an
    arm on the committed model, every segment for every arm), which a parked arm's copies never do. No
    fsync: the file lives only as long as the job (a crash loses the job, and the stores are the resume)."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, safetensors_header(tensors, {}))
        for t in tensors.values():
            write_all(fd, bytes_of(t))
    finally:
        os.close(fd)


def _held_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by its state_dict name (the tensors themselves, not copies)."""
    own = dict(model.named_parameters())
    own.update((n, b) for n, b in model.named_buffers() if n in model.state_dict())
    return own


def layout_line(offload: str, n_arms: int, arm_bytes: int) -> str:
    """What the device holds in each layout (train.offload), so a user sees which fits: every arm
    resident, or one arm (the one training) with the others parked in host memory or on disk."""
    mb = 1e6
    layouts = {"none": f"all {n_arms} arms on the device ({n_arms * arm_bytes / mb:,.1f} MB)",
               "cpu": f"one arm on the device ({arm_bytes / mb:,.1f} MB), {n_arms - 1} parked in host memory",
               "disk": f"one arm on the device ({arm_bytes / mb:,.1f} MB), {n_arms - 1} parked on disk"}
    others = "; ".join(f"offload={k}: {v}" for k, v in layouts.items() if k != offload)
    return f"models and optimizer states: {layouts[offload]} (train.offload={offload}; {others})"
