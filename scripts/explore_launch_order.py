"""GPU exploration (not a test): the sparse and dense walks' speed by the order their programs launch in.

usage: git show fa62708:kernels/attend.py > minference_fx/kernels/attend.py && git apply scripts/explore_launch_order.patch &&
       python scripts/explore_launch_order.py --out DIR [--orders m,heads,rev,heads_rev] [--lengths 32k,128k]

The patch makes the launch order an environment switch of the kernel of fa62708 (and ``MFX_WS=1`` marks its key loops
``warp_specialize``, which Triton 3.6 ignores on sm_90a: the PTX is the same). The kernel now launches ``rev``'s
order. Each order runs in a process of its own (``MFX_ORDER`` is read when ``kernels.attend`` is imported):

* ``m``: query tiles fastest, then (batch, head): fa62708's order for the sparse walk;
* ``heads``: the query heads of one kv head side by side on one query tile, so their K/V reads meet in L2;
* ``rev`` / ``heads_rev``: the same, last query tile (the longest walk) first (the dense walk's order in every
  case).

Shapes: Llama-3-8B's heads (32 q / 8 kv, d128) on both input families, VS(1000, 6096) every head, with the
shipped H200 launch configs; Qwen2.5-Coder-1.5B's (12 / 2) on the structured family; and the dense walk (every
head forced dense) against cuDNN. Every order's outputs are compared with the first's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SHAPES = {"llama3_8b": dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
          "qwen2.5_1.5b": dict(num_q_heads=12, num_kv_heads=2, head_dim=128)}
CASES = [("llama3_8b", "structured"), ("llama3_8b", "scattered"), ("qwen2.5_1.5b", "structured")]


def run_order(lengths: list[int], out_dir: Path, order: str) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minference_fx.autotune.workload import scattered_qkv, structured_qkv
    from minference_fx.kernels.attend import sparse_attention_triton
    from minference_fx.kernels.index import build_index_gpu
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern
    from minference_fx.tools.bench import _ms

    rows = []
    for shape_name, family in CASES:
        shape = SHAPES[shape_name]
        heads = shape["num_q_heads"]
        make = structured_qkv if family == "structured" else scattered_qkv
        for n in lengths:
            q, k, v = make(n, **shape)
            scale = shape["head_dim"] ** -0.5
            plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * heads)
            args = plan.op_arguments()
            index = build_index_gpu(q, k, plan, scale=scale)
            walks = {"sparse": lambda: sparse_attention_triton(q, k, v, index, *args, scale=scale, num_warps=4,
                                                                num_stages=3, block_m=64, block_n=64)}
            if family == "structured":
                everyone = torch.ones(1, heads, dtype=torch.bool, device=q.device)
                walks["dense"] = lambda: sparse_attention_triton(q, k, v, index, *args, scale=scale,
                                                                 force_dense=everyone, forced="only", num_warps=4,
                                                                 num_stages=2, block_m=128, block_n=64)
            cudnn = None
            if order == "m":
                group = heads // shape["num_kv_heads"]
                kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = _ms(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True), 25)
                del kr, vr
            for walk, fn in walks.items():
                out = fn()
                ms = _ms(fn, 25)
                sample = out[:, :, ::97].float().cpu()
                key = f"{shape_name}_{family}_{n}_{walk}"
                torch.save(sample, out_dir / f"{key}_{order}.pt")
                row = dict(order=order, shape=shape_name, family=family, length=n, walk=walk, ms=ms, cudnn_ms=cudnn)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del out
            del q, k, v, index
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--orders", default="m,heads,rev,heads_rev")
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    from minference_fx.cli import parse_lengths

    lengths = parse_lengths(a.lengths)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        rows = run_order(lengths, a.out, a.child)
        (a.out / f"launch_order_{a.child}.json").write_text(json.dumps(rows, indent=1))
        return
    orders = a.orders.split(",")
    for order in orders:
        subprocess.run([sys.executable, __file__, "--out", str(a.out), "--lengths", a.lengths, "--child", order],
                       env={**os.environ, "MFX_ORDER": order}, check=False)
    import torch

    rows = [r for o in orders if (a.out / f"launch_order_{o}.json").exists()
            for r in json.loads((a.out / f"launch_order_{o}.json").read_text())]
    base = {(r["shape"], r["family"], r["length"], r["walk"]): r for r in rows if r["order"] == orders[0]}
    print(f"{'shape':<13} {'family':<10} {'length':>7} {'walk':<6} {'order':<10} {'ms':>9} {'x first':>8} "
          f"{'x cuDNN':>8} {'max|diff|':>9}")
    for r in rows:
        key = (r["shape"], r["family"], r["length"], r["walk"])
        first = base.get(key)
        name = f"{r['shape']}_{r['family']}_{r['length']}_{r['walk']}"
        diff = (torch.load(a.out / f"{name}_{r['order']}.pt") - torch.load(a.out / f"{name}_{orders[0]}.pt")).abs().max()
        cudnn = first["cudnn_ms"] if first else None
        print(f"{r['shape']:<13} {r['family']:<10} {r['length']:>7} {r['walk']:<6} {r['order']:<10} {r['ms']:9.2f} "
              f"{first['ms'] / r['ms'] if first else float('nan'):8.3f} "
              f"{(cudnn / r['ms']) if cudnn else float('nan'):8.3f} {diff:9.2e}")
    for p in a.out.glob("*.pt"):
        p.unlink()


if __name__ == "__main__":
    main()
