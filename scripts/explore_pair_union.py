"""CPU exploration (not a test): how much larger the union of two neighbouring 64-row query tiles' key-tile
lists is than either list, on the kernel bench's structured inputs with VS(1000, 6096).

A 128-row program would walk that union; on dense work 128 rows per program are 1.11x faster than 64 on
the H200 (results/explore_dense_h200_2026-11-30.txt), so the union must stay under that to pay.

usage: python scripts/explore_pair_union.py [--lengths 32k,128k] [--heads 4]
"""
from __future__ import annotations

import argparse

import torch

from minference_fx.autotune.workload import structured_qkv
from minference_fx.cli import parse_lengths
from minference_fx.kernels import reference
from minference_fx.plan import HeadPlan, LayerPlan, Pattern


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--heads", type=int, default=4)
    a = ap.parse_args()
    for n in parse_lengths(a.lengths):
        q, k, _ = structured_qkv(n, num_q_heads=a.heads, num_kv_heads=1, head_dim=128, dtype=torch.float32, device="cpu")
        plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * a.heads)
        index = reference.build_index(q, k, plan, scale=128 ** -0.5)
        counts, tiles = index.tile_count[0], index.tile_index[0]
        listed = union = 0
        for h in range(counts.shape[0]):
            for m in range(0, counts.shape[1] - 1, 2):
                top = set(tiles[h, m, :counts[h, m]].tolist())
                bottom = set(tiles[h, m + 1, :counts[h, m + 1]].tolist())
                listed += len(top) + len(bottom)
                union += len(top | bottom)
        print(f"{n}: {counts.float().mean().item():.1f} tiles per query tile; union of a pair / mean list "
              f"{2 * union / listed:.3f}", flush=True)


if __name__ == "__main__":
    main()
