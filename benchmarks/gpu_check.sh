#!/usr/bin/env bash
# The one device check of what only a GPU shows (issue 23), for a session lent a GPU. From the repo root:
#   bash benchmarks/gpu_wheels.sh                     # here, where the package index is reachable: .whl/
#   OUT=gpu_check bash benchmarks/gpu_check.sh        # there: sized for under 8 minutes on an H100/H200
#   OUT=/tmp/dry bash benchmarks/gpu_check.sh --cpu-dry-run   # here: the same flow on the CPU, up to CUDA
# It checks its dependencies first (installing the missing ones from $WHEELS, default .whl/), then runs,
# each step bounded by a timeout (step A's longest, 240 s, then B's 210 s: 7.5 minutes at most):
#   A (side by side): the sentinel twice with determinism on, and under TF32; `pytest -m gpu`; the probe
#     end to end with a replicate: vmap and folds eager, folds compiled (default; max-autotune with
#     determinism on and off), the vmap index_add_ branch, diffusers' UNet with determinism on and off;
#   B (alone, it times): benchmarks/bench_gpu.py at the shapes twinrun runs, folds checked against vmap.
# Then every result is judged (benchmarks/gpu_check_judge.py): a summary of what passed and what failed
# is printed and written to $OUT/summary.txt, and the exit status is non-zero if anything failed.
# $OUT receives at most 8 files (the device tool's limit): summary.txt, summary.json, bench_gpu.json,
# pytest.log, nvidia-smi.txt and details.tar.gz (every log and run record; no stores).
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check}
dry=0
[ "${1:-}" = "--cpu-dry-run" ] && dry=1
py=${PYTHON:-python3}
command -v "$py" >/dev/null || py=python
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" GPU_CHECK_WORK="$work"
if [ $dry = 1 ]; then
  dev=cpu scale=4 max_par=2  # a 2-core CPU compiles with gcc, minutes per graph: two steps at a time
else
  dev=cuda scale=1 max_par=16
fi
echo "gpu_check: device $dev, work $work, results $out" | tee "$out/summary.txt"

