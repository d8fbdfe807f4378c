"""An op that deterministic algorithms refuse is reported as such, with the knob, never as the model's
fault; the sentinel hashes only what must repeat under the run's determinism setting (issue 23, point 3).

torch refuses Tensor.put_ under deterministic algorithms on the CPU too, with the same message it gives
for CUDA-only ops (upsample and pooling backward, some attention backends): that real refusal stands in
for them here. cuBLAS's and Inductor's refusals are raised as stubs with torch's own words."""

import pytest
import torch
from conftest import TINY
from fault_models import NotDeterministicAboveSigma, tiny_dit
from torch._dynamo.exc import BackendCompilerFailed

from twinrun.errors import EXIT_USAGE, DeterminismError, ModelError
from twinrun.job import run_job
from twinrun.measures import failures, trial
from twinrun.measures import fold_sums as fs
from twinrun.plan import plan_run, trusted_targets
from twinrun.provenance import determinism, record
from twinrun.provenance.sentinel import repeats_backward
from twinrun.storage.rundir import RunIndex

UNIT = {"label": "bin 2 (σ=1.2)"}
CUBLAS = ("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
          "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because "
          "it uses CuBLAS and you have CUDA >= 10.2. To enable deterministic behavior in this case, you must "
          "set an environment variable before running your PyTorch application: "
          "CUBLAS_WORKSPACE_CONFIG=:4096:8 or CUBLAS_WORKSPACE_CONFIG=:16:8.")
INDUCTOR = ("In the deterministic mode of Inductor, we will avoid those benchmarkings that would cause "
            "non-deterministic results.")


@pytest.fixture(autouse=True)
def switches_restored():
    state = determinism._current()
    yield
    determinism._restore(state)


def refused_put() -> RuntimeError:
    torch.use_deterministic_algorithms(True)
    try:
        torch.zeros(4).put_(torch.tensor([0]), torch.ones(1))
    except RuntimeError as err:
        return err
    raise AssertionError("torch no longer refuses put_ under deterministic algorithms: pick another op")


def test_torchs_refusal_of_an_op_names_the_op_and_the_knob_not_the_model():
    with pytest.raises(DeterminismError) as err:
        failures.as_model_error("native", UNIT, lambda: (_ for _ in ()).throw(refused_put()))
    line = str(err.value)
    assert line.startswith("determinism.enabled=True: arm native, bin 2 (σ=1.2): the op put_ has no ")
    assert "deterministic algorithms are on" in line and "set determinism.enabled=false" in line
    assert "not the model's fault" in line and "user code raised" not in line
    assert err.value.exit_code == EXIT_USAGE
    with pytest.raises(ModelError):  # any other error of the model stays the model's (exit 4)
        failures.as_model_error("native", UNIT, lambda: (_ for _ in ()).throw(ValueError("my bug")))


def wrapped(cause: BaseException) -> BaseException:
    """`cause` raised inside user code that wraps it in an error of its own (`raise … from`)."""
    try:
        raise cause
    except type(cause) as inner:
        try:
            raise ValueError("the model's forward failed") from inner
        except ValueError as outer:
            return outer


@pytest.mark.parametrize("raised, says, fix", [
    (RuntimeError(CUBLAS), "cuBLAS is deterministic only with CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8",
     "unset CUBLAS_WORKSPACE_CONFIG"),
    # torch.compile wraps what Inductor raised (its message quotes it).
    (BackendCompilerFailed(lambda: None, RuntimeError(INDUCTOR), None),
     "Inductor runs in its deterministic mode", "use probe.compile=default"),
    # A wrapper whose own message says nothing: the refusal is found in its cause.
    (wrapped(RuntimeError(INDUCTOR)), "Inductor runs in its deterministic mode", "use probe.compile=default"),
])
def test_cublas_and_inductor_refusals_are_named_with_their_own_fix(monkeypatch, raised, says, fix):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(DeterminismError) as err:
        failures.as_model_error("native", UNIT, lambda: (_ for _ in ()).throw(raised))
    assert says in str(err.value) and fix in str(err.value), str(err.value)
    if "cuBLAS" in says:
        assert "':0:0'" in str(err.value)  # the value this process has, which twinrun kept


def test_the_trial_reports_the_refused_op_instead_of_taking_another_method():
    model = NotDeterministicAboveSigma()
    images = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    names = fs.select_params(model, ["*"])
    torch.use_deterministic_algorithms(True)
    with pytest.raises(DeterminismError, match=r"the trial run under probe.method=vmap: the op put_"):
        trial.run_trial(model, names, images, 1.2, {"native": torch.tensor(1.2)}, "auto")
    torch.use_deterministic_algorithms(False)  # the knob the message names: the same trial then runs
    assert trial.run_trial(model, names, images, 1.2, {"native": torch.tensor(1.2)}, "auto")[0] == "vmap"


def test_an_op_refused_mid_run_is_recorded_as_determinisms_and_earlier_bins_stay(tmp_path, compose_cfg):
    run_dir = tmp_path / "run"
    cfg = compose_cfg(["+experiment=pin_sigma", *TINY,
                       "model._target_=fault_models.not_deterministic_above_sigma"])
    plan_run(cfg, run_dir)  # planning runs its trial at the first σ, without determinism: fine
    with pytest.raises(DeterminismError) as err:
        run_job(run_dir, trusted_targets(cfg))
    assert "arm native, bin 2 (σ=1.2): the op put_" in str(err.value)  # (the twin is measured first)
    index = RunIndex.load(run_dir)
    assert index.failure["error"] == "determinism" and index.failure["unit_index"] == 2
    assert "type" not in index.failure  # not recorded as the model's exception
    assert [u["index"] for u in index.whole_units()] == [0, 1]


def test_the_sentinel_hashes_the_models_backward_only_where_it_must_repeat(monkeypatch):
    assert repeats_backward(torch.device("cpu"))
    torch.use_deterministic_algorithms(False)
    assert not repeats_backward(torch.device("cuda", 0))  # cuDNN weight gradients, atomics: need not repeat
    torch.use_deterministic_algorithms(True)
    assert repeats_backward(torch.device("cuda", 0))
    model, shape = tiny_dit(), (1, 8, 8)
    full = record.read_sentinel(model, torch.device("cpu"), shape)
    assert "model_backward" not in full["skipped"]
    # As on CUDA with determinism off: the model's forward only, and the reading says what it left out.
    monkeypatch.setattr(record, "repeats_backward", lambda device: False)
    forward_only = record.read_sentinel(model, torch.device("cpu"), shape)
    assert "need not repeat" in forward_only["skipped"]["model_backward"]
    assert forward_only["ops"]["model"] != full["ops"]["model"]
    expected = record.model_sentinel_fn(model, torch.device("cpu"), shape, backward=False)()
    assert expected.dim() == 4 and not expected.requires_grad  # the output alone, no gradient
    assert {k for k in full["ops"] if full["ops"][k] != forward_only["ops"][k]} == {"model"}
