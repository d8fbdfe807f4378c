"""Kernel pins: a compiled job's compile bundle, the decisions it holds, and the certificate that a
replay took exactly those decisions (docs/kernel-paths.md, "Pinning a kernel path").

A compiled job saves `torch.compiler.save_cache_artifacts()` after its warm-up (every graph compiled)
into `env/compile-<first 12 hex of its sha256>.bundle`, and records its digest, the cache keys it
holds, every autotune decision this process timed (candidates, timings in ms, winner; each Triton
kernel's chosen config, read from the bundle's autotune entries) and torch's own counters.

A replay (`determinism.kernel_path_from=RUN`, or `reference=RUN` whose reference has a bundle) loads
that bundle before the first compile, on a cache of its own, and reads the counters after its
compiles: no cache miss and no timing decision means no kernel was chosen in this process.

A bundle is code: Inductor's cache entries in it are pickles, unpickled when a graph is looked up, so
loading one runs what its writer chose. A replay loads only a bundle a job of this user wrote on this
machine (its sha256 listed in `written_bundles_dir()`, a folder no one else may write), or one the user
vouches for with `determinism.trust_bundle=true`, as `trust_remote_code` does for a model's code.

Inductor replays a cached graph's counter deltas on a hit (`counters["inductor"] += deltas`), so a
hit counts the autotuning its graph once did. `Watch` tells the two apart: what a hit replayed is
kept aside, and only what this process did itself certifies or unpins.
"""

import hashlib
import importlib.metadata
import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import torch

from twinrun.errors import ConfigError, KernelPathRefused, StoreError, raise_signal_in
from twinrun.files import atomic_write, read_json, read_regular
from twinrun.provenance.compile_cache import ours_alone

BUNDLE_MAX_BYTES = 1 << 30  # a bundle holds generated code and kernels; a larger file is not one of ours
# Counters that say a graph was compiled in this process instead of read from the bundle.
MISS_COUNTERS = ("inductor.fxgraph_cache_miss", "inductor.fxgraph_cache_bypass",
                 "aot_autograd.autograd_cache_miss", "aot_autograd.autograd_cache_bypass")
# Counters that say something was timed to choose a kernel (GEMM templates, Triton configs, fusions).
TIMING_PREFIXES = ("inductor.benchmarking.", "inductor.select_algorithm_autotune",
                   "inductor.coordesc_tuning_bench", "inductor.combo_autotune_bench")
COLD = "cold"  # determinism.kernel_path_from=cold: compile afresh even beside a reference with a bundle
NOTHING_TO_PIN = "eager: no torch.compile, nothing to pin"


