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

from .plan import HeadPlan, LayerPlan, Pattern

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


# The synthetic attention's parts, in logits (q·k / sqrt(D)); see structured_qkv.
_WINDOW_LOGIT = 7.0          # recency window: bonus at distance 0, Gaussian in the distance ...
_WINDOW_TOKENS = 4500.0      # ... with this standard deviation (tokens)
_ROPE_LOGIT = 2.0            # slow RoPE-like decay on top: bonus at distance 0 ...
_ROPE_PERIODS = (2.0 ** 13, 2.0 ** 21)  # ... from cosines with periods log-spaced in this range (tokens)
_SINK_LOGIT = 14.0           # the first `sinks` keys
_HOT_LOGIT = 10.0            # `hot_columns` random keys
_WEAK_LOGIT = 5.5            # weak vertical lines ("delimiter" keys), one in _WEAK_EVERY on average
_WEAK_EVERY = 256
_DIAG_LOGIT = 9.0            # strong far diagonal, one offset per kv head, seen by one query head per group
_NOISE = 0.3                 # per-dimension std of the content noise of q and k
_HEAD_SPREAD = 0.15          # per-query-head log-normal spread of the part strengths
_GEN_CHUNK = 1 << 16         # positions generated at a time
_CODE_BLOCK = 4096           # positions per seeded block of the repeat code


