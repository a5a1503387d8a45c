"""How many keys a vertical-slash head's diagonals cost per query tile: aligned 64-key tiles (our index) against
unaligned 64-key ranges merged per run of nearby diagonals (MInference's block offsets).

A diagonal ``d`` crosses query tile ``m`` (rows ``64m .. 64m+63``) on keys ``64m - d .. 64m + 63 - d``: one
64-key range, which two aligned tiles cover unless ``d`` is a multiple of 64. Diagonals closer than 64 merge
into one range. For every layer of SmolLM2-135M (real weights, Austen prose) at the given length, with the
default budgets (1000 columns, 6096 diagonals) on every head, this prints the mean per query tile of: aligned
tiles our index lists, unaligned 64-key blocks covering the merged ranges, and the keys in those ranges. The
ratio tiles / blocks bounds what walking unaligned ranges would save in the sparse walk (whose time is spent
almost wholly on those tiles: results/explore_prefill_profile_smollm2_h200_2026-12-01.txt).

``--model llama-random`` asks the same of the issue's benchmark model (Llama-3-8B shape, HF's random init,
random token ids, ``--layers`` of them): whether MInference's unaligned ranges would keep fewer keys than our
aligned tiles where the diagonals scatter, which decides whether any vertical-slash kernel can beat dense there.

usage: python3 scripts/explore_slash_ranges.py [--length 128k] [--model smollm2|llama-random] [--layers 2]
       (smollm2: set up as scripts/gpu_smollm2.sh does)
"""
from __future__ import annotations

import argparse

import torch

from minference_fx.tools.bench_prefill import build_model, build_smollm2, llama3_8b_config, prompt_ids, text_prompt_ids
from minference_fx.cli import parse_lengths
from minference_fx.kernels.guard import causal_tiles as causal_tile_pairs
from minference_fx.kernels.index import build_index_gpu, vs_estimate
from minference_fx.kernels.reference import BLOCK, VS_FORCED_DIAGONALS
from minference_fx.observe import run_observed
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

COLUMNS, DIAGONALS = 1000, 6096


def unaligned_cost(diags: torch.Tensor, sq: int) -> tuple[float, float]:
    """(mean 64-key blocks, mean keys) per query tile covering the merged ranges of sorted diagonals ``diags``."""
    gap = diags[1:] - diags[:-1]
    starts = torch.cat([diags[:1], diags[1:][gap > BLOCK]])
    ends = torch.cat([diags[:-1][gap > BLOCK], diags[-1:]])
    m = torch.arange((sq + BLOCK - 1) // BLOCK, device=diags.device)
    q_lo, q_hi = m * BLOCK, torch.clamp(m * BLOCK + BLOCK - 1, max=sq - 1)
    lo = torch.clamp(q_lo[None] - ends[:, None], min=0)  # [runs, tiles]
    hi = q_hi[None] - starts[:, None]
    keys = torch.clamp(hi - lo + 1, min=0)
    blocks = (keys + BLOCK - 1) // BLOCK
    return blocks.sum(0).float().mean().item(), keys.sum(0).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=lambda text: parse_lengths(text)[0], default=131072)
    parser.add_argument("--model", choices=("smollm2", "llama-random"), default="smollm2")
    parser.add_argument("--layers", type=int, default=2, help="llama-random only")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.model == "smollm2":
        model, tokenizer = build_smollm2(args.length, device, torch.bfloat16)
        ids = text_prompt_ids(tokenizer, args.length, 0, device)
    else:
        model = build_model(llama3_8b_config(args.layers, args.length), device, torch.bfloat16)
        ids = prompt_ids(args.length, model.config.vocab_size, 0, device)
    causal_tiles = causal_tile_pairs(args.length, args.length, 0) / -(-args.length // BLOCK)  # a query tile's mean causal row
    rows = []

    def observe(call) -> None:
        q, k = call.q, call.k
        plan = LayerPlan(tuple(HeadPlan(Pattern.VERTICAL_SLASH, COLUMNS, DIAGONALS) for _ in range(q.shape[1])))
        index = build_index_gpu(q, k, plan, scale=call.scale)
        _, slash = vs_estimate(q, k, scale=call.scale)
        slash[..., :VS_FORCED_DIAGONALS] = float("inf")
        diags = slash.topk(min(DIAGONALS, slash.shape[-1]), dim=-1).indices.sort(dim=-1).values[0]  # batch 0
        costs = [unaligned_cost(d, q.shape[-2]) for d in diags]
        tiles = index.block_count[0].float().mean().item()
        blocks = sum(c[0] for c in costs) / len(costs)
        keys = sum(c[1] for c in costs) / len(costs)
        cols = index.col_count[0].float().mean().item()
        rows.append((call.layer, tiles, blocks, keys, cols))
        print(f"layer {call.layer:2d}: aligned tiles {tiles:7.1f} ({tiles / causal_tiles:.2f} of causal), unaligned blocks "
              f"{blocks:7.1f} ({tiles / blocks:.2f}x fewer; {blocks / causal_tiles:.2f} of causal), keys in ranges "
              f"{keys:8.0f} ({keys / (tiles * BLOCK):.2f} of the tiles' keys), leftover columns {cols:5.1f}", flush=True)

    # the base model: an observed forward would keep every position's logits (128K x 128,256 in bf16 is 33.6 GB)
    run_observed(model.model, ids, observe)
    tiles = sum(r[1] for r in rows) / len(rows)
    blocks = sum(r[2] for r in rows) / len(rows)
    print(f"mean over {len(rows)} layers at {args.length} ({args.model}): aligned tiles {tiles:.1f}, unaligned blocks "
          f"{blocks:.1f} -> {tiles / blocks:.2f}x fewer key steps; a causal query tile has {causal_tiles:.0f} tiles on "
          f"average (aligned {tiles / causal_tiles:.2f} of it, unaligned {blocks / causal_tiles:.2f})")


if __name__ == "__main__":
    main()
