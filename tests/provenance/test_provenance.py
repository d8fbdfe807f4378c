"""Provenance rules failing for the right reason: fingerprints, kernel paths, references."""

import json
import os
import textwrap

import pytest
from conftest import REPO, TINY, run_twinrun
from rundirs import create, run_doc
from stores import write_sums

from twinrun.provenance.record import kernel_path_sha256
from twinrun.storage.rundir import RunIndex
from twinrun.storage.store import read_store

pytestmark = pytest.mark.slow

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a genuinely different kernel path on this CPU (see notes)

# SIMULATION of a kernel-path shift: the same weights, whose every output is moved by a fixed
# seeded direction, as a changed kernel moves every result by a shared bias. Large enough to
# matter; nothing in any store is edited.
SHIFTED = textwrap.dedent("""
    import torch
    from twinrun.model import DiTDenoiser, read_weights
    import json

    class ShiftedDiT(DiTDenoiser):
        def __init__(self, **arch):
            super().__init__(**arch)
            gen = torch.Generator().manual_seed(99)
            shape = (self.img_channels, self.img_resolution, self.img_resolution)
            self.register_buffer("direction", torch.randn(shape, generator=gen), persistent=False)

        def forward(self, x, sigma, sigma_cond=None):
            return super().forward(x, sigma, sigma_cond) + 0.3 * self.direction

    def load_shifted(path=None):
        tensors, meta = read_weights(path)
        model = ShiftedDiT(**json.loads(meta["arch"]))
        model.load_state_dict(tensors)
        return model.eval()
""")