def _band_code(n_freq: int, device):
    """(omega, weight) fp64 per frequency of the position code: q_i·k_j gets ``sum weight * cos(omega (i - j))``.

    Three quarters of the pairs sample a half-normal spectrum of std ``1/_WINDOW_TOKENS`` at its
    quantiles (their mean cosine is a Gaussian window in the distance); the rest are RoPE-like low
    frequencies, log-spaced in period, for a slow decay beyond the window. No high frequencies: a
    code shared by every token that oscillates fast would score far diagonals like near ones.
    """
    n_win = max(1, (3 * n_freq) // 4)
    n_rope = n_freq - n_win
    u = (torch.arange(n_win, device=device, dtype=torch.float64) + 0.5) / n_win
    win = math.sqrt(2.0) * torch.erfinv(u) / _WINDOW_TOKENS
    rope = 2 * math.pi / torch.logspace(math.log10(_ROPE_PERIODS[0]), math.log10(_ROPE_PERIODS[1]), n_rope,
                                        device=device, dtype=torch.float64)
    w_win = torch.full((n_win,), _WINDOW_LOGIT / n_win, device=device, dtype=torch.float64)
    w_rope = torch.full((n_rope,), _ROPE_LOGIT / max(n_rope, 1), device=device, dtype=torch.float64)
    if n_rope == 0:
        w_win = w_win + _ROPE_LOGIT / n_win
    return torch.cat([win, rope]), torch.cat([w_win, w_rope])


def structured_qkv(seq: int, *, batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                   device="cuda", seed=0, hot_columns=16, sinks=4):
    """Q/K/V ``[B, H, S, D]`` whose causal attention looks like a long-context LLM head's.

    Used by the kernel benchmark and the autotuner, so that the online vertical-slash index sees
    the structure it was designed for. Logits ``q_i·k_j / sqrt(D)`` of a query ``i`` over keys
    ``j <= i`` are the sum of:

    * **Recency**: half the head dim carries a position code shared by q and k, built from low
      frequencies only (see :func:`_band_code`), so ``q_i·k_j`` depends smoothly on ``i - j``: about
      ``_WINDOW_LOGIT + _ROPE_LOGIT`` (9) near the diagonal, falling over a few thousand tokens (a
      Gaussian window of ``_WINDOW_TOKENS``) to a far remainder of about +-1 logit that varies
      slowly with the distance, as RoPE's long-term decay does. An earlier version used RoPE's
      full frequency range on a constant vector; its high frequencies made far diagonals score
      like near ones, so the top slashes scattered over every key tile, unlike real heads.
      The window width moves the index's density most: the near diagonals fill the slash budget
      only if the window is about as wide as it; past the window, the remaining picks go to far
      diagonals chosen by the noise, each costing up to two key tiles per query tile. It is set
      so that VS(1000, 6096) lands near MInference's reported density at 128K (5-15% of causal
      work); with 3000 tokens it lists about 20-27%.
    * **Sinks**: the first ``sinks`` keys, ``_SINK_LOGIT`` (a large share of every row's mass).
    * **Vertical lines**: ``hot_columns`` random keys at ``_HOT_LOGIT`` and weak "delimiter" keys,
      about one in ``_WEAK_EVERY``, at ``_WEAK_LOGIT``.
    * **A strong far diagonal** per kv head: key ``j`` carries a random code of position
      ``j + offset`` (text that repeats an earlier passage), which the first query head of each
      group matches (``_DIAG_LOGIT``); offsets lie in ``[min(seq/64, 1024), seq/2)``.
    * **Content noise** on every dim of q and k (``_NOISE``), plus the random cross terms of the
      parts above: about a logit per (i, j), so rows are neither one-hot nor flat.

    Query heads differ by a random strength per part (log-normal, ``_HEAD_SPREAD``); the query
    heads of a group share their kv head's keys. ``v`` is plain noise.

    Measured on CPU with the reference index, VS(1000, 6096), fp32, seeds 0 and 1, eight query
    heads over two kv heads (physical work / causal pairs; recall = attention mass of the last
    64 rows inside their listed keys): 32K 47% (39-68%), recall >= 0.995; 128K 15-17% (11-14%
    on most heads, 20-31% on the heads that read the repeat code, whose mismatches add per-pair
    noise), recall 0.95-1.0; estimated from the last rows at 512K 3.5% and 1M 2.2%, recall
    0.86-0.99 (the far field's share grows with the length). Where the mass goes varies a lot
    by head and seed: sinks 0-80%, the window 7-95%, vertical lines up to ~85% when a hot
    column falls inside the window; the far field about 1% at 128K. The numbers are a stand-in
    chosen to give that kind of head, not measured from a model; nothing is noise-free.

    Memory: generated in chunks of ``_GEN_CHUNK`` positions with fp32 scratch of one chunk, written
    straight into the ``dtype`` outputs. Deterministic for a given seed, shape and device.
    """
    if head_dim < 8:
        raise ValueError(f"head_dim must be at least 8, got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    f32 = torch.float32
    g = torch.Generator(device=device).manual_seed(seed)
    group = num_q_heads // num_kv_heads
    D = head_dim
    inv = D ** 0.5  # logit = q·k / sqrt(D)
    n_freq = D // 4
    loc = slice(0, 2 * n_freq)  # the position code
    hot_dim = 2 * n_freq  # the sink / vertical direction
    code = slice(hot_dim + 1, D)  # the repeat code
    d_code = D - hot_dim - 1
    freqs, weights = _band_code(n_freq, device)
    band_total = float(weights.sum())
    amp = (weights / band_total).sqrt().to(f32)  # unit-norm code; band_total logits at distance 0

    # per query head: strengths of the band, hot-direction and repeat-code parts
    spread = torch.exp(_HEAD_SPREAD * torch.randn(3, num_q_heads, generator=g, device=device))
    a_band = (band_total * inv) ** 0.5 * spread[0]
    a_hot = 6.0 * spread[1]
    reads_code = (torch.arange(num_q_heads, device=device) % group == 0).to(f32)
    a_code = (_DIAG_LOGIT * inv) ** 0.5 * spread[2] * reads_code
    b_band = (band_total * inv) ** 0.5
    b_code = (_DIAG_LOGIT * inv) ** 0.5
    hot_cols = torch.randint(0, max(seq, 1), (hot_columns,), generator=g, device=device)
    lo_off = min(max(seq // 64, 1), 1024)
    offsets = torch.randint(lo_off, max(seq // 2, lo_off + 1), (num_kv_heads,), generator=g, device=device).tolist()
    code_seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g, device=device))
    code_gen = torch.Generator(device=device)

    def repeat_code(p0: int, p1: int) -> torch.Tensor:
        """[p1 - p0, d_code] random vectors of norm about 1, a pure function of the position (and the seed)."""
        parts = []
        for blk in range(p0 // _CODE_BLOCK, (p1 - 1) // _CODE_BLOCK + 1):
            code_gen.manual_seed(code_seed + blk)
            x = torch.randn(_CODE_BLOCK, d_code, generator=code_gen, device=device) * d_code ** -0.5
            lo, hi = max(p0 - blk * _CODE_BLOCK, 0), min(p1 - blk * _CODE_BLOCK, _CODE_BLOCK)
            parts.append(x[lo:hi])
        return torch.cat(parts)

    q = torch.empty(batch, num_q_heads, seq, D, dtype=dtype, device=device)
    k = torch.empty(batch, num_kv_heads, seq, D, dtype=dtype, device=device)
    v = torch.empty(batch, num_kv_heads, seq, D, dtype=dtype, device=device)
    for p0 in range(0, seq, _GEN_CHUNK):
        p1 = min(seq, p0 + _GEN_CHUNK)
        n = p1 - p0
        pos = torch.arange(p0, p1, device=device, dtype=torch.float64)
        ang = (pos[:, None] * freqs[None]).remainder(2 * math.pi).to(f32)
        band = torch.cat([ang.cos() * amp, ang.sin() * amp], -1)  # [n, 2F], unit norm

        x = torch.randn(batch, num_q_heads, n, D, generator=g, device=device) * _NOISE
        x[..., loc] += a_band[:, None, None] * band
        x[..., hot_dim] += a_hot[:, None]
        x[..., code] += a_code[:, None, None] * repeat_code(p0, p1)
        q[:, :, p0:p1] = x.to(dtype)

        x = torch.randn(batch, num_kv_heads, n, D, generator=g, device=device) * _NOISE
        x[..., loc] += b_band * band
        j = torch.arange(p0, p1, device=device)
        hot_logit = torch.where(torch.rand(n, generator=g, device=device) < 1.0 / _WEAK_EVERY, _WEAK_LOGIT, 0.0)
        hot_logit = torch.where(torch.isin(j, hot_cols), _HOT_LOGIT, hot_logit)
        hot_logit = torch.where(j < sinks, _SINK_LOGIT, hot_logit)
        x[..., hot_dim] += hot_logit * inv / 6.0
        for h, off in enumerate(offsets):
            x[:, h, :, code] += b_code * repeat_code(p0 + off, p1 + off)
        k[:, :, p0:p1] = x.to(dtype)
        v[:, :, p0:p1] = torch.randn(batch, num_kv_heads, n, D, generator=g, device=device).to(dtype)
    return q, k, v


def _ms(fn, reps_hint: float) -> float:
    """Median milliseconds of ``fn``. ``reps_hint`` <= 1 means a long call (seconds at 512K+): do_bench
    would still run it ~8 times to estimate its runtime, so time one warm-up and two calls instead."""
    import triton

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
    from .kernels.reference import BLOCK

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
    from torch.nn.attention.flex_attention import BlockMask

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


def bench_kernels(lengths, *, budgets=(1000, 6096), baselines=KERNEL_BASELINES, num_warps=None, num_stages=None):
    unknown = [name for name in baselines if name not in KERNEL_BASELINES]
    if unknown:  # a misspelt baseline would just be missing from the table
        raise ValueError(f"unknown baseline(s) {unknown}; known: {', '.join(KERNEL_BASELINES)}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .kernels.attend import sparse_attention_triton
    from .kernels.index import build_index_gpu

    rows = []
    shape = LLAMA3_8B
    group = shape["num_q_heads"] // shape["num_kv_heads"]
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * shape["num_q_heads"])
    patterns, budget_a, budget_b = plan.op_arguments()
    for seq in lengths:
        q, k, v = structured_qkv(seq, **shape)
        scale = shape["head_dim"] ** -0.5
        reps = 5 if seq <= 131072 else 1
        from .autotune.dispatch import launch_config

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
                from torch.nn.attention.flex_attention import flex_attention

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
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
    }


def write_json(path, rows, command):
    with open(path, "w") as fh:
        json.dump({"command": command, **environment(), "rows": [dataclasses.asdict(r) for r in rows]}, fh, indent=2)
