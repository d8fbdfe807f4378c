"""What a job does with an exception, whatever kind measures: user code's error as a ModelError naming
the arm, the unit and the frame (exit 4); what deterministic algorithms refused, with its knob (exit 2);
an allocation that failed; and run.json's failure fields for each. Every kind's session and the job
skeleton (twinrun/job.py) share them."""

import logging
import os
import traceback

import torch

from twinrun.errors import DeterminismError, ModelError, TwinrunError

log = logging.getLogger(__name__)


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def failing_frame(err: BaseException) -> str:
    """The innermost frame outside torch: the model code that made the failing call."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(torch_dir)]
    if not frames:
        return "inside torch"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()[:80]}"


def as_model_error(arm: str, u: dict, call, *args, **kwargs):
    """call(*args, **kwargs); anything the model raises becomes a ModelError (exit 4) naming arm and unit,
    except what is not the model's doing: an op refused under deterministic algorithms (DeterminismError,
    exit 2) and running out of memory (raised as it is, for the caller to name its estimate)."""
    try:
        return call(*args, **kwargs)
    except TwinrunError:
        raise
    except Exception as err:  # user code may raise anything: named, recorded, exit 4
        if is_out_of_memory(err):
            raise
        if determinism_cause(err) is not None:
            raise determinism_error(err, f"arm {arm}, {u['label']}") from err
        raise to_model_error(arm, u, err) from err


# What torch says when deterministic algorithms refuse an op (ATen's alertNotDeterministic, cuBLAS's
# workspace check) and when Inductor's deterministic mode refuses an autotuning benchmark.
NOT_DETERMINISTIC = " does not have a deterministic implementation"
CUBLAS_NOT_DETERMINISTIC = "because it uses CuBLAS"
INDUCTOR_DETERMINISTIC = "In the deterministic mode of Inductor"


def causes(err: BaseException) -> list[BaseException]:
    """The error and what it wraps (its cause and context), outermost first."""
    out, todo = [], [err]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
    return out


def determinism_cause(err: BaseException) -> str | None:
    """What deterministic algorithms refused, in words, if that is why `err` was raised; else None."""
    for e in causes(err):
        text = str(e)
        if NOT_DETERMINISTIC in text:
            line = next(ln for ln in text.splitlines() if NOT_DETERMINISTIC in ln)
            op = line.split(NOT_DETERMINISTIC)[0].strip().split()[-1]
            return f"the op {op} has no deterministic implementation on this device"
        if CUBLAS_NOT_DETERMINISTIC in text and "CUBLAS_WORKSPACE_CONFIG" in text:
            value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            return (f"cuBLAS is deterministic only with CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8, and this "
                    f"process has {value!r} (a value set before twinrun started is kept)")
        if INDUCTOR_DETERMINISTIC in text:
            return ("torch.compile's Inductor runs in its deterministic mode with deterministic algorithms "
                    "on (torch >= 2.10) and refused an autotuning benchmark")
    return None


def determinism_error(err: BaseException, where: str) -> DeterminismError:
    """The op (or cuBLAS, or Inductor) that deterministic algorithms refused, with the knob: exit 2."""
    cause = determinism_cause(err)
    fix = ("unset CUBLAS_WORKSPACE_CONFIG (twinrun then sets :4096:8) or set determinism.enabled=false"
           if "cuBLAS" in cause else "use probe.compile=default, or set determinism.enabled=false"
           if "Inductor" in cause else "set determinism.enabled=false (both arms still run on one kernel "
           "path; arms.replicate=true shows whether it repeats), or avoid that op in the model")
    return DeterminismError("determinism.enabled", True, f"{where}: {cause}, and deterministic algorithms "
                            f"are on; this is not the model's fault: {fix}")


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation failed: torch.cuda.OutOfMemoryError, or the CPU allocator's RuntimeError."""
    return any(isinstance(e, torch.cuda.OutOfMemoryError) or "can't allocate memory" in str(e)
               for e in causes(err))


def to_model_error(arm: str, u: dict, err: BaseException) -> ModelError:
    """User code's exception as a ModelError (exit 4) naming arm, unit, type, message and frame."""
    where = f"arm {arm}, {u['label']}"
    model_error = ModelError(f"{where}: user code raised {type(err).__name__}: {first_line(err)} "
                             f"(at {failing_frame(err)}); earlier units are kept, resume after fixing it")
    model_error.record = {"type": type(err).__name__, "message": first_line(err), "at": failing_frame(err)}
    log.error("%s", model_error)
    return model_error


def failure_record(err: BaseException | None) -> dict:
    """run.json's failure fields beyond arm and bin: when the model raised, its exception's type, message
    and frame (`as_model_error`); for twinrun's own refusals that a waiting launcher reads (kernel path,
    device, device memory, determinism), what it is and the line the console shows."""
    record = dict(getattr(err, "record", None) or {})
    if record and "type" not in record:
        record["message"] = str(err)
    return record
