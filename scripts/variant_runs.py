"""What the kernel-variant explorations share (``explore_launch_order.py``, ``explore_walk_step.py``,
``explore_list_prefetch.py``, ``explore_pair_heads.py``; ``explore_list_cost.py`` takes the cuDNN baseline): a patched
copy of the tree, the cases' inputs, cuDNN's time on them, and for the variants switched by the
environment at import (one process each) the walks' timing, ``{stem}_{variant}.json`` with a sample of each output,
and the table that sets every row against the first variant's."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def patched_tree(tree: Path, patch: Path) -> Path:
    """A copy of this checkout with ``patch`` applied, importable as ``minference_fx`` from ``tree`` (the
    package's subpackages that live at the top level are linked in, as the editable install maps them)."""
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", ".xfer*", "results"))
    try:
        subprocess.run(["patch", "-p1", "-i", str(patch)], cwd=tree, check=True)
    except FileNotFoundError:  # no patch(1): git applies it outside a repository too
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)
    for sub in ("passes", "autotune", "configs"):
        (tree / "minference_fx" / sub).symlink_to(Path("..") / sub)
    return tree


SHAPES = {"llama3_8b": dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
          "qwen2.5_1.5b": dict(num_q_heads=12, num_kv_heads=2, head_dim=128)}
CASES = [("llama3_8b", "structured"), ("llama3_8b", "scattered"), ("qwen2.5_1.5b", "structured")]


def cases(lengths: list[int]):
    """Yield ``(shape name, family, length, q, k, v, scale, plan, group)`` for every case at every length on the GPU:
    VS(1000, 6096) every head; the caller drops its references before the next case is made."""
    from minference_fx.autotune.workload import scattered_qkv, structured_qkv
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern

    for shape_name, family in CASES:
        shape = SHAPES[shape_name]
        heads = shape["num_q_heads"]
        make = structured_qkv if family == "structured" else scattered_qkv
        for n in lengths:
            q, k, v = make(n, **shape)
            plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * heads)
            yield shape_name, family, n, q, k, v, shape["head_dim"] ** -0.5, plan, heads // shape["num_kv_heads"]
            del q, k, v  # the next case's tensors are made without this one's


