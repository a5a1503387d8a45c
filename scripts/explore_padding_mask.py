"""GPU exploration (not a test): what a padding mask costs the op's dense path.

Under torch.compile HF always hands attention a padding mask (``generate`` passes an all-ones one), so the
op's dense calls (below the crossover, routed and static dense heads) carry a key mask. SDPA takes no
padding mask beside ``is_causal``: the mask-building path (``dense.masked_sdpa``) materialises [B, 1, Sq, Skv]
(a byte per pair) and SDPA runs a masked kernel; the sparse kernel's dense walk (``dense.dense_walk``) reads the
key mask per tile; ``dense.dense_attention`` picks between them (for one prompt: cuDNN without the mask, then
the row again in the walk if padded). For each shape and length this prints cuDNN without a mask (what an
all-ones mask could at best cost) and each path, with each one's peak memory over its inputs. ``--pad F``
left-pads the prompt by F of its length.

usage: python scripts/explore_padding_mask.py [--lengths 32k,128k] [--shapes smollm2,llama3-8b] [--pad 0.1]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from minference_fx import dense
from minference_fx.autotune.dispatch import launch_config
from minference_fx.autotune.workload import structured_qkv
from minference_fx.call_masks import CallMasks
from minference_fx.tools.bench import LLAMA3_8B, _ms
from minference_fx.cli import parse_lengths

SHAPES = {"smollm2": dict(num_q_heads=9, num_kv_heads=3, head_dim=64), "llama3-8b": LLAMA3_8B}


def measure(fn, long: bool) -> tuple:
    """(ms, peak GiB over what was allocated before), or the error's name; ``long``: a call of seconds."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        ms = _ms(fn, 1 if long else 10)
    except torch.OutOfMemoryError:
        return "out of memory", None
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--pad", type=float, default=0.0, help="left padding, a fraction of the length")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        for n in parse_lengths(a.lengths):
            q, k, v = structured_qkv(n, **shape)
            scale = shape["head_dim"] ** -0.5
            mask = torch.ones(1, n, dtype=torch.bool, device="cuda")
            mask[:, :int(a.pad * n)] = False
            masks, walk = CallMasks(mask), launch_config(q, k, "dense_walk")
            runs = {
                "SDPA is_causal, no mask": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                                  enable_gqa=True),
                "mask + SDPA": lambda: dense.masked_sdpa(q, k, v, masks, scale),
                "dense walk": lambda: dense.dense_walk(q, k, v, masks, scale, walk),
                "dense_attention": lambda: dense.dense_attention(q, k, v, masks, scale, walk),
            }
            results = {label: measure(fn, n >= 1 << 17) for label, fn in runs.items()}
            base = results["SDPA is_causal, no mask"][0]
            for label, (ms, gib) in results.items():
                if isinstance(ms, str):
                    print(f"{name} @ {n} pad {a.pad:g}: {label:24s} {ms}")
                else:
                    print(f"{name} @ {n} pad {a.pad:g}: {label:24s} {ms:9.3f} ms  {base / ms:5.2f}x no-mask  "
                          f"peak +{gib:6.2f} GiB")
            del q, k, v


if __name__ == "__main__":
    main()
