"""GPU exploration (not a test): what the index costs without launch overhead, and where its device time goes.

usage: python scripts/explore_kernels.py [lengths, default 32k,128k]
Prints the index time eager vs CUDA-graph replay, and at 128K+ the index's top device kernels.
(The tile-size sweep in results/explore_kernels_h200_2026-11-30.txt used a temporary launcher argument
that was not kept; see results/README.md.)
"""
from __future__ import annotations

import sys

import torch

from minference_fx.bench import LLAMA3_8B, _ms, structured_qkv
from minference_fx.cli import parse_lengths
from minference_fx.kernels.index import build_index_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern


def index_graph(seq: int) -> None:
    shape = LLAMA3_8B
    q, k, _ = structured_qkv(seq, **shape)
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


if __name__ == "__main__":
    main()
