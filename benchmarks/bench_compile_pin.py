"""Compile time of the default model, cold, warm and replayed from a compile bundle, side by side.

    python benchmarks/bench_compile_pin.py            # probe.compile=max-autotune, determinism off (~10 min)
    python benchmarks/bench_compile_pin.py --smoke    # torch.compile's default mode (what tests run)

Each compile runs in a fresh process on the default model (`dit_digits`), its forward and backward as
the sentinel runs them (twinrun/cold_check.py): cold = an empty cache (every kernel chosen, GEMMs
timed under max-autotune); warm = the same cache again; replayed elsewhere = an empty cache of its own
filled from the cold compile's bundle first, as `determinism.kernel_path_from` does on another machine
(Inductor's C++ is compiled again); replayed here = the same, plus the C++ libraries the cold compile
built, as a replay does on the machine whose cache holds its source run's (twinrun/job.py,
reuse_libraries). A replay must time nothing (its certificate is printed); replayed here must cost no
more than the warm compile; replayed elsewhere pays the C++ build a warm cache holds already
(docs/kernel-paths.md says why)."""

import argparse
import os
import sys
import tempfile
from pathlib import Path

from twinrun.cold_check import in_fresh_process


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="torch.compile's default mode: quick, no meaning")
    p.add_argument("--determinism", choices=("on", "off"), default="off")
    a = p.parse_args()
    mode = "default" if a.smoke else "max-autotune"
    load = os.getloadavg()[0]
    print(f"bench_compile_pin: mode {mode}, determinism {a.determinism}, load average {load:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-compile-pin-") as tmp:
        work, on = Path(tmp), a.determinism == "on"
        cold = in_fresh_process(work, "cold", mode, on, None)
        warm = in_fresh_process(work, "warm", mode, on, None, cache=work / "cold" / "cache")
        elsewhere = in_fresh_process(work, "replay_elsewhere", mode, on, work / "cold")
        here = in_fresh_process(work, "replay_here", mode, on, work / "cold",
                                libraries_from=work / "cold" / "cache" / "inductor")
    c, w, e, h = (r["compile_s"] for r in (cold, warm, elsewhere, here))
    timed = len(cold["kernel_pin"].get("decisions") or [])
    print(f"compile time: cold {c:.1f} s ({timed} GEMMs timed), warm {w:.1f} s, "
          f"replayed elsewhere {e:.1f} s, replayed here {h:.1f} s")
    print(f"ratios: replayed here / warm {h / w:.2f}x, replayed elsewhere / warm {e / w:.2f}x, "
          f"replayed here / cold {h / c:.2f}x, replayed elsewhere / cold {e / c:.2f}x, "
          f"warm / cold {w / c:.2f}x")
    same = len({r["sentinel"]["digest"] for r in (cold, warm, elsewhere, here)}) == 1
    print(f"bits: cold, warm and replayed sentinels {'identical' if same else 'DIFFER'}")
    print(f"replay elsewhere: {elsewhere['certificate']['line']}")
    print(f"replay here: {here['certificate']['line']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