def with_path(folder) -> dict:
    """PYTHONPATH with a test's own module folder, the checkout still first on it."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO), str(folder)])}


def run(tmp_path, name, *extra, env=None):
    run_dir = tmp_path / name
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, f"hydra.run.dir={run_dir}", *extra], cwd=tmp_path,
                       env=env)
    return proc, run_dir


def test_replicate_reports_bit_identity(tmp_path):
    proc, run_dir = run(tmp_path, "r", "arms.replicate=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replicate"]["n_differ"] == 0 and summary["replicate"]["n_tensors"] == 3
    assert "0 / 3 bins differ" in proc.stdout
    assert sorted(p.name for p in (run_dir / "arms").iterdir()) == ["native", "native_replicate", "pin_sigma"]


def _with_kernel_path(meta: dict, edit) -> dict:
    """meta with its kernel-path object edited and its digest recomputed (a consistent record)."""
    meta = json.loads(json.dumps(meta))
    edit(meta["kernel_path"])
    meta["env"]["kernel_path_sha256"] = kernel_path_sha256({"kernel_path": meta["kernel_path"]})
    return meta


def test_compare_reads_the_numbers_before_the_kernel_path_records(tmp_path):
    proc, run_dir = run(tmp_path, "r")
    assert proc.returncode == 0
    original = next((run_dir / "arms" / "native").glob("bin00*.safetensors"))
    store = read_store(original)

    def more_threads(kp):
        kp["threads"]["intra_op"] = 64

    # An object rewritten under its old digest is damage: one line naming the field, exit 2.
    forged = json.loads(json.dumps(store.meta))
    more_threads(forged["kernel_path"])
    write_sums(tmp_path / "forged.safetensors", store.sums, forged)
    damaged = run_twinrun([str(original), str(tmp_path / "forged.safetensors")], cwd=tmp_path,
                          module="twinrun.compare")
    assert damaged.returncode == 2 and "metadata.kernel_path" in damaged.stderr
    # Another kernel path on record, the same bits: bit-identical is bit-identical (exit 0, said so).
    write_sums(tmp_path / "same.safetensors", store.sums, _with_kernel_path(store.meta, more_threads))
    same = run_twinrun([str(original), str(tmp_path / "same.safetensors")], cwd=tmp_path,
                       module="twinrun.compare")
    assert same.returncode == 0 and "bit-identical in every bin; the records differ" in same.stdout
    assert "threads.intra_op" in same.stdout
    # Another kernel path and numbers that differ: refused (exit 3), even with --force (INVALID).
    moved = tmp_path / "moved.safetensors"
    write_sums(moved, store.sums * (1 + 1e-6), _with_kernel_path(store.meta, more_threads))
    refused = run_twinrun([str(original), str(moved)], cwd=tmp_path, module="twinrun.compare")
    assert refused.returncode == 3 and "threads.intra_op" in refused.stderr
    assert "debiased cos" not in refused.stdout
    forced = run_twinrun([str(original), str(moved), "--force"], cwd=tmp_path, module="twinrun.compare")
    assert forced.returncode == 3 and "INVALID" in forced.stdout
    # every estimand, residual included, with bit-identity and the size of the difference
    rows = [line.split() for line in forced.stdout.splitlines()[2:] if line.strip()[:1].isdigit()]
    # one bin each: the residual (each bin against the mean over bins) is zero there, so it is left out
    assert [r[1] for r in rows] == ["all", "cond"] and all(r[2] == "no" for r in rows)


def test_compare_refuses_a_reference_from_another_kernel_path(tmp_path):
    # The probe's chunking is on the kernel path and moves bits on this CPU (a thread count may not).
    (_, a), (_, b) = run(tmp_path, "a"), run(tmp_path, "b", "probe.chunk_draws=1")
    refused = run_twinrun([str(a), str(b)], cwd=tmp_path, module="twinrun.compare")
    assert refused.returncode == 3 and "chunk" in refused.stderr, refused.stderr
    same_path = run_twinrun([str(a), str(run(tmp_path, "c")[1])], cwd=tmp_path, module="twinrun.compare")
    assert same_path.returncode == 0 and "valid: bit-identical in every bin" in same_path.stdout


def test_reference_alive_across_a_path_change_that_moves_no_bit_then_vouched_for_compare(tmp_path):
    _, ref = run(tmp_path, "ref", env=ONE_THREAD)  # another thread count; on this tiny model, the same bits
    proc, today = run(tmp_path, "today", f"reference={ref}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((today / "summary.json").read_text())
    assert (summary["reference"]["alive"] is True
            and summary["reference"]["rule"] == "bit-identical in every bin")
    assert any(f.startswith("threads") for f in summary["reference"]["kernel_path_differs_in"])
    assert "reference ALIVE" in proc.stdout
    # compare reads the same bits as the same bits, whatever the records say
    same = run_twinrun([str(today), str(ref)], cwd=tmp_path, module="twinrun.compare")
    assert same.returncode == 0 and "bit-identical in every bin; the records differ" in same.stdout
    # once the bits differ, the same-environment control vouches for the reference (recomputed from
    # the stores): alter the reference's bits by far less than an effect, keep its summary
    run_ref = json.loads((ref / "run.json").read_text())
    entry = run_ref["units"][0]["stores"]["native"]
    store = read_store(ref / "arms" / "native" / entry["file"])
    entry["sha256"] = write_sums(ref / "arms" / "native" / entry["file"], store.sums * (1 + 1e-6), store.meta)
    (ref / "run.json").write_text(json.dumps(run_ref))
    assert json.loads((today / "summary.json").read_text())["reference"]["alive"] is True
    refused = run_twinrun([str(today), str(ref)], cwd=tmp_path, module="twinrun.compare")
    assert refused.returncode == 3 and "vouched" not in refused.stdout  # its summary's "alive" is not trusted


def test_reference_dead_when_the_path_shifts_while_the_twin_gate_still_passes(tmp_path):
    _, ref = run(tmp_path, "ref")
    (tmp_path / "shifted_model.py").write_text(SHIFTED)
    proc, today = run(tmp_path, "today", f"reference={ref}", "model._target_=shifted_model.load_shifted",
                      env=with_path(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]  # the twin-based gate passes
    summary = json.loads((today / "summary.json").read_text())
    assert all(g["passed"] for g in summary["gates"]) and summary["effects"]
    ref_verdict = summary["reference"]
    assert ref_verdict["alive"] is False and ref_verdict["config_differs_in"] == ["model._target_"]
    assert "reference DEAD in this environment" in proc.stdout
    # a changed model is named as such, never blamed on the environment
    # (its buffer is part of the model as built: the model's digest differs, and the key is named)
    assert ("What was measured changed: the model as built (its parameters and buffers) differ "
            "(model._target_ changed): this gap is not the environment's") in proc.stdout
    assert "environment's" not in ref_verdict["detail"].replace("not the environment's", "")
    assert "intervention_vs_reference" not in ref_verdict
    # the size of the shift per bin and estimand, residual included
    rows = ref_verdict["native_vs_reference"]
    assert ({r["estimand"] for r in rows} == {"all", "cond", "residual"}
            and all(r["max_shift"] > 0 for r in rows))
    assert "reference shift" in (today / "report.md").read_text()


def test_reference_with_another_protocol_is_bad_input(tmp_path):
    _, ref = run(tmp_path, "ref", "probe.n_draws=3")
    proc, _ = run(tmp_path, "today", f"reference={ref}")
    assert proc.returncode == 2 and "protocol" in proc.stderr and "Traceback" not in proc.stderr
    missing, _ = run(tmp_path, "x", f"reference={tmp_path / 'nowhere'}")
    assert missing.returncode == 2 and "reference=" in missing.stderr


def test_resume_on_another_kernel_path_is_refused(tmp_path):
    proc, run_dir = run(tmp_path, "r")
    assert proc.returncode == 0
    run_json = json.loads((run_dir / "run.json").read_text())
    last = run_json["units"][-1]
    for arm, entry in last["stores"].items():  # as if the job died before its last bin
        (run_dir / "arms" / arm / entry["file"]).unlink()
    refused = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.resume", env=ONE_THREAD)
    assert refused.returncode == 3 and "must not straddle" in refused.stderr and "threads" in refused.stderr
    resumed = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_bin_pieced_from_two_processes_fails_the_same_allocation_check(tmp_path):
    (_, a), (_, b) = run(tmp_path, "a"), run(tmp_path, "b")
    # Splice b's native store of bin 1 (same config, measured by another process) into a, and
    # make a's index vouch for its bytes: only the per-bin allocation record can tell.
    run_a = json.loads((a / "run.json").read_text())
    entry = run_a["units"][1]["stores"]["native"]
    donor = b / "arms" / "native" / entry["file"]
    (a / "arms" / "native" / entry["file"]).write_bytes(donor.read_bytes())
    entry["sha256"] = json.loads((b / "run.json").read_text())["units"][1]["stores"]["native"]["sha256"]
    (a / "run.json").write_text(json.dumps(run_a))
    proc = run_twinrun([str(a)], cwd=tmp_path, module="twinrun.reduce")
    assert proc.returncode == 1, proc.stderr
    summary = json.loads((a / "summary.json").read_text())
    failed = {c["name"]: c["detail"] for c in summary["checks"] if not c["passed"]}
    assert list(failed) == ["same_allocation_per_bin"] and "bin 1: pid" in failed["same_allocation_per_bin"]
    assert summary["effects"] == [] and "INSTRUMENT BROKEN" in proc.stdout


def test_sentinel_check_fails_when_a_job_saw_the_path_move(tmp_path):
    from twinrun.analysis.reduction import provenance_checks

    class FakeStore:
        def __init__(self, sentinel):
            self.meta = {"env": {"kernel_path_sha256": "k", "pid": 1, "sentinel": sentinel}}

    index = create(tmp_path, run_doc([0.5], arms=(("x", "intervention"), ("native", "twin"))))
    index.add_job({"kernel_path_sha256": "e" * 64, "sentinel_start": "s1", "sentinel_end": None,
                   "hostname": None, "boot_id": None, "slurm_job_id": None})
    stores = {("x", 0): FakeStore("s1"), ("native", 0): FakeStore("s1")}

    def checks():
        return {c["name"]: c for c in provenance_checks(RunIndex.load(tmp_path), stores)}

    assert not checks()["sentinel_unchanged"]["passed"]  # killed before its closing reading
    assert "without its closing sentinel reading" in checks()["sentinel_unchanged"]["detail"]
    index.end_job(0, "s2")
    assert checks()["same_allocation_per_bin"]["passed"] and checks()["one_kernel_path"]["passed"]
    sentinel = checks()["sentinel_unchanged"]
    assert not sentinel["passed"] and "changed" in sentinel["detail"]
    index.end_job(0, "s1")
    assert all(c["passed"] for c in checks().values())


# One changed value per key of the probe and determinism schemas. A key added later without an
# entry here fails the walk below: every setting must be shown to move no bit or the digest.
ALTERNATIVES = {
    "probe.n_images": 6, "probe.n_draws": 3, "probe.n_folds": 3,
    "probe.params": "['blocks.*','cond_embed.*']", "probe.chunk_images": 3, "probe.chunk_draws": 1,
    "probe.accumulator_dtype": "float32", "probe.train_mode": "true",
    "probe.device": None,  # one device on a CPU-only machine: nothing to change to
    "probe.method": "folds",
    # Compiling takes minutes on this CPU; test_probe_methods.py shows the compile mode moves the digest.
    "probe.compile": None,
    "determinism.enabled": "false", "determinism.float32_matmul_precision": "medium",
    "determinism.compile_cache_dir": "{tmp}/compile_cache",
    # It names a compiled run whose bundle to replay: an eager probe has none to take (refused, exit 2);
    # tests/provenance/test_kernel_pin.py shows a replay moves no bit of what it pins.
    "determinism.kernel_path_from": None,
    # The cold-against-warm control compiles in processes of its own and records a verdict, no store:
    # an eager probe has nothing to compile (refused, exit 2); tests/test_kernel_pin.py runs it in a job.
    "determinism.cold_check": None,
    # A permission to load a bundle no job of this user wrote: it computes nothing and moves no bit.
    "determinism.trust_bundle": "true",
}


def digests(run_dir):
    """{store: (sums bytes, (kernel-path digest, protocol))} of a run."""
    from twinrun.protocol import STORE_PROTOCOL_KEYS as PROTOCOL_KEYS

    out = {}
    for path in sorted(run_dir.glob("arms/*/*.safetensors")):
        store = read_store(path)
        protocol = json.dumps([store.meta.get(k) for k in (*PROTOCOL_KEYS, "image_ids", "seed")],
                              sort_keys=True)
        out[path.relative_to(run_dir).as_posix()] = (store.sums.numpy().tobytes(),
                                                     (store.meta["env"]["kernel_path_sha256"], protocol))
    return out


def test_every_bit_moving_setting_is_on_the_record(tmp_path):
    """Changing any probe or determinism key leaves the stores bit-identical or changes the
    kernel-path or protocol digest: never different bits under one digest."""
    from dataclasses import fields

    from twinrun.config import DeterminismConfig, ProbeConfig

    keys = ([f"probe.{f.name}" for f in fields(ProbeConfig)]
            + [f"determinism.{f.name}" for f in fields(DeterminismConfig)])
    assert set(keys) == set(ALTERNATIVES), ("give each new key a changed value in ALTERNATIVES: "
                                            f"{set(keys) ^ set(ALTERNATIVES)}")
    _, base_dir = run(tmp_path, "base")
    base = digests(base_dir)
    moved = []
    for key in keys:
        if ALTERNATIVES[key] is None:
            continue
        proc, other_dir = run(tmp_path, key, f"{key}={str(ALTERNATIVES[key]).format(tmp=tmp_path)}")
        assert proc.returncode == 0, (key, proc.stderr[-1500:])
        other = digests(other_dir)
        for name, (bits, digest) in other.items():
            if name in base and bits != base[name][0]:
                assert digest != base[name][1], (f"{key} changed {name} under the same kernel-path and "
                                                 "protocol digest")
                moved.append(key)
    # the walk is not vacuous: chunking really moves bits (that is why it is in the digest)
    assert "probe.chunk_images" in moved or "probe.chunk_draws" in moved


def test_interventions_that_prove_nothing_are_refused_before_compute(tmp_path):
    noop_dir = tmp_path / "gamma1"
    noop = run_twinrun(["+experiment=scale_cond", *TINY, "intervention.gamma=1", f"hydra.run.dir={noop_dir}"],
                       cwd=tmp_path)
    assert noop.returncode == 2 and "a no-op everywhere: nothing to measure" in noop.stderr
    assert "Traceback" not in noop.stderr and not (noop_dir / "run.json").exists()
    (tmp_path / "gateless.py").write_text(textwrap.dedent("""
        from twinrun.interventions import PinSigma

        class Gateless(PinSigma):
            def gate_sigmas(self, grid):
                return []
    """))
    gateless, _ = run(tmp_path, "gateless", "intervention._target_=gateless.Gateless",
                      env=with_path(tmp_path))
    assert (gateless.returncode == 2 and "has no gate bin" in gateless.stderr
            and "Traceback" not in gateless.stderr)


def test_a_builder_that_only_exports_inductors_default_cache_changes_no_numerics_switch(monkeypatch, capsys):
    """Importing diffusers exports TORCHINDUCTOR_CACHE_DIR (Inductor's /tmp default): no arithmetic changes,
    so nothing is said; a cache directory the builder chose, or a real switch, is still named."""
    from twinrun.provenance.compile_cache import default_inductor_cache_dir
    from twinrun.provenance.determinism import switches_kept

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with switches_kept("model", restore=True):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = default_inductor_cache_dir()
    assert capsys.readouterr().out == "" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    with switches_kept("model", restore=True):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/somewhere/else"
    assert "changed numerics switches while it was built (TORCHINDUCTOR_CACHE_DIR" in capsys.readouterr().out
