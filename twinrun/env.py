"""Print the fingerprint a run made here records: `python -m twinrun.env [--determinism on|off]`.

`--measure KIND` (default: the config's default kind) adds that kind's arithmetic settings, as its run
records them.

The kernel-path digest comes first (a run writes env/kernel_path-<first 12 digits>.json), then the
determinism record and the fingerprint itself (twinrun/provenance/fingerprint.py says what each
field is and why it is compared or only recorded).
"""

import argparse
import json
from pathlib import Path

from twinrun import cold_check
from twinrun.config import TwinrunConfig
from twinrun.errors import TwinrunError, fail
from twinrun.measures.kind import resolve_device
from twinrun.measures.registry import measure_names, measure_of
from twinrun.provenance.fingerprint import fingerprint
from twinrun.provenance.record import kernel_path_sha256, setup_determinism


def main(argv=None) -> int:
    """`python -m twinrun.env`: this machine's fingerprint as a run records it, its digest first."""
    p = argparse.ArgumentParser(
        prog="python -m twinrun.env",
        description="Print this machine's environment fingerprint as JSON, as a run here records it: the "
        "kernel-path digest (a run writes env/kernel_path-<first 12 digits>.json), the determinism record "
        "and the fingerprint. Exit 0.")
    p.add_argument("--determinism", choices=("on", "off"), default="on",
                   help="as a run with determinism.enabled=true (default) or false: the switches are part "
                   "of the kernel path, so the digest differs")
    p.add_argument("--measure", default=TwinrunConfig.measure, choices=measure_names(),
                   help="the run's measurement kind, whose default arithmetic settings join the kernel path")
    p.add_argument("--method", default=None,
                   help="the method the kind resolved, where it has several (its log says which; the "
                   "default: the default model's)")
    p.add_argument("--device", default="auto",
                   help="the run's device setting (auto: this machine's GPU if torch sees one, else the CPU)")
    p.add_argument("--cold-check", action="store_true",
                   help="compile the sentinel and the default model cold and from a compile bundle, each in "
                   "a fresh process, and require the same bits (exit 0; 1 when they differ)")
    p.add_argument("--run", type=Path, help="with --cold-check: replay this compiled run's bundle")
    p.add_argument("--trust-bundle", action="store_true",
                   help="with --run: load its bundle although no job of yours wrote it on this machine "
                   "(a bundle is code: Inductor's cache entries are pickles)")
    p.add_argument("--compile", default="max-autotune", choices=("default", "max-autotune"),
                   help="with --cold-check: the torch.compile mode")
    args = p.parse_args(argv)
    if args.cold_check:
        return cold_check.main(args)
    kind = measure_of(args.measure)
    if args.method is not None and args.method not in kind.methods:
        p.error(f"argument --method: invalid choice: {args.method!r} (choose from "
                f"{', '.join(map(repr, kind.methods)) or 'none: the kind has one method'})")
    # A run pins determinism before it fingerprints (twinrun.job); do the same, or the switches
    # (deterministic algorithms, cuDNN, CUBLAS_WORKSPACE_CONFIG) read here would not be the run's.
    determinism = setup_determinism({"determinism": {"enabled": args.determinism == "on"}})
    try:
        device = resolve_device(args.device, key="--device")
    except TwinrunError as err:
        fail(err)
    fp = fingerprint(device=device)
    # A run adds its kind's arithmetic settings (twinrun.job); take the kind's default config's.
    fp["kernel_path"][kind.name] = kind.default_arithmetic(args.method, device.type)
    sha = kernel_path_sha256(fp)
    out = {"kernel_path_sha256": sha, "kernel_path_file": f"env/kernel_path-{sha[:12]}.json",
           "determinism": determinism, **fp}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
