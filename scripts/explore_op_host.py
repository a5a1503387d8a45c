"""GPU exploration (not a test): the op's host time on the dense path, on a Qwen2.5-Coder-1.5B-shaped model with
random weights (no weights to carry: only the attention's shapes and the graph matter here).

usage: python scripts/explore_op_host.py [--length 32k] [--layers 28] [--out PATH]

``bench breakdown`` on the real model at 32K (H100, 2026-12-06) timed each dense-path op call at 10.5 ms against
eager's 5.2 ms SDPA, while the same SDPA on the same layouts alone takes 5.0-5.3 ms (explore_dense_path.py). This
times eager and the compiled model in one process and profiles one compiled forward: the CPU time of the op and of
what it calls, against the CUDA time of its SDPA, so host time that starves the GPU shows.
"""
from __future__ import annotations

import argparse
import json

import torch
import transformers
from torch.nn.attention import sdpa_kernel

import minference_fx  # noqa: F401  (registers the backend)
from minference_fx.cli import parse_lengths
from minference_fx.tools.bench import event_ms
from minference_fx.tools.bench_prefill import CUDNN_FIRST



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", default="32k")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--eager-first-cudnn-block", action="store_true",
                    help="time eager inside sdpa_kernel(cuDNN first, set_priority=True), as bench breakdown does")
    ap.add_argument("--out")
    args = ap.parse_args()
    n = parse_lengths(args.length)[0]
    cfg = transformers.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=args.layers,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=131072, rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    model = model.eval()
    ids = torch.randint(0, 151936, (1, n), device="cuda")
    found = {"length": n, "layers": args.layers, "gpu": torch.cuda.get_device_name()}
    with torch.no_grad():
        if args.eager_first_cudnn_block:
            with sdpa_kernel(list(CUDNN_FIRST), set_priority=True):
                found["eager_ms"] = event_ms(lambda: model(ids, logits_to_keep=1), reps=3)
        else:
            found["eager_ms"] = event_ms(lambda: model(ids, logits_to_keep=1), reps=3)
        found["sdpa_order_after_eager"] = [int(b) for b in torch._C._get_sdp_priority_order()]
        compiled = torch.compile(model, backend="minference")
        compiled(ids, logits_to_keep=1)
        found["compiled_ms"] = event_ms(lambda: compiled(ids, logits_to_keep=1), reps=3)
        print(found)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            compiled(ids, logits_to_keep=1)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    print(table)
    print(found)
    found["profile"] = table
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
