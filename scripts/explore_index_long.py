"""GPU exploration (not a test): where the index's time goes at long prompts on issue 36's layer.

usage: python scripts/explore_index_long.py [--lengths 128k,1m] [--families structured] [--reps 5] [--out PATH]

At 1M the index is 4.2 % of `bench kernels`' index + kernel (H100, 2026-12-07: 19.16 of 459.4 ms, 39.26× cuDNN against
issue 36's 40×). Its tables are sized for the worst case (``index.index_bytes``: 14.6 GB at 1M for VS(1000, 6096) on
32 heads, 11.7 GB of them block-start slots) and padded before the tile kernel fills them, so by arithmetic the padding
alone may be a quarter of its time. This times ``build_index_gpu`` as `bench kernels` calls it (Llama-3-8B's 32 query /
8 KV heads, d128, every head VS(1000, 6096), no guard) and lists its CUDA time by kernel, memsets and fills included.
"""
from __future__ import annotations

import argparse
import json

import torch

from explore_index_parts import kernel_table
from minference_fx.autotune.workload import family_qkv
from minference_fx.cli import parse_lengths
from minference_fx.kernels.index import build_index_gpu, index_bytes
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools.bench import event_ms

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="128k,1m")
    ap.add_argument("--families", default="structured")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * LLAMA3_8B["num_q_heads"])
    runs = []
    for family in args.families.split(","):
        for length in parse_lengths(args.lengths):
            q, k, _ = family_qkv(family, length, **LLAMA3_8B)
            scale = LLAMA3_8B["head_dim"] ** -0.5
            build = lambda: build_index_gpu(q, k, plan, scale=scale)  # noqa: E731
            ms = event_ms(build, args.reps)
            table, launches = kernel_table(build)
            sizes = {name: round(n / 2**30, 3) for name, n in index_bytes(plan, 1, length).items()}
            print(f"\n{family} {length}: index {ms:.2f} ms (median of {args.reps}), {launches} device activities, "
                  f"GiB {sizes}")
            for row in table:
                print(f"  {row['kernel']:<90} {row['calls']:>6} {row['ms']:>9.3f}")
            runs.append(dict(family=family, length=length, index_ms=ms, kernels=table, launches=launches, gib=sizes))
            del q, k
            torch.cuda.empty_cache()
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, plan="VS(1000, 6096) x 32 heads")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
