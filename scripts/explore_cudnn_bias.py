"""GPU exploration (not a test): can cuDNN run causal attention with a padding bias beside ``is_causal``?

SDPA's public API refuses ``attn_mask`` with ``is_causal``; ATen's cuDNN op takes both. If it accepts a
[B, 1, 1, Skv] padding bias expanded (stride 0) over heads and queries, a padded dense call could run at
cuDNN's speed instead of the dense walk's. Prints whether it runs, its error against masked attention,
and its time against maskless causal SDPA.

usage: python scripts/explore_cudnn_bias.py [--lengths 32k,128k]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from minference_fx.autotune.dispatch import launch_config
from minference_fx.autotune.workload import structured_qkv
from minference_fx.call_masks import CallMasks
from minference_fx.dense import dense_walk
from minference_fx.tools.bench import _ms
from minference_fx.cli import parse_lengths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32k,128k")
    a = ap.parse_args()
    for n in parse_lengths(a.lengths):
        q, k, v = structured_qkv(n, num_q_heads=9, num_kv_heads=3, head_dim=64)
        kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        key_mask = torch.ones(1, n, dtype=torch.bool, device="cuda")
        key_mask[:, : n // 8] = False
        bias = torch.where(key_mask, 0.0, float("-inf")).to(q.dtype)[:, None, None, :].expand(1, 9, n, n)
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kr, vr, bias, False, 0.0, True, False,
                                                                     scale=0.125)[0]
            walk = launch_config(q, k, "dense_walk")
            want = dense_walk(q, k, v, CallMasks(key_mask), 0.125, walk)
            rows = slice(n // 8, n)  # rows before the first valid key read nothing: their value is undefined
            err = ((out[:, :, rows].float() - want[:, :, rows].float()).norm() / want[:, :, rows].float().norm()).item()
            t_bias = _ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, kr, vr, bias, False, 0.0, True,
                                                                                   False, scale=0.125), 1)
            t_plain = _ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True), 1)
            t_walk = _ms(lambda: dense_walk(q, k, v, CallMasks(key_mask), 0.125, walk), 1)
            print(f"{n}: cuDNN causal + expanded padding bias runs; rel err vs dense walk {err:.2e}; "
                  f"{t_bias:.2f} ms vs maskless SDPA {t_plain:.2f} ms vs dense walk {t_walk:.2f} ms")
        except Exception as exc:  # what the probe is for: whether cuDNN takes it at all
            print(f"{n}: cuDNN causal + expanded padding bias fails: {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()
