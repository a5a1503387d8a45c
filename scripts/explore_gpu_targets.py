"""Which GPUs the op's sparse path fits, without those GPUs: for each target (compute capability and the shared
memory it gives one block), head dim and dtype, run the op's GPU path once on CPU tensors under a simulated
device (``kernels.codegen.simulated_gpu``): every Triton kernel compiles for that target and meets Triton's own
first-launch check, and nothing runs. Prints, per case, each kernel's shared memory as compiled after any
fallback to a smaller launch config (``kernels.fit``), or the kernel that fits no config (the op then runs such
calls dense).

usage: TRITON_INTERPRET=0 python scripts/explore_gpu_targets.py [--capabilities 80,86,89,90] [--head-dims 64,128,256]
       [--dtypes bfloat16,float32] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from minference_fx.autotune.cache import DEFAULT_ENTRIES
from minference_fx.call_masks import CallMasks
from minference_fx.kernels import fit
from minference_fx.kernels.codegen import SHARED_MEMORY_OPTIN, simulated_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern, escalated_plan
from minference_fx.sparse_path import sparse_on_gpu

GPU_TARGETS = {"A100": 80, "A10 / A40 / RTX 3090": 86, "L4 / L40S / RTX 4090": 89, "H100 / H200": 90,
               "B200": 100, "RTX 5090": 120}
# every kind of head and every launch the op makes: the estimate, both index builds, the guard, the sparse walk,
# the dense walk of the forced heads (the guard forces none on zeros, so a key mask makes the dense walk run the
# padded rows again)
PLAN = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096), HeadPlan(Pattern.BLOCK_SPARSE, 8, 0),
                  HeadPlan(Pattern.A_SHAPE, 64, 512), HeadPlan(Pattern.DENSE, 0, 0)) * 2)


def run_case(capability: int, head_dim: int, dtype: torch.dtype, length: int = 1024) -> dict:
    """The op's GPU path once at this target, head dim and dtype: what compiled, or what did not fit."""
    q = torch.zeros(1, 8, length, head_dim, dtype=dtype)
    k, v = (torch.zeros(1, 2, length, head_dim, dtype=dtype) for _ in range(2))
    masks = CallMasks(key_mask=torch.ones(1, length, dtype=torch.bool))
    fit.forget()
    with simulated_gpu(capability) as gpu:
        try:
            sparse_on_gpu(q, k, v, PLAN, head_dim ** -0.5, masks, 0.8, DEFAULT_ENTRIES["sparse_attention"],
                          DEFAULT_ENTRIES["dense_walk"], (), escalated_plan(PLAN, (2000, 8000)))
            failed = None
        except fit.DoesNotFit as exc:
            failed = str(exc)
    limit = SHARED_MEMORY_OPTIN[capability]
    return {"capability": capability, "shared_memory_limit": limit, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "compiled": gpu.compiled, "does_not_fit": failed,
            "largest_fitting": max((shared for _, shared in gpu.compiled if shared <= limit), default=0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capabilities", default="80,86,89,90")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--out")
    args = parser.parse_args()
    names = {cap: name for name, cap in GPU_TARGETS.items()}
    rows = []
    for cap in map(int, args.capabilities.split(",")):
        for head_dim in map(int, args.head_dims.split(",")):
            for dtype in args.dtypes.split(","):
                row = run_case(cap, head_dim, getattr(torch, dtype))
                rows.append(row)
                verdict = f"does not fit: {row['does_not_fit']}" if row["does_not_fit"] else "fits"
                print(f"sm_{cap} ({names.get(cap, '?')}, {row['shared_memory_limit']} B) d{head_dim} {dtype}: {verdict}; "
                      f"largest kernel that ran {row['largest_fitting']} B", file=sys.stderr, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
