"""GPU exploration (not a test): which SDPA backend torch's default picks before and after a
``sdpa_kernel(..., set_priority=True)`` block, and whether cuDNN can be called directly with grouped KV heads.

usage: python scripts/explore_sdpa_priority.py [--length 32k] [--out PATH]

``bench breakdown`` times eager under a cuDNN-first priority block, then the compiled model in the same process;
its dense-path calls took 10.5 ms at 32K on Qwen's shape (H100, 2026-12-06), about flash's time, where the same
call alone (cuDNN by torch's default choice) took 5.2 ms.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from minference_fx.cli import parse_lengths
from minference_fx.tools.bench import event_ms
from minference_fx.tools.bench_prefill import CUDNN_FIRST



def backend_of(fn) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    keys = {e.key for e in prof.key_averages()}
    return ",".join(sorted(k for k in keys if k.startswith("aten::_scaled_dot_product") or k.startswith("aten::_flash")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", default="32k")
    ap.add_argument("--out")
    args = ap.parse_args()
    n = parse_lengths(args.length)[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 12, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=128 ** -0.5, enable_gqa=True)  # noqa: E731
    rows = {}
    rows["default, before"] = (backend_of(sdpa), event_ms(sdpa, reps=5), str(torch._C._get_sdp_priority_order()))
    with sdpa_kernel(list(CUDNN_FIRST), set_priority=True):
        rows["inside cuDNN-first block"] = (backend_of(sdpa), event_ms(sdpa, reps=5),
                                            str(torch._C._get_sdp_priority_order()))
    rows["default, after the block"] = (backend_of(sdpa), event_ms(sdpa, reps=5), str(torch._C._get_sdp_priority_order()))
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)
        rows["can_use_cudnn_attention"] = (str(torch.backends.cuda.can_use_cudnn_attention(params, True)), None, "")
    except Exception as exc:  # noqa: BLE001  (an exploration: record what failed)
        rows["can_use_cudnn_attention"] = (f"{type(exc).__name__}: {exc}"[:200], None, "")
    try:
        direct = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
            q, k, v, None, False, 0.0, True, False, scale=128 ** -0.5)[0]
        got, want = direct(), sdpa()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        rows["aten cuDNN op directly, GQA"] = (backend_of(direct), event_ms(direct, reps=5), f"rel err {err:.2e}")
    except Exception as exc:  # noqa: BLE001
        rows["aten cuDNN op directly, GQA"] = (f"{type(exc).__name__}: {exc}"[:300], None, "")
    for name, row in rows.items():
        print(f"{name:<32} {row}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(length=n, gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
