"""GPU exploration (not a test): which fused SDPA the op's dense path runs, and at what cost against eager's.

usage: python scripts/explore_dense_path.py [--lengths 8k,32k] [--out PATH]

The compiled model's timeline (``bench breakdown``, H100, 2026-12-06) put each dense-path call at 32K at 10.5 ms
against eager's 5.2; on the CPU the compiled graph hands the op q, k and v all token-major, where eager's k and v
are head-major: the layout variants below time that.

On Qwen2.5-Coder-1.5B at 32K (H100, 2026-12-06) the compiled model on the dense path spent about 175 ms in attention
where HF eager's SDPA (cuDNN first) spent 152 ms. This times, on the model's attention shape (12 query / 2 KV heads,
d128, bf16, causal), in one run: ``dense.fused_sdpa`` as the op calls it (torch's own backend priority, grouped KV
heads by ``enable_gqa``), the same under cuDNN-first priority, each SDPA backend alone, and five of the twelve heads
as the op runs its routed heads (``dense.dense_heads_by_sdpa``), with the aten ops the profiler sees for each.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minference_fx import dense
from minference_fx.call_masks import CallMasks
from minference_fx.cli import parse_lengths
from minference_fx.tools.bench import event_ms
from minference_fx.tools.bench_prefill import CUDNN_FIRST



def aten_ops(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "sdpa" in e.key.lower()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8k,32k")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.cuda.init()  # torch sets its default SDPA order for the device when CUDA starts (cuDNN first on an H100)
    order = getattr(torch._C, "_get_sdp_priority_order", lambda: [])()
    found = dict(priority=[str(b) for b in order], gpu=torch.cuda.get_device_name(),
                 torch=torch.__version__, cudnn=torch.backends.cudnn.version(), rows=[])
    print(found)
    for n in parse_lengths(args.lengths):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, 12, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        scale = 128 ** -0.5
        kr, vr = k.repeat_interleave(6, dim=1), v.repeat_interleave(6, dim=1)
        variants = {
            "op's fused_sdpa (torch's priority)": lambda: dense.fused_sdpa(q, k, v, causal=True, scale=scale),
            "SDPA enable_gqa, no .contiguous()": lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        }
        for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            variants[f"{name}, enable_gqa"] = (lambda b: lambda: _with(b, lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True)))(backend)
            variants[f"{name}, KV repeated"] = (lambda b: lambda: _with(b, lambda: F.scaled_dot_product_attention(
                q, kr, vr, is_causal=True, scale=scale)))(backend)
        # the layouts the compiled model hands the op (CPU trace, 2026-12-06: q, k and v all token-major, memory
        # [B, S, H, D]) against eager's (q token-major, k and v head-major from the cache's cat)
        tq, tk, tv = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        for name, (a, b, c) in {"q,k,v token-major (compiled)": (tq, tk, tv),
                                "q token-major, k,v head-major (eager)": (tq, k, v),
                                "q,k,v token-major, k,v made contiguous": (tq, None, None)}.items():
            variants[f"op's fused_sdpa, {name}"] = (lambda a, b, c: lambda: dense.fused_sdpa(
                a, tk.contiguous() if b is None else b, tv.contiguous() if c is None else c, causal=True,
                scale=scale))(a, b, c)
        heads = (0, 3, 7, 8, 11)  # five heads as the op's routed heads run: each with its KV head gathered
        out = torch.empty_like(q)
        masks = CallMasks(None, None, 0, 0)
        variants["op's dense_heads_by_sdpa, 5 of 12 heads"] = lambda: dense.dense_heads_by_sdpa(
            q, k, v, out, heads, dense.kv_heads_of(heads, 6), scale, masks)
        variants["cuDNN-first priority, as eager"] = lambda: _with_priority(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True))
        for name, fn in variants.items():
            try:
                ms = event_ms(fn, reps=5)
                ops = aten_ops(fn)
            except RuntimeError as exc:
                ms, ops = None, [f"{type(exc).__name__}: {str(exc)[:120]}"]
            print(f"{n:>7} {name:<40} {'-' if ms is None else f'{ms:8.3f} ms'}  {', '.join(ops)}")
            found["rows"].append(dict(length=n, variant=name, ms=ms, aten=ops))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1)


def _with_priority(fn):
    with sdpa_kernel(list(CUDNN_FIRST), set_priority=True):
        return fn()


def _with(backend, fn):
    with sdpa_kernel([backend]):
        return fn()


if __name__ == "__main__":
    main()
