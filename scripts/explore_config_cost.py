"""Where a semantic config's op time goes, layer by layer, without the model: each layer's plan run through the op
on synthetic Qwen2.5-Coder-1.5B-shaped inputs (12 q / 2 kv heads, d128), against cuDNN on the same inputs, and the
index build alone. Each layer is a routing site of its own, as in a compiled model: from its second call, heads that
ran dense at its last call go to cuDNN (``--no-routing``: every forced pair runs in the Triton dense walk, as the
runs before 2026-12-03 23:00 did). Then, per length, every layer's call queued back to back as in a model (host ms against GPU ms
between events: is the path host-bound?), and the host operations with the most self time over one such pass.

    python scripts/explore_config_cost.py CONFIG.json --lengths 16k,32k,128k [--out X.json]
"""
import argparse
import cProfile
import io
import json
import pstats
import time
from collections import Counter

import torch
import torch.nn.functional as F

from minference_fx import routing
from minference_fx.autotune.workload import structured_qkv
from minference_fx.cli import parse_lengths
from minference_fx.config import load_config
from minference_fx.kernels.index import build_index_gpu
from minference_fx.op import sparse_attention
from minference_fx.plan import escalation_arguments
from minference_fx.tools.bench import event_ms


QWEN = dict(num_q_heads=12, num_kv_heads=2, head_dim=128)
SCALE = QWEN["head_dim"] ** -0.5


SITES: dict = {}
"""each layer's routing site (empty: no routing)"""


def run_layer(config, layer: int, q, k, v):
    """One call of the op with ``layer``'s plan and the config's guard (and escalation, and budget growth), sparse
    at any length."""
    patterns, budget_a, budget_b = config.layer_plan(layer, 0, QWEN["num_q_heads"]).op_arguments()
    escalation = escalation_arguments(tuple(config.guard_escalation))
    growth = tuple(config.budget_growth) or (0, 0.0)
    return sparse_attention(q, k, v, None, None, SCALE, 0, 0, patterns, budget_a, budget_b, 0,
                            config.guard_threshold, SITES.get(layer, routing.NO_SITE), *escalation, *growth)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--lengths", default="16k,32k,128k")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-routing", action="store_true", help="forced pairs run in the dense walk at every call")
    args = ap.parse_args()
    config = load_config(args.config)
    layers = range(len(config.layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    if not args.no_routing:
        SITES.update({layer: routing.new_site() for layer in layers})
    rows = []
    for seq in parse_lengths(args.lengths):
        routing.ROUTER.reset()  # each length from a first call, as a model's first prompt of that length
        q, k, v = structured_qkv(seq, **QWEN)
        cudnn = event_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True), 3)
        for layer in layers:
            plan = config.plan_at(layer, 0, QWEN["num_q_heads"], seq)
            ms = event_ms(lambda: run_layer(config, layer, q, k, v), 3)
            idx = event_ms(lambda: build_index_gpu(q, k, plan, scale=SCALE), 3)
            kinds = dict(Counter(f"{h.pattern.value[:2]}{h.budget_a}/{h.budget_b}" for h in plan.heads))
            rows.append(dict(seq=seq, layer=layer, op_ms=ms, index_ms=idx, cudnn_ms=cudnn, heads=kinds))
            print(f"{seq:7d} L{layer:2d} op {ms:7.2f} ms index {idx:6.2f} cudnn {cudnn:6.2f}  {kinds}", flush=True)
        tot = sum(r["op_ms"] for r in rows if r["seq"] == seq)
        print(f"{seq:7d} total op {tot:.1f} ms vs cudnn x{len(layers)} {cudnn * len(layers):.1f} ms", flush=True)
        queued_pass(config, layers, q, k, v, seq, rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def queued_pass(config, layers, q, k, v, seq: int, rows: list) -> None:
    """Every layer's call back to back with no sync between (as a model's forward runs them): host and GPU ms of
    the pass, then the host operations with the most self time in one profiled pass."""
    def one_pass():
        for layer in layers:
            run_layer(config, layer, q, k, v)

    one_pass()
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    start_event.record()
    one_pass()
    end_event.record()
    host_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    gpu_ms = start_event.elapsed_time(end_event)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        one_pass()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    # device rows only: an operator's row repeats the time of the kernels it launched
    on_device = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.self_device_time_total for e in on_device) / 1e3
    launches = sum(e.count for e in averages if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync")))
    rows.append(dict(seq=seq, queued_host_ms=host_ms, queued_gpu_ms=gpu_ms, kernel_ms=kernels, launches=launches))
    print(f"{seq:7d} queued pass of {len(layers)} calls: host {host_ms:.1f} ms, GPU between events {gpu_ms:.1f} ms, "
          f"kernels {kernels:.1f} ms, {launches} launches/copies; host self time by op:", flush=True)
    for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:30]:
        print(f"  {e.self_cpu_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:90]}")
    print("  GPU time by kernel:")
    for e in sorted(on_device, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:100]}")
    # the op's own Python (plan, lookups, Triton's launcher) is one opaque row above: split it by function
    python_profile = cProfile.Profile()
    python_profile.runcall(one_pass)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(python_profile, stream=text).sort_stats("tottime").print_stats(45)
    pstats.Stats(python_profile, stream=text).sort_stats("cumulative").print_stats(60)
    print(text.getvalue())


if __name__ == "__main__":
    main()
