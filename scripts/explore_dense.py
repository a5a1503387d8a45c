"""GPU exploration (not a test): how close the sparse kernel gets to cuDNN on dense work, and what
the online index keeps on diffuse (random-weight-like) attention.

usage: python scripts/explore_dense.py [--lengths 32k,128k] [--split-at 128k] [--variants 128/64/4/2/tma,...]
                                      [--layouts bhsd,bshd] [--data structured,diffuse] [--no-diffuse]

* dense work (every head forced dense: the op's dense walk, contiguous key steps): launch variants
  (BLOCK_M/BLOCK_N/warps/stages[/tma]) including BLOCK_M 128 (allowed there, since forced-dense heads read
  no list);
* diffuse Q/K (N(0, 1.28^2) entries, logits of std ~1.6, as a std-0.02 random Llama gives): the
  VS(1000, 6096) index's physical density, kernel time, and cuDNN on the same inputs;
* ``--split-at``: the op's GPU path on plans with dense heads, those heads through SDPA (as shipped)
  against the same plan with every head in the kernel (as before), on SmolLM2's layer 0 (7 of 9 heads
  dense, d64) and a Llama-3-8B-shaped layer with half its heads dense.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minference_fx.autotune.workload import structured_qkv
from minference_fx.tools.bench import LLAMA3_8B, _index_work, _ms
from minference_fx.cli import parse_lengths
from minference_fx.kernels import attend
from minference_fx.kernels.index import build_index_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

from explore_kernels import time_variant  # noqa: E402  (scripts/ is on sys.path when run as a script)

# (block_m, block_n, num_warps, num_stages, tma)
DENSE_VARIANTS = [
    (128, 64, 4, 2, True), (128, 64, 4, 3, True), (128, 128, 8, 2, True), (128, 128, 8, 3, True),
    (128, 128, 8, 3, False), (128, 64, 8, 2, True), (64, 64, 4, 2, True), (64, 128, 4, 2, True),
]


def launch(q, k, v, index, patterns, budget_a, budget_b, scale, bm, bn, warps, stages, tma):
    """The kernel's dense walk (every head forced dense, so BLOCK_M 128 is allowed) at one launch config."""
    every_head = torch.ones(q.shape[0], q.shape[1], dtype=torch.bool, device=q.device)
    return attend.sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale,
                                          force_dense=every_head, forced="only", block_m=bm, block_n=bn,
                                          num_warps=warps, num_stages=stages, kv_desc=tma)


def cudnn_ms(q, k, v) -> float:
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = _ms(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True), 3)
    return ms


