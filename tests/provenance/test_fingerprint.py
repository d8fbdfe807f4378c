"""Environment fingerprint, kernel-path sentinel and determinism mode.

Anything that changes torch's global state runs in a subprocess, so this process stays untouched.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from twinrun.provenance.fingerprint import fingerprint, kernel_path_diff
from twinrun.provenance.sentinel import sentinel, sentinel_changed

ROOT = Path(__file__).resolve().parents[2]

# Prints {"fingerprint": ..., "sentinel": ...} after pinning the intra-op thread count.
PROBE = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(int(sys.argv[1]))
    from twinrun.provenance.fingerprint import fingerprint
    from twinrun.provenance.sentinel import sentinel
    print(json.dumps({"fingerprint": fingerprint(), "sentinel": sentinel()}))
    """
)


def _env(**extra: str) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _start(args: list[str], **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=_env(**extra_env), stdout=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"subprocess {proc.args} exited {proc.returncode}"
    return json.loads(out)


@pytest.fixture(scope="module")
def runs() -> dict:
    """Fresh processes, started together: two on the CLI, two with 2 threads, one with 1 thread."""
    procs = {
        "cli_a": _start(["-m", "twinrun.env"]),
        "cli_b": _start(["-m", "twinrun.env"]),
        "threads2_a": _start(["-c", PROBE, "2"]),
        "threads2_b": _start(["-c", PROBE, "2"]),
        "threads1": _start(["-c", PROBE, "1"]),
    }
    return {name: _finish(proc) for name, proc in procs.items()}


def test_fingerprint_is_json_and_stable_within_process():
    a, b = fingerprint(), fingerprint()
    assert set(a) == {"kernel_path", "info"}
    assert json.dumps(a) == json.dumps(b)  # same values, same key order
    assert json.loads(json.dumps(a)) == a
    assert kernel_path_diff(a, b) == []


def test_fingerprint_kernel_path_stable_across_processes(runs):
    a, b = runs["cli_a"], runs["cli_b"]
    assert a["kernel_path"] == b["kernel_path"]
    assert kernel_path_diff(a, b) == []
    assert a["info"]["pid"] != b["info"]["pid"]  # genuinely two processes


def test_thread_count_is_a_kernel_path_field(runs):
    two, one = runs["threads2_a"]["fingerprint"], runs["threads1"]["fingerprint"]
    assert two["kernel_path"]["threads"]["intra_op"] == 2
    assert one["kernel_path"]["threads"]["intra_op"] == 1
    assert "threads.intra_op" in kernel_path_diff(two, one)
    assert "threads.intra_op" in kernel_path_diff(two["kernel_path"], one["kernel_path"])


def test_sentinel_identical_across_processes(runs):
    a, b = runs["threads2_a"]["sentinel"], runs["threads2_b"]["sentinel"]
    assert sentinel_changed(a, b) == []
    assert a == b


def test_sentinel_sees_thread_count(runs):
    # ATen splits a long reduction per thread, reordering the float32 sum. On the 2-core dev box
    # (torch 2.13 CPU, MKL) dot_4m, layer_norm_grad and conv2d_grad changed too; matmuls did not.
    changed = sentinel_changed(runs["threads2_a"]["sentinel"], runs["threads1"]["sentinel"])
    assert "sum_4m" in changed, changed
    assert runs["threads2_a"]["sentinel"]["digest"] != runs["threads1"]["sentinel"]["digest"]


def test_sentinel_in_process_matches_and_hashes_model_outputs():
    import torch

    base = sentinel()
    assert base == sentinel()
    assert set(base["ops"]) >= {
        "matmul_512",
        "conv2d",
        "softmax",
        "attention",
        "layer_norm",
        "sum_4m",
        "cumsum",
    }
    with_model = sentinel(lambda: (torch.ones(3), torch.zeros(2, dtype=torch.bfloat16)))
    assert sentinel_changed(base, with_model) == ["model"]
    other_model = sentinel(lambda: torch.ones(3))
    assert sentinel_changed(with_model, other_model) == ["model"]


def test_kernel_path_diff_names_dotted_fields():
    a = {"kernel_path": {"threads": {"intra_op": 2}, "gpus": [{"name": "A"}], "env": {"X": None}}}
    b = {"threads": {"intra_op": 1}, "gpus": [{"name": "A"}, {"name": "B"}], "env": {"X": None}}
    assert kernel_path_diff(a, b) == ["gpus.1.name", "threads.intra_op"]
    assert kernel_path_diff({"gpus": []}, {"gpus": [{"name": "A"}]}) == ["gpus", "gpus.0.name"]


def test_compile_cache_digest_joins_kernel_path_only_when_compiling(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    absent = fingerprint("default")
    assert absent["kernel_path"]["compile"]["caches"]["inductor"] == "absent"
    assert "caches" not in fingerprint()["kernel_path"]["compile"]
    (cache / "fxgraph").mkdir(parents=True)
    assert kernel_path_diff(absent, fingerprint("default")) == []  # an empty dir holds no winners
    (cache / "fxgraph" / "entry").write_bytes(b"kernel")
    (cache / "locks").mkdir()
    (cache / "locks" / "x.lock").write_bytes(b"")
    filled = fingerprint("default")
    assert filled["info"]["compile_caches"]["inductor"]["files"] == 1  # lock files are skipped
    assert kernel_path_diff(absent, filled) == ["compile.caches.inductor"]
    assert kernel_path_diff(fingerprint(), fingerprint("max-autotune")) != []


def test_apply_determinism_in_subprocess(tmp_path):
    script = textwrap.dedent(
        """
        import json, os, sys, torch
        import torch._inductor.config  # exports its /tmp default cache dir: still not the user's choice
        from twinrun.provenance.determinism import apply_determinism
        off = apply_determinism(False, sys.argv[1])
        still_off = torch.are_deterministic_algorithms_enabled()
        os.environ["TRITON_CACHE_DIR"] = sys.argv[2]  # the user's own choice is kept
        on = apply_determinism(True, sys.argv[1], "high")
        print(json.dumps({"off": off, "still_off": still_off, "on": on,
                          "now": torch.are_deterministic_algorithms_enabled(),
                          "precision": torch.get_float32_matmul_precision(),
                          "environ": {k: os.environ.get(k) for k in on["found"] if k.isupper()}}))
        """
    )
    env = _env()
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUBLAS_WORKSPACE_CONFIG"):
        env.pop(name, None)
    user_triton = str(tmp_path / "user_triton")
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), user_triton],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    off, on = result["off"], result["on"]
    assert off["set"] == {} and off["changed"] == [] and result["still_off"] is False
    assert on["found"]["deterministic_algorithms"] is False
    assert on["set"]["deterministic_algorithms"] is True and result["now"] is True
    assert "deterministic_algorithms" in on["changed"]
    assert on["set"]["cudnn_deterministic"] is True and on["set"]["cudnn_benchmark"] is False
    assert on["set"]["cudnn_allow_tf32"] is False
    assert on["set"]["float32_matmul_precision"] == "high" == result["precision"]
    assert on["cuda_initialized"] is False and on["cublas_workspace_config_may_be_ignored"] is False
    assert result["environ"] == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),  # not Inductor's own /tmp default
        "TRITON_CACHE_DIR": user_triton,
    }
    assert "TRITON_CACHE_DIR" not in on["set"]


