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
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -v -m gpu -p no:cacheprovider --import-mode=importlib tests -s ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "PASS|FAIL|ERROR|passed|failed|fuzz|assert" 
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_TIMEOUT:-400}" minference-fx bench kernels --lengths "$lengths" --out "$OUT/bench_kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_kernels.txt"
fi
