"""Where a prefill's GPU time goes: HF eager against backend="minference", kernel by kernel.

Random-weight Llama-3-8B shape (few layers), one profiled forward per variant after a warm-up; prints each
variant's kernels by total CUDA time and the totals. Then one layer's op inputs, captured from a compiled
forward, are timed alone: the op's GPU path against cuDNN on them, and on contiguous copies. Used to find
what the compiled model spends beyond dense attention at 128K (index, dense walk against cuDNN, the rest of
the layer). The profiled forward is each variant's second, so with routing on (the default since
2026-12-01 04:00 UTC) the compiled model's near-dense heads run through cuDNN there; the captured layer is
from a fresh compile's first call, before any routing, so it times the op's own path (index + dense walk).

usage: python3 scripts/explore_prefill_profile.py [--length 128k] [--layers 2] [--top 15]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from minference_fx.bench_prefill import _sdpa_context, build_model, llama3_8b_config, make_variant, prompt_ids
from minference_fx.cli import parse_lengths


def kernel_times(step, top: int):
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return rows[:top], sum(r[1] for r in rows)


def time_captured_layer(captured: dict) -> None:
    """The op's inputs of one layer, as the compiled model passed them: its GPU path and cuDNN timed alone."""
    from explore_dense import cudnn_ms  # scripts/ is on sys.path when run as a script

    from minference_fx.bench import _ms
    from minference_fx.op import sparse_on_gpu

    q, k, v = captured["qkv"]
    print(f"op inputs: q {tuple(q.shape)} strides {q.stride()}, k {tuple(k.shape)} strides {k.stride()}")
    op_ms = _ms(lambda: sparse_on_gpu(*captured["qkv"], *captured["rest"])[0], 3)
    cudnn = cudnn_ms(q, k, v)
    contiguous = [t.contiguous() for t in (q, k, v)]
    op_contiguous = _ms(lambda: sparse_on_gpu(*contiguous, *captured["rest"])[0], 3)
    print(f"one layer alone: op's GPU path {op_ms:.2f} ms ({cudnn / op_ms:.3f}x cuDNN {cudnn:.2f} ms); "
          f"on contiguous [B, H, S, D] copies {op_contiguous:.2f} ms")


def capture_layer_inputs(model, ids, length: int) -> dict:
    """The first layer's arguments of the op's GPU path at ``length`` in a compiled forward (cloned, strides kept)."""
    import minference_fx.op as op_module

    captured = {}
    real = op_module.sparse_on_gpu

    def capture(q, k, v, *rest, **kwargs):
        if q.shape[-2] == length and "qkv" not in captured:  # not the background precompile's short calls
            captured["qkv"] = (q.clone(), k.clone(), v.clone())  # clone keeps the strides (preserve_format)
            captured["rest"] = rest
        return real(q, k, v, *rest, **kwargs)

    op_module.sparse_on_gpu = capture
    try:
        with torch.no_grad():
            make_variant("minference", model).fn(input_ids=ids, logits_to_keep=1)
    finally:
        op_module.sparse_on_gpu = real
    return captured


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=lambda text: parse_lengths(text)[0], default=131072)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_model(llama3_8b_config(layers=args.layers, max_len=args.length), device, torch.bfloat16)
    ids = prompt_ids(args.length, model.config.vocab_size, 0, device)
    for name in ("eager", "minference"):
        variant = make_variant(name, model)

        def step():
            with torch.no_grad(), _sdpa_context(name, device):  # eager: cuDNN first, as the benchmark
                variant.fn(input_ids=ids, logits_to_keep=1)

        rows, total = kernel_times(step, args.top)
        print(f"--- {name} @ {args.length}, {args.layers} layers: {total:.1f} ms of GPU kernels")
        for key, ms, count in rows:
            print(f"{ms:10.2f} ms {count:5d}x  {key[:110]}")
        torch._dynamo.reset()
    captured = capture_layer_inputs(model, ids, args.length)
    del model
    torch.cuda.empty_cache()
    time_captured_layer(captured)

if __name__ == "__main__":
    main()
