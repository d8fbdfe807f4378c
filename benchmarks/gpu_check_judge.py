"""Judge what benchmarks/gpu_check.sh measured: one line per check (PASS, FAIL, or NOTE for what is only
recorded), summary.json beside the work, exit 1 if anything failed.

    python benchmarks/gpu_check_judge.py WORK_DIR cuda|cpu
"""

import argparse
import json
from pathlib import Path

from twinrun.measures import fold_sums as fs
from twinrun.provenance.sentinel import sentinel_changed

TIMED_OUT = (124, 137)
# What each end-to-end run is: (determinism on, probe.method, probe.compile).
RUNS = {
    "vmap_eager": (True, "vmap", False),
    "folds_eager": (True, "folds", False),
    "folds_default": (True, "folds", "default"),
    "folds_max_autotune": (True, "folds", "max-autotune"),
    "folds_max_autotune_det_off": (False, "folds", "max-autotune"),
    "vmap_index_add": (True, "vmap", False),
    "unet_det_on": (True, "folds", False),
    "unet_det_off": (False, "folds", False),
}
# How a run says that Inductor's deterministic mode refused max-autotune (twinrun.measures.trial).
REFUSED_BY_INDUCTOR = "Inductor runs in its deterministic mode"
# A peak above the estimate by more than this lets an out-of-memory error through the job's check.
ESTIMATE_AT_LEAST = 0.8


class Verdicts:
    def __init__(self):
        self.rows = []

    def add(self, check: str, passed: bool | None, detail: str) -> None:
        """passed None: recorded only (what the run found where no single answer is right)."""
        self.rows.append({"check": check, "verdict": {True: "PASS", False: "FAIL", None: "NOTE"}[passed],
                          "detail": detail})
        print(f"{self.rows[-1]['verdict']:4} {check}: {detail}", flush=True)

    @property
    def failed(self) -> list:
        return [r for r in self.rows if r["verdict"] == "FAIL"]


def step(work: Path, name: str) -> tuple[int | None, int | None, str]:
    """(exit status, seconds, last log lines) of a step; (None, None, …) if it never ran."""
    rc = work / f"{name}.rc"
    log = work / f"{name}.log"
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:]) if log.is_file() else ""
    if not rc.is_file():
        return None, None, tail
    code, seconds = (int(x) for x in rc.read_text().split())
    return code, seconds, tail


def ran(v: Verdicts, work: Path, name: str, ok_codes=(0,)) -> int | None:
    """The step's exit status, a FAIL line if it timed out, never ran, or exited otherwise."""
    code, seconds, tail = step(work, name)
    if code is None:
        v.add(name, False, f"never ran ({tail or 'no log'})")
    elif code in TIMED_OUT:
        v.add(name, False, f"timed out after {seconds} s ({tail})")
    elif code not in ok_codes:
        v.add(name, False, f"exit {code} after {seconds} s: {tail}")
    return code


def judge_sentinel(v: Verdicts, work: Path, device: str) -> None:
    readings = {}
    for name in ("sentinel_a", "sentinel_b", "sentinel_tf32"):
        if ran(v, work, name) == 0:
            readings[name] = json.loads((work / f"{name}.json").read_text())
    if {"sentinel_a", "sentinel_b"} <= set(readings):
        a, b = readings["sentinel_a"], readings["sentinel_b"]
        changed = sentinel_changed(a, b)
        v.add("sentinel twice, determinism on", not changed and "model" in a["ops"],
              f"{len(a['ops'])} ops, changed {changed or 'none'}; left out: "
              f"{sorted(a.get('skipped', {})) or 'none'}")
        if "sentinel_tf32" in readings:
            moved = sentinel_changed(a, readings["sentinel_tf32"])
            # TF32 exists on CUDA only: there it must move the matmuls, or the sentinel cannot see it.
            v.add("sentinel under TF32", bool(moved) if device == "cuda" else None,
                  f"moved {moved or 'nothing'}")


