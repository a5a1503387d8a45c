#!/usr/bin/env bash
# Time to first token of Qwen2.5-Coder-1.5B under tensor parallelism on 2 GPUs (HF tp_plan="auto", torchrun,
# NCCL), compiled with backend="minference" against HF eager under TP, and against one GPU; recompile counts.
# TP=2 gives each rank 6 of the 12 query heads and 1 of the 2 KV heads; the backend reads each rank's first
# head from the sharding (the report lines "tensor parallel: rank r of 2 holds query heads ...").
#
# On an nvidia-h200-x2 machine, from the repository root, one step a device call (each under 600 s):
#   scripts/bench_tp.sh tune     the kernels and crossover for d128, GQA group 6 (one rank's 6 q / 1 kv heads; the
#                                cache is keyed by head dim and group, so one GPU's 12 / 2 reads the same entries)
#   scripts/bench_tp.sh one      minference-fx bench prefill on GPU 0 alone -> $STATE/one_gpu.json
#   scripts/bench_tp.sh tp       torchrun, 2 ranks -> $STATE/tp2.json and the table (with one_gpu.json's column)
#   scripts/bench_tp.sh collect  $STATE's logs and JSON into $OUT
# First the model must be on the machine, converted (scripts/device_model.py receive ... && ... convert), into the
# same MINFERENCE_FX_CACHE_DIR. A fresh machine between calls loses $STATE, the cache and the model.
#
#   LENGTHS (32k,128k)  VARIANTS (eager,minference)  REPS (3)
#   CONFIG              a semantic config JSON for the whole model (scripts/gpu_qwen.sh search writes one); each
#                       rank reads its own heads of it. Default: the backend's default heads, the tuned crossover
set -uo pipefail
STATE=${STATE:-/root/mfx-state}
OUT=${OUT:-/tmp/out}
LENGTHS=${LENGTHS:-32k,128k}
VARIANTS=${VARIANTS:-eager,minference}
REPS=${REPS:-3}
MODEL=qwen2.5-coder-1.5b
export MINFERENCE_FX_CACHE_DIR=${MINFERENCE_FX_CACHE_DIR:-/root/mfx}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
# NVLink multicast stays off on these machines (KINDS.md: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$STATE" "$OUT" "$MINFERENCE_FX_CACHE_DIR"
config_args=()
[[ -n ${CONFIG:-} ]] && config_args=(--config "$CONFIG")

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$STATE/install.log" 2>&1 || { cat "$STATE/install.log"; exit 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers, accelerate; print("torch", torch.__version__, "triton", triton.__version__,
              "transformers", transformers.__version__, "accelerate", accelerate.__version__, "gpus", torch.cuda.device_count())'
} | tee "$STATE/gpu.txt"

case ${1:-} in
  tune)
    timeout 540 minference-fx autotune --lengths "$LENGTHS" --head-dim 128 --gqa 6 --kv-heads 1 --dtype bf16 2>&1 | tee "$STATE/tune.txt"
    minference-fx autotune --show 2>&1 | tee -a "$STATE/tune.txt" ;;
  one)
    CUDA_VISIBLE_DEVICES=0 timeout 540 minference-fx bench prefill --model $MODEL --lengths "$LENGTHS" \
      --variants "$VARIANTS" "${config_args[@]}" --reps "$REPS" --out "$STATE/one_gpu.json" 2>&1 | tee "$STATE/one_gpu.txt" ;;
  tp)
    # every variant in each rank's process (the ranks must run the same forwards in step), compile caches warm
    # from the first variant on; the one-GPU run gives each variant a fresh process and empty caches
    timeout 540 torchrun --standalone --nproc_per_node 2 -m minference_fx.tools.bench_tp --model $MODEL \
      --lengths "$LENGTHS" --variants "$VARIANTS" "${config_args[@]}" --reps "$REPS" --out "$STATE/tp2.json" \
      --single "$STATE/one_gpu.json" 2>&1 | tee "$STATE/tp2.txt" ;;
  collect)
    cp "$STATE"/*.json "$STATE"/*.txt "$OUT"/ 2>/dev/null
    cp "$MINFERENCE_FX_CACHE_DIR"/autotune*.json "$OUT"/ 2>/dev/null
    ls -la "$OUT" ;;
  *) echo "usage: scripts/bench_tp.sh tune|one|tp|collect" >&2; exit 2 ;;
esac
