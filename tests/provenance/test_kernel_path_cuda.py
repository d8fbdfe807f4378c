"""What chooses kernels on CUDA is on the kernel path (issue 23, point 2): the probe's own GPU, what a
compile mode really turns on, the CUDA libraries' variables, switches a builder changed; and every run
compiles into a cache of its own, whose digest covers every entry that decides kernels, by content."""

import os
import types
from pathlib import Path

import pytest
import torch
import torch._inductor
from conftest import CPU, TINY, pin_device
from torch._inductor.codecache import CacheBase  # Inductor's own reader of its autotune timings

from twinrun.measures import probe
from twinrun.provenance import compile_cache, determinism
from twinrun.provenance.fingerprint import fingerprint, kernel_path_diff
from twinrun.provenance.record import kernel_path_sha256, setup_determinism


@pytest.fixture(autouse=True)
def switches_restored():
    state = determinism._current()
    yield
    determinism._restore(state)


def test_the_kernel_path_holds_the_probes_gpu_not_every_visible_one(monkeypatch):
    gpus = [types.SimpleNamespace(name=name, multi_processor_count=sm, major=9, minor=0, uuid=f"GPU-{k}")
            for k, (name, sm) in enumerate((("NVIDIA H100 80GB HBM3", 132), ("NVIDIA H100 MIG 3g.40gb", 60)))]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: gpus[torch.device(d).index or 0])
    on_second = fingerprint(device="cuda:1")
    assert on_second["kernel_path"]["gpu"] == {"name": "NVIDIA H100 MIG 3g.40gb", "sm_count": 60,
                                               "capability": "9.0"}
    assert on_second["info"]["device"] == "cuda:1" and on_second["info"]["device_uuid"] == "GPU-1"
    on_first = fingerprint(device="cuda:0")
    assert kernel_path_diff(on_first, on_second) == ["gpu.name", "gpu.sm_count"]
    assert fingerprint(device="cpu")["kernel_path"]["gpu"] is None  # a CPU run: no GPU chose its kernels


def test_a_compile_mode_is_recorded_by_what_it_turns_on(monkeypatch):
    compiled = fingerprint("max-autotune")["kernel_path"]["compile"]
    assert compiled["mode_options"] == torch._inductor.list_mode_options("max-autotune")  # read from torch
    assert compiled["effective"]["triton.cudagraphs"] is True
    assert compiled["effective"]["max_autotune"] is True
    assert fingerprint("default")["kernel_path"]["compile"]["effective"]["triton.cudagraphs"] is False
    # Deterministic algorithms put Inductor in its deterministic mode (autotuning skipped): recorded.
    assert compiled["effective"]["deterministic"] is torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not torch.are_deterministic_algorithms_enabled())
    flipped = fingerprint("max-autotune")["kernel_path"]["compile"]
    assert flipped["effective"]["deterministic"] is not compiled["effective"]["deterministic"]


@pytest.mark.parametrize("name, value", [
    ("PYTORCH_TUNABLEOP_ENABLED", "1"), ("DISABLE_ADDMM_CUDA_LT", "1"), ("CUBLASLT_WORKSPACE_SIZE", "1024"),
    ("CUDNN_CONV_WSCAP_DBG", "4096"), ("TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT", "1")])
def test_cuda_variables_that_choose_kernels_join_the_kernel_path(monkeypatch, name, value):
    monkeypatch.delenv(name, raising=False)
    before = fingerprint()
    monkeypatch.setenv(name, value)
    after = fingerprint()
    assert after["kernel_path"]["env"][name] == value
    assert kernel_path_sha256(after) != kernel_path_sha256(before)


def config(enabled: bool, builder: str = "fault_models.flips_switches") -> dict:
    return {"model": {"_target_": builder}, "data": {"_target_": "twinrun.data.load_heldout_images"},
            "determinism": {"enabled": enabled}}


def test_a_builder_that_turns_tf32_or_benchmarking_back_on_is_named_and_set_back(capsys):
    determinism.apply_determinism(True, None)
    p = probe.ProbeConfig(n_images=8, n_folds=4)
    probe.build_components(config(True), p, [], torch.device("cpu"))
    said = capsys.readouterr().out
    assert "model._target_=fault_models.flips_switches changed numerics switches while it was built" in said
    assert "cudnn_benchmark False -> True" in said and "float32_matmul_precision 'highest' -> 'high'" in said
    assert "set back" in said
    assert torch.backends.cudnn.benchmark is False and torch.get_float32_matmul_precision() == "highest"
    # With determinism off the builder's choice stands, and is said (the kernel path records it).
    probe.build_components(config(False), p, [], torch.device("cpu"))
    assert "kept (determinism.enabled=false)" in capsys.readouterr().out and torch.backends.cudnn.benchmark
    probe.build_components(config(True, "fault_models.tiny"), p, [], torch.device("cpu"))
    assert "changed numerics switches" not in capsys.readouterr().out  # a builder that changes nothing


