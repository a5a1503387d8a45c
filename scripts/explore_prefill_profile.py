"""Where a prefill's GPU time goes: HF eager against backend="minference", kernel by kernel.

Random-weight Llama-3-8B shape (few layers), one profiled forward per variant after a warm-up; prints each
variant's kernels by total CUDA time and the totals. Then one layer's op inputs, captured from a compiled
forward, are timed alone: the op's GPU path against cuDNN on them, and on contiguous copies. Used to find
what the compiled model spends beyond dense attention at 128K (index, dense walk against cuDNN, the rest of
the layer). The profiled forward is each variant's second, so with routing on (the default since
2026-12-01 04:00 UTC) the compiled model's near-dense heads run through cuDNN there; the captured layer is
from a fresh compile's first call, before any routing, so it times the op's own path (index + dense walk).

With ``--model smollm2`` the model is SmolLM2-135M's real weights (all 30 layers) on Austen prose (set up as
``scripts/gpu_smollm2.sh`` does). Each variant also prints the wall time of its profiled forward next to its
summed kernel time: a gap means the GPU waited for the host (launch overhead). The captured layer is split into
its stages (index alone, the sparse walk alone on that index) so the index's share is visible.

usage: python3 scripts/explore_prefill_profile.py [--length 128k] [--layers 2] [--top 15] [--model smollm2]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import time

from minference_fx.tools.bench_prefill import (SMOLLM2, _sdpa_context, build_model, build_smollm2, llama3_8b_config,
                                         make_variant, prompt_ids, text_prompt_ids)
from minference_fx.cli import parse_lengths


def kernel_times(step, top: int):
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return rows[:top], sum(r[1] for r in rows), wall_ms


def time_captured_layer(captured: dict) -> None:
    """The op's inputs of one layer, as the compiled model passed them: its GPU path and cuDNN timed alone."""
    from explore_dense import cudnn_ms  # scripts/ is on sys.path when run as a script

    from minference_fx.tools.bench import _ms
    from minference_fx.sparse_path import sparse_on_gpu

    q, k, v = captured["qkv"]
    print(f"op inputs: q {tuple(q.shape)} strides {q.stride()}, k {tuple(k.shape)} strides {k.stride()}")
    op_ms = _ms(lambda: sparse_on_gpu(*captured["qkv"], *captured["rest"])[0], 3)
    cudnn = cudnn_ms(q, k, v)
    contiguous = [t.contiguous() for t in (q, k, v)]
    op_contiguous = _ms(lambda: sparse_on_gpu(*contiguous, *captured["rest"])[0], 3)
    print(f"one layer alone: op's GPU path {op_ms:.2f} ms ({cudnn / op_ms:.3f}x cuDNN {cudnn:.2f} ms); "
          f"on contiguous [B, H, S, D] copies {op_contiguous:.2f} ms")
    time_stages(q, k, v, *captured["rest"])


def time_stages(q, k, v, plan, scale, masks, guard_threshold, tuned, *_rest, **_kw) -> None:
    """The captured layer's GPU path stage by stage: the index alone, then the sparse walk alone on it."""
    from minference_fx.tools.bench import _ms
    from minference_fx.kernels.attend import sparse_attention_triton
    from minference_fx.kernels.index import build_index_gpu
    from minference_fx.dense import split_plan

    split = split_plan(plan)
    index_ms = _ms(lambda: build_index_gpu(q, k, plan, scale=scale, **masks.kwargs()), 3)
    index = build_index_gpu(q, k, plan, scale=scale, **masks.kwargs())
    walk_ms = _ms(lambda: sparse_attention_triton(q, k, v, index, *split.kernel_args, scale=scale,
                                                  **tuned.launch(), **masks.kwargs()), 3)
    listed = [h for h, on in enumerate(split.listed_mask) if on]
    tiles = index.block_count[:, listed].float().mean().item()
    cols = index.col_count[:, listed].float().mean().item()
    print(f"stages: index {index_ms:.2f} ms, sparse walk alone {walk_ms:.2f} ms; listed heads' mean per query tile: "
          f"{tiles:.1f} tiles + {cols:.0f} columns (a causal row reads {q.shape[-2] / 128:.0f} tiles on average)")
    print(f"plan: {plan}")


def capture_layer_inputs(model, ids, length: int) -> dict:
    """The first layer's arguments of the op's GPU path at ``length`` in a compiled forward (cloned, strides kept)."""
    import minference_fx.sparse_path as sparse_path  # the op calls sparse_path.sparse_on_gpu through the module

    captured = {}
    real = sparse_path.sparse_on_gpu

    def capture(q, k, v, *rest, **kwargs):
        if q.shape[-2] == length and "qkv" not in captured:  # not the background precompile's short calls
            captured["qkv"] = (q.clone(), k.clone(), v.clone())  # clone keeps the strides (preserve_format)
            captured["rest"] = rest
        return real(q, k, v, *rest, **kwargs)

    sparse_path.sparse_on_gpu = capture
    try:
        with torch.no_grad():
            make_variant("minference", model).fn(input_ids=ids, logits_to_keep=1)
    finally:
        sparse_path.sparse_on_gpu = real
    return captured


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=lambda text: parse_lengths(text)[0], default=131072)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--model", choices=("llama3-8b-random", SMOLLM2), default="llama3-8b-random")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.model == SMOLLM2:
        model, tokenizer = build_smollm2(args.length, device, torch.bfloat16)
        ids = text_prompt_ids(tokenizer, args.length, 0, device)
        args.layers = model.config.num_hidden_layers
    else:
        model = build_model(llama3_8b_config(layers=args.layers, max_len=args.length), device, torch.bfloat16)
        ids = prompt_ids(args.length, model.config.vocab_size, 0, device)
    for name in ("eager", "minference"):
        variant = make_variant(name, model)

        def step():
            with torch.no_grad(), _sdpa_context(name, device):  # eager: cuDNN first, as the benchmark
                variant.fn(input_ids=ids, logits_to_keep=1)

        rows, total, wall_ms = kernel_times(step, args.top)
        print(f"--- {name} @ {args.length}, {args.layers} layers: {total:.1f} ms of GPU kernels, "
              f"{wall_ms:.1f} ms wall (unprofiled)")
        for key, ms, count in rows:
            print(f"{ms:10.2f} ms {count:5d}x  {key[:110]}")
        torch._dynamo.reset()
    captured = capture_layer_inputs(model, ids, args.length)
    del model
    torch.cuda.empty_cache()
    time_captured_layer(captured)

if __name__ == "__main__":
    main()
