"""Second process after `minference-fx autotune`: the op's lookups find every tuned entry and nothing is tuned.

usage: python scripts/autotune_reads_cache.py 32k,128k --head-dim 128 --gqa 4
Exit status 1 when a lookup misses or a tuning run happens.
"""
import argparse
import sys

import torch

from minference_fx.autotune import cache, dispatch
from minference_fx.cli import parse_lengths

parser = argparse.ArgumentParser()
parser.add_argument("lengths")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--gqa", type=int, default=4)
parser.add_argument("--kv-heads", type=int, default=8)
args = parser.parse_args()
dispatch.set_on_miss(True)  # a miss would tune (and be recorded in _tuned_here): there must be none
ok = True
for length in parse_lengths(args.lengths):
    # metadata only: the lookups read shapes, dtype and device, so empty tensors of the right shape do
    q = torch.empty(1, args.kv_heads * args.gqa, length, args.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(1, args.kv_heads, length, args.head_dim, device="cuda", dtype=torch.bfloat16)
    found = cache.find(dispatch.tune_key("sparse_attention", q.device, q.dtype, args.head_dim, args.gqa, length))
    crossover = dispatch.tuned_min_sparse_len(q, k)
    config = dispatch.launch_config(q, k)
    print(f"{length}: stored config {found}, used {config}, crossover {crossover}")
    ok &= found is not None and found == config
ok &= not dispatch._tuned_here
print("second process read the cache without tuning" if ok else f"MISSING entries or tuning ran: {dispatch._tuned_here}")
sys.exit(0 if ok else 1)