def test_each_run_compiles_into_its_own_cache(tmp_path, monkeypatch):
    for name in compile_cache.CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = {"determinism": {"compile_cache_dir": str(tmp_path / "cache")}}
    setup_determinism(cfg, tmp_path / "run_a")
    mine = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert mine.startswith(str(tmp_path / "cache" / "runs")) and mine.endswith("inductor")
    marker = Path(mine).parent / compile_cache.RUN_CACHE_MARKER
    assert str(tmp_path / "run_a") in marker.read_text()
    os.makedirs(os.path.join(mine, "fxgraph"))
    with open(os.path.join(mine, "fxgraph", "entry"), "w") as f:
        f.write("a's kernel")
    digest = fingerprint("default")["kernel_path"]["compile"]["caches"]["inductor"]
    # Another run compiles in between (in this process, as a local sweep does): into its own cache.
    setup_determinism(cfg, tmp_path / "run_b")
    theirs = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert theirs != mine and os.environ["TRITON_CACHE_DIR"] != os.path.join(os.path.dirname(mine), "triton")
    os.makedirs(os.path.join(theirs, "fxgraph"))
    with open(os.path.join(theirs, "fxgraph", "entry"), "w") as f:
        f.write("b's kernel, another size")
    setup_determinism(cfg, tmp_path / "run_a")  # the resume of run a: its own cache, its digest unchanged
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == mine
    assert fingerprint("default")["kernel_path"]["compile"]["caches"]["inductor"] == digest


def test_a_shared_cache_twinrun_chose_is_never_taken_for_the_users_own(tmp_path, monkeypatch):
    # An eager job points the process at the shared cache (no run of its own to key one); a compiled
    # run after it in that process, or in a child that inherits its variables, once kept that cache as
    # "the user's choice" and every such run compiled into it: a wiped-cache recompile read its kernels.
    for name in compile_cache.CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = {"determinism": {"compile_cache_dir": str(tmp_path / "cache")}}
    setup_determinism(cfg)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    setup_determinism(cfg, tmp_path / "run_a")
    assert compile_cache.is_run_cache(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert compile_cache.is_run_cache(os.environ["TRITON_CACHE_DIR"])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own: kept
    setup_determinism(cfg, tmp_path / "run_a")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_inductor_s_memoized_autotune_cache_follows_the_run_in_one_process(tmp_path, monkeypatch):
    for name in compile_cache.CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = {"determinism": {"compile_cache_dir": str(tmp_path / "cache")}}
    for run in ("run_a", "run_b"):  # a local sweep's two points, one process
        setup_determinism(cfg, tmp_path / run)
        timings = str(CacheBase.get_local_cache_path())
        assert timings.startswith(os.environ["TORCHINDUCTOR_CACHE_DIR"] + os.sep), (run, timings)


def test_the_cache_digest_covers_every_entry_by_content_not_by_time(tmp_path):
    root = tmp_path / "inductor"
    (root / "fxgraph").mkdir(parents=True)
    for k in range(10_001):  # one more than the old walk stopped at
        (root / "fxgraph" / f"{k:05d}").write_bytes(b"")
    first = compile_cache._dir_digest(str(root))
    assert first["files"] == 10_001
    (root / "fxgraph" / "10000").write_bytes(b"a kernel")  # the last file of the walk
    second = compile_cache._dir_digest(str(root))["digest"]
    assert second != first["digest"]
    os.utime(root / "fxgraph" / "00000", (1, 1))  # rewritten with the same bytes (a replay's load)
    (root / "ab").mkdir()
    (root / "ab" / "cabkey.main.so").write_bytes(b"built with this cache's paths inside")
    assert compile_cache._dir_digest(str(root))["digest"] == second  # code generated from the entries
    (root / "aotautograd").mkdir()
    (root / "aotautograd" / "entry").write_bytes(b"a joint graph")
    (root / "x.best_config").write_text('{"XBLOCK": 8}')
    assert compile_cache._dir_digest(str(root))["files"] == 10_003


def test_every_test_run_pins_the_cpu_unless_it_names_a_device():
    """On a GPU box probe.device=auto would move every end-to-end test to CUDA: conftest pins the CPU."""
    assert pin_device(TINY) == [*TINY, CPU] and pin_device(["probe.device=cuda"]) == ["probe.device=cuda"]
