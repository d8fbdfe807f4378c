#!/usr/bin/env bash
# The one prepared check of what only a GPU shows (issues 3 and 5), for a session lent a GPU:
#   OUT=gpu_check bash benchmarks/gpu_check.sh          (a few minutes on an H100/H200)
# 1. sentinel: identical across two processes, and moved by TF32 (fp32 matmul precision "high");
# 2. replicate bit-identity of the native twin with determinism on and off (probe on the GPU);
# 3. the probe benchmark's speed section at a larger model on the GPU.
# Written into $OUT; a summary is printed at the end. DEVICE=cpu runs the same flow on a CPU; SMOKE=1 at toy
# sizes (tests/test_benchmarks.py runs DEVICE=cpu SMOKE=1, so the script cannot rot between GPU sessions).
set -u
out=${OUT:-gpu_check}
dev=${DEVICE:-cuda}
py=${PYTHON:-python}
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi > "$out/nvidia-smi.txt" 2>&1

sentinel() {  # $1 = file, $2 = fp32 matmul precision
  $py -c "import json, torch; torch.set_float32_matmul_precision('$2'); \
from twinrun.provenance.sentinel import sentinel; print(json.dumps(sentinel(device='$dev')))" > "$out/$1"
}
sentinel sentinel_a.json highest
sentinel sentinel_b.json highest
sentinel sentinel_tf32.json high

tiny=(probe.n_images=40 probe.n_draws=12 "probe.device=$dev" arms.replicate=true)
if [ -n "${SMOKE:-}" ]; then
  tiny=(probe.n_images=8 probe.n_draws=2 probe.n_folds=4 "sigma_grid.sigmas=[0.2,0.5,1.2]" "probe.device=$dev"
        arms.replicate=true)
  BENCH_ARGS=${BENCH_ARGS:---smoke}
fi
$py -m twinrun +experiment=pin_sigma "${tiny[@]}" determinism.enabled=true "hydra.run.dir=$out/det_on" > "$out/det_on.log" 2>&1
$py -m twinrun +experiment=pin_sigma "${tiny[@]}" determinism.enabled=false "hydra.run.dir=$out/det_off" > "$out/det_off.log" 2>&1

$py benchmarks/bench_probe.py --device "$dev" ${BENCH_ARGS:---width 256 --depth 8 --reps 3} > "$out/bench.txt" 2>&1

$py - "$out" <<'PY'
import json, sys
from pathlib import Path
from twinrun.provenance.sentinel import sentinel_changed
out = Path(sys.argv[1])
a, b, t = (json.loads((out / f).read_text()) for f in ("sentinel_a.json", "sentinel_b.json", "sentinel_tf32.json"))
print("sentinel across processes: changed ops", sentinel_changed(a, b) or "none")
print("sentinel with TF32 (precision high): changed ops", sentinel_changed(a, t) or "none")
for mode in ("det_on", "det_off"):
    s = out / mode / "summary.json"
    print(f"replicate, determinism {mode[4:]}:", json.loads(s.read_text())["replicate"]["detail"] if s.is_file()
          else f"no summary (see {out / (mode + '.log')})")
print((out / "bench.txt").read_text())
PY
