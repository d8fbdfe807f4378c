"""The cold-against-warm control: `python -m twinrun.env --cold-check [--run RUN] [--compile MODE]`.

Compiles the sentinel battery with the model's own forward and backward twice, each in a fresh
process with an empty compile cache of its own: once cold (every kernel chosen there) and once from a
compile bundle (RUN's, or the cold process's own), then requires the two readings to be bit-identical.
It prints the autotune decisions the cold compile took differently from the bundle's record, and
whether the bundle's replay was pinned (no cache miss, nothing timed). With determinism on (torch >=
2.10: Inductor's deterministic mode, no template timing) it tests that nothing is timed; with
`--determinism off --compile max-autotune` it shows whether this machine's timings crown the same
winners. Exit 0 bit-identical, 1 not, 2 bad input.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from twinrun.errors import EXIT_GATE, EXIT_OK, TwinrunError, fail
from twinrun.files import read_json, write_json
from twinrun.model import load_pretrained
from twinrun.provenance import kernel_pin
from twinrun.provenance.compile_cache import reuse_built_libraries
from twinrun.provenance.determinism import apply_determinism
from twinrun.provenance.record import model_sentinel_fn
from twinrun.provenance.sentinel import sentinel, sentinel_changed

IMAGE_SHAPE = (1, 8, 8)  # the default model's digits
WORKER_TIMEOUT_S = 3600


def compile_once(cache_dir: Path, mode: str, determinism: bool, bundle: dict | None, out: Path,
                 libraries_from: Path | None = None) -> dict:
    """In a fresh process: the sentinel with the compiled default model, on an empty cache (or one
    filled from `bundle` first, and the C++ libraries built in `libraries_from`, another compile's
    Inductor cache on this machine, as a replay on the machine of its source run takes them); its
    reading, decisions, counters and the bundle it saves."""
    apply_determinism(determinism, str(cache_dir))
    watch = kernel_pin.Watch()
    if bundle is not None:
        kernel_pin.load_bundle(kernel_pin.read_bundle(bundle["run_dir"], bundle["record"]))
    if libraries_from is not None:
        reuse_built_libraries(str(libraries_from), str(cache_dir / "inductor"))
    model = load_pretrained()
    compiled = torch.compile(model, mode=mode)
    t0 = time.perf_counter()
    compiled_op = model_sentinel_fn(compiled, torch.device("cpu"), IMAGE_SHAPE)
    compiled_op()  # the compiles (forward and backward), timed apart from the battery
    compile_s = time.perf_counter() - t0
    reading = sentinel(compiled_op, device="cpu")
    (out / "env").mkdir(parents=True, exist_ok=True)
    record = kernel_pin.save_bundle(out / "env", watch, None)
    cert = kernel_pin.certificate("the bundle", watch) if bundle is not None else None
    result = {"sentinel": reading, "kernel_pin": record, "certificate": cert, "compile_s": compile_s}
    write_json(out / "result.json", result)
    return result


def in_fresh_process(work: Path, name: str, mode: str, determinism: bool, bundle_from: Path | None,
                     cache: Path | None = None, libraries_from: Path | None = None) -> dict:
    """One compile_once in a new Python process, writing under work/name (its cache: work/name/cache,
    or `cache`, another's, for a warm compile; with the C++ libraries of `libraries_from` copied in)."""
    out = work / name
    out.mkdir()
    cmd = [sys.executable, "-m", "twinrun.cold_check", "--worker", str(out), "--compile", mode,
           "--determinism", "on" if determinism else "off", "--cache", str(cache or out / "cache")]
    if bundle_from is not None:
        cmd += ["--bundle-from", str(bundle_from)]
    if libraries_from is not None:
        cmd += ["--libraries-from", str(libraries_from)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise TwinrunError(f"--cold-check: the {name} compile failed: {tail}")
    return read_json(out / "result.json")


def cold_check(run: Path | None, mode: str, determinism: bool, trust_bundle: bool = False
               ) -> tuple[bool, list[str]]:
    """(bit-identical, report lines)."""
    record = kernel_pin.recorded_pin(run) if run is not None else None
    if run is not None and record is None:
        raise TwinrunError(f"--run {run}: it recorded no compile bundle (eager, or from before twinrun "
                           "saved bundles); name a compiled run, or leave --run out")
    if run is not None:
        kernel_pin.refuse_untrusted("--run", run, record, trust_bundle,
                                    vouch="leave --run out, or add --trust-bundle")
    with tempfile.TemporaryDirectory(prefix="twinrun-cold-check-") as tmp:
        work = Path(tmp)
        cold = in_fresh_process(work, "cold", mode, determinism, None)
        source = run if run is not None else work / "cold"
        replay = in_fresh_process(work, "replay", mode, determinism, source)
        reference = kernel_pin.recorded_pin(run) if run is not None else cold["kernel_pin"]
    changed = sentinel_changed(cold["sentinel"], replay["sentinel"])
    winners = kernel_pin.winners_differ(reference.get("decisions") or [], cold["kernel_pin"].get("decisions")
                                        or [], reference.get("triton_configs"),
                                        cold["kernel_pin"].get("triton_configs"))
    where = f"{run}'s bundle" if run is not None else "the cold compile's bundle"
    lines = [f"cold compile vs from {where} (torch.compile mode {mode}, determinism "
             f"{'on' if determinism else 'off'}): "
             + ("bit-identical" if not changed else f"DIFFER in {', '.join(changed)}"),
             f"cold compile: {len(cold['kernel_pin'].get('decisions') or [])} autotune decisions timed; "
             + (f"winners differ from the bundle's: {'; '.join(winners)}" if winners
                else "every winner as the bundle's record"),
             f"replay: {replay['certificate']['line']}"]
    return not changed, lines


def main(args) -> int:
    """From `python -m twinrun.env --cold-check` (its parsed arguments)."""
    try:
        same, lines = cold_check(args.run, args.compile, args.determinism == "on", args.trust_bundle)
    except TwinrunError as err:
        fail(err)
    print("\n".join(lines))
    return EXIT_OK if same else EXIT_GATE


def _worker(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m twinrun.cold_check")
    p.add_argument("--worker", type=Path, required=True)
    p.add_argument("--compile", default="max-autotune")
    p.add_argument("--determinism", choices=("on", "off"), default="on")
    p.add_argument("--bundle-from", type=Path)
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--libraries-from", type=Path)
    a = p.parse_args(argv)
    bundle = None
    if a.bundle_from is not None:
        record = kernel_pin.recorded_pin(a.bundle_from) if (a.bundle_from / "run.json").is_file() else \
            read_json(a.bundle_from / "result.json")["kernel_pin"]
        bundle = {"run_dir": a.bundle_from, "record": record}
    a.cache.mkdir(exist_ok=True)
    compile_once(a.cache, a.compile, a.determinism == "on", bundle, a.worker, a.libraries_from)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
