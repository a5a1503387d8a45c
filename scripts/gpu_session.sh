#!/usr/bin/env bash
# One device call: install, then the steps asked for; every step's output lands in $OUT.
# usage: scripts/gpu_session.sh STEPS   (comma list of: tests, tune, bench, prefill, densepath)
#   TEST_TIMEOUT / TEST_ARGS / TEST_K   pytest -m gpu (the whole suite took 453-533 s on an H200 in 2026-12-02's runs, before
#                                   the 2**31 indexing test's 50 s: past the 600 s a call may run with it; split it with
#                                   TEST_K (one -k expression, spaces kept): TEST_K="not fuzz", then TEST_K=fuzz;
#                                   TEST_ARGS is split on spaces, so it cannot carry such an expression)
#   TUNE_LENGTHS / TUNE_TIMEOUT     minference-fx autotune into $OUT/autotune, then a second process reads it
#   TUNE_EXTRA                      autotune arguments of a second shape, tuned into the same cache
#   BENCH_LENGTHS / BENCH_TIMEOUT / BENCH_ARGS    minference-fx bench kernels
#   PREFILL_ARGS / PREFILL_TIMEOUT                minference-fx bench prefill
#   densepath: DENSE_ARGS (default PREFILL_ARGS)  bench prefill again, the op held to its dense path for d128/g4
#                                                 (a cache whose one entry says dense at every length)
set -uo pipefail
steps=",${1:-tests,bench},"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
mkdir -p autotune configs; python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'; } | tee "$OUT/gpu.txt"
if [[ $steps == *,tests,* ]]; then
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -v -m gpu -p no:cacheprovider --import-mode=importlib --durations=12 tests -s ${TEST_ARGS:-} ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/gpu_tests.txt"
fi
if [[ $steps == *,tune,* ]]; then
  tl=${TUNE_LENGTHS:-32k,128k}
  export MINFERENCE_FX_CACHE_DIR="${MINFERENCE_FX_CACHE_DIR:-$OUT/autotune}"  # kept for the steps after: bench uses the tuned configs
  timeout "${TUNE_TIMEOUT:-300}" minference-fx autotune --lengths "$tl" --head-dim 128 --gqa 4 --dtype bf16 2>&1 | tee "$OUT/autotune.txt"
  if [[ -n ${TUNE_EXTRA:-} ]]; then  # another shape, e.g. "--lengths 32k,128k --head-dim 64 --gqa 3 --kv-heads 3"
    timeout "${TUNE_TIMEOUT:-300}" minference-fx autotune $TUNE_EXTRA --dtype bf16 2>&1 | tee "$OUT/autotune_extra.txt"
  fi
  minference-fx autotune --show 2>&1 | tee -a "$OUT/autotune.txt"
  python3 scripts/autotune_reads_cache.py "$tl" --head-dim 128 --gqa 4 2>&1 | tee "$OUT/autotune_second_process.txt"
fi
if [[ $steps == *,bench,* ]]; then
  timeout "${BENCH_TIMEOUT:-400}" minference-fx bench kernels --lengths "${BENCH_LENGTHS:-8k,32k,128k}" --out "$OUT/bench_kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_kernels.txt"
fi
if [[ $steps == *,prefill,* ]]; then
  timeout "${PREFILL_TIMEOUT:-400}" minference-fx bench prefill ${PREFILL_ARGS:-} --out "$OUT/bench_prefill.json" 2>&1 | tee "$OUT/bench_prefill.txt"
fi
if [[ $steps == *,densepath,* ]]; then
  dense_cache=$(mktemp -d)
  MINFERENCE_FX_CACHE_DIR=$dense_cache python3 -c 'import torch; from minference_fx.autotune import cache, dispatch
cache.write(crossovers={dispatch.crossover_key(torch.device("cuda"), torch.bfloat16, 128, 4): None})'
  MINFERENCE_FX_CACHE_DIR=$dense_cache minference-fx autotune --show 2>&1 | tee "$OUT/bench_prefill_dense_path.txt"
  MINFERENCE_FX_CACHE_DIR=$dense_cache timeout "${PREFILL_TIMEOUT:-400}" minference-fx bench prefill ${DENSE_ARGS:-${PREFILL_ARGS:-}} \
    --out "$OUT/bench_prefill_dense_path.json" 2>&1 | tee -a "$OUT/bench_prefill_dense_path.txt"
fi
