"""The GPU workload the tuner times: realistic sparse indices, not dense fake masks.

Inputs come from an input family (:data:`FAMILIES`): :func:`structured_qkv` (a wide
local band, sinks and hot columns, like real Q/K after RoPE; the tuner's default) or
:func:`scattered_qkv` (a narrow band, slashes at scattered offsets, a noisy far field).
The kernel benchmark, ``minference_fx.tools.bench``, times both. The index comes from
``build_index_gpu`` with the default vertical-slash plan on every head, so the kernel
walks the tile and column lists it walks in a real prefill.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..call_masks import CallMasks
from ..defaults import DEFAULTS
from ..dense import dense_attention
from ..kernels import guard
from ..kernels.attend import sparse_attention_triton
from ..kernels.index import build_index_gpu
from ..plan import HeadPlan, LayerPlan, Pattern
from ..sparse_path import sparse_on_gpu
from .cache import TuneEntry
from .identity import DeviceIdentity, device_identity

NEEDS_GPU = ("autotuning times the Triton kernels on a CUDA GPU, and torch sees none here; "
             "run `minference-fx autotune` on the machine whose GPU will run the model "
             "(`minference-fx autotune --show` prints the cache anywhere)")

# MInference's default head (the backend's default plan): the index the kernel meets most.
DEFAULT_BUDGETS = DEFAULTS.budgets


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
      so that the default vertical-slash head lands near MInference's reported density at 128K (5-15% of causal
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

    Measured on CPU with the reference index, the default vertical-slash head, fp32, seeds 0 and 1, eight query
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


# The scattered family's parts, in logits (q·k / sqrt(D)); see scattered_qkv.
_SC_BAND_LOGIT = 10.0        # local band: bonus at distance 0 ...
_SC_BAND_TOKENS = 16.0       # ... from a drift smoothed over this many tokens (std of the Gaussian kernel)
_SC_SINK_LOGIT = 11.0        # the first `sinks` keys
_SC_HOT_LOGIT = 8.0          # `hot_columns` random keys per kv head
_SC_REPEAT_LOGIT = 3.5       # each of a kv head's `slash_offsets` repeat diagonals
_SC_MIN_OFFSET = 256         # repeat offsets are log-uniform from here to the length
_SC_PERIOD_LOGIT = 3.0       # the periodic slash: every multiple of a kv head's period
_SC_PERIODS = (300, 3000)    # periods are log-uniform in this range (tokens)
_SC_READS_REPEAT = 0.75      # share of query heads that read the repeat code
_SC_NOISE = 0.3              # per-dimension std of the content noise of q and k
_SC_HEAD_SPREAD = 0.15       # per-query-head log-normal spread of the part strengths


def _position_rows(seed: int, p0: int, p1: int, width: int, device) -> torch.Tensor:
    """fp32 ``[p1 - p0, width]`` standard normal rows, a pure function of (seed, position) for positions
    ``>= -_CODE_BLOCK``: one seeded draw per block of ``_CODE_BLOCK`` positions, so any chunking gives the same rows."""
    gen = torch.Generator(device=device)
    parts = []
    for blk in range(p0 // _CODE_BLOCK, (p1 - 1) // _CODE_BLOCK + 1):
        gen.manual_seed(seed + blk + 1)  # blk >= -1: the drift's halo reaches before position 0
        x = torch.randn(_CODE_BLOCK, width, generator=gen, device=device)
        lo, hi = max(p0 - blk * _CODE_BLOCK, 0), min(p1 - blk * _CODE_BLOCK, _CODE_BLOCK)
        parts.append(x[lo:hi])
    return torch.cat(parts)


def _drift(seed: int, p0: int, p1: int, width: int, device) -> torch.Tensor:
    """fp32 ``[p1 - p0, width]`` vectors of norm about 1 that drift smoothly with the position: white noise
    smoothed by a Gaussian of ``_SC_BAND_TOKENS``, so ``x_i·x_j`` is about ``exp(-(i - j)^2 / (4 sigma^2))`` near the
    diagonal and ``N(0, 1/width)`` far from it."""
    radius = math.ceil(4 * _SC_BAND_TOKENS)
    t = torch.arange(-radius, radius + 1, device=device, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (t / _SC_BAND_TOKENS) ** 2)
    kernel = kernel / kernel.norm()  # unit variance per coordinate after smoothing
    noise = _position_rows(seed, p0 - radius, p1 + radius, width, device)  # [n + 2r, width]
    smooth = torch.nn.functional.conv1d(noise.T[None], kernel.expand(width, 1, -1).contiguous(), groups=width)
    return smooth[0].T * width ** -0.5


def scattered_qkv(seq: int, *, batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                  device="cuda", seed=0, hot_columns=48, sinks=4, slash_offsets=6):
    """Q/K/V ``[B, H, S, D]`` whose slashes beyond a narrow local band scatter and whose far field is noisy.

    The second input family of the kernel benchmark (``family="scattered"``; :func:`structured_qkv` is the
    first). There a recency window of thousands of tokens fills the slash budget with near diagonals, which
    pack into few key tiles; here the band is a couple of hundred tokens wide, so most of the budget goes to
    far diagonals, isolated ones, each crossing up to two key tiles of every query tile for one key per row.
    That is the case where the tile walk's work outgrows the keys the index keeps (physical against logical
    density, ``kernels.density``). Logits ``q_i·k_j / sqrt(D)`` are the sum of:

    * **A narrow local band from drifting keys**: q and k share, per kv head, a vector that drifts smoothly
      along the position (white noise smoothed over ``_SC_BAND_TOKENS``, see :func:`_drift`): about
      ``_SC_BAND_LOGIT`` (10) at distance 0, ``exp(-d^2 / (4 * 16^2))`` of it at distance d (5 % by d = 56,
      so the band fits in the forced 100 diagonals). Far from the diagonal the drift's overlap is not zero
      but about ``10 / sqrt(width)`` logit in patches as wide as the band: part of the far field's noise.
    * **Sinks**: the first ``sinks`` keys at ``_SC_SINK_LOGIT``.
    * **Hot columns**: ``hot_columns`` random keys per kv head (each kv head its own) at ``_SC_HOT_LOGIT``.
    * **Repeat slashes at scattered offsets**: each kv head has ``slash_offsets`` offsets, log-uniform in
      ``[256, S)``; key j carries a random code of each position ``j + offset`` and a query reads the code of its
      own position, so diagonal ``offset`` gains ``_SC_REPEAT_LOGIT`` for the query heads that read the code
      (each does with probability ``_SC_READS_REPEAT``). Unmatched codes are independent per (i, j): per-pair
      far-field noise of about ``3.5 * sqrt(slash_offsets / width)`` logit.
    * **A periodic slash**: q and k of kv head h carry a random code of ``position mod P_h`` (P_h log-uniform in
      ``_SC_PERIODS``), so every multiple of P_h gains ``_SC_PERIOD_LOGIT``: tens of diagonals spread evenly
      over the whole length, as a fixed-size record or table row makes; independent per-pair noise otherwise.
    * **Content noise** on every dim of q and k (``_SC_NOISE``).

    So the far field is noisy per pair (a std of 1.6-2.4 logits at head dim 128, measured; the heads that
    do not read the repeat code at the low end), and the rows' favourite far keys differ
    from row to row: the diagonal sums that rank the slashes are led, past the band and the real slashes, by
    whichever rows drew a high score, at offsets spread over the whole length. Query heads differ by a random
    strength per part (log-normal, ``_SC_HEAD_SPREAD``); the heads of a group share their kv head's keys.
    ``v`` is plain noise. Deterministic for a given seed, shape and device; generated in chunks of
    ``_GEN_CHUNK`` positions with fp32 scratch of one chunk, whose noise draws depend on the chunk size but
    whose codes (drift, repeat, period) do not.

    The head dim is split into the hot direction (1 dim), the drift (3/8), the repeat code (1/4), the
    period code (1/8) and noise only (the rest), so ``head_dim`` must be at least 16.
    """
    if head_dim < MIN_HEAD_DIM["scattered"]:
        raise ValueError(f"head_dim must be at least {MIN_HEAD_DIM['scattered']} for the scattered family, got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if seq < 0 or sinks < 0 or hot_columns < 0 or slash_offsets < 0:
        raise ValueError(f"seq, sinks, hot_columns and slash_offsets must be >= 0, got {seq}, {sinks}, "
                         f"{hot_columns}, {slash_offsets}")
    f32 = torch.float32
    g = torch.Generator(device=device).manual_seed(seed)
    group = num_q_heads // num_kv_heads
    D = head_dim
    root_d = D ** 0.5  # logit = q·k / sqrt(D)
    d_band, d_rep, d_per = 3 * D // 8, D // 4, D // 8
    hot_dim = 0
    band = slice(1, 1 + d_band)
    rep = slice(band.stop, band.stop + d_rep)
    per = slice(rep.stop, rep.stop + d_per)

    # per query head: strengths of the band, hot, repeat and period parts; who reads the repeat code
    spread = torch.exp(_SC_HEAD_SPREAD * torch.randn(4, num_q_heads, generator=g, device=device))
    reads_repeat = (torch.rand(num_q_heads, generator=g, device=device) < _SC_READS_REPEAT).to(f32)
    n_off = max(slash_offsets, 1)
    a_band = (_SC_BAND_LOGIT * root_d) ** 0.5 * spread[0]
    a_hot = 6.0 * spread[1]
    a_rep = (_SC_REPEAT_LOGIT * root_d * n_off ** 0.5) ** 0.5 * spread[2] * reads_repeat
    a_per = (_SC_PERIOD_LOGIT * root_d) ** 0.5 * spread[3]
    b_band = (_SC_BAND_LOGIT * root_d) ** 0.5
    b_rep = (_SC_REPEAT_LOGIT * root_d * n_off ** 0.5) ** 0.5 / n_off ** 0.5 * float(slash_offsets > 0)
    b_per = (_SC_PERIOD_LOGIT * root_d) ** 0.5

    # per kv head: hot columns, repeat offsets, period and its code table, seeds of the drift
    hot_cols = [torch.randint(min(sinks, max(seq - 1, 0)), max(seq, 1), (hot_columns,), generator=g, device=device)
                for _ in range(num_kv_heads)]
    lo_off, hi_off = math.log(_SC_MIN_OFFSET), math.log(max(seq, _SC_MIN_OFFSET + 1))
    offsets = (torch.exp(lo_off + (hi_off - lo_off) * torch.rand(num_kv_heads, slash_offsets, generator=g,
                                                                  device=device)).long()).tolist()
    lo_p, hi_p = math.log(_SC_PERIODS[0]), math.log(_SC_PERIODS[1])
    periods = torch.exp(lo_p + (hi_p - lo_p) * torch.rand(num_kv_heads, generator=g, device=device)).long().tolist()
    period_codes = [torch.randn(p, d_per, generator=g, device=device) * d_per ** -0.5 for p in periods]
    code_seeds = torch.randint(0, 2 ** 30, (num_kv_heads + 1,), generator=g, device=device).tolist()
    drift_seeds, repeat_seed = code_seeds[:num_kv_heads], code_seeds[num_kv_heads]

    q = torch.empty(batch, num_q_heads, seq, D, dtype=dtype, device=device)
    k = torch.empty(batch, num_kv_heads, seq, D, dtype=dtype, device=device)
    v = torch.empty(batch, num_kv_heads, seq, D, dtype=dtype, device=device)
    kv_of = [h // group for h in range(num_q_heads)]
    for p0 in range(0, seq, _GEN_CHUNK):
        p1 = min(seq, p0 + _GEN_CHUNK)
        n = p1 - p0
        pos = torch.arange(p0, p1, device=device)
        drift = [_drift(s, p0, p1, d_band, device) for s in drift_seeds]  # per kv head [n, d_band]
        period = [codes[pos % p] for codes, p in zip(period_codes, periods)]  # per kv head [n, d_per]
        own_code = _position_rows(repeat_seed, p0, p1, d_rep, device) * d_rep ** -0.5

        x = torch.randn(batch, num_q_heads, n, D, generator=g, device=device) * _SC_NOISE
        for h in range(num_q_heads):
            x[:, h, :, band] += a_band[h] * drift[kv_of[h]]
            x[:, h, :, per] += a_per[h] * period[kv_of[h]]
            x[:, h, :, rep] += a_rep[h] * own_code
        x[..., hot_dim] += a_hot[:, None]
        q[:, :, p0:p1] = x.to(dtype)

        x = torch.randn(batch, num_kv_heads, n, D, generator=g, device=device) * _SC_NOISE
        for h in range(num_kv_heads):
            x[:, h, :, band] += b_band * drift[h]
            x[:, h, :, per] += b_per * period[h]
            for off in offsets[h]:
                x[:, h, :, rep] += b_rep * _position_rows(repeat_seed, p0 + off, p1 + off, d_rep, device) * d_rep ** -0.5
            hot_logit = torch.where(torch.isin(pos, hot_cols[h]), _SC_HOT_LOGIT, 0.0)
            hot_logit = torch.where(pos < sinks, _SC_SINK_LOGIT, hot_logit)
            x[:, h, :, hot_dim] += hot_logit * root_d / 6.0
        k[:, :, p0:p1] = x.to(dtype)
        v[:, :, p0:p1] = torch.randn(batch, num_kv_heads, n, D, generator=g, device=device).to(dtype)
    return q, k, v


FAMILIES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "structured": structured_qkv,
    "scattered": scattered_qkv,
}
"""The input families by name: ``family_qkv(name, seq, ...)``, ``bench kernels --families``."""

MIN_HEAD_DIM = {"scattered": 16}
"""the smallest head dim a family builds (the scattered family splits it into its codes); the kernels take 9 and up"""


def family_qkv(family: str, seq: int, **kwargs):
    """Q/K/V of the input family ``family`` (a key of :data:`FAMILIES`); ``kwargs`` as that family takes them."""
    try:
        make = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown input family {family!r}; known: {', '.join(FAMILIES)}") from None
    return make(seq, **kwargs)


class CudaWorkload:
    """Index + sparse attention and dense SDPA at one shape, on the current CUDA device."""

    def __init__(self, head_dim: int, group: int, dtype: torch.dtype, *, num_kv_heads: int = 8,
                 budgets: tuple[int, int] = DEFAULT_BUDGETS, guard_threshold: float | None = None,
                 family: str = "structured"):
        if family not in FAMILIES:
            raise ValueError(f"unknown input family {family!r}; known: {', '.join(FAMILIES)}")
        if not torch.cuda.is_available():
            raise RuntimeError(NEEDS_GPU)
        self.family = family
        device = torch.device("cuda", torch.cuda.current_device())
        self.identity: DeviceIdentity = device_identity(device)
        self.smem_limit: int = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        self.head_dim, self.group, self.dtype, self.num_kv_heads = head_dim, group, dtype, num_kv_heads
        self.plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * (num_kv_heads * group))
        if guard_threshold is None:

            guard_threshold = DEFAULTS.guard_threshold
        self.guard_threshold = guard_threshold
        self._length = None
        self._inputs = None

    def _at(self, length: int):
        if self._length != length:
            # one length at a time: at 1M tokens the inputs alone take gigabytes
            self._inputs = None
            torch.cuda.empty_cache()
            q, k, v = family_qkv(self.family, length, num_q_heads=self.num_kv_heads * self.group,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)
            scale = self.head_dim ** -0.5
            self._inputs = (q, k, v, scale, build_index_gpu(q, k, self.plan, scale=scale))
            self._length = length
        return self._inputs

    def kernel(self, length: int, config: TuneEntry) -> Callable[[], object]:
        """The attention kernel alone on a prebuilt index: what the launch config changes."""
        q, k, v, scale, index = self._at(length)
        return lambda: sparse_attention_triton(q, k, v, index, *self.plan.op_arguments(), scale=scale, **config.launch())

    def dense_walk(self, length: int, config: TuneEntry) -> Callable[[], object]:
        """The kernel's launch for forced-dense heads, every head forced: dense work, no list read."""
        q, k, v, scale, index = self._at(length)
        every_head = torch.ones(q.shape[0], q.shape[1], dtype=torch.bool, device=q.device)
        return lambda: sparse_attention_triton(q, k, v, index, *self.plan.op_arguments(), scale=scale,
                                               force_dense=every_head, forced="only", **config.launch())

    def sparse(self, length: int, config: TuneEntry, dense_walk: TuneEntry) -> Callable[[], object]:
        """The op's sparse path: index (with the quality guard's mass estimate when it is on), then the kernel."""
        q, k, v, scale, _ = self._at(length)
        return lambda: sparse_on_gpu(q, k, v, self.plan, scale, CallMasks(), self.guard_threshold, config, dense_walk)

    def dense(self, length: int) -> Callable[[], object]:
        """The op's dense path (fused SDPA, causal, GQA without repeat_kv)."""
        q, k, v, scale, _ = self._at(length)
        return lambda: dense_attention(q, k, v, CallMasks(), scale)

    def index(self, length: int) -> Callable[[], object]:
        """The online index alone."""
        q, k, _, scale, _ = self._at(length)
        return lambda: build_index_gpu(q, k, self.plan, scale=scale)

    def kept_share(self, length: int) -> float:
        """The share of the causal key tiles the index keeps, over every head: what :meth:`kernel` walks."""
        q, k, _, _, index = self._at(length)
        return float(guard.kept_share(index, length, length, 0).mean())