def diffuse_qkv(n: int, shape: dict):
    """Q/K/V of N(0, 1.28^2) entries: logits of std ~1.6, as a std-0.02 random Llama gives."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: (1.28 * torch.randn(1, h, n, shape["head_dim"], device="cuda", generator=g)).bfloat16()  # noqa: E731
    return mk(shape["num_q_heads"]), mk(shape["num_kv_heads"]), mk(shape["num_kv_heads"])


def dense_variants(n: int, variants=DENSE_VARIANTS, layout: str = "bhsd", data: str = "structured") -> None:
    """``layout`` "bshd": the [B, H, S, D] views of [B, S, H, D] memory that HF's attention (and so the op
    in a compiled model) receives, one head's rows ``H * D`` elements apart. ``data`` "diffuse": random
    Q/K/V (:func:`diffuse_qkv`) instead of the benchmark's structured ones (the same work either way)."""
    shape = LLAMA3_8B
    scale = shape["head_dim"] ** -0.5
    q, k, v = structured_qkv(n, **shape) if data == "structured" else diffuse_qkv(n, shape)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    plan = LayerPlan((HeadPlan(Pattern.DENSE),) * shape["num_q_heads"])
    args = plan.op_arguments()
    index = attend.empty_index(1, shape["num_q_heads"], -(-n // 64), q.device)
    cud = cudnn_ms(q, k, v)
    flops = 4 * shape["head_dim"] * shape["num_q_heads"] * n * (n + 1) / 2
    print(f"dense @ {n} {layout} {data}: cuDNN {cud:.2f} ms ({flops / cud / 1e9:.0f} TF/s causal)", flush=True)
    base = None
    for bm, bn, w, st, tma in variants:
        name = f"bm{bm} bn{bn} w{w} s{st}{' tma' if tma else ''}"
        fn = lambda: launch(q, k, v, index, *args, scale, bm, bn, w, st, tma)  # noqa: E731
        timed = time_variant(f"dense @ {n}: {name}", fn)
        if timed is None:
            continue
        out, ms = timed
        if base is None:
            base = out
        err = (out.float() - base.float()).abs().max().item()
        print(f"dense @ {n} {layout} {data}: {name:<24} {ms:8.2f} ms {flops / ms / 1e9:5.0f} TF/s causal, "
              f"{cud / ms:.3f}x cuDNN, max|diff| {err:.2e}", flush=True)
    del q, k, v, base
    torch.cuda.empty_cache()


def diffuse(n: int) -> None:
    shape = LLAMA3_8B
    scale = shape["head_dim"] ** -0.5
    q, k, v = diffuse_qkv(n, shape)
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * shape["num_q_heads"])
    args = plan.op_arguments()
    index = build_index_gpu(q, k, plan, scale=scale)
    physical, _ = _index_work(index, *args, n, n)
    causal = shape["num_q_heads"] * n * (n + 1) / 2
    idx_ms = _ms(lambda: build_index_gpu(q, k, plan, scale=scale), 5)
    kern = _ms(lambda: attend.sparse_attention_triton(q, k, v, index, *args, scale=scale, num_stages=3), 5)
    cols = index.col_count.float().mean().item()
    cud = cudnn_ms(q, k, v)
    print(f"diffuse VS(1000,6096) @ {n}: physical density {physical / causal:.4f}, leftover columns/query tile "
          f"{cols:.1f}, index {idx_ms:.2f} ms, kernel {kern:.2f} ms, cuDNN {cud:.2f} ms, "
          f"{cud / (idx_ms + kern):.3f}x cuDNN", flush=True)
    del q, k, v, index
    torch.cuda.empty_cache()


def split_dense_heads(n: int) -> None:
    from minference_fx.autotune.dispatch import launch_config
    from minference_fx.call_masks import CallMasks
    from minference_fx.kernels.attend import sparse_attention_triton
    from minference_fx.sparse_path import sparse_on_gpu

    vs, bs, dense = (HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096), HeadPlan(Pattern.BLOCK_SPARSE, 64),
                     HeadPlan(Pattern.DENSE))
    cases = {
        "SmolLM2 layer 0 (7/9 dense, d64)": (dict(num_q_heads=9, num_kv_heads=3, head_dim=64),
                                             LayerPlan((dense,) * 3 + (vs,) + (dense,) * 3 + (bs, dense))),
        "Llama-3-8B shape, 16/32 dense": (dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
                                          LayerPlan((vs, dense) * 16)),
    }
    for label, (shape, plan) in cases.items():
        q, k, v = structured_qkv(n, **shape)
        scale = shape["head_dim"] ** -0.5
        masks = CallMasks()
        tuned, walk = launch_config(q, k), launch_config(q, k, "dense_walk")

        def in_kernel():
            index = build_index_gpu(q, k, plan, scale=scale)
            return sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, **tuned.launch())

        split = lambda: sparse_on_gpu(q, k, v, plan, scale, masks, 0.0, tuned, walk)[0]  # noqa: E731
        err = (split().float() - in_kernel().float()).abs().max().item()
        old, new = _ms(in_kernel, 3), _ms(split, 3)
        print(f"split @ {n} {label}: every head in the kernel {old:.2f} ms, dense heads by SDPA {new:.2f} ms, "
              f"{old / new:.3f}x; max|diff| {err:.2e}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--split-at", default="")
    ap.add_argument("--variants", default="", help="dense-walk launches to time, e.g. 128/64/4/2/tma,128/128/8/3")
    ap.add_argument("--layouts", default="bhsd", help="memory layouts of Q/K/V for the dense walk: bhsd, bshd")
    ap.add_argument("--data", default="structured", help="Q/K/V for the dense walk: structured, diffuse")
    ap.add_argument("--no-diffuse", action="store_true", help="only the dense walk")
    a = ap.parse_args()
    variants = ([tuple(int(x) for x in v.split("/")[:4]) + (v.endswith("/tma"),) for v in a.variants.split(",")]
                if a.variants else DENSE_VARIANTS)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for n in parse_lengths(a.split_at) if a.split_at else []:
        split_dense_heads(n)
    for n in parse_lengths(a.lengths) if a.lengths else []:
        if not a.no_diffuse:
            diffuse(n)
        for layout in a.layouts.split(","):
            for data in a.data.split(","):
                dense_variants(n, variants, layout, data)


if __name__ == "__main__":
    main()
