"""Where a semantic config's op time goes, layer by layer, without the model: each layer's plan run through the op
on synthetic Qwen2.5-Coder-1.5B-shaped inputs (12 q / 2 kv heads, d128), against cuDNN on the same inputs, and the
index build alone. Then a profile of the slowest layer at the shortest length.

    python scripts/explore_config_cost.py CONFIG.json --lengths 16k,32k,128k [--out X.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from minference_fx.autotune.workload import structured_qkv
from minference_fx.config import load_config
from minference_fx.kernels.index import build_index_gpu
from minference_fx.op import sparse_attention
from minference_fx.plan import escalation_of
from minference_fx.tools.bench import event_ms
from minference_fx.cli import parse_lengths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--lengths", default="16k,32k,128k")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = load_config(args.config)
    n_layers = len(config.layers)
    layers = range(n_layers) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    esc = tuple(config.guard_escalation or ())
    rows = []
    for seq in parse_lengths(args.lengths):
        q, k, v = structured_qkv(seq, num_q_heads=12, num_kv_heads=2, head_dim=128)
        scale = 128 ** -0.5
        cudnn = event_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True), 3)
        for layer in layers:
            plan = config.layer_plan(layer, 0, 12)
            pats, ba, bb = plan.op_arguments()

            def op():
                return sparse_attention(q, k, v, None, None, scale, 0, 0, pats, ba, bb, 0,
                                        config.guard_threshold, -1, *(esc or (0, 0)))

            ms = event_ms(op, 3)
            idx = event_ms(lambda: build_index_gpu(q, k, plan, scale=scale), 3)
            kinds = {}
            for h in plan.heads:
                kinds[h.pattern.value[:2] + f"{h.budget_a}/{h.budget_b}"] = kinds.get(h.pattern.value[:2] + f"{h.budget_a}/{h.budget_b}", 0) + 1
            row = dict(seq=seq, layer=layer, op_ms=ms, index_ms=idx, cudnn_ms=cudnn, heads=kinds)
            rows.append(row)
            print(f"{seq:7d} L{layer:2d} op {ms:7.2f} ms index {idx:6.2f} cudnn {cudnn:6.2f}  {kinds}", flush=True)
        tot = sum(r["op_ms"] for r in rows if r["seq"] == seq)
        print(f"{seq:7d} total op {tot:.1f} ms vs cudnn x{len(layers)} {cudnn * len(layers):.1f} ms", flush=True)
    seq = parse_lengths(args.lengths)[0]
    worst = max((r for r in rows if r["seq"] == seq), key=lambda r: r["op_ms"] - r["cudnn_ms"])
    q, k, v = structured_qkv(seq, num_q_heads=12, num_kv_heads=2, head_dim=128)
    plan = config.layer_plan(worst["layer"], 0, 12)
    pats, ba, bb = plan.op_arguments()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            sparse_attention(q, k, v, None, None, 128 ** -0.5, 0, 0, pats, ba, bb, 0, config.guard_threshold, -1,
                             *(esc or (0, 0)))
        torch.cuda.synchronize()
    print(f"profile of layer {worst['layer']} at {seq}:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
