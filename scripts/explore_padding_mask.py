"""GPU exploration (not a test): what a padding mask costs the op's dense path.

Under torch.compile HF always hands attention a padding mask (``generate`` passes an all-ones one), so the
op's dense calls (below the crossover, routed and static dense heads) carry a key mask. SDPA takes no
padding mask beside ``is_causal``: the mask-building path materialises [B, 1, Sq, Skv] (a byte per pair)
and SDPA runs a masked kernel. Past ``op.MASKED_SDPA_MAX_PAIRS`` the op now runs the sparse kernel's dense
walk instead, which reads the key mask per tile. For each shape and length this prints cuDNN without a
mask (SDPA with is_causal: what an all-ones mask could at best cost), the mask-building SDPA path (the op before), and the
dense walk (the op now), with each one's peak memory over its inputs.

usage: python scripts/explore_padding_mask.py [--lengths 32k,128k] [--shapes smollm2,llama3-8b]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from minference_fx import op
from minference_fx.bench import LLAMA3_8B, _ms, structured_qkv
from minference_fx.cli import parse_lengths

SHAPES = {"smollm2": dict(num_q_heads=9, num_kv_heads=3, head_dim=64), "llama3-8b": LLAMA3_8B}


def measure(fn) -> tuple:
    """(ms, peak GiB over what was allocated before), or the error's name."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        ms = _ms(fn, 1)
    except torch.OutOfMemoryError:
        return "out of memory", None
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        for n in parse_lengths(a.lengths):
            q, k, v = structured_qkv(n, **shape)
            scale = shape["head_dim"] ** -0.5
            ones = torch.ones(1, n, dtype=torch.bool, device="cuda")
            runs = {
                "SDPA is_causal, no mask": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                        enable_gqa=True),
                "mask + SDPA (before)": lambda: op.dense_attention(q, k, v, ones, None, scale, 0, 0),
                "dense walk (now)": lambda: op.dense_walk(q, k, v, ones, None, scale, 0, 0),
            }
            limit = op.MASKED_SDPA_MAX_PAIRS
            results = {}
            for label, fn in runs.items():
                op.MASKED_SDPA_MAX_PAIRS = 1 << 62  # "before": the mask-building path at any length
                try:
                    results[label] = measure(fn)
                finally:
                    op.MASKED_SDPA_MAX_PAIRS = limit
            base = results["SDPA is_causal, no mask"][0]
            for label, (ms, gib) in results.items():
                if isinstance(ms, str):
                    print(f"{name} @ {n}: {label:24s} {ms}")
                else:
                    print(f"{name} @ {n}: {label:24s} {ms:9.2f} ms  {base / ms:5.2f}x no-mask  peak +{gib:6.2f} GiB")
            del q, k, v


if __name__ == "__main__":
    main()
