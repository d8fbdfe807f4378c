"""Tensor diff: `python -m twinrun.diff A B` for two safetensors files or two directories of them.

Prints how many tensors differ, the largest absolute difference and the cosine of the flattened
whole: the check that tells "bit-identical" from merely "close". Two run directories also get the
kernel-path fields that differ between their latest jobs and the autotune decisions (each GEMM's
winner, from their compile bundles' records) that differ. Exit 0 when bit-identical,
1 when they differ, 2 for bad input (missing path, not safetensors, mismatched names or shapes).
"""

from twinrun.errors import exit_as_command, exit_on_signals

if __name__ == "__main__":  # as a command: a signal while the imports below load is one line too
    exit_on_signals()

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from twinrun.errors import EXIT_GATE, EXIT_OK, Interrupted, StoreError, TwinrunError, fail, raise_on_signals
from twinrun.files import memory_bytes, open_regular, read_json
from twinrun.provenance.fingerprint import kernel_path_diff
from twinrun.provenance.kernel_pin import decisions_between
from twinrun.storage.store import OLD_STORE_FORMAT, STORE_FORMAT, StoreReader
from twinrun.storage.train_store import TRAIN_STORE_FORMAT, read_train_store


@dataclass
class TensorDiff:
    n_tensors: int
    n_differ: int
    max_abs_diff: float
    cosine: float  # of the two flattened wholes (every tensor concatenated), float64
    differing: list  # names of the tensors that are not bit-identical


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of every *.safetensors below a directory (keyed by
    relative path + name). safetensors never unpickles: safe on files from anyone."""
    path = Path(path)
    files = sorted(path.rglob("*.safetensors")) if path.is_dir() else [path]
    if not path.exists():
        raise StoreError(path, "not found")
    if not files:
        raise StoreError(path, "holds no .safetensors files")
    out = {}
    for f in files:
        prefix = f"{f.relative_to(path).as_posix()}:" if path.is_dir() else ""
        out.update({prefix + name: t for name, t in _file_tensors(f).items()})
    return out


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """One file's tensors: a regular file of plausible size; a twinrun store is verified first."""
    os.close(open_regular(path, memory_bytes(), "safetensors file")[0])  # no FIFO, no 1 TiB
    try:
        with safe_open(str(path), framework="pt") as handle:
            fmt = (handle.metadata() or {}).get("format")
            if fmt in (STORE_FORMAT, OLD_STORE_FORMAT):
                return _store_tensors(path)  # each tensor's own digest is checked (an old format: one line)
            if fmt == TRAIN_STORE_FORMAT:  # weights, optimizer state and losses, each digest checked
                return read_train_store(path).tensors
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except StoreError:
        raise
    except Exception as err:  # noqa: BLE001 — any damage in a foreign file ends as a named error
        raise StoreError(path, f"not a readable safetensors file ({type(err).__name__})") from None


def _store_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A twinrun store's parameters, each [n_folds, numel], read through its checks."""
    with StoreReader(path) as reader:
        out = {t.name: reader.columns(t, 0, t.numel) for t in reader.tensors}
        reader.finish()
    return out


def diff_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> TensorDiff:
    if a.keys() != b.keys():
        only = sorted(a.keys() ^ b.keys())
        raise TwinrunError(f"the two sides hold different tensors: {only[:5]}{' …' if len(only) > 5 else ''}")
    differing, max_abs = [], 0.0
    dot = norm_a = norm_b = 0.0
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.shape != y.shape:
            raise TwinrunError(f"tensor {name}: shapes {list(x.shape)} and {list(y.shape)} differ")
        if not (x.dtype == y.dtype and torch.equal(x, y)):
            differing.append(name)
            max_abs = max(max_abs, float((x.double() - y.double()).abs().max()) if x.numel() else 0.0)
        xd, yd = x.double().flatten(), y.double().flatten()
        dot += float(xd @ yd)
        norm_a += float(xd @ xd)
        norm_b += float(yd @ yd)
    cos = dot / (norm_a * norm_b) ** 0.5 if norm_a > 0 and norm_b > 0 else float("nan")
    return TensorDiff(len(a), len(differing), max_abs, cos, differing)


def render(d: TensorDiff) -> str:
    if d.n_differ == 0:
        return f"bit-identical: 0 / {d.n_tensors} tensors differ"
    head = ", ".join(d.differing[:5]) + (" …" if len(d.differing) > 5 else "")
    return (f"{d.n_differ} / {d.n_tensors} tensors differ ({head}); max |a−b| = {d.max_abs_diff:.3e}; "
            f"cosine of the whole = {d.cosine:.12f}")


def kernel_decisions(a: Path, b: Path) -> list[str]:
    """For two run directories: the kernel-path fields that differ, and the autotune winners that do."""
    if not all((Path(d) / "run.json").is_file() for d in (a, b)):
        return []
    paths = []
    for d in (a, b):
        jobs = read_json(Path(d) / "run.json").get("jobs") or [{}]
        sha = str(jobs[-1].get("kernel_path_sha256") or "")
        paths.append(Path(d) / "env" / f"kernel_path-{sha[:12]}.json")
    if all(p.is_file() and len(p.name) == len("kernel_path-") + 12 + len(".json") for p in paths):
        fields = kernel_path_diff(read_json(paths[0]), read_json(paths[1]))
        line = f"kernel-path fields differ: {', '.join(fields) or 'none'}"
    else:
        line = "kernel-path fields: unknown (a run recorded no job)"
    return [line, decisions_between(a, b)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m twinrun.diff", description=__doc__.splitlines()[0],
        epilog="exit codes: 0 bit-identical (every tensor equal, dtype included); 1 at least one tensor "
        "differs (however close: see the max difference and cosine); 2 bad input (missing path, not "
        "safetensors, different tensor names or shapes).")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = p.parse_args(argv)
    raise_on_signals()
    try:
        d = diff_tensors(load_tensors(args.a), load_tensors(args.b))
        decisions = kernel_decisions(args.a, args.b)
    except (TwinrunError, Interrupted) as err:
        fail(err)
    print(render(d))
    for line in decisions:
        print(line)
    return EXIT_OK if d.n_differ == 0 else EXIT_GATE


if __name__ == "__main__":
    exit_as_command(main)