def test_apply_determinism_rejects_unknown_precision():
    from twinrun.errors import ConfigError
    from twinrun.provenance.determinism import apply_determinism

    with pytest.raises(
        ConfigError, match="float32_matmul_precision='exact': choose one of highest, high, medium"
    ):
        apply_determinism(True, None, "exact")


def test_autotune_winners_join_the_kernel_path_by_content(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    (cache / "triton" / "ab").mkdir(parents=True)
    winner = cache / "triton" / "ab" / "kernel.best_config"
    winner.write_text('{"XBLOCK": 64, "num_warps": 4}')
    first = fingerprint("max-autotune")["kernel_path"]["compile"]["autotune_choices"]
    assert first["files"] == 1
    winner.write_text('{"XBLOCK": 128, "num_warps": 4}')  # a re-autotune crowned another winner
    second = fingerprint("max-autotune")["kernel_path"]["compile"]["autotune_choices"]
    assert second["digest"] != first["digest"]
    assert "autotune_choices" not in fingerprint()["kernel_path"]["compile"]


def test_kernel_path_names_the_versions_of_packages_that_move_numbers():
    import importlib.metadata

    import torch

    packages = fingerprint()["kernel_path"]["torch"]["packages"]
    assert packages["torch"] == importlib.metadata.version("torch") and torch.__version__.startswith(
        packages["torch"].split("+")[0])
    assert "pytest" not in packages  # test tools move no numbers


def test_kernel_path_names_every_installed_package_that_chooses_a_models_kernels():
    """diffusers builds the networks and peft a LoRA adapter's layers (their forward and scaling
    arithmetic): another release of either moves the numbers, so each is named on the kernel path."""
    import importlib.metadata

    packages = fingerprint()["kernel_path"]["torch"]["packages"]
    for name in ("diffusers", "peft", "transformers", "accelerate", "safetensors"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional extra not installed here: nothing of it can run
        assert packages.get(name) == version, name


def test_installed_packages_read_as_importlib_metadata_reads_them(tmp_path, monkeypatch):
    """The scan parses each metadata file's headers only: the same names and versions as importlib.metadata's
    full parse, for every installed distribution and for planted ones whose long description (the body)
    holds header-like lines, an old egg-info file, a PKG-INFO with Windows line ends, a line that is no
    header."""
    import importlib.metadata
    import re

    from twinrun.provenance.machine import _installed_packages

    body = "Name: not-this\nVersion: 9.9\n\n" * 200  # a README that quotes metadata
    wheel = tmp_path / "Twin_Planted-1.2.post3.dist-info"
    wheel.mkdir()
    (wheel / "METADATA").write_text(f"Metadata-Version: 2.1\nName: Twin_Planted\nVersion: 1.2.post3\n"
                                    f"Summary: a\n  folded summary\n\n{body}")
    (tmp_path / "old.planted-0.1-py3.11.egg-info").write_text("Name: old.planted\nVersion: 0.1\n\n" + body)
    egg = tmp_path / "pkginfo_planted.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Name: pkginfo-planted\r\nVersion: 4.0\r\n\r\n" + body)
    odd = tmp_path / "odd_planted-5.dist-info"  # a line that is no header ends the headers there
    odd.mkdir()
    (odd / "METADATA").write_text("Name: odd-planted\nVersion: 5\nnot a header\nVersion: 6\n\nbody\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            expected[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    found = _installed_packages()
    assert found == expected
    names = ("twin-planted", "old-planted", "pkginfo-planted", "odd-planted")
    assert [found[n] for n in names] == ["1.2.post3", "0.1", "4.0", "5"]


@pytest.mark.parametrize("text", [
    "Name: a\r\nVersion: 1\r\n\r\nVersion: 2\r\n",  # Windows line ends: "\r\n" is one, not two
    "Summary: x\r \rName: a\r\rVersion: 3\r",  # old Mac ones; a blank-looking continuation line
    "Name: a\n\rVersion: 4\n",  # mixed: an empty line of its own end
    "\nName: a\nVersion: 5\n",  # empty at once: no headers
    "Name: a\nVersion: 6",  # no line end at all
])
def test_metadata_headers_end_where_the_email_parser_ends_them(text):
    """A distribution whose finder hands over its metadata text as it is (no universal newlines): the
    headers read up to the first empty line are the full parse's, whatever the line ends."""
    import email
    import importlib.metadata

    from twinrun.provenance.machine import _metadata_headers

    class Raw(importlib.metadata.Distribution):
        def read_text(self, filename):
            return text if filename == "METADATA" else None

        def locate_file(self, path):
            return path

    full = email.message_from_string(text)
    assert _metadata_headers(Raw()).items() == full.items()
