"""GPU exploration (not a test): what larger tiles buy on dense work, and what the index costs without launch overhead.

usage: python scripts/explore_kernels.py [lengths, default 32k,128k]
Prints the index time eager vs CUDA-graph replay and the index's top device kernels at 128K; then, if the
launcher accepts ``block_m`` / ``block_n`` (it did only in the 2026-11-30 experiment, for plans of dense
heads; see results/README.md), dense-plan throughput per tile config vs cuDNN.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minference_fx.bench import LLAMA3_8B, _ms, structured_qkv
from minference_fx.cli import parse_lengths
from minference_fx.kernels.attend import empty_index, sparse_attention_triton
from minference_fx.kernels.index import build_index_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

TILE_CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 2)]


def dense_tiles(seq: int) -> None:
    shape = LLAMA3_8B
    q, k, v = structured_qkv(seq, **shape)
    hq, d = shape["num_q_heads"], shape["head_dim"]
    plan = LayerPlan((HeadPlan(Pattern.DENSE, 0, 0),) * hq)
    args = plan.op_arguments()
    index = empty_index(1, hq, -(-seq // 64), q.device)
    reps = 3 if seq <= 65536 else 1
    flops = 4 * d * hq * seq * (seq + 1) / 2
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        cudnn = _ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps)
    print(f"dense {seq}: cuDNN {cudnn:.2f} ms = {flops / cudnn / 1e9:.0f} TF/s", flush=True)
    for bm, bn, w, s in TILE_CONFIGS:
        fn = lambda: sparse_attention_triton(q, k, v, index, *args, scale=d ** -0.5, num_warps=w, num_stages=s,  # noqa: E731
                                             block_m=bm, block_n=bn)
        try:
            err = (fn().float() - ref.float()).abs().max().item()
            ms = _ms(fn, reps)
            print(f"dense {seq}: tiles {bm}x{bn} warps {w} stages {s}: {ms:.2f} ms = {flops / ms / 1e9:.0f} TF/s, "
                  f"{cudnn / ms:.2f}x cuDNN, max err {err:.2e}", flush=True)
        except Exception as exc:  # a config that does not compile is a result too
            print(f"dense {seq}: tiles {bm}x{bn} warps {w} stages {s}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def index_graph(seq: int) -> None:
    shape = LLAMA3_8B
    q, k, v = structured_qkv(seq, **shape)
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * shape["num_q_heads"])
    scale = shape["head_dim"] ** -0.5
    fn = lambda: build_index_gpu(q, k, plan, scale=scale)  # noqa: E731
    eager = _ms(fn, 5)
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    replay = _ms(graph.replay, 5)
    print(f"index {seq}: eager {eager:.2f} ms, CUDA-graph replay {replay:.2f} ms", flush=True)
    if seq >= 131072:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)


def main() -> None:
    lengths = parse_lengths(sys.argv[1] if len(sys.argv) > 1 else "32k,128k")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for seq in lengths:
        index_graph(seq)
    import inspect

    if "block_m" not in inspect.signature(sparse_attention_triton).parameters:
        print("tile sizes: the launcher fixes 64x64 tiles (the index granularity); dense-tile sweep skipped")
        return
    for seq in lengths:
        dense_tiles(seq)


if __name__ == "__main__":
    main()
