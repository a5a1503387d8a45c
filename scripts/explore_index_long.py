"""GPU exploration (not a test): where the index's time goes at long prompts on issue 36's layer.

usage: python scripts/explore_index_long.py [--lengths 128k,1m] [--families structured] [--reps 5] [--unpadded]
                                           [--out PATH]

At 1M the index is 4.2 % of `bench kernels`' index + kernel (H100, 2026-12-07: 19.16 of 459.4 ms, 39.26× cuDNN against
issue 36's 40×). Its tables are sized for the worst case (``index.index_bytes``: 14.6 GB at 1M for VS(1000, 6096) on
32 heads, 11.7 GB of them block-start slots) and padded before the tile kernel fills them, so by arithmetic the padding
alone may be a quarter of its time. This times ``build_index_gpu`` as `bench kernels` calls it (Llama-3-8B's 32 query /
8 KV heads, d128, every head VS(1000, 6096), no guard) and lists its CUDA time by kernel, memsets and fills included.

``--unpadded`` also times the same build with the block-start table left unfilled (``torch.empty``; the column table
stays padded, since the walk reads leftover columns 64 at a time), swapped in for ``index._empty_index`` in this process
only, and checks that it lists the same blocks and columns and that the sparse walk's output over it is bit-identical:
what dropping the padding from ``SparseIndex``'s contract would gain.
"""
from __future__ import annotations

import argparse
import json

import torch

from explore_index_parts import kernel_table, listed
from minference_fx.autotune.dispatch import launch_config
from minference_fx.autotune.workload import family_qkv
from minference_fx.cli import parse_lengths
from minference_fx.kernels import index as index_module
from minference_fx.kernels.attend import sparse_attention_triton
from minference_fx.kernels.index import build_index_gpu, index_bytes
from minference_fx.kernels.reference import SparseIndex
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools.bench import event_ms

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
PADDED_EMPTY_INDEX = index_module._empty_index


def unpadded_empty_index(q, k, plan, wider=None) -> SparseIndex:
    """``index._empty_index`` with its block-start slots left as ``torch.empty`` finds them."""
    padded = PADDED_EMPTY_INDEX(q[:, :, :0], k, plan, wider)  # the shapes' capacities, for no query tile
    m_tiles = index_module._cdiv(q.shape[2], index_module.BLOCK)
    B, Hq = q.shape[:2]
    return SparseIndex(
        block_count=torch.zeros(B, Hq, m_tiles, dtype=torch.int32, device=q.device),
        block_start=torch.empty(B, Hq, m_tiles, padded.block_start.shape[-1], dtype=padded.block_start.dtype,
                                device=q.device),
        col_count=torch.zeros(B, Hq, m_tiles, dtype=torch.int32, device=q.device),
        col_index=torch.full((B, Hq, m_tiles, padded.col_index.shape[-1]), -1, dtype=torch.int32, device=q.device),
    )


def unpadded(q, k, v, plan, scale, reps: int) -> dict:
    patterns, budget_a, budget_b = plan.op_arguments()
    launch = launch_config(q, k).launch()
    padded = build_index_gpu(q, k, plan, scale=scale)
    index_module._empty_index = unpadded_empty_index
    try:
        ms = event_ms(lambda: build_index_gpu(q, k, plan, scale=scale), reps)
        bare = build_index_gpu(q, k, plan, scale=scale)
    finally:
        index_module._empty_index = PADDED_EMPTY_INDEX
    same = all(torch.equal(a, b) for a, b in zip(listed(padded), listed(bare)))
    outputs = [sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale, **launch)
               for index in (padded, bare)]
    return dict(unpadded_index_ms=ms, same_listing=same, same_output=torch.equal(*outputs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="128k,1m")
    ap.add_argument("--families", default="structured")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--unpadded", action="store_true", help="also time and check the build without block-start padding")
    ap.add_argument("--out")
    args = ap.parse_args()
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * LLAMA3_8B["num_q_heads"])
    runs = []
    for family in args.families.split(","):
        for length in parse_lengths(args.lengths):
            q, k, v = family_qkv(family, length, **LLAMA3_8B)
            scale = LLAMA3_8B["head_dim"] ** -0.5
            build = lambda: build_index_gpu(q, k, plan, scale=scale)  # noqa: E731
            ms = event_ms(build, args.reps)
            table, launches = kernel_table(build)
            sizes = {name: round(n / 2**30, 3) for name, n in index_bytes(plan, 1, length).items()}
            print(f"\n{family} {length}: index {ms:.2f} ms (median of {args.reps}), {launches} device activities, "
                  f"GiB {sizes}")
            for row in table:
                print(f"  {row['kernel']:<90} {row['calls']:>6} {row['ms']:>9.3f}")
            run = dict(family=family, length=length, index_ms=ms, kernels=table, launches=launches, gib=sizes)
            if args.unpadded:
                run.update(unpadded(q, k, v, plan, scale, args.reps))
                print(f"  unpadded block starts: index {run['unpadded_index_ms']:.2f} ms, same listing "
                      f"{run['same_listing']}, walk output bit-identical {run['same_output']}")
            runs.append(run)
            del q, k, v
            torch.cuda.empty_cache()
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, plan="VS(1000, 6096) x 32 heads")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
