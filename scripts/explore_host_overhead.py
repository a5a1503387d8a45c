"""Host time of the op's GPU path (index + guard + kernel launches) against its GPU time, and where the host
time goes. Below ~16K the tuner's "index + sparse" is ~2 ms whatever the length (results/autotune_warmup_*),
far above the kernels' GPU time: the path is host-bound there, which sets the dense/sparse crossover.

For each shape and length: host ms per call (calls queued back to back, no sync between them), GPU ms per
call (events around the same calls), then the 25 host operations with the most self time in one profiled call.

usage: python3 scripts/explore_host_overhead.py [--lengths 4k,32k] [--shapes 64/3/3,128/4/8] [--kernels 30]
       (shapes: head_dim/group/kv heads)
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
from minference_fx.autotune.workload import structured_qkv
from minference_fx.call_masks import CallMasks
from minference_fx.cli import parse_lengths
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.sparse_path import sparse_on_gpu

CALLS = 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=parse_lengths, default=[4096, 32768])
    parser.add_argument("--shapes", default="64/3/3,128/4/8")
    parser.add_argument("--kernels", type=int, default=0, help="also list this many GPU kernels by time")
    args = parser.parse_args()
    masks = CallMasks()
    for shape in args.shapes.split(","):
        head_dim, group, kv_heads = (int(x) for x in shape.split("/"))
        plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * (kv_heads * group))
        for n in args.lengths:
            q, k, v = structured_qkv(n, num_q_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim,
                                     dtype=torch.bfloat16)

            def call():
                return sparse_on_gpu(q, k, v, plan, head_dim ** -0.5, masks, 0.5, DEFAULT_ENTRY,
                                     DEFAULT_ENTRIES["dense_walk"])

            for _ in range(3):
                call()
            torch.cuda.synchronize()
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            start_event.record()
            for _ in range(CALLS):
                call()
            end_event.record()
            host_ms = (time.perf_counter() - start) * 1e3 / CALLS
            torch.cuda.synchronize()
            gpu_ms = start_event.elapsed_time(end_event) / CALLS
            print(f"d{head_dim} g{group} kv{kv_heads} @ {n}: host {host_ms:.3f} ms a call, GPU (wall between events) "
                  f"{gpu_ms:.3f} ms a call", flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
            kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
            print(f"  one profiled call: GPU kernels {kernels:.3f} ms; host self time by op:")
            for e in rows:
                print(f"  {e.self_cpu_time_total / 1e3:8.3f} ms {e.count:4d}x  {e.key[:90]}")
            if args.kernels:
                print("  GPU time by kernel:")
                gpu = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                             key=lambda e: -e.self_device_time_total)
                for e in gpu[:args.kernels]:
                    print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:4d}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
