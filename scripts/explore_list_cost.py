"""GPU exploration (not a test): what the sparse walk's block list costs, on the same work as the dense walk.

usage: python scripts/explore_list_cost.py --out FILE.json [--lengths 32k,128k] [--reps 10]

The dense walk (every causal key, 128-row programs) runs at about 1.24x the sparse walk's rate per tile, and two heads
a 128-row program on one list did not close that gap (BENCHMARKS section 1). This times full causal attention of the
Llama-3-8B attention shape (random bf16 inputs: the work does not depend on the values) five ways, all through
``sparse_attention_triton``, so that each step between neighbours changes one thing:

* ``listed vs``: every head vertical-slash, its index listing every causal key tile (aligned diagonal blocks);
* ``listed bs``: the same list, every head block-sparse (no diagonal-block bookkeeping);
* ``enumerated``: every head dense in the sparse launch: the same tile loop, tile addresses computed, no list;
* ``dense walk 64`` / ``dense walk 128``: the dense walk (``forced="only"``), 64- and 128-row programs.

The launch configs are the shipped H100 table's for this shape (sparse walk 64/64, 4 warps, 3 stages; dense walk
128/64, 4 warps, 2 stages; the 64-row dense walk takes the sparse walk's). cuDNN runs beside them, and every output is
compared with the first one's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from minference_fx.cli import parse_lengths
from minference_fx.kernels.attend import sparse_attention_triton
from minference_fx.kernels.reference import BLOCK, SparseIndex
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools.bench import _ms
from variant_runs import cudnn_causal_ms

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SPARSE_LAUNCH = dict(block_m=64, block_n=64, num_warps=4, num_stages=3)
DENSE_LAUNCH = dict(block_m=128, block_n=64, num_warps=4, num_stages=2)


def full_index(n: int, device) -> SparseIndex:
    """Every causal key tile of every query tile, listed in order; no columns."""
    m = -(-n // BLOCK)
    tiles = torch.arange(m, dtype=torch.int32, device=device)
    block_start = (tiles * BLOCK).expand(1, HEADS, m, m).contiguous()
    block_count = (tiles + 1).expand(1, HEADS, m).contiguous()
    col_index = torch.full((1, HEADS, m, 1), -1, dtype=torch.int32, device=device)
    col_count = torch.zeros(1, HEADS, m, dtype=torch.int32, device=device)
    return SparseIndex(block_count, block_start, col_count, col_index)


def measure(lengths: list[int], reps: int, device: str) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    for n in lengths:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, HEADS, n, HEAD_DIM, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=g, device=device, dtype=dtype) for _ in range(2))
        scale = HEAD_DIM ** -0.5
        index = full_index(n, device)
        everyone = torch.ones(1, HEADS, dtype=torch.bool, device=device)

        def walk(pattern, **launch):
            args = LayerPlan((HeadPlan(pattern, 0, 0),) * HEADS).op_arguments()
            return lambda: sparse_attention_triton(q, k, v, index, *args, scale=scale, **launch)

        runs = {
            "listed vs": walk(Pattern.VERTICAL_SLASH, **SPARSE_LAUNCH),
            "listed bs": walk(Pattern.BLOCK_SPARSE, **SPARSE_LAUNCH),
            "enumerated": walk(Pattern.DENSE, **SPARSE_LAUNCH),
            "dense walk 64": walk(Pattern.DENSE, force_dense=everyone, forced="only", **SPARSE_LAUNCH),
            "dense walk 128": walk(Pattern.DENSE, force_dense=everyone, forced="only", **DENSE_LAUNCH),
        }
        group = HEADS // KV_HEADS
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        want = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale)
        row = {"length": n, "ms": {}, "max_diff_vs_sdpa": {}}
        if device == "cuda":
            row["cudnn_ms"] = cudnn_causal_ms(q, k, v, group, reps)
        for name, fn in runs.items():
            row["max_diff_vs_sdpa"][name] = float((fn().float() - want.float()).abs().max())
            if device == "cuda":
                row["ms"][name] = _ms(fn, reps)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, kr, vr, want, index
    return rows


def print_table(rows: list[dict]) -> None:
    names = list(rows[0]["ms"])
    print("| length | cuDNN | " + " | ".join(names) + " | max diff |")
    print("| --- | --- | " + " | ".join("---" for _ in names) + " | --- |")
    for r in rows:
        cells = [f"{r['ms'][x]:.2f}" for x in names]
        print(f"| {r['length'] // 1024}K | {r['cudnn_ms']:.2f} | " + " | ".join(cells)
              + f" | {max(r['max_diff_vs_sdpa'].values()):.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = measure(parse_lengths(a.lengths), a.reps, device)
    a.out.write_text(json.dumps(rows, indent=1))
    if device == "cuda":
        print_table(rows)


if __name__ == "__main__":
    main()
