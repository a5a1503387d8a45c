"""GPU exploration (not a test): two changes to the walk's step, measured against the shipped kernel in one run.

usage: python scripts/explore_walk_step.py --out DIR [--variants base,lazy8,pair,lazy8_pair] [--lengths 32k,128k]

``scripts/explore_walk_step.patch`` makes two environment switches of ``kernels/attend.py`` (read at import; both
off is the shipped kernel, PTX for PTX):

* ``MFX_LAZY=T`` (``lazyT``): on unmasked full blocks, the accumulator and the row sums are rescaled only when some
  row's max grew by more than T (log2 units) in the block; otherwise the old max stays the reference, so the
  probabilities reach at most 2**T. Mathematically the same softmax; it saves the rescale's multiplies and the
  exponent of the correction on most steps, for a reduction across the tile's warps a step.
* ``MFX_PAIR=1`` (``pair``): unmasked listed blocks two a step (two TMA copies, two score tiles), one online-softmax
  update for both: half the max/sum bookkeeping and rescales per key.

The patch is applied to a copy of this tree (``--tree``, made here) and every variant runs in a process of its
own from that copy. Shapes: Llama-3-8B's heads (32 q / 8 kv, d128) on both input families and Qwen2.5-Coder-1.5B's
(12 / 2) on the structured one, VS(1000, 6096) every head, the H200's tuned launch configs of those shapes
(sparse walk 64 x 64, 4 warps, 3 stages at 32K and 2 at 128K; dense walk 128 x 64, 4 warps, 2 stages); the dense
walk (every head forced dense) on the structured family. Outputs are compared with the base variant's; cuDNN
runs in the base variant's process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCH = Path(__file__).resolve().parent / "explore_walk_step.patch"
SHAPES = {"llama3_8b": dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
          "qwen2.5_1.5b": dict(num_q_heads=12, num_kv_heads=2, head_dim=128)}
CASES = [("llama3_8b", "structured"), ("llama3_8b", "scattered"), ("qwen2.5_1.5b", "structured")]
VARIANTS = {"base": {}, "lazy8": {"MFX_LAZY": "8"}, "lazy0": {"MFX_LAZY": "1e-6"}, "pair": {"MFX_PAIR": "1"},
            "lazy8_pair": {"MFX_LAZY": "8", "MFX_PAIR": "1"}}


def run_variant(lengths: list[int], out_dir: Path, variant: str, reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minference_fx.autotune.workload import scattered_qkv, structured_qkv
    from minference_fx.kernels import attend
    from minference_fx.kernels.index import build_index_gpu
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern
    from minference_fx.tools.bench import _ms

    print(f"variant {variant}: {attend.__file__} LAZY={attend.LAZY} PAIR={attend.PAIR}", flush=True)
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
            stages = 3 if n <= 32768 else 2
            walks = {"sparse": lambda: attend.sparse_attention_triton(q, k, v, index, *args, scale=scale, num_warps=4,
                                                                       num_stages=stages, block_m=64, block_n=64)}
            if family == "structured":
                everyone = torch.ones(1, heads, dtype=torch.bool, device=q.device)
                walks["dense"] = lambda: attend.sparse_attention_triton(q, k, v, index, *args, scale=scale,
                                                                        force_dense=everyone, forced="only",
                                                                        num_warps=4, num_stages=2, block_m=128,
                                                                        block_n=64)
            cudnn = None
            if variant == "base":
                group = heads // shape["num_kv_heads"]
                kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = _ms(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True), reps)
                del kr, vr
            for walk, fn in walks.items():
                out = fn()
                ms = _ms(fn, reps)
                key = f"{shape_name}_{family}_{n}_{walk}"
                torch.save(out[:, :, ::97].float().cpu(), out_dir / f"{key}_{variant}.pt")
                row = dict(variant=variant, shape=shape_name, family=family, length=n, walk=walk, ms=ms, cudnn_ms=cudnn)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del out
            del q, k, v, index
            torch.cuda.empty_cache()
    return rows


def patched_tree(tree: Path) -> Path:
    """A copy of this checkout with the patch applied, importable as ``minference_fx`` from ``tree`` (the
    package's subpackages that live at the top level are linked in, as the editable install maps them)."""
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", ".xfer*", "results"))
    try:
        subprocess.run(["patch", "-p1", "-i", str(PATCH)], cwd=tree, check=True)
    except FileNotFoundError:  # no patch(1): git applies it outside a repository too
        subprocess.run(["git", "apply", str(PATCH)], cwd=tree, check=True)
    for sub in ("passes", "autotune", "configs"):
        (tree / "minference_fx" / sub).symlink_to(Path("..") / sub)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="base,lazy8,lazy0,pair,lazy8_pair")
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tree", type=Path, default=Path("/tmp/mfx-walk-step"))
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    from minference_fx.cli import parse_lengths

    lengths = parse_lengths(a.lengths)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        rows = run_variant(lengths, a.out, a.child, a.reps)
        (a.out / f"walk_step_{a.child}.json").write_text(json.dumps(rows, indent=1))
        return
    variants = a.variants.split(",")
    tree = patched_tree(a.tree)
    for variant in variants:
        env = {**os.environ, "PYTHONPATH": str(tree), **VARIANTS[variant]}
        subprocess.run([sys.executable, str(tree / "scripts" / Path(__file__).name), "--out", str(a.out), "--lengths",
                        a.lengths, "--reps", str(a.reps), "--child", variant], env=env, cwd="/", check=False)
    import torch

    rows = [r for v in variants if (a.out / f"walk_step_{v}.json").exists()
            for r in json.loads((a.out / f"walk_step_{v}.json").read_text())]
    base = {(r["shape"], r["family"], r["length"], r["walk"]): r for r in rows if r["variant"] == variants[0]}
    print(f"{'shape':<13} {'family':<10} {'length':>7} {'walk':<6} {'variant':<11} {'ms':>9} {'x first':>8} "
          f"{'x cuDNN':>8} {'max|diff|':>9}")
    for r in rows:
        key = (r["shape"], r["family"], r["length"], r["walk"])
        first = base.get(key)
        name = f"{r['shape']}_{r['family']}_{r['length']}_{r['walk']}"
        diff = (torch.load(a.out / f"{name}_{r['variant']}.pt") - torch.load(a.out / f"{name}_{variants[0]}.pt")).abs().max()
        cudnn = first["cudnn_ms"] if first else None
        print(f"{r['shape']:<13} {r['family']:<10} {r['length']:>7} {r['walk']:<6} {r['variant']:<11} {r['ms']:9.2f} "
              f"{first['ms'] / r['ms'] if first else float('nan'):8.3f} "
              f"{(cudnn / r['ms']) if cudnn else float('nan'):8.3f} {diff:9.2e}")
    for p in a.out.glob("*.pt"):
        p.unlink()


if __name__ == "__main__":
    main()