def judge_run(v: Verdicts, work: Path, name: str, device: str) -> None:
    deterministic, method, compile_mode = RUNS[name]
    # max-autotune may be refused under determinism (exit 2); without determinism a gate may fail (exit 1).
    lenient = compile_mode == "max-autotune" or not deterministic
    code = ran(v, work, name, ok_codes=(0, 1, 2) if lenient else (0,))
    if code is None or code in TIMED_OUT:
        return
    run_dir = work / "runs" / name
    log = (work / f"{name}.log").read_text(errors="replace")
    if code == 2 and REFUSED_BY_INDUCTOR in log:
        v.add(name, None, "refused, named as Inductor's deterministic mode with determinism on (exit 2)")
        return
    if code not in (0, 1):
        v.add(name, False, f"exit {code}: {log.strip().splitlines()[-1] if log.strip() else ''}")
        return
    summary = json.loads((run_dir / "summary.json").read_text())
    kernel_path = json.loads(next(run_dir.glob("env/kernel_path-*.json")).read_text())["kernel_path"]
    job = json.loads((run_dir / "env" / "job000.json").read_text())
    index = json.loads((run_dir / "run.json").read_text())
    replicate = summary["replicate"]
    problems = []
    if kernel_path["probe"]["method"] != method or kernel_path["probe"]["device"] != device:
        problems.append(f"measured by {kernel_path['probe']['method']} on {kernel_path['probe']['device']}")
    if device == "cuda" and not (kernel_path.get("gpu") and index["jobs"][0]["device"].startswith("cuda:0")):
        problems.append(f"GPU not recorded (job device {index['jobs'][0].get('device')})")
    if compile_mode == "max-autotune":
        effective = kernel_path["compile"]["effective"]
        if not effective.get("triton.cudagraphs") or effective.get("deterministic") is not deterministic:
            problems.append(f"compile options not recorded as run: {effective}")
    if deterministic:
        if not summary["passed"] or replicate["n_differ"]:
            problems.append(f"passed={summary['passed']}; {replicate['detail']}")
        if job["determinism"].get("cuda_initialized"):
            problems.append("CUDA was initialised before determinism was applied")
    elif device == "cuda" and "model_backward" not in job["sentinel"]["skipped"]:
        problems.append("the sentinel hashed the model's backward with determinism off on CUDA")
    if name == "vmap_index_add":
        _, groups = fs.fold_groups([0, 0, 0, 1, 1, 2, 2], 3, -1)
        folds = [f for f, _ in groups]
        if folds == list(range(folds[0], folds[-1] + 1)):
            problems.append("7 images in 3 folds no longer reach the index_add_ branch")
    verdict = not problems if deterministic else (None if not problems else False)
    v.add(name, verdict, "; ".join(problems) or f"exit {code}, {replicate['detail']}")


def judge_bench(v: Verdicts, work: Path, device: str) -> None:
    code = ran(v, work, "bench_gpu", ok_codes=(0, 1))
    path = work / "bench_gpu.json"
    if not path.is_file():
        v.add("bench_gpu", False, "no bench_gpu.json")
        return
    rows = json.loads(path.read_text())["rows"]
    sizes = {r["size"] for r in rows}
    v.add("bench_gpu rows", bool(rows) and code == 0, f"{len(rows)} rows over {sorted(sizes)}, exit {code}")
    for r in rows:
        what = f"bench {r['size']} {r['mode']} {r['method']}"
        if "refused" in r:
            v.add(what, None if r["ok"] else False, r["refused"])
            continue
        agree = "" if r["checked_against"] is None else (f"vs {r['checked_against']} "
                                                         f"{r['max_abs_diff_over_max']:.1e}, ")
        memory = ""
        low = False
        if r["peak_gb_probe"]:
            ratio = r["estimate_gb"] / r["peak_gb_probe"]
            low = ratio < ESTIMATE_AT_LEAST
            memory = f", peak {r['peak_gb_probe']:.2f} GB vs estimate {r['estimate_gb']:.2f} ({ratio:.2f}x)"
        v.add(what, r["ok"] and not low, f"{agree}probe/floor {r['ratio']:.2f}x at {r['samples_per_call']} "
              f"samples per call{memory}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path, help="the work folder benchmarks/gpu_check.sh wrote")
    ap.add_argument("device", choices=("cuda", "cpu"))
    args = ap.parse_args()
    work, device = args.work, args.device
    if not work.is_dir():
        ap.error(f"{work}: no such folder (give the work folder benchmarks/gpu_check.sh wrote)")
    v = Verdicts()
    judge_sentinel(v, work, device)
    if ran(v, work, "pytest_gpu") == 0:
        v.add("pytest -m gpu", True, step(work, "pytest_gpu")[2])
    for name in RUNS:
        judge_run(v, work, name, device)
    judge_bench(v, work, device)
    (work / "summary.json").write_text(json.dumps({"device": device, "checks": v.rows}, indent=2))
    print(f"gpu_check: {len(v.rows) - len(v.failed)} of {len(v.rows)} checks passed or noted; "
          f"{len(v.failed)} FAILED: {', '.join(r['check'] for r in v.failed) or 'none'}", flush=True)
    return 1 if v.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
