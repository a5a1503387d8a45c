"""GPU exploration (not a test): can cuDNN's variable-length attention take the (batch, head) pairs whose
online index turned out near-dense, chosen on the device, with no host sync?

The idea: lay every candidate head out as its own sequence of one packed batch, the ones to run first;
sequence lengths (``cum_seq``) are computed on the device, so the heads that stay sparse get length 0 and
cost nothing, while every buffer keeps a shape-sized extent (CUDA graphs).

usage: python scripts/explore_varlen.py [--lengths 32k,128k]

Prints, per length, for a Llama-3-8B-shaped layer (32 q heads, 8 kv heads, d128, bf16): dense cuDNN SDPA;
varlen cuDNN with every head, half the heads and no head run (lengths 0), per query head (K/V gathered
per query head) and per kv head (the group's query heads together, GQA inside cuDNN); the gather copies;
FA2 varlen for comparison; max |diff| against SDPA on the heads run and whether the rest stays finite.
"""
from __future__ import annotations

import argparse
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minference_fx.tools.bench import _ms
from minference_fx.cli import parse_lengths


def cudnn_varlen(q, k, v, cum, max_len):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cum, cum, max_len, max_len, False, 0.0, True, False,
                                                   scale=q.shape[-1] ** -0.5)[0]


def flash_varlen(q, k, v, cum, max_len):
    return torch.ops.aten._flash_attention_forward(q, k, v, cum, cum, max_len, max_len, 0.0, True, False,
                                                   scale=q.shape[-1] ** -0.5)[0]


def cum_from(run: torch.Tensor, n: int) -> torch.Tensor:
    """Sequence offsets for sequences of length n where ``run`` (ordered: run first), else 0."""
    lengths = run.to(torch.int32) * n
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])


def explore(n: int) -> None:
    hq, hkv, d = 32, 8, 128
    group = hq // hkv
    g = torch.Generator(device="cuda").manual_seed(0)
    # q/k/v laid out as HF hands them over: [B, S, H, D] memory viewed as [B, H, S, D]
    q = torch.randn(1, n, hq, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, n, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(1, n, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        dense_ms = _ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 3)
    print(f"@ {n}: dense cuDNN SDPA (GQA) {dense_ms:.2f} ms", flush=True)

    heads = torch.arange(hq, device="cuda")

    def gather_per_q_head():
        qs = q[0].reshape(hq * n, 1, d) if q[0].is_contiguous() else q[0].contiguous().view(hq * n, 1, d)
        ks = k[0].index_select(0, heads // group).reshape(hq * n, 1, d)
        vs = v[0].index_select(0, heads // group).reshape(hq * n, 1, d)
        return qs, ks, vs

    def gather_per_kv_head():
        qs = q[0].reshape(hkv, group, n, d).permute(0, 2, 1, 3).reshape(hkv * n, group, d)
        return qs, k[0].reshape(hkv * n, 1, d), v[0].reshape(hkv * n, 1, d)

    print(f"@ {n}: gather per q head {_ms(gather_per_q_head, 3):.2f} ms, per kv head {_ms(gather_per_kv_head, 3):.2f} ms",
          flush=True)
    for layout, gather, seqs in (("per q head", gather_per_q_head, hq), ("per kv head", gather_per_kv_head, hkv)):
        qs, ks, vs = gather()
        for impl_name, impl in (("cuDNN", cudnn_varlen), ("FA2", flash_varlen)):
            for label, n_run in (("all", seqs), ("half", seqs // 2), ("none", 0)):
                run = torch.arange(seqs, device="cuda") < n_run
                cum = cum_from(run, n)
                try:
                    out = impl(qs, ks, vs, cum, n)
                    torch.cuda.synchronize()
                    ms = _ms(lambda: impl(qs, ks, vs, cum, n), 3)
                    rows = n_run * n
                    if layout == "per q head":
                        got = out[:rows].view(n_run, n, d)
                        want = ref[0, :n_run]
                    else:
                        got = out[:rows].view(n_run, n, group, d).permute(0, 2, 1, 3)
                        want = ref[0, :n_run * group].reshape(n_run, group, n, d)
                    err = (got.float() - want.float()).abs().max().item() if n_run else 0.0
                    finite = bool(torch.isfinite(out[:rows]).all().item())
                    print(f"@ {n}: {impl_name} varlen {layout:<11} {label:<4} ({n_run}/{seqs} seqs) {ms:8.2f} ms "
                          f"{dense_ms / ms if ms else 0:.3f}x dense; max|diff| {err:.2e}; run rows finite {finite}",
                          flush=True)
                except Exception as e:  # noqa: BLE001 - exploration: report and go on
                    print(f"@ {n}: {impl_name} varlen {layout} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    traceback.print_exc(limit=1)
        del qs, ks, vs
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32k,128k")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, torch.backends.cudnn.version(), flush=True)
    for n in parse_lengths(a.lengths):
        explore(n)


if __name__ == "__main__":
    main()
