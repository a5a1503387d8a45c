"""GPU exploration (not a test): launch variants of the sparse kernel, and the index against a saved older one.

usage: python scripts/explore_kernels.py [--old-index PATH] [--variants-at 128k,...] [--dense-at 32k,...] [--index-at 8k,32k,128k]
                                        [--parts-at 128k]

* launch variants (block_m, block_n, warps, stages, TMA copies) on the bench's VS(1000, 6096)
  index over structured inputs, and on dense work (every head DENSE) against cuDNN, in one run; each
  variant's output is checked against the first;
* the index, eager and CUDA-graph replay, and with ``--old-index`` the same inputs through an older
  ``minference_fx/kernels/index.py`` (e.g. ``git show REV:kernels/index.py``) for an A/B in the same run;
* ``--parts-at``: the shipped sparse walk on both input families with the index whole, with its leftover columns
  dropped and with its blocks dropped, and the units of work each part lists (a block, or a gather of up to 64
  columns): what a gathered column costs against a block.
Resident programs (a few an SM sharing the (query tile, head) items out) lost to one program an item by 6-140 %
(H200, 2026-12-05, BENCHMARKS.md section 1): ``git show da7a5bf:scripts/explore_kernels.py`` for that comparison.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools

import torch
import torch.nn.functional as F

from minference_fx.autotune.workload import FAMILIES, structured_qkv
from minference_fx.kernels.reference import SparseIndex
from minference_fx.tools.bench import LLAMA3_8B, _index_work, _ms
from minference_fx.cli import parse_lengths
from minference_fx.kernels.attend import sparse_attention_triton
from minference_fx.kernels.index import build_index_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

# (block_m, block_n, num_warps, num_stages, kv_desc); the first is the shipped H200 config
VARIANTS = [
    (64, 64, 4, 3, True), (64, 64, 4, 3, False), (64, 64, 4, 2, True), (64, 128, 4, 3, False),
    (32, 64, 4, 3, True), (32, 64, 4, 2, True), (32, 128, 4, 3, False), (16, 64, 4, 3, True),
    (64, 64, 4, 4, True), (64, 64, 8, 3, True),
]


def _vs_plan(budgets=(1000, 6096)) -> LayerPlan:
    return LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * LLAMA3_8B["num_q_heads"])


def time_variant(what: str, fn):
    """(output, median ms) of one launch variant, or None (printed) when it cannot compile or run."""
    try:
        return fn(), _ms(fn, 5)
    except Exception as exc:  # a variant that cannot compile is a finding, not a stop
        print(f"{what}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None


def launch_variants(seq: int | None, dense_seq: int | None) -> None:
    """The variants on the vertical-slash index at ``seq`` and on dense work at ``dense_seq`` (either None: not run)."""
    shape = LLAMA3_8B
    scale = shape["head_dim"] ** -0.5
    for label, n, plan in (("VS(1000,6096)", seq, _vs_plan()),
                           ("dense", dense_seq, LayerPlan((HeadPlan(Pattern.DENSE),) * shape["num_q_heads"]))):
        if not n:
            continue
        q, k, v = structured_qkv(n, **shape)
        args = plan.op_arguments()
        index = build_index_gpu(q, k, plan, scale=scale)
        if label == "dense":
            m = -(-n // 64)
            physical = q.shape[1] * 64 * 64 * m * (m + 1) / 2
            group = shape["num_q_heads"] // shape["num_kv_heads"]
            kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = _ms(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True), 3)
            del kr, vr
            print(f"{label} @ {n}: cuDNN {cudnn:.2f} ms", flush=True)
        else:
            physical, _ = _index_work(index, *args, n, n)
            cudnn = None
        base = None
        for bm, bn, w, st, desc in VARIANTS:
            name = f"bm{bm} bn{bn} w{w} s{st}{' tma' if desc else ''}"
            fn = lambda: sparse_attention_triton(q, k, v, index, *args, scale=scale, num_warps=w,  # noqa: E731
                                                 num_stages=st, block_m=bm, block_n=bn, kv_desc=desc)
            timed = time_variant(f"{label} @ {n}: {name}", fn)
            if timed is None:
                continue
            out, ms = timed
            if base is None:
                base, base_ms = out, ms
            err = (out - base).abs().max().item()  # in the output dtype: at 1M an fp32 copy is 16 GiB
            tf = 4 * shape["head_dim"] * physical / (ms * 1e-3) / 1e12
            vs_cudnn = f", {cudnn / ms:.2f}x cuDNN" if cudnn else ""
            print(f"{label} @ {n}: {name:<18} {ms:8.2f} ms {tf:5.0f} TF/s, {base_ms / ms:.3f}x first{vs_cudnn}, "
                  f"max|diff| {err:.2e}", flush=True)
        del q, k, v, index, base
        torch.cuda.empty_cache()


def _graph_ms(fn) -> float:
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _ms(graph.replay, 5)


def index_ab(seq: int, old_path: str | None) -> None:
    shape = LLAMA3_8B
    q, k, _ = structured_qkv(seq, **shape)
    plan = _vs_plan()
    scale = shape["head_dim"] ** -0.5
    builders = {"current": build_index_gpu}
    if old_path:
        spec = importlib.util.spec_from_file_location("index_old", old_path)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        builders["old"] = old.build_index_gpu
    results, masses = {}, {}
    for name, build in builders.items():
        fn = lambda: build(q, k, plan, scale=scale)  # noqa: E731
        masses[name] = torch.zeros(1, shape["num_q_heads"], device=q.device)
        results[name] = build(q, k, plan, scale=scale, mass_out=masses[name])
        print(f"index {seq} {name}: eager {_ms(fn, 5):.2f} ms, CUDA-graph replay {_graph_ms(fn):.2f} ms", flush=True)
    if "old" in results:
        a, b = results["current"], results["old"]
        same = (a.block_count == b.block_count).float().mean().item()
        print(f"index {seq}: tile counts equal in {100 * same:.3f} % of (head, query tile); "
              f"column counts equal in {100 * (a.col_count == b.col_count).float().mean().item():.3f} %; "
              f"block starts identical: {torch.equal(a.padded().block_start.int(), b.padded().block_start.int())}, columns identical: "
              f"{torch.equal(a.col_index, b.col_index)}; guard mass max difference "
              f"{(masses['current'] - masses['old']).abs().max().item():.2e}", flush=True)
    if seq >= 131072:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                build_index_gpu(q, k, plan, scale=scale)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)


def walk_parts(seq: int) -> None:
    shape = LLAMA3_8B
    plan = _vs_plan()
    args = plan.op_arguments()
    scale = shape["head_dim"] ** -0.5
    for family, make in FAMILIES.items():
        q, k, v = make(seq, **shape)
        index = build_index_gpu(q, k, plan, scale=scale)
        parts = {
            "whole": index,
            "blocks only": SparseIndex(index.block_count, index.block_start, torch.zeros_like(index.col_count),
                                       index.col_index),
            "columns only": SparseIndex(torch.zeros_like(index.block_count), index.block_start, index.col_count,
                                        index.col_index),
        }
        blocks = index.block_count.sum().item()
        gathers = ((index.col_count + 63) // 64).sum().item()
        print(f"parts {family} @ {seq}: {blocks} blocks, {gathers} column gathers "
              f"({100 * gathers / (blocks + gathers):.1f} % of the units)", flush=True)
        for name, part in parts.items():
            ms = _ms(lambda: sparse_attention_triton(q, k, v, part, *args, scale=scale), 5)  # noqa: B023
            print(f"parts {family} @ {seq}: {name:<13} {ms:8.2f} ms", flush=True)
        del q, k, v, index, parts
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-index")
    ap.add_argument("--variants-at", default="128k")
    ap.add_argument("--dense-at", default="32k")
    ap.add_argument("--index-at", default="8k,32k,128k")
    ap.add_argument("--parts-at", default="")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for seq in parse_lengths(a.index_at) if a.index_at else ():
        index_ab(seq, a.old_index)
    for seq in parse_lengths(a.parts_at) if a.parts_at else ():
        walk_parts(seq)
    for seq, dense_seq in itertools.zip_longest(parse_lengths(a.variants_at) if a.variants_at else [],
                                                parse_lengths(a.dense_at) if a.dense_at else []):
        launch_variants(seq, dense_seq)


if __name__ == "__main__":
    main()