# ---------------------------------------------------------------- step 0: dependencies (fail at once)
command -v timeout >/dev/null && command -v tar >/dev/null || { echo "FAIL deps: needs timeout and tar"; exit 2; }
missing() {
  "$py" - <<'PY'
import importlib.util
need = ["torch", "hydra", "omegaconf", "antlr4", "submitit", "diffusers", "pytest", "safetensors", "sklearn",
        "scipy", "matplotlib", "tqdm", "yaml"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
}
lack=$(missing)
if [ -n "$lack" ]; then
  wheels=${WHEELS:-.whl}
  echo "gpu_check: installing from $wheels: missing $lack"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
    "$wheels"/*.whl > "$work/pip.log" 2>&1 || { cat "$work/pip.log"; echo "FAIL deps: pip install from $wheels"; exit 2; }
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
  lack=$(missing)
fi
[ -z "$lack" ] || { echo "FAIL deps: still missing $lack (bash benchmarks/gpu_wheels.sh builds .whl/)" | tee -a "$out/summary.txt"; exit 2; }
if [ $dry = 0 ]; then
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    { echo "FAIL deps: torch sees no GPU (use --cpu-dry-run on a CPU)" | tee -a "$out/summary.txt"; exit 2; }
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
fi

# ---------------------------------------------------------------- the steps
declare -A pid_of
launch() {  # name, timeout_s, command...: in the background, its log and exit status in $work
  local name=$1 limit=$(( $2 * scale ))
  shift 2
  while [ "$(jobs -rp | wc -l)" -ge "$max_par" ]; do wait -n; done
  ( start=$(date +%s); timeout --kill-after=10 "$limit" "$@" > "$work/$name.log" 2>&1; rc=$?
    echo "$rc $(( $(date +%s) - start ))" > "$work/$name.rc" ) &
  pid_of[$name]=$!
}
sentinel() {  # file, fp32 matmul precision: the default model's sentinel as a run with determinism on reads it
  "$py" - "$work/$1" "$2" "$dev" <<'PY'
import json, sys, tempfile
import torch
from twinrun.provenance.determinism import apply_determinism
apply_determinism(True, tempfile.mkdtemp(), sys.argv[2])
from twinrun.model import load_pretrained
from twinrun.provenance.record import read_sentinel
device = torch.device(sys.argv[3])
model = load_pretrained().to(device)
json.dump(read_sentinel(model, device, (1, 8, 8)), open(sys.argv[1], "w"))
PY
}
run() {  # name, overrides...: a tiny pin_sigma run with the twin's replicate, on $dev
  local name=$1
  shift
  "$py" -m twinrun +experiment=pin_sigma probe.n_images=8 probe.n_draws=2 probe.n_folds=4 \
    "sigma_grid.sigmas=[0.2,0.5,1.2]" "probe.device=$dev" arms.replicate=true "hydra.run.dir=$work/runs/$name" "$@"
}
unet() {  # name, determinism on|off: diffusers' UNet (examples/diffusers), with the replicate
  PYTHONPATH="$PWD/examples/diffusers:$PYTHONPATH" "$py" -m twinrun --config-dir examples/diffusers/conf \
    +experiment=unet_pin_sigma "probe.device=$dev" arms.replicate=true "determinism.enabled=$2" \
    "hydra.run.dir=$work/runs/$1"
}
export -f sentinel run unet
export py dev work

# A: side by side (no timings here). Threads split between them; each bounded by its own timeout.
export OMP_NUM_THREADS=2
launch sentinel_a 90 bash -c 'sentinel sentinel_a.json highest'
launch sentinel_b 90 bash -c 'sentinel sentinel_b.json highest'
launch sentinel_tf32 90 bash -c 'sentinel sentinel_tf32.json high'
launch pytest_gpu 240 "$py" -m pytest -m gpu -q -ra -p no:cacheprovider tests
launch vmap_eager 150 bash -c 'run vmap_eager probe.method=vmap'
launch folds_eager 150 bash -c 'run folds_eager probe.method=folds'
launch folds_default 220 bash -c 'run folds_default probe.method=folds probe.compile=default'
launch folds_max_autotune 220 bash -c 'run folds_max_autotune probe.method=folds probe.compile=max-autotune'
launch folds_max_autotune_det_off 220 bash -c \
  'run folds_max_autotune_det_off probe.method=folds probe.compile=max-autotune determinism.enabled=false'
# 7 images in 3 folds ([3, 2, 2]): fold 0 is split in two groups, so vmap adds with index_add_.
launch vmap_index_add 150 bash -c 'run vmap_index_add probe.method=vmap probe.n_images=7 probe.n_folds=3 probe.chunk_images=-1'
launch unet_det_on 180 bash -c 'unet unet_det_on true'
launch unet_det_off 180 bash -c 'unet unet_det_off false'
for name in "${!pid_of[@]}"; do wait "${pid_of[$name]}"; done
unset OMP_NUM_THREADS

# B: alone, because it times: the GPU benchmark at twinrun's shapes (the smoke variant on the CPU).
if [ $dry = 1 ]; then
  launch bench_gpu 210 "$py" benchmarks/bench_gpu.py --smoke --json "$work/bench_gpu.json"
else
  launch bench_gpu 210 "$py" benchmarks/bench_gpu.py --reps 2 --modes eager,default,max-autotune \
    --json "$work/bench_gpu.json"
fi
wait "${pid_of[bench_gpu]}"

# ---------------------------------------------------------------- judge, and hand back
"$py" benchmarks/gpu_check_judge.py "$work" "$dev" | tee -a "$out/summary.txt"
verdict=${PIPESTATUS[0]}
cp "$work/summary.json" "$out/" 2>/dev/null
cp "$work/bench_gpu.json" "$out/" 2>/dev/null
cp "$work/pytest_gpu.log" "$out/pytest.log" 2>/dev/null
tar -czf "$out/details.tar.gz" -C "$work" --exclude='*.safetensors' --exclude='submitit' . 2>/dev/null
exit "$verdict"
