#!/usr/bin/env bash
# The Qwen2.5-Coder-1.5B session on one GPU machine, in steps that outlast single device calls: each step runs
# in its own process session (setsid), so it goes on between calls while the machine stays warm, and writes
# under $STATE (kept on the machine); `status` prints where each stands, `collect` packs the results into $OUT.
#
#   scripts/gpu_qwen.sh start STEP...   run the steps one after another in the background
#   scripts/gpu_qwen.sh stop STEP       end a running step; the steps after it in its chain still run
#   scripts/gpu_qwen.sh status          the tail of every step's log
#   scripts/gpu_qwen.sh collect         $OUT/qwen_results.tar.gz: logs, JSON, the tuned cache, the config
#   scripts/gpu_qwen.sh poll [SECONDS]  wait up to SECONDS (default 240) or until no step runs, then status and
#                                       collect: every poll brings back all results so far
#
# The device tool gives a machine back after 30 s without a call, and what the steps wrote goes with it: while
# steps run, keep calling `poll` (each call keeps the machine busy while it waits), never leave a gap. A machine can
# also be taken back mid-step without warning (twice on 2026-12-05, once with a finished step's JSON on it): end every
# call, a model part's `receive` included, with `collect`, so each result reaches $OUT in the call after it lands.
# Steps: tune (d128/g6, the model's shape, with the 64K bucket the shipped table lacks), retune (the three shipped shapes
# after a Triton kernel edit; retune_d128 the two d128 ones; stages: 2 against 3 stages
# for the block-a-step walk, 32K-128K), tests (the GPU suite but the fuzz), fuzz (the GPU fuzz, 1000 shapes), kernels (bench kernels, both input
# families), search (the model's per-head config at 32K, sparse from 16K), prefill_searched (TTFT 8K-128K with it), prefill (TTFT 4K-128K, eager vs minference with the
# searched config; eager, Inductor, minference with and without the guard), prefill_sparse4k (the same config sparse
# from 4K, not from the tuned crossover), breakdown (where the time goes at 128K, the config shipped past 8K; breakdown32 at 32K with it sparse from 32K),
# cautious_cost (bench kernels with this GPU's table set aside: the cost model borrowing another GPU's rates), eval32 / eval128 (RULER-style
# tasks, NIAH, NLL on Austen and on code, dense vs sparse), evalg0 (NLL at 128K without the guard), tradeoff (TTFT
# at 64K/128K and NLL/NIAH at 128K with the guard at 0.5 and 0.65: the curve between guard 0 and the shipped 0.8),
# escalation (weak heads try MInference's (1000, 6096) before dense: TTFT at 64K/128K, fidelity at 128K), recall
# (the index's recall against an oracle of the same key count, both configs, 32K and 128K),
# candidate32k (the 32K-searched config in results/ sparse from 64K: TTFT 4K-128K, fidelity at 128K;
# candidate32k_g0.9 the same with the guard at 0.9), task_layers (the layers of that config whose dense run gives
# variable tracking back at 128K: every layer, measured), candidate32k_xN (that config with
# every budget times N, e.g. _x2), candidate32k_grow (budgets growing past 32K as sqrt(keys / 32K)), candidate32k_ro (that config sparse from 16K,
# with and without CUDA graphs), candidate32k_eval32 (its fidelity at 32K), peers
# (benchmarks/peers.py: MInference and FlashInfer, carried to /root/peers, against our kernel), index_ab (the index
# against an older index.py carried to /root/peers, eager and graph-replayed, outputs compared), walk_parts (the
# sparse walk with its columns or its blocks dropped: what each part costs), costs (the cost
# model's rates of the three tuned shapes), tests_cost (the GPU tests of routing and the cost model), kernels_op
# (bench kernels with the op's guarded, routed column, both families, 32K-512K), eval128_shipped32k (fidelity at 128K of
# the config shipped past 8K), fwe_layers32 (its layers that lose frequent words at 32K), candidate32k_fwe (it sparse
# from 32K with those layers dense: TTFT with and without CUDA graphs, fidelity at 32K; candidate32k_noesc the same
# without the guard's escalation), vt_code_layers128 (the
# layers of that config that lose code variable tracking at 128K), eval128_8k (the 8K config's fidelity at 128K),
# candidate128_links (the shipped config with variable tracking's link heads dense: TTFT at 64K/128K, fidelity at 128K),
# peers_512k (MInference at 512K, after step peers), vt_seeds128 (variable tracking at 128K, prose and code, three
# seeds, the config shipped past 8K), vt_code_seeds6 (code variable tracking alone, six seeds), search_prose_code32k (the 32K search calibrated on prose and code: code VT at 128K, TTFT,
# the fidelity table), compile_qwen (compile time at 4K against HF + Inductor's, one run), sparse32k_shipped (the shipped
# config past 8K sparse from 32K: TTFT, fidelity at 32K on three seeds), sparse32k_guard (the same with the guard at 0.9
# and 0.95: TTFT, frequent words and code variable tracking), tune_qwen (Qwen's shape alone, on a GPU with no table), tune_llama (Llama-3-8B's
# shape alone, into the user cache), kernels_ab (bench kernels with the shipped table, then with the user cache's tune), index_parts (the index
# taken apart on Qwen's shipped plans: escalation, guard mass, CUDA time by kernel; needs no model), dense_path (which SDPA
# the op's dense path and routed heads run on Qwen's shape, against eager's cuDNN-first SDPA; needs no model), prefill_shipped_all (TTFT 4K-128K with the config shipped past 8K), prefill_head (the same with HF + Inductor beside it), prefill_long (eager vs minference at 32K, 64K, 128K alone), tests_routed (the GPU tests of routing against the op's fused SDPA), breakdown32_dense (where the time goes at 32K on the dense path), tests_layout (the GPU tests of the op's output layout and padded dense calls), minference (MInference built and run alone, 32K-512K), kernels_1m (bench kernels at 1M, structured), kernels_escalation (its op column at 512K and 1M with
# the guard's escalation), index_long (the index at 128K and 1M by CUDA kernel, and without its block-start padding), pair_heads (two heads a program on shared picks), list_cost (full causal attention through the walk's list, its
# enumerated tiles and the dense walk). walk_step and list_prefetch, whose patches apply only to the kernel before 6cb727e, went once measured:
# git show a9f7d15:scripts/gpu_qwen.sh. The steps that compared column
# candidates (candidate_cols1024, eval128_cols1024, compare_vt128) went once their config shipped: git show a729960:scripts/gpu_qwen.sh.
# The model must have been converted first (scripts/device_model.py convert).
set -uo pipefail
STATE=${STATE:-/root/mfx-state}
# the project's default cache, where device_model.py's receive and convert put the Austen text and the model unless
# told otherwise (a cache of its own here once left the steps without the text: every eval and bench failed)
export MINFERENCE_FX_CACHE_DIR=${MINFERENCE_FX_CACHE_DIR:-$HOME/.cache/minference-fx}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
mkdir -p "$STATE" "$MINFERENCE_FX_CACHE_DIR"
# the config searched here at 32K (step search) when it exists, else the shipped one (searched at 8K on a CPU)
CONFIG=$STATE/qwen2.5-coder-1.5b_32k.json
[ -f "$CONFIG" ] || CONFIG=configs/qwen2.5_coder_1.5b_instruct_8k_yarn.json
MODEL=qwen2.5-coder-1.5b

install() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$STATE/install.log" 2>&1 || { cat "$STATE/install.log"; return 1; }
}

derived_config() {   # $1 config -> $2: guard threshold $3, sparse from $4 tokens, every head's budgets times $5
                     # (default 1), budget growth $6 ("KEYS,EXPONENT"; default none)
  python3 -m minference_fx.tools.candidates derived "$1" --out "$2" --guard-threshold "$3" --min-sparse-len "$4" \
    --scale "${5:-1}" ${6:+--budget-growth ${6%,*} ${6#*,}}
}

SHIPPED32K=configs/qwen2.5_coder_1.5b_instruct_32k_yarn.json

install_minference() {   # MInference from the source snapshot in /root/peers (its CUDA index converter built here with
                         # nvcc), and einops for its prefill's modules where the machine lacks it (a carried wheel)
  rm -rf /root/MInference && mkdir -p /root/MInference && tar -xzf /root/peers/minference_src.tar.gz -C /root/MInference
  MINFERENCE_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 timeout 400 \
    python3 -m pip install -q --no-deps --no-build-isolation /root/MInference || return 1
  python3 -c "import einops" 2>/dev/null || python3 -m pip install -q --no-deps /root/peers/einops-*.whl
}

step() {   # $1: step name; its log is $STATE/$1.txt
  local t0=$SECONDS
  echo "== $1 started $(date -u +%H:%M:%S)"
  case $1 in
    tune) timeout 560 minference-fx autotune --lengths 32k,64k,128k --head-dim 128 --gqa 6 --kv-heads 2 --dtype bf16
          minference-fx autotune --show ;;
    retune)  # after an edit of a Triton kernel: the three shipped shapes from scratch (launch configs, crossovers, costs),
             # then the table as the shipped autotune/h200.json would hold it (collect copies the user cache)
          timeout 450 minference-fx autotune --lengths 32k,128k --head-dim 64 --gqa 3 --kv-heads 3 --dtype bf16 --quiet
          bash "$0" run retune_d128 ;;  # a process of its own, so that `stop retune_d128` finds it
    stages)  # 2 against 3 stages for the block-a-step walk at 32K-128K, both families (the read-ahead
             # of 6cb727e deepened its copies at 3 stages only); the choices that differ from the table into the user cache
          timeout 400 python3 scripts/explore_stages.py --write-cache --out "$STATE/stages.json" ;;
    retune_d128)  # retune's two head_dim-128 shapes alone (Llama-3-8B's, the kernel benchmark's, and Qwen's), when the
                  # device time left is short of all three; SmolLM2's d64 entries stay as they were
          timeout 450 minference-fx autotune --lengths 32k,128k --head-dim 128 --gqa 4 --dtype bf16 --quiet
          timeout 450 minference-fx autotune --lengths 32k,128k --head-dim 128 --gqa 6 --kv-heads 2 --dtype bf16 --quiet
          minference-fx autotune --show ;;
    tune_qwen)  # Qwen's shape alone, as retune tunes it: on a GPU with no shipped table, before its TTFT is measured
          timeout 450 minference-fx autotune --lengths 32k,128k --head-dim 128 --gqa 6 --kv-heads 2 --dtype bf16 --quiet ;;
    fuzz) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider \
             --import-mode=importlib tests/test_gpu.py -k fuzz ;;
    costs)  # the cost model's rates (sparse walk and index against cuDNN) of the three tuned shapes, at 64K, with the
            # launch configs of the shipped table: SmolLM2's d64/g3, Llama-3-8B's d128/g4, Qwen's d128/g6
          timeout 200 minference-fx autotune --costs-only --head-dim 64 --gqa 3 --kv-heads 3
          timeout 200 minference-fx autotune --costs-only --head-dim 128 --gqa 4 --kv-heads 8
          timeout 200 minference-fx autotune --costs-only --head-dim 128 --gqa 6 --kv-heads 2
          minference-fx autotune --show | grep " cost " ;;
    tests_cost)  # the GPU tests of routing, capture and the cost model
          TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
            --import-mode=importlib tests/test_gpu.py -k "cost or routed or captures or near_dense" ;;
    index_ab)  # the index now against an older one (its index.py carried to /root/peers as old_index_*.py), same run
          timeout 300 python3 scripts/explore_kernels.py --old-index /root/peers/old_index_*.py --variants-at '' \
            --index-at 32k,128k ;;
    walk_parts)  # the sparse walk whole, without its columns and without its blocks, both families at 128K
          timeout 300 python3 scripts/explore_kernels.py --index-at '' --variants-at '' --parts-at 128k ;;
    kernels_op)  # bench kernels with the op column (guard, routing, cost model), both families, up to 512K
          timeout 500 minference-fx bench kernels --lengths 32k,128k,512k --families structured,scattered \
            --baselines cudnn --out "$STATE/bench_kernels_op.json" ;;
    tune_llama)  # Llama-3-8B's shape (the kernel benchmark's) alone, tuned against both input families into the user
                 # cache; kernels_ab then compares it with the shipped table (the user cache comes before the shipped table)
          timeout 500 minference-fx autotune --lengths 32k,128k --head-dim 128 --gqa 4 --dtype bf16 --quiet
          minference-fx autotune --show ;;
    kernels_ab)  # after tune_llama: bench kernels at 32K/128K, both families, with the shipped table (the user cache set
                 # aside), then with the tune in the user cache, one machine
          c=$MINFERENCE_FX_CACHE_DIR/autotune.json
          mv "$c" "$c.aside" || return 1
          timeout 240 minference-fx bench kernels --lengths 32k,128k --families structured,scattered --baselines cudnn \
            --out "$STATE/bench_kernels_shipped_table.json"
          mv "$c.aside" "$c"
          timeout 240 minference-fx bench kernels --lengths 32k,128k --families structured,scattered --baselines cudnn \
            --out "$STATE/bench_kernels_two_family_tune.json" ;;
    index_parts) timeout 300 python3 scripts/explore_index_parts.py --lengths 32k,128k --families structured,scattered \
                   --old-index minference_fx/kernels/index.py \
                   --out "$STATE/index_parts.json" ;;
    dense_path) timeout 200 python3 scripts/explore_dense_path.py --lengths 8k,32k,128k --out "$STATE/dense_path.json" ;;
    tests) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider \
             --import-mode=importlib --durations=10 tests -k "not fuzz" ;;
    kernels) timeout 300 minference-fx bench kernels --lengths 32k,128k --families structured,scattered \
               --out "$STATE/bench_kernels.json" ;;
    search) timeout 900 minference-fx search --model $MODEL --lengths 32k --samples 1 --yarn 4 \
              --guard-threshold 0.8 --guard-escalation 1000 6096 --min-sparse-len 16384 \
              --out "$STATE/qwen2.5-coder-1.5b_32k.json" ;;
    candidate32k_grow)  # the 32K-searched config whose budgets grow past 32K as sqrt(keys / 32K) (option budget_growth):
          # x1.41 at 64K, x2 at 128K, one config for every length; TTFT 64K/128K, fidelity at 128K
          derived_config results/search_qwen_32k_h200_2026-12-03.json "$STATE/$1.json" 0.8 65536 1 32768,0.5 || return 1
          timeout 600 minference-fx bench prefill --model $MODEL --lengths 64k,128k --variants eager,minference \
            --config "$STATE/$1.json" --reps 3 --out "$STATE/bench_prefill_qwen_$1.json"
          timeout 600 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config "$STATE/$1.json" --out "$STATE/eval128_qwen_$1.json" ;;
    candidate32k|candidate32k_g0.9|candidate32k_x*)  # the 32K-searched config of results/ sparse from 64K (dense
          # below, where it lost to cuDNN): TTFT 4K-128K and fidelity at 128K; _g0.9 with the guard at 0.9, _xN with
          # every budget times N (budgets are absolute: at 128K a 32K search's keep a quarter of the share they kept
          # there), both at 64K/128K only; the escalation stays (1000, 6096), which then raises fewer heads
          C=$STATE/$1.json G=0.8 L=4k,8k,16k,32k,64k,128k X=1
          case $1 in
            candidate32k_g0.9) G=0.9 L=64k,128k ;;
            candidate32k_x*) X=${1#candidate32k_x} L=64k,128k ;;
          esac
          derived_config results/search_qwen_32k_h200_2026-12-03.json "$C" "$G" 65536 "$X" || return 1
          timeout 600 minference-fx bench prefill --model $MODEL --lengths $L --variants eager,minference \
            --config "$C" --reps 3 --out "$STATE/bench_prefill_qwen_$1.json"
          timeout 600 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config "$C" --out "$STATE/eval128_qwen_$1.json" ;;
    candidate32k_ro)  # the 32K-searched config sparse from 16K (as searched), with and without CUDA graphs
          # (mode="reduce-overhead"): whether the op's host time (about 290 launches a call) is what loses 16K-32K
          derived_config results/search_qwen_32k_h200_2026-12-03.json "$STATE/$1.json" 0.8 16384 || return 1
          timeout 600 minference-fx bench prefill --model $MODEL --lengths 16k,32k,64k --variants eager,minference,minference-ro \
            --config "$STATE/$1.json" --reps 3 --out "$STATE/bench_prefill_qwen_$1.json" ;;
    candidate32k_eval32)  # fidelity at 32K of candidate32k_ro's config (forced sparse, as eval32)
          derived_config results/search_qwen_32k_h200_2026-12-03.json "$STATE/$1.json" 0.8 16384 || return 1
          timeout 600 minference-fx eval --model $MODEL --lengths 32k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config "$STATE/$1.json" --out "$STATE/eval32_qwen_$1.json" ;;
    task_layers)  # which layers of the 32K-searched config lose variable tracking at 128K (scripts/explore_task_layers.py)
          timeout 580 python3 scripts/explore_task_layers.py results/search_qwen_32k_h200_2026-12-03.json --model $MODEL \
            --length 128k --tasks variable_tracking --out "$STATE/task_layers_vt_128k.json" ;;
    prefill_searched)  # TTFT 8K-128K, eager vs minference, with the config as searched (sparse from 16K)
          timeout 900 minference-fx bench prefill --model $MODEL --lengths 8k,16k,32k,64k,128k --variants eager,minference \
            --config "$CONFIG" --reps 3 --out "$STATE/bench_prefill_qwen_searched.json" ;;
    prefill_shipped32k)  # TTFT 32K-128K, eager vs minference, the config shipped for prompts past 8K
          timeout 600 minference-fx bench prefill --model $MODEL --lengths 32k,64k,128k --variants eager,minference \
            --config $SHIPPED32K --reps 3 \
            --out "$STATE/bench_prefill_qwen_shipped32k.json" ;;
    sparse32k_shipped)  # the shipped config past 8K sparse from 32K (since its columns were raised): TTFT at 32K with and without
                        # CUDA graphs, then fidelity at 32K forced sparse on three seeds (with its columns as searched, frequent
                        # words lost 2 of 9 words there, one prompt); 1.3x at 32K with every task within 2 points would ship it
          timeout 300 minference-fx bench prefill --model $MODEL --lengths 32k --variants eager,minference,minference-ro \
            --config $SHIPPED32K --min-sparse-len 32768 --reps 3 --out "$STATE/bench_prefill_qwen_$1.json"
          timeout 500 minference-fx eval --model $MODEL --lengths 32k --tasks ruler,ruler-code,ppl,ppl-code,niah --seeds 3 \
            --ppl-tokens 1024 --config $SHIPPED32K --out "$STATE/eval32_qwen_$1.json" ;;
    sparse32k_guard)  # sparse from 32K with a stricter guard (0.9, 0.95), since the raised columns left frequent words and code
                      # variable tracking under dense at 0.8 (sparse32k_shipped): TTFT at 32K, then those two tasks on three
                      # seeds, both guards in one eval process (one dense side)
          for g in 0.9 0.95; do
            derived_config $SHIPPED32K "$STATE/shipped32k_guard$g.json" $g 32768 1 32768,0.5 || return 1  # its growth kept
            timeout 300 minference-fx bench prefill --model $MODEL --lengths 32k --variants eager,minference \
              --config "$STATE/shipped32k_guard$g.json" --reps 3 --out "$STATE/bench_prefill_qwen_$1_$g.json"
          done
          timeout 500 minference-fx eval --model $MODEL --lengths 32k --tasks ruler,ruler-code \
            --ruler-tasks freq_words,variable_tracking --seeds 3 \
            --config "$STATE/shipped32k_guard0.9.json,$STATE/shipped32k_guard0.95.json" --out "$STATE/eval32_qwen_$1.json" ;;
    compile_qwen)  # compile time against HF + Inductor's in one run: the first call at 4K compiles (the config shipped
                   # past 8K, whose 4K runs the dense path; the sparse kernels JIT beside Inductor), 32K checks no recompile
          timeout 500 minference-fx bench prefill --model $MODEL --lengths 4k,32k --variants eager,inductor,minference \
            --config $SHIPPED32K --reps 1 --out "$STATE/bench_prefill_qwen_$1.json" ;;
    eval128_shipped32k)  # fidelity at 128K of the config shipped past 8K (forced sparse, as eval128)
          timeout 900 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config $SHIPPED32K --out "$STATE/$1_qwen.json" ;;
    fwe_layers32)  # which layers of the config shipped past 8K lose frequent-words extraction at 32K (forced sparse),
                   # on three prompts (seeds) instead of eval's one
          timeout 580 python3 scripts/explore_task_layers.py $SHIPPED32K \
            --model $MODEL --length 32k --tasks freq_words --haystacks austen --depths 0.5 --seeds 0,1,2 \
            --out "$STATE/task_layers_fwe_32k.json" ;;
    candidate32k_noesc)  # candidate32k_fwe's config without the guard's escalation (weak heads to cuDNN): TTFT and fidelity at 32K
          [ -f "$STATE/candidate32k_fwe.json" ] || { echo "run candidate32k_fwe first"; return 1; }
          timeout 400 minference-fx bench prefill --model $MODEL --lengths 32k --variants eager,minference \
            --config "$STATE/candidate32k_fwe.json" --guard-escalation 0 0 --reps 3 --out "$STATE/bench_prefill_qwen_$1.json"
          timeout 400 minference-fx eval --model $MODEL --lengths 32k --tasks ruler,ruler-code,ppl,ppl-code,niah --seeds 3 \
            --ppl-tokens 1024 --config "$STATE/candidate32k_fwe.json" --guard-escalation 0 0 --out "$STATE/eval32_qwen_$1.json" ;;
    vt_code_layers128)  # which layers of the config shipped past 8K lose code variable tracking at 128K on the diagonal blocks
          timeout 590 python3 scripts/explore_task_layers.py $SHIPPED32K \
            --model $MODEL --length 128k --tasks variable_tracking --haystacks code --out "$STATE/task_layers_vt_code_128k.json" ;;
    candidate128_links)  # the config shipped past 8K with the heads that carry variable tracking's links run dense (the top
                         # link heads of scripts/explore_estimate_rows.py on the CPU): TTFT at 64K/128K, fidelity at 128K
          python3 -m minference_fx.tools.candidates dense-heads $SHIPPED32K \
            --probes results/explore_estimate_rows_qwen_cpu_2026-12-05_8k*.json --out "$STATE/$1.json" || return 1
          timeout 400 minference-fx bench prefill --model $MODEL --lengths 64k,128k --variants eager,minference \
            --config "$STATE/$1.json" --reps 3 --out "$STATE/bench_prefill_qwen_$1.json"
          timeout 900 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config "$STATE/$1.json" --out "$STATE/eval128_qwen_$1.json" ;;
    vt_seeds128)  # variable tracking at 128K, prose and code, three seeds (45 strings a haystack, not 15): whether the
                  # shipped config's code VT loss (2 of 15 strings) is its own or one seed's
          timeout 900 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ruler-code \
            --ruler-tasks variable_tracking --seeds 3 --config $SHIPPED32K \
            --out "$STATE/$1_qwen.json" ;;
    vt_code_seeds6)  # code variable tracking at 128K on six seeds (90 strings), the shipped config past 8K: seeds 0-2 repeat
                     # vt_seeds128's prompts (a check that the scores replay), 3-5 are new; the total is what counts
          timeout 900 minference-fx eval --model $MODEL --lengths 128k --tasks ruler-code \
            --ruler-tasks variable_tracking --seeds 6 --config $SHIPPED32K \
            --out "$STATE/$1_qwen.json" ;;
    search_prose_code32k)  # the 32K search calibrated on prose and code (one window each), with the shipped config's
                           # defaults; then code variable tracking at 128K on three seeds (the shipped config loses 9 of 45
                           # strings there) and the full fidelity table and TTFT at 64K/128K
          timeout 400 minference-fx search --model $MODEL --data austen,code --lengths 32k --samples 1 --yarn 4 \
            --guard-threshold 0.8 --guard-escalation 1000 6096 --min-sparse-len 65536 --budget-growth 32768 0.5 \
            --out "$STATE/$1.json" || return 1
          timeout 600 minference-fx eval --model $MODEL --lengths 128k --tasks ruler-code --ruler-tasks variable_tracking \
            --seeds 3 --config "$STATE/$1.json" --out "$STATE/eval128_vt_qwen_$1.json"
          timeout 400 minference-fx bench prefill --model $MODEL --lengths 64k,128k --variants eager,minference \
            --config "$STATE/$1.json" --reps 3 --out "$STATE/bench_prefill_qwen_$1.json"
          timeout 900 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config "$STATE/$1.json" --out "$STATE/eval128_qwen_$1.json" ;;
    eval128_8k)  # fidelity at 128K of the 8K-searched config (guard 0.8 + escalation) on the diagonal blocks
          timeout 900 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config configs/qwen2.5_coder_1.5b_instruct_8k_yarn.json --out "$STATE/$1_qwen.json" ;;
    candidate32k_fwe)  # that config sparse from 32K with the layers fwe_layers32 found run dense: TTFT at 32K with and
                       # without CUDA graphs, fidelity at 32K (forced sparse, three seeds)
          python3 -m minference_fx.tools.candidates dense-layers $SHIPPED32K \
            --found "$STATE/task_layers_fwe_32k.json" --min-sparse-len 32768 --out "$STATE/$1.json" || return 1
          timeout 400 minference-fx bench prefill --model $MODEL --lengths 32k,64k --variants eager,minference,minference-ro \
            --config "$STATE/$1.json" --reps 3 --out "$STATE/bench_prefill_qwen_$1.json"
          timeout 400 minference-fx eval --model $MODEL --lengths 32k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --seeds 3 --ppl-tokens 1024 --config "$STATE/$1.json" --out "$STATE/eval32_qwen_$1.json" ;;
    prefill_shipped)  # TTFT 32K-128K, eager vs minference, the shipped config (after a change to the op's routing)
          timeout 600 minference-fx bench prefill --model $MODEL --lengths 32k,64k,128k --variants eager,minference \
            --config "$CONFIG" --reps 3 --out "$STATE/bench_prefill_qwen_shipped.json" ;;
    prefill) timeout 900 minference-fx bench prefill --model $MODEL --lengths 4k,8k,16k,32k,64k,128k \
               --variants eager,inductor,minference,minference-noguard --config "$CONFIG" --reps 3 \
               --out "$STATE/bench_prefill_qwen.json" ;;
    prefill_sparse4k)  # the same config sparse from 4K instead of from the tuned crossover
          python3 -m minference_fx.tools.candidates min-sparse-len "$CONFIG" 4096 --out "$STATE/config_sparse4k.json" || return 1
          timeout 400 minference-fx bench prefill --model $MODEL --lengths 4k,8k,16k,32k --variants eager,minference \
            --config "$STATE/config_sparse4k.json" --reps 3 --out "$STATE/bench_prefill_qwen_sparse4k.json" ;;
    breakdown) timeout 400 minference-fx bench breakdown --model $MODEL --lengths 128k \
                 --config $SHIPPED32K \
                 --out "$STATE/breakdown_qwen_128k.json" ;;
    cautious_cost)  # the cost model on a GPU whose table lacks the shape: this GPU's shipped table set aside in the
                    # step's private tree and an empty user cache, so it borrows the other GPU's cost (cache.cautious_cost)
          t=autotune/$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100).json
          mv "$t" "$t.off" || return 1
          MINFERENCE_FX_CACHE_DIR=$(mktemp -d) timeout 300 minference-fx bench kernels --lengths 32k,128k \
            --families structured,scattered --baselines cudnn --out "$STATE/bench_kernels_cautious.json"
          mv "$t.off" "$t" ;;
    prefill_shipped_all|prefill_head)  # TTFT 4K-128K with the config shipped past 8K: eager vs minference, and with
          # prefill_head HF + Inductor beside them in one run (the compile target beside the speed)
          variants=eager,minference
          [ "$1" = prefill_head ] && variants=eager,inductor,minference
          timeout 900 minference-fx bench prefill --model $MODEL --lengths 4k,8k,16k,32k,64k,128k \
            --variants $variants --config $SHIPPED32K --reps 3 --out "$STATE/bench_prefill_qwen_$1.json" ;;
    prefill_long)  # TTFT at issue 35's three target lengths alone (32K, 64K, 128K), eager vs minference with the config
                   # shipped past 8K: the re-measure after a kernel or table change, in less device time than prefill_head
          timeout 600 minference-fx bench prefill --model $MODEL --lengths 32k,64k,128k --variants eager,minference \
            --config $SHIPPED32K --reps 3 --out "$STATE/bench_prefill_qwen_long.json" ;;
    tests_routed)  # the GPU tests of routed heads and the cost model (their reference is the op's own fused SDPA)
          TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
            --import-mode=importlib tests/test_gpu.py -k "routed or cost_model or runs_cudnn or near_dense" ;;
    breakdown32_dense)  # where the time goes at 32K on the dense path (the shipped config runs dense there)
          timeout 300 minference-fx bench breakdown --model $MODEL --lengths 32k --config $SHIPPED32K \
            --out "$STATE/breakdown_qwen_32k_dense.json" ;;
    tests_layout)  # the GPU tests of the op's output layout and the dense path's masked calls
          TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
            --import-mode=importlib tests/test_gpu.py -k "layout or masked_dense or padded or routed" ;;
    breakdown32)  # the same at 32K with the shipped config sparse from 32K: what stands between its 1.33x and more
          timeout 300 minference-fx bench breakdown --model $MODEL --lengths 32k --config $SHIPPED32K \
            --min-sparse-len 32768 --out "$STATE/breakdown_qwen_32k_sparse.json" ;;
    eval32|eval128) timeout 900 minference-fx eval --model $MODEL --lengths ${1#eval}k --tasks ruler,ruler-code,ppl,ppl-code,niah \
            --ppl-tokens 1024 --config "$CONFIG" --out "$STATE/$1_qwen.json" ;;
    tradeoff)  # speed against fidelity by guard threshold at 64K and 128K: TTFT, then NLL and NIAH at 128K, without
               # the config's escalation (0 0), as BENCHMARKS.md's rows were measured
          for g in 0.5 0.65; do
            timeout 400 minference-fx bench prefill --model $MODEL --lengths 64k,128k --variants eager,minference \
              --config "$CONFIG" --guard-threshold $g --guard-escalation 0 0 --reps 3 --out "$STATE/bench_prefill_qwen_guard$g.json"
            timeout 400 minference-fx eval --model $MODEL --lengths 128k --tasks ppl,ppl-code,niah --ppl-tokens 1024 \
              --config "$CONFIG" --guard-threshold $g --guard-escalation 0 0 --out "$STATE/eval128_qwen_guard$g.json"
          done ;;
    escalation)  # weak heads escalate to MInference's default budgets instead of running dense: TTFT, fidelity
          timeout 400 minference-fx bench prefill --model $MODEL --lengths 64k,128k --variants eager,minference \
            --config "$CONFIG" --guard-escalation 1000 6096 --reps 3 --out "$STATE/bench_prefill_qwen_escalation.json"
          timeout 600 minference-fx eval --model $MODEL --lengths 128k --tasks ruler,ppl,ppl-code,niah --ppl-tokens 1024 \
            --config "$CONFIG" --guard-escalation 1000 6096 --out "$STATE/eval128_qwen_escalation.json" ;;
    recall)  # issue 35's oracle bound: per head, the index's recall of dense attention mass against the heaviest keys
             # at the same count (the oracle), shipped config and the 32K-searched one, at 32K and 128K
          timeout 500 minference-fx eval --model $MODEL --lengths 32k,128k --tasks recall --config "$CONFIG" \
            --out "$STATE/recall_qwen_shipped.json"
          timeout 500 minference-fx eval --model $MODEL --lengths 32k,128k --tasks recall \
            --config results/search_qwen_32k_h200_2026-12-03.json --out "$STATE/recall_qwen_search32k.json" ;;
    evalg0) timeout 600 minference-fx eval --model $MODEL --lengths 128k --tasks ppl,ppl-code --ppl-tokens 1024 \
              --config "$CONFIG" --guard-threshold 0 --out "$STATE/evalg0_qwen.json" ;;
    peers)  # issue 36 part 4: MInference as shipped (its source, built here with nvcc) and FlashInfer (its wheel,
            # carried in two halves) on bench kernels' inputs; outside the package (benchmarks/peers.py)
          cat /root/peers/flashinfer_python-*.whl.part* > /tmp/flashinfer_python-0.7.4-py3-none-any.whl
          python3 -m pip install -q --no-deps /tmp/flashinfer_python-0.7.4-py3-none-any.whl /root/peers/*.whl
          install_minference
          bash "$0" run peers_run ;;
    minference)  # MInference alone (no FlashInfer wheel carried): built from /root/peers/minference_src.tar.gz, then
                 # its kernel on our picks and its prefill end to end (its own estimate; needs einops, carried as a
                 # wheel) at 32K/128K and 512K, both families, against our index and kernel
          install_minference || return 1
          timeout 400 python3 -m benchmarks.peers --lengths 32k,128k --families structured,scattered \
            --peers minference,minference-prefill --out "$STATE/peers_minference.json"
          step peers_512k ;;
    pair_heads)  # the sparse walk with two query heads a program on picks they share, against the shipped walk
                 # (scripts/explore_pair_heads.py: a patched copy of the tree)
          timeout 400 python3 scripts/explore_pair_heads.py --out "$STATE/pair_heads.json" ;;
    list_cost)  # what the sparse walk's block list costs: full causal attention listed, enumerated, and by the dense walk
                # at 64 and 128 rows (scripts/explore_list_cost.py)
          timeout 300 python3 scripts/explore_list_cost.py --out "$STATE/list_cost.json" ;;
    index_variants)  # the index now against each variant index.py carried as out/idx_NAME.py (written by
                     # scripts/make_index_variants.py; explore_index_long's A/B at 128K and 1M, one process a variant):
                     # which launch change of the estimate to keep
          # the filter keeps the Triton kernels' rows; a variant's failure is its python's status, not the filter's
          failed=0
          for v in out/idx_*.py; do
            name=$(basename "$v" .py)
            timeout 200 python3 scripts/explore_index_long.py --lengths 128k,1m --old-index "$v" \
              --out "$STATE/index_variant_${name#idx_}.json" | grep -v "^ *void\|^ *at::\|Memset\|Memcpy"
            rc=${PIPESTATUS[0]}
            [ "$rc" = 0 ] || { echo "variant ${name#idx_} failed: rc $rc"; failed=1; }
          done
          [ "$failed" = 0 ] ;;
    index_long)  # where the index's time goes at 128K and 1M on issue 36's layer (CUDA time by kernel, fills included),
                # against the older index.py carried as out/old_index.py (git show REV:minference_fx/kernels/index.py)
          timeout 300 python3 scripts/explore_index_long.py --lengths 128k,1m --old-index out/old_index.py --out "$STATE/index_long.json" ;;
    kernels_escalation)  # the op column at 512K and 1M with the guard's weak heads first trying 4x MInference's budgets
                         # (without it they run on cuDNN: 2 of 32 heads, 469 against 207 ms at 512K); after kernels_1m
          timeout 580 minference-fx bench kernels --lengths 512k,1m --families structured --baselines cudnn \
            --guard-escalation 4000 24384 --out "$STATE/bench_kernels_escalation.json" ;;
    kernels_1m)  # bench kernels at 1M on the project's structured family (issue 36's 40x row)
          timeout 580 minference-fx bench kernels --lengths 1m --families structured --baselines cudnn \
            --out "$STATE/bench_kernels_1m.json" ;;
    peers_run)  # the peers' runs alone, once step peers has installed them
          timeout 400 python3 -m benchmarks.peers --lengths 32k,128k --families structured,scattered --peers minference \
            --out "$STATE/peers_minference.json"
          timeout 600 python3 -m benchmarks.peers --lengths 32k,128k --families structured,scattered --peers flashinfer \
            --out "$STATE/peers_flashinfer.json" ;;
    peers_512k)  # MInference at 512K on both families, once step peers has installed it (the issue's third row)
          timeout 580 python3 -m benchmarks.peers --lengths 512k --families structured,scattered \
            --peers minference,minference-prefill --out "$STATE/peers_minference_512k.json" ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
  echo "== $1 rc=$? took $((SECONDS - t0)) s"
}

case ${1:-status} in
  start)
    shift
    # steps run from a private copy of the tree: every device call syncs the working tree anew, and a step that
    # read a kernel file mid-sync hashed a missing file (no tuned launch config for the rest of that process)
    src=/root/mfx-src-$(date +%s)
    mkdir -p "$src" && tar --exclude=./.xfer --exclude=./.xfer_peers -cf - . | tar -xf - -C "$src"
    cd "$src" && install || exit 1
    # one step at a time on the GPU, also across chains started by separate calls: each holds the lock while it runs
    setsid bash -c "cd '$src'; for s in $*; do flock '$STATE/gpu.lock' bash '$src/scripts/gpu_qwen.sh' run \$s > '$STATE'/\$s.txt 2>&1; done" </dev/null >/dev/null 2>&1 &
    echo "started: $*" ;;
  run) step "$2" ;;
  stop)  # end step $2 and what it runs (timeout ends its command's process group); its chain goes on to the next
         # step. `pkill -f STEP` would also match the chain's own command line, and end every step after it too
    pids=$(pgrep -f "^bash .*gpu_qwen\.sh run $2\$")
    [ -n "$pids" ] || { echo "not running: $2"; exit 1; }
    for pid in $pids; do
      kids=$(pgrep -P "$pid"); kill "$pid"; [ -n "$kids" ] && kill $kids
    done
    echo "stopped: $2" ;;
  status)
    for f in "$STATE"/*.txt; do [ -f "$f" ] && { echo "--- $(basename "$f")"; tail -n "${TAIL:-4}" "$f"; }; done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
  poll)
    for _ in $(seq "${2:-240}"); do pgrep -f "[g]pu_qwen.sh' run" >/dev/null || pgrep -f "[g]pu_qwen.sh run" >/dev/null || break; sleep 1; done
    TAIL=${TAIL:-4} bash "$0" status
    bash "$0" collect ;;
  collect)
    cp "$MINFERENCE_FX_CACHE_DIR"/autotune*.json "$STATE"/ 2>/dev/null
    tar -czf "$OUT/qwen_results.tar.gz" -C "$STATE" .
    ls -la "$OUT" ;;
esac
