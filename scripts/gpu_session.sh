#!/usr/bin/env bash
# One device call: install, GPU tests, kernel benchmark. Results land in $OUT (and are copied into results/ by hand).
# usage: scripts/gpu_session.sh [tests|bench|all] [lengths]
set -uo pipefail
what=${1:-all}
lengths=${2:-8k,32k,128k}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
mkdir -p autotune configs; python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider --import-mode=importlib tests -x -s 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  minference-fx bench kernels --lengths "$lengths" --out "$OUT/bench_kernels.json" 2>&1 | tail -30 | tee "$OUT/bench_kernels.txt"
fi
