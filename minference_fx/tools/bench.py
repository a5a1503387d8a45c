"""``minference-fx bench kernels``: index + sparse kernel vs dense and FlexAttention, same run, same inputs.

Inputs are *structured* so the online index sees what it sees in a long-context LLM
(see :func:`structured_qkv`): a recency window of a few thousand tokens over a slowly
decaying far field, attention sinks, vertical lines, a strong far diagonal, and noise.
Random Q/K make every diagonal look alike and would flatter nobody in particular.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..autotune.dispatch import launch_config
from ..autotune.workload import structured_qkv
from ..defaults import DEFAULTS
from ..kernels.attend import sparse_attention_triton
from ..kernels.index import build_index_gpu
from ..kernels.reference import BLOCK
from ..plan import HeadPlan, LayerPlan, Pattern

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def _ms(fn, reps_hint: float) -> float:
    """Median milliseconds of ``fn``. ``reps_hint`` <= 1 means a long call (seconds at 512K+): do_bench
    would still run it ~8 times to estimate its runtime, so time one warm-up and two calls instead."""
    if reps_hint <= 1:
        fn()
        times = []
        for _ in range(2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return float(sorted(times)[0] + sorted(times)[1]) / 2
    return float(triton.testing.do_bench(fn, warmup=max(1, int(reps_hint)), rep=max(1, int(4 * reps_hint)), return_mode="median"))


def _index_work(index, patterns, budgets_a, budgets_b, sq, skv):
    """(computed (i, j) pairs, logical pairs) over all (b, h) — tiles at 64×64, columns at 64 rows each."""
    tiles = index.tile_count.sum().item()
    cols = index.col_count.sum().item()
    m_tiles = math.ceil(sq / BLOCK)
    diag_tiles = index.tile_count.shape[0] * index.tile_count.shape[1] * m_tiles  # every VS head lists its diagonal
    physical = tiles * BLOCK * BLOCK + cols * BLOCK
    logical = physical - diag_tiles * BLOCK * (BLOCK - 1) // 2
    return physical, logical


def _flex_from_index(index, sq, skv, block):
    """A BlockMask with the same key tiles (diagonal tile partial, the rest full). Leftover columns are not given
    to Flex: it does less work than we do, so its ratio is flattered, not ours."""
    m = torch.arange(index.tile_index.shape[2], device=index.tile_index.device)[None, None, :, None]
    listed = torch.arange(index.tile_index.shape[-1], device=m.device) < index.tile_count[..., None]
    tile_index = index.tile_index.to(torch.int32)  # the GPU index stores tile numbers as int16
    is_diag = listed & (tile_index == m)
    full_idx = torch.where(listed & ~is_diag, tile_index, torch.iinfo(torch.int32).max)
    full_idx = full_idx.sort(-1).values
    full_num = (listed & ~is_diag).sum(-1).to(torch.int32)
    full_idx = torch.where(full_idx == torch.iinfo(torch.int32).max, 0, full_idx).to(torch.int32)
    part_num = is_diag.any(-1).to(torch.int32)
    part_idx = m[..., 0:1].expand(*index.tile_count.shape, 1).to(torch.int32).contiguous()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=causal,
                                    seq_lengths=(sq, skv), compute_q_blocks=False)


@dataclasses.dataclass
class KernelRow:
    seq: int
    index_ms: float
    kernel_ms: float
    total_ms: float
    physical_density: float
    logical_density: float
    tflops_computed: float
    cudnn_ms: float | None
    flash_ms: float | None
    flex_ms: float | None
    flex_mask_ms: float | None

    def speedup(self, baseline):
        return None if baseline is None else baseline / self.total_ms


KERNEL_BASELINES = ("cudnn", "flash", "flex")


def bench_kernels(lengths, *, budgets=DEFAULTS.budgets, baselines=KERNEL_BASELINES, num_warps=None, num_stages=None):
    unknown = [name for name in baselines if name not in KERNEL_BASELINES]
    if unknown:  # a misspelt baseline would just be missing from the table
        raise ValueError(f"unknown baseline(s) {unknown}; known: {', '.join(KERNEL_BASELINES)}")

    rows = []
    shape = LLAMA3_8B
    group = shape["num_q_heads"] // shape["num_kv_heads"]
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * shape["num_q_heads"])
    patterns, budget_a, budget_b = plan.op_arguments()
    for seq in lengths:
        q, k, v = structured_qkv(seq, **shape)
        scale = shape["head_dim"] ** -0.5
        reps = 5 if seq <= 131072 else 1
        tuned = launch_config(q, k)  # what the op launches at this length: the tuned config, else the default
        config = dataclasses.replace(tuned, num_warps=num_warps or tuned.num_warps, num_stages=num_stages or tuned.num_stages)
        print(f"seq {seq}: kernel launch config BLOCK_M={config.BLOCK_M} BLOCK_N={config.BLOCK_N} "
              f"num_warps={config.num_warps} num_stages={config.num_stages}", flush=True)
        index_fn = lambda: build_index_gpu(q, k, plan, scale=scale)  # noqa: E731
        index = index_fn()
        kernel_fn = lambda: sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale,  # noqa: E731
                                                    **config.launch())
        total_fn = lambda: sparse_attention_triton(q, k, v, index_fn(), patterns, budget_a, budget_b, scale=scale,  # noqa: E731
                                                   **config.launch())
        index_ms, kernel_ms, total_ms = _ms(index_fn, reps), _ms(kernel_fn, reps), _ms(total_fn, reps)
        physical, logical = _index_work(index, patterns, budget_a, budget_b, seq, seq)
        causal_pairs = q.shape[0] * q.shape[1] * seq * (seq + 1) / 2
        row = dict(seq=seq, index_ms=index_ms, kernel_ms=kernel_ms, total_ms=total_ms,
                   physical_density=physical / causal_pairs, logical_density=logical / causal_pairs,
                   tflops_computed=4 * shape["head_dim"] * physical / (kernel_ms * 1e-3) / 1e12,
                   cudnn_ms=None, flash_ms=None, flex_ms=None, flex_mask_ms=None)
        dense_reps = 3 if seq <= 131072 else 1
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            if name == "flash" and seq > 131072:
                print(f"flash at {seq}: skipped (minutes of device time; cuDNN is the faster dense baseline)")
                continue
            if name in baselines:
                try:
                    with sdpa_kernel(backend):
                        row[f"{name}_ms"] = _ms(lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True), dense_reps)
                except RuntimeError as exc:
                    print(f"{name} at {seq}: {exc}")
        del k_rep, v_rep
        print(f"seq {seq}: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)), flush=True)
        if "flex" in baselines:
            try:
                flex = torch.compile(flex_attention, dynamic=False)
                opts = {"BLOCK_M": 64, "BLOCK_N": 64}
                block_mask = _flex_from_index(index, seq, seq, 64)
                flex(q, k, v, block_mask=block_mask, enable_gqa=True, scale=scale, kernel_options=opts)
                row["flex_mask_ms"] = _ms(lambda: _flex_from_index(index, seq, seq, 64), reps)
                row["flex_ms"] = _ms(lambda: flex(q, k, v, block_mask=_flex_from_index(index, seq, seq, 64), enable_gqa=True,
                                                  scale=scale, kernel_options=opts), reps)
            except Exception as exc:  # a baseline that cannot run is reported, not fatal
                print(f"flex at {seq}: {type(exc).__name__}: {exc}"[:400])
        rows.append(KernelRow(**row))
        del q, k, v, index
        torch.cuda.empty_cache()
    return rows


def format_kernel_rows(rows) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = f"{'seq':>8} {'index':>8} {'kernel':>8} {'total':>8} {'idx%':>5} {'phys%':>6} {'log%':>6} {'TF/s':>6} " \
           f"{'cuDNN':>9} {'x':>6} {'flash':>9} {'x':>6} {'flex':>8} {'x':>6}"
    lines = [head]
    for r in rows:
        flex_x = None if r.flex_ms is None else r.flex_ms / r.kernel_ms
        lines.append(
            f"{r.seq:>8} {r.index_ms:>8.2f} {r.kernel_ms:>8.2f} {r.total_ms:>8.2f} {100 * r.index_ms / r.total_ms:>5.1f} "
            f"{100 * r.physical_density:>6.2f} {100 * r.logical_density:>6.2f} {r.tflops_computed:>6.0f} "
            f"{f(r.cudnn_ms, '9.2f')} {f(r.speedup(r.cudnn_ms), '6.2f')} {f(r.flash_ms, '9.2f')} {f(r.speedup(r.flash_ms), '6.2f')} "
            f"{f(r.flex_ms, '8.2f')} {f(flex_x, '6.2f')}"
        )
    lines.append("times in ms; x = baseline / ours (index + kernel; flex: its kernel+mask vs our kernel on the same tiles)")
    return "\n".join(lines)


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
    }


def write_json(path, rows, command):
    with open(path, "w") as fh:
        json.dump({"command": command, **environment(), "rows": [dataclasses.asdict(r) for r in rows]}, fh, indent=2)