class _LiveCounter(Counter):
    """torch's inductor counters, with what cache hits replayed kept aside (`replayed`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.replayed = Counter()

    def __iadd__(self, other):  # Inductor's only use of += on the group: a cache hit's deltas
        self.replayed.update(other)
        return super().__iadd__(other)


_decisions: list = []  # every autotune this process timed, in order (the feedback saver appends)
_saver_added = False


class Watch:
    """What this process compiles and times from now on: counters since `start`, decisions since."""

    def __init__(self):
        global _saver_added
        import torch._inductor.select_algorithm as select  # compiled jobs only: the import costs seconds

        counters = _counters()
        if not isinstance(counters["inductor"], _LiveCounter):
            counters["inductor"] = _LiveCounter(counters["inductor"])
        if not _saver_added:
            select.add_feedback_saver(_feedback)
            _saver_added = True
        self.start, self.first = self._live(), len(_decisions)

    @staticmethod
    def _live() -> Counter:
        counters = _counters()
        inductor = counters["inductor"]
        replayed = getattr(inductor, "replayed", Counter())
        live = Counter({f"inductor.{k}": v - replayed[k] for k, v in inductor.items()})
        live.update({f"aot_autograd.{k}": v for k, v in counters["aot_autograd"].items()})
        return live

    def counters(self) -> dict:
        """This process's own counts since the watch began (hits' replayed deltas excluded)."""
        now = self._live()  # counts only grow; a group torch cleared meanwhile starts again from zero
        return {k: now[k] - self.start[k] if now[k] >= self.start[k] else now[k] for k in sorted(now)
                if now[k] and now[k] != self.start[k]}

    def decisions(self) -> list[dict]:
        return list(_decisions[self.first:])


def _counters():
    """torch's compile counters (torch._dynamo.utils.counters): imported only where a job compiles, since
    importing Dynamo costs seconds."""
    from torch._dynamo.utils import counters

    return counters


def _feedback(timings, name, input_nodes, choices, profiled, precompile_times) -> None:
    """Inductor calls this after timing a GEMM's candidates (never on a cache hit). It must not raise:
    an exception here would end the compile."""
    try:
        sizes = ["×".join(str(s) for s in node.get_size()) for node in input_nodes]  # symbols stay symbols
        ms = {_candidate(c): float(t) for c, t in timings.items()}
    except Exception as err:  # noqa: BLE001 — a record we cannot read is recorded as such
        raise_signal_in(err)  # unless a signal's unwinding made it: that ends the compile, as it should
        _decisions.append({"op": str(name), "shapes": [], "timings_ms": {}, "winner": None,
                           "unreadable": f"{type(err).__name__}: {err}"[:200]})
        return
    finite = {k: v for k, v in ms.items() if math.isfinite(v)}
    _decisions.append({"op": str(name), "shapes": sizes, "timings_ms": ms,
                       "winner": min(finite, key=finite.get) if finite else None})


def _candidate(choice) -> str:
    """'aten' for an ATen call, the template family and name otherwise (cpp template, triton …)."""
    name = str(getattr(choice, "name", choice))
    kind = type(choice).__name__
    if kind == "ExternKernelCaller":
        return f"aten {name}"
    if name.startswith("cpp_") or "Cpp" in kind:
        return f"cpp template {name}"
    return f"triton {name}" if "Triton" in kind else f"{kind} {name}"


def capability(device: torch.device | None) -> dict:
    """What a bundle's kernels were generated for: a bundle from another is refused."""
    triton_version = None
    for name in ("triton", "pytorch-triton"):
        try:
            triton_version = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    cap = {"torch": torch.__version__, "triton": triton_version,
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device is not None and torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cap["gpu"] = f"{props.name} sm_{props.major}{props.minor}"
    return cap


def save_bundle(env_dir, watch: Watch, device) -> dict:
    """After the warm-up: the bundle written beside the job's records, and what it holds."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {"bundle": None, "why": "torch saved no cache artifacts (caches disabled?)",
                "capability": capability(device), "decisions": watch.decisions(),
                "counters": watch.counters()}
    data, info = saved
    sha = hashlib.sha256(data).hexdigest()
    name = f"compile-{sha[:12]}.bundle"
    atomic_write(env_dir / name, data)
    remember_written(sha)
    return {"bundle": {"file": f"env/{name}", "sha256": sha, "bytes": len(data)},
            "capability": capability(device),
            "keys": {kind: sorted(keys) for kind, keys in info.artifacts.items()},
            "decisions": watch.decisions(), "triton_configs": triton_configs(data),
            "counters": watch.counters()}


def triton_configs(data: bytes) -> dict:
    """Each Triton kernel's chosen config in a bundle (its autotune entries are JSON, never unpickled)."""
    from torch.compiler._cache import CacheArtifactManager  # the reader of the format torch wrote

    artifacts = CacheArtifactManager.deserialize(data) or {}
    out = {}
    for artifact in artifacts.get("autotune", []):
        try:
            out[str(artifact.key)] = json.loads(artifact.content)
        except (TypeError, ValueError):
            out[str(artifact.key)] = "(unreadable)"
    return out


def read_bundle(run_dir, record: dict) -> bytes:
    """A recorded bundle's bytes: inside `run_dir/env`, a regular file, bounded, its sha256 checked."""
    run_dir, bundle = Path(run_dir), record.get("bundle") or {}
    name = str(bundle.get("file", ""))
    env = (run_dir / "env").resolve()
    path = (run_dir / name).resolve()  # a link is followed here, so a link out of env/ is refused below
    if (not name.startswith("env/compile-") or path.parent != env or (run_dir / "env").is_symlink()
            or (run_dir / name).is_symlink()):
        raise StoreError(run_dir / "run.json", f"compile bundle {name!r} is not a file of its env/")
    data = read_regular(path, BUNDLE_MAX_BYTES, "compile bundle")
    if hashlib.sha256(data).hexdigest() != bundle.get("sha256"):
        raise StoreError(path, "sha256 differs from the one its job recorded: damaged or replaced")
    return data


def written_bundles_dir() -> Path:
    """Where this user's jobs list the bundles they wrote on this machine (one empty file per sha256)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "twinrun" / "written-bundles"


def remember_written(sha256: str) -> None:
    """List a bundle this job wrote, so its user's replays load it without vouching. A home that cannot
    be written only costs that: the replay then asks for determinism.trust_bundle."""
    folder = written_bundles_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if ours_alone(folder):
            (folder / sha256).touch(mode=0o600)
    except OSError as err:
        print(f"twinrun: the compile bundle is not listed as yours in {folder} ({err.strerror or err}); "
              "a replay of it will ask for determinism.trust_bundle=true", flush=True)


def written_here(sha256) -> bool:
    """Whether a job of this user wrote the bundle with this sha256 on this machine: its entry a regular
    file of this user's in a folder only this user may write."""
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        return False
    folder = written_bundles_dir()
    entry = folder / sha256
    return ours_alone(folder) and ours_alone(entry) and entry.is_file() and not entry.is_symlink()


def refuse_untrusted(key: str, source, record: dict, trusted: bool,
                     vouch: str = "compile afresh (determinism.kernel_path_from=cold), or set "
                                  "determinism.trust_bundle=true") -> None:
    """One line, before any compute: a bundle neither written by this user's jobs here nor vouched for
    (`vouch`: how the user vouches where they asked)."""
    if trusted or written_here((record.get("bundle") or {}).get("sha256")):
        return
    raise ConfigError(key, str(source), "its compile bundle was not written by a job of yours on this "
                      "machine, and loading one runs code its writer chose (Inductor's cache entries are "
                      f"pickles); {vouch} if you trust whoever wrote that run")


def refuse_other_capability(source: str, recorded: dict, here: dict) -> None:
    """One line, before any compute: kernels generated for another torch, Triton, GPU or CPU."""
    differ = [f"{k} {recorded.get(k)!r} (here {here.get(k)!r})" for k in sorted(set(recorded) | set(here))
              if recorded.get(k) != here.get(k)]
    if differ:
        raise KernelPathRefused(f"kernel path from {source}: its compile bundle was made for another "
                                f"{', '.join(differ)}; replay it where it was made, or set "
                                "determinism.kernel_path_from=cold")


def load_bundle(data: bytes) -> dict:
    """Into this process's (cold) caches, before the first compile; the keys it put there."""
    info = torch.compiler.load_cache_artifacts(data)
    if info is None:
        raise StoreError("compile bundle", "torch could not read it (another torch, or damaged)")
    return {kind: sorted(keys) for kind, keys in info.artifacts.items()}


def certificate(source: str, watch: Watch) -> dict:
    """After the job's compiles: pinned when no graph missed the cache and nothing was timed."""
    seen = watch.counters()
    moved = {k: v for k, v in seen.items() if k in MISS_COUNTERS or k.startswith(TIMING_PREFIXES)}
    out = {"from": source, "counters": seen, "moved": moved, "pinned": not moved}
    if moved:
        what = "; ".join(f"{d['op']} {' · '.join(d['shapes'])}" for d in watch.decisions()) or "a graph"
        out["line"] = (f"PATH UNPINNED: {', '.join(f'{k}={v}' for k, v in moved.items())} in this process "
                       f"({what}): kernels were chosen here, not taken from {source}")
    else:
        out["line"] = (f"kernel path pinned from {source}: 0 cache misses and 0 timing decisions "
                       f"({', '.join(f'{k}={v}' for k, v in seen.items()) or 'no counter moved'})")
    return out


def winners_differ(a: list[dict], b: list[dict], triton_a: dict | None = None,
                   triton_b: dict | None = None) -> list[str]:
    """The autotune decisions two records took differently, one line each: which GEMM, its winners,
    and how far the timings of the two winners were apart."""
    def by_key(decisions):
        return {(d["op"], tuple(d["shapes"])): d for d in decisions}

    da, db = by_key(a), by_key(b)
    lines = []
    for key in sorted(da.keys() & db.keys()):
        wa, wb = da[key]["winner"], db[key]["winner"]
        if wa != wb:
            lines.append(f"{key[0]} {' · '.join(key[1])} ({_family(wa)} → {_family(wb)}; first timed "
                         f"{_ms(da[key], wa)} against {_ms(da[key], wb)}, second {_ms(db[key], wb)} "
                         f"against {_ms(db[key], wa)}: {wa} → {wb})")
    lines += [f"{op} {' · '.join(shapes)} (tuned on one side only)"
              for op, shapes in sorted(da.keys() ^ db.keys())]
    for kernel in sorted((triton_a or {}).keys() & (triton_b or {}).keys()):
        if triton_a[kernel] != triton_b[kernel]:
            lines.append(f"triton {kernel} ({triton_a[kernel]} → {triton_b[kernel]})")
    return lines


def _family(candidate: str | None) -> str:
    return "none" if candidate is None else candidate.split(" ")[0] + (
        " template" if candidate.startswith(("cpp", "triton")) else "")


def _ms(decision: dict, candidate: str | None) -> str:
    t = decision["timings_ms"].get(candidate)
    return "untimed" if t is None else f"{t:.4g} ms"


def recorded_pin(run_dir) -> dict | None:
    """The kernel-pin record of a run's latest compiled job (its env/jobNNN.json), None when no job
    recorded one; read as untrusted (bounded JSON, files of its own env/ only)."""
    run_dir = Path(run_dir)
    jobs = read_json(run_dir / "run.json").get("jobs") or []
    for job in reversed([j for j in jobs if isinstance(j, dict)]):
        bundle = job.get("compile_bundle")
        if isinstance(bundle, dict) and bundle.get("sha256") and isinstance(job.get("index"), int):
            record = read_json(run_dir / "env" / f"job{int(job['index']):03d}.json").get("kernel_pin")
            if isinstance(record, dict) and record.get("bundle"):
                return record
    return None


def decisions_between(a_dir, b_dir) -> str:
    """One line on the kernel decisions of two runs' latest compiled jobs: which GEMM's winner moved, or
    that none did, or why it cannot be said (a run recorded no bundle)."""
    a, b = recorded_pin(a_dir), recorded_pin(b_dir)
    if a is None or b is None:
        which = " and ".join(str(d) for d, r in ((a_dir, a), (b_dir, b)) if r is None)
        return f"autotune winners: unknown ({which} recorded no compile bundle)"
    lines = winners_differ(a.get("decisions") or [], b.get("decisions") or [],
                           a.get("triton_configs"), b.get("triton_configs"))
    if lines:
        return f"autotune winners differ: {'; '.join(lines)}"
    timed = len(a.get("decisions") or []) + len(b.get("decisions") or [])
    return ("autotune winners: none differ" + ("" if timed else " (neither run timed a kernel: replayed or "
                                               "not autotuned)"))