def cudnn_causal_ms(q, k, v, group: int, reps: int) -> float:
    """cuDNN's causal attention of ``q`` over ``k``/``v`` (their kv heads repeated ``group`` times), in ms: the baseline
    every exploration here sets its walks against."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minference_fx.tools.bench import _ms

    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return _ms(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True), reps)


def run_cases(lengths: list[int], out_dir: Path, variant: str, field: str, *, first: bool, reps: int,
              sparse_stages) -> list[dict]:
    """Time the walks of every case at every length in this process: the sparse walk (VS(1000, 6096) every head, 64 x 64
    blocks, 4 warps, ``sparse_stages(length)`` stages) and, on the structured family, the dense walk (every head forced,
    128 x 64, 4 warps, 2 stages); cuDNN too when ``first``. Each row names the variant under ``field``."""
    import torch

    from minference_fx.kernels.attend import sparse_attention_triton
    from minference_fx.kernels.index import build_index_gpu
    from minference_fx.tools.bench import _ms

    rows = []
    for shape_name, family, n, q, k, v, scale, plan, group in cases(lengths):
        heads = len(plan.heads)
        args = plan.op_arguments()
        index = build_index_gpu(q, k, plan, scale=scale)
        stages = sparse_stages(n)
        walks = {"sparse": lambda: sparse_attention_triton(q, k, v, index, *args, scale=scale, num_warps=4,
                                                            num_stages=stages, block_m=64, block_n=64)}
        if family == "structured":
            everyone = torch.ones(1, heads, dtype=torch.bool, device=q.device)
            walks["dense"] = lambda: sparse_attention_triton(q, k, v, index, *args, scale=scale,
                                                             force_dense=everyone, forced="only", num_warps=4,
                                                             num_stages=2, block_m=128, block_n=64)
        cudnn = cudnn_causal_ms(q, k, v, group, reps) if first else None
        for walk, fn in walks.items():
            out = fn()
            ms = _ms(fn, reps)
            key = f"{shape_name}_{family}_{n}_{walk}"
            torch.save(out[:, :, ::97].float().cpu(), out_dir / f"{key}_{variant}.pt")
            row = {field: variant, "shape": shape_name, "family": family, "length": n, "walk": walk, "ms": ms,
                   "cudnn_ms": cudnn}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del out
        del q, k, v, index
        torch.cuda.empty_cache()
    return rows


def print_variant_table(out: Path, stem: str, variants: list[str], field: str) -> list[dict]:
    """Print one row a (case, variant): its time, the first variant's time over it, cuDNN's over it and the largest
    difference of its output sample from the first variant's; then delete the samples. ``field``: the rows' key
    that names the variant. Returns the rows."""
    import torch

    rows = [r for v in variants if (out / f"{stem}_{v}.json").exists()
            for r in json.loads((out / f"{stem}_{v}.json").read_text())]
    base = {(r["shape"], r["family"], r["length"], r["walk"]): r for r in rows if r[field] == variants[0]}
    print(f"{'shape':<13} {'family':<10} {'length':>7} {'walk':<6} {field:<11} {'ms':>9} {'x first':>8} "
          f"{'x cuDNN':>8} {'max|diff|':>9}")
    for r in rows:
        first = base.get((r["shape"], r["family"], r["length"], r["walk"]))
        name = f"{r['shape']}_{r['family']}_{r['length']}_{r['walk']}"
        diff = (torch.load(out / f"{name}_{r[field]}.pt") - torch.load(out / f"{name}_{variants[0]}.pt")).abs().max()
        cudnn = first["cudnn_ms"] if first else None
        print(f"{r['shape']:<13} {r['family']:<10} {r['length']:>7} {r['walk']:<6} {r[field]:<11} {r['ms']:9.2f} "
              f"{first['ms'] / r['ms'] if first else float('nan'):8.3f} "
              f"{(cudnn / r['ms']) if cudnn else float('nan'):8.3f} {diff:9.2e}")
    for p in out.glob("*.pt"):
        p.unlink()
    return rows


def variant_arguments(variants: str, tree: str) -> argparse.ArgumentParser:
    """The command line of an exploration of patched variants: ``--variants`` (``variants`` by default), the lengths,
    the timed runs, the patched tree's folder (``tree`` by default) and the child's switches."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tree", type=Path, default=Path(tree))
    ap.add_argument("--child", default="", help="(internal) the variant this process runs")
    ap.add_argument("--first", action="store_true", help="(internal) the child also times cuDNN")
    return ap


def run_patched_variants(a: argparse.Namespace, script: Path, patch: Path, environments: dict, stem: str,
                         run_variant) -> None:
    """As a child (``--child``): ``run_variant(lengths, out, variant, first, reps)`` and its rows into
    ``{stem}_{variant}.json``. Otherwise: the tree patched with ``patch``, then each variant of ``--variants`` in a process
    of its own from it, with ``environments[variant]`` set, and the table against the first."""
    from minference_fx.cli import parse_lengths

    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        rows = run_variant(parse_lengths(a.lengths), a.out, a.child, a.first, a.reps)
        (a.out / f"{stem}_{a.child}.json").write_text(json.dumps(rows, indent=1))
        return
    variants = a.variants.split(",")
    tree = patched_tree(a.tree, patch)
    for i, variant in enumerate(variants):
        env = {**os.environ, "PYTHONPATH": str(tree), **environments[variant]}
        subprocess.run([sys.executable, str(tree / "scripts" / script.name), "--out", str(a.out.resolve()), "--lengths",
                        a.lengths, "--reps", str(a.reps), "--child", variant] + (["--first"] if i == 0 else []),
                       env=env, cwd="/", check=False)
    print_variant_table(a.out, stem, variants, "variant")
