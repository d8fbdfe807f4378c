#!/usr/bin/env bash
# Build the wheels benchmarks/gpu_check.sh needs on the GPU image, which reaches no package index and
# lacks them (see the device README's package list): into .whl/ (ignored by git, carried by the device
# tool). Run here, from the repo root, where pip reaches PyPI:  bash benchmarks/gpu_wheels.sh
# All are pure Python (py3-none-any), so they install on the image's Python 3.12; their own needs
# (PyYAML, packaging, cloudpickle, typing-extensions, zipp, huggingface-hub ≥ 1.32, safetensors ≥ 0.8,
# Pillow, requests, regex, filelock, numpy) are on the image. About 7 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$dest"
grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null ||
  echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  hydra-core==1.3.8 omegaconf==2.3.1 submitit==1.5.4 diffusers==0.42.1 importlib_metadata==8.7.0
# antlr4-python3-runtime 4.9.3 (hydra's and omegaconf's parser runtime) is published as a source
# distribution only: built into a wheel here.
"$py" -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
ls -l "$dest"/*.whl
du -ch "$dest"/*.whl | tail -1
