"""Sparse attention forward in Triton: one launch for every head of a layer.

A program owns one query tile (``BLOCK`` rows, or a part of one) of one (batch,
query head) and reads K/V through ``kv_head = h // group`` (no repeat_kv copy).
A launch of forced-dense heads only (the op's dense walk) reads no list: its
programs may own two tiles and walk the keys in contiguous steps. Other launches visit:

1. key tiles — listed in the index for vertical-slash and block-sparse heads;
   enumerated from the plan for dense (every tile up to the diagonal) and
   A-shape heads (sink tiles, then window tiles), so those heads materialise
   nothing;
2. leftover single key columns (vertical-slash), gathered ``BLOCK`` at a time.

Tiles and columns never overlap (the index guarantees it), so every (i, j) is
counted once. Softmax is online in fp32 with base-2 exponentials; a row that can
read no key ends as exactly 0.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from ..plan import PATTERN_CODES, Pattern
from . import fit
from .reference import BLOCK, NO_BLOCK, SparseIndex, first_kept_keys
from .tables import int_table, rows_per_batch

DENSE = tl.constexpr(PATTERN_CODES[Pattern.DENSE])
A_SHAPE = tl.constexpr(PATTERN_CODES[Pattern.A_SHAPE])
VERTICAL_SLASH = tl.constexpr(PATTERN_CODES[Pattern.VERTICAL_SLASH])
BLOCK_SPARSE = tl.constexpr(PATTERN_CODES[Pattern.BLOCK_SPARSE])
SKIP_CODE = -1
"""A kernel-only pattern code (no semantic pattern has it): the head's programs read no key and write
zeros, for heads whose rows another kernel writes (the op's dense heads go to cuDNN)."""
SKIP = tl.constexpr(SKIP_CODE)

# What a launch does with the (batch, head) pairs of its ``force_dense`` table (the op's dense heads of
# this call: the quality guard's and the near-dense ones). Programs that run nothing store nothing, so
# two launches can write one output: the sparse walk skips the forced pairs, a dense walk with 128-row
# programs and contiguous key steps (1.24x faster per tile on near-dense work at 128K) runs only them.
FORCE_MODES = {None: 0, "here": 1, "skip": 2, "only": 3}
FORCE_HERE = tl.constexpr(FORCE_MODES["here"])
FORCE_SKIP = tl.constexpr(FORCE_MODES["skip"])
FORCE_ONLY = tl.constexpr(FORCE_MODES["only"])

TILE_KEYS = tl.constexpr(BLOCK)
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _visible(cols, pos, col_ok, b, masks,
             HAS_KEY_MASK: tl.constexpr, HAS_DOC: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr = True):
    """[BLOCK_M, BLOCK_N] mask of the base rule: causal, padding, same document, window.

    ``masks``: ``(KeyMask, stride_km, DocRow, doc_q, window)``; ``DocRow``: the batch row's document ids;
    ``doc_q``: the query rows' own, loaded once per program.

    ``CAUSAL=False`` for tiles wholly before the query tile and inside the keys: only the optional masks apply."""
    KeyMask, stride_km, DocRow, doc_q, window = masks
    if CAUSAL:
        ok = col_ok[None, :] & (cols[None, :] <= pos[:, None])
    else:
        ok = (cols[None, :] >= 0) & (pos[:, None] >= 0)
    if HAS_KEY_MASK:
        km = tl.load(KeyMask + b * stride_km + cols, mask=col_ok, other=0)
        ok = ok & (km != 0)[None, :]
    if HAS_DOC:
        doc_k = tl.load(DocRow + cols, mask=col_ok, other=-1)
        ok = ok & (doc_q[:, None] == doc_k[None, :])
    if HAS_WINDOW:
        ok = ok & (pos[:, None] - cols[None, :] < window)
    return ok


@triton.jit
def _load_block(ptrs, desc, b, hk, row0, col_ok, d_ok, FULL_TILE: tl.constexpr, USE_DESC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One [BLOCK_N, BLOCK_D] block of K or V: a TMA copy of rows row0.. (zero past the end), or a pointer load."""
    if USE_DESC:
        blk = desc.load([b.to(tl.int32), hk.to(tl.int32), tl.cast(row0, tl.int32), 0]).reshape(BLOCK_N, BLOCK_D)
    elif FULL_TILE:
        blk = tl.load(ptrs)
    else:
        blk = tl.load(ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    return blk


@triton.jit
def _update(q, k_ptrs, v_ptrs, ok, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, d_ok, col_ok,
            APPLY_MASK: tl.constexpr = True, FULL_TILE: tl.constexpr = False,
            k_desc=None, v_desc=None, b=0, hk=0, row0=0, USE_DESC: tl.constexpr = False):
    """One key block of the online softmax.

    ``FULL_TILE``: every key of the block exists and the head dim fills BLOCK_D, so the loads need
    no mask; and with ``APPLY_MASK`` off every row sees a finite score, so the max needs no -inf guard.
    ``USE_DESC``: the block is the contiguous rows ``row0..`` of K and V, copied by TMA."""
    BLOCK_N: tl.constexpr = k_ptrs.shape[0]
    BLOCK_D: tl.constexpr = k_ptrs.shape[1]
    k = _load_block(k_ptrs, k_desc, b, hk, row0, col_ok, d_ok, FULL_TILE, USE_DESC, BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if APPLY_MASK:
        s = tl.where(ok, s, float("-inf"))
    # qk_scale > 0, so scaling after the max keeps it exact and fuses into the exponent's FMA
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if APPLY_MASK or not FULL_TILE:
        # rows with nothing visible yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s * qk_scale - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_block(v_ptrs, v_desc, b, hk, row0, col_ok, d_ok, FULL_TILE, USE_DESC, BLOCK_N, BLOCK_D)
    # the rescaled accumulator goes into the MMA as its addend: no separate add of the product tile
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _step(cols, col_ok, q, m_i, l_i, acc, qk_scale, kv, prog, masks,
          HAS_KEY_MASK: tl.constexpr, HAS_DOC: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
          CAUSAL: tl.constexpr = True, APPLY_MASK: tl.constexpr = True, FULL_TILE: tl.constexpr = False,
          row0=0, USE_DESC: tl.constexpr = False):
    """Keys ``cols`` of one step (every walk's): the base rule's mask, then the online-softmax update.

    The grouped arguments (built once per program by ``_sparse_attn_fwd``):

    * ``kv``: ``(k_base, v_base, stride_k, stride_v, KDesc, VDesc)``: the (batch, kv head)'s K and V, their
      strides (batch, head, key, dim) and TMA descriptors (read only with ``USE_DESC``, from key ``row0``);
    * ``prog``: ``(b, hk, pos, d, d_ok, seq_k)``: the program's batch row, kv head, query positions, head-dim
      lanes and key count;
    * ``masks``: ``(KeyMask, stride_km, DocRow, doc_q, window)``, read as the ``HAS_*`` flags say."""
    k_base, v_base, stride_k, stride_v, KDesc, VDesc = kv
    b, hk, pos, d, d_ok, seq_k = prog
    ok = _visible(cols, pos, col_ok, b, masks, HAS_KEY_MASK, HAS_DOC, HAS_WINDOW, CAUSAL=CAUSAL)
    return _update(q, k_base + cols[:, None] * stride_k[2] + d[None, :] * stride_k[3],
                   v_base + cols[:, None] * stride_v[2] + d[None, :] * stride_v[3],
                   ok, m_i, l_i, acc, qk_scale, DOT_PRECISION, d_ok, col_ok, APPLY_MASK=APPLY_MASK,
                   FULL_TILE=FULL_TILE, k_desc=KDesc, v_desc=VDesc, b=b, hk=hk, row0=row0, USE_DESC=USE_DESC)


@triton.jit
def _contiguous_step(start, q, m_i, l_i, acc, qk_scale, kv, prog, masks, offs_n,
                     HAS_KEY_MASK: tl.constexpr, HAS_DOC: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, KV_DESC: tl.constexpr, CROSSING: tl.constexpr,
                     APPLY_MASK: tl.constexpr, FULL_TILE: tl.constexpr):
    """Keys ``start .. start + BLOCK_N - 1`` (one whole block, or one step of the dense walk): contiguous rows of
    K/V, so TMA can copy them when ``KV_DESC`` (zeros past either end). Unless ``CROSSING``, they lie inside the
    keys."""
    seq_k = prog[5]
    cols = start + offs_n
    if CROSSING:
        col_ok = (cols >= 0) & (cols < seq_k)
    else:
        col_ok = cols >= 0  # all true
    return _step(cols, col_ok, q, m_i, l_i, acc, qk_scale, kv, prog, masks, HAS_KEY_MASK, HAS_DOC, HAS_WINDOW,
                 DOT_PRECISION, CAUSAL=CROSSING, APPLY_MASK=APPLY_MASK, FULL_TILE=FULL_TILE, row0=start,
                 USE_DESC=KV_DESC)


@triton.jit
def _block_start(i, tiles, slot_ok=True):
    """First key of the block in slot i (scalar or vector) of a query tile's visits: listed (VS/BS), or
    enumerated for dense and A-shape (sink tiles from tile ``sink_first``, then the window's tiles).

    ``tiles``: ``(pattern, listed, block_list, sink_first, sink_tiles, win_first)``."""
    pattern, listed, block_list, sink_first, sink_tiles, win_first = tiles
    n = tl.where(i < sink_tiles, sink_first + i, win_first + i - sink_tiles)
    n = tl.where(pattern == DENSE, i, n)
    return tl.where(listed, tl.load(block_list + i, mask=tl.where(listed, slot_ok, False), other=0).to(tl.int32), n * TILE_KEYS)


@triton.jit
def _walk_tiles(first, stop, q, m_i, l_i, acc, qk_scale, tiles, kv, prog, masks, offs_n,
                HAS_KEY_MASK: tl.constexpr, HAS_DOC: tl.constexpr, HAS_WINDOW: tl.constexpr,
                DOT_PRECISION: tl.constexpr, TILE: tl.constexpr, KV_DESC: tl.constexpr,
                CROSSING: tl.constexpr, APPLY_MASK: tl.constexpr, FULL_TILE: tl.constexpr):
    """Visit slots ``first .. stop - 1`` of the query tile's key blocks.

    ``CROSSING``: the slots whose blocks may cross the diagonal, the end of the keys or key 0 (causal mask,
    bounds); the others lie wholly before the query rows and inside the keys. BLOCK_N == TILE walks a block a
    step (TMA copies when ``KV_DESC``); otherwise a step holds part of one block (BLOCK_N < TILE) or several
    listed blocks side by side (BLOCK_N > TILE: a gather, so no TMA), step v holding slots
    (v*BLOCK_N + offs_n) // TILE.

    ``tiles``: the query tile's visits (see ``_block_start``); ``kv``, ``prog``, ``masks``: as ``_step`` reads them."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    seq_k = prog[5]
    if BLOCK_N == TILE:
        # Each slot's start is read a step ahead, so a step's TMA coordinate is a value of the step before: read in
        # the step itself, it took a pipeline stage of its own, and 3 stages copied K/V one step ahead into two
        # buffers instead of two steps ahead into three (scripts/explore_list_prefetch.py)
        start = _block_start(first, tiles, first < stop)
        for i in range(first, stop):
            now = start
            start = _block_start(i + 1, tiles, i + 1 < stop)
            m_i, l_i, acc = _contiguous_step(now, q, m_i, l_i, acc, qk_scale, kv, prog, masks, offs_n,
                                             HAS_KEY_MASK, HAS_DOC, HAS_WINDOW, DOT_PRECISION, KV_DESC, CROSSING,
                                             APPLY_MASK, FULL_TILE)
    else:
        lo = first * TILE // BLOCK_N
        if CROSSING:
            hi = tl.cdiv(stop * TILE, BLOCK_N)
        else:
            hi = stop * TILE // BLOCK_N  # a step half clear, half crossing is walked with the crossing ones
        for v in range(lo, hi):
            at = v * BLOCK_N + offs_n
            if CROSSING:
                slot_ok = at // TILE < stop
                cols = _block_start(at // TILE, tiles, slot_ok) + at % TILE
                col_ok = slot_ok & (cols >= 0) & (cols < seq_k)
            else:
                cols = _block_start(at // TILE, tiles) + at % TILE
                col_ok = cols >= 0
            m_i, l_i, acc = _step(cols, col_ok, q, m_i, l_i, acc, qk_scale, kv, prog, masks, HAS_KEY_MASK, HAS_DOC,
                                  HAS_WINDOW, DOT_PRECISION, CAUSAL=CROSSING, APPLY_MASK=APPLY_MASK,
                                  FULL_TILE=FULL_TILE)
    return m_i, l_i, acc


@triton.jit
def _walk_keys(lo, hi, q, m_i, l_i, acc, qk_scale, kv, prog, masks, offs_n,
               HAS_KEY_MASK: tl.constexpr, HAS_DOC: tl.constexpr, HAS_WINDOW: tl.constexpr,
               DOT_PRECISION: tl.constexpr, KV_DESC: tl.constexpr, CROSSING: tl.constexpr, APPLY_MASK: tl.constexpr,
               FULL_TILE: tl.constexpr):
    """Keys ``lo .. hi - 1`` (multiples of BLOCK_N apart) in contiguous steps of BLOCK_N: the dense walk, which
    reads no list, so each step's K/V rows are known before the loop (TMA copies at any BLOCK_N when
    ``KV_DESC``) and the pipeline never waits on a list entry."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _contiguous_step(start, q, m_i, l_i, acc, qk_scale, kv, prog, masks, offs_n, HAS_KEY_MASK,
                                         HAS_DOC, HAS_WINDOW, DOT_PRECISION, KV_DESC, CROSSING, APPLY_MASK, FULL_TILE)
    return m_i, l_i, acc


# Lengths and offsets change with every prompt: specialising on them (==1, %16) would
# compile new variants as prompts vary. So do the index's and the masks' strides (query
# tiles, list capacities, key count), which are read a scalar or a row at a time anyway.
# Q/K/V/Out strides stay specialised (vectorised loads); a multiple of 16 for any length.
# They come as one tuple a tensor, (batch, head, row, dim). The unspecialised strides stay
# separate arguments: Triton specialises every int inside a tuple argument whatever
# do_not_specialize says (3.6 and 3.8 alike).
_UNSPECIALISED = ["num_heads", "group", "seq_q", "seq_k", "q_offset", "window", "stride_tc_bh", "stride_ti_bh",
                  "stride_ti_m", "stride_cc_bh", "stride_ci_bh", "stride_ci_m", "stride_km", "stride_doc", "stride_lb",
                  "stride_lh"]


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _sparse_attn_fwd(
    Q, K, V, Out, stride_q, stride_k, stride_v, stride_o,
    KDesc, VDesc,
    Index, stride_tc_bh, stride_ti_bh, stride_ti_m, stride_cc_bh, stride_ci_bh, stride_ci_m,
    Plan, ForceDense,
    KeyMask, stride_km, FirstKey, DocIds, stride_doc, Lse, stride_lb, stride_lh,
    num_heads, group, seq_q, seq_k, q_offset, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, HAS_DOC: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FORCE_MODE: tl.constexpr, KV_DESC: tl.constexpr, RETURN_LSE: tl.constexpr, ROWS_I64: tl.constexpr = False,
):
    """One program a query tile (BLOCK_M rows) and (batch, head) pair. ``Index``: the tables ``(BlockCount,
    BlockStart, ColCount, ColIndex)``, [B*H, M] and [B*H, M, cap]; ``Plan``: the per-head tables ``(Patterns, BudgetA,
    BudgetB)``."""
    # A head's programs differ in length: by the causal triangle, and in the sparse walk by the diagonals whose keys
    # exist only past the first rows. Launching each head's last query tile (its longest walk) first leaves short
    # programs for the last wave: on the scattered family at 128K this cut the sparse walk by 9 %
    # (scripts/explore_launch_order.py)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # (b, h) offsets pass 2^31 elements at 1M tokens x 32 heads
    BlockCount, BlockStart, ColCount, ColIndex = Index
    Patterns, BudgetA, BudgetB = Plan
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_q
    pos = q_offset + rows
    pos_lo = q_offset + pid_m * BLOCK_M
    pos_hi = q_offset + tl.minimum(pid_m * BLOCK_M + BLOCK_M, seq_q) - 1
    # The index lists keys per query tile of TILE rows; a program of BLOCK_M < TILE rows reads the
    # lists of the tile holding its rows (tiles past its own diagonal are then fully masked).
    # A-shape windows are defined per query tile too, so they start from the tile's first row.
    # (BLOCK_M > TILE only runs forced-dense heads, which read no list.)
    if BLOCK_M == TILE:
        m_list = pid_m
        list_lo = pos_lo
        list_hi = pos_hi
    else:
        m_list = pid_m * BLOCK_M // TILE
        list_lo = q_offset + m_list * TILE
        list_hi = q_offset + tl.minimum(m_list * TILE + TILE, seq_q) - 1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    pattern = tl.load(Patterns + h)
    if FORCE_MODE != 0:  # this call runs the (batch, head) dense: the quality guard or a near-dense index
        forced = tl.load(ForceDense + pid_bh) != 0
        if FORCE_MODE == FORCE_HERE:
            pattern = tl.where(forced, DENSE, pattern)
        elif FORCE_MODE == FORCE_SKIP:
            pattern = tl.where(forced, SKIP, pattern)
        else:
            pattern = tl.where(forced & (pattern != SKIP), DENSE, SKIP)
    runs = pattern != SKIP
    # keys before the row's first one the key mask keeps are hidden from every query: a left-padded row's
    # padding query tiles read nothing (they end as 0, as the mask says), and the dense walk starts past them
    first_key = 0
    if HAS_KEY_MASK:
        first_key = tl.load(FirstKey + b)
    sees_keys = pos_hi >= first_key
    # A row's offset in its (batch, head), row x stride(2) + column x stride(3), is int32 unless ROWS_I64: HF's
    # [B, S, H, D].transpose(1, 2) views (stride(2) = H x D) pass 2**31 from 2**31 / (H x D) rows on, 512K tokens for
    # H x D = 4096. Only such launches pay for int64 addresses, which follow from the widened strides (tl.cast, since a
    # stride of 1 arrives as a constant)
    if ROWS_I64:
        stride_q = (stride_q[0], stride_q[1], tl.cast(stride_q[2], tl.int64), tl.cast(stride_q[3], tl.int64))
        stride_k = (stride_k[0], stride_k[1], tl.cast(stride_k[2], tl.int64), tl.cast(stride_k[3], tl.int64))
        stride_v = (stride_v[0], stride_v[1], tl.cast(stride_v[2], tl.int64), tl.cast(stride_v[3], tl.int64))
        stride_o = (stride_o[0], stride_o[1], tl.cast(stride_o[2], tl.int64), tl.cast(stride_o[3], tl.int64))
    # load q: it stays in SRAM throughout (a skipped program reads and writes nothing). A scalar condition joins a
    # vector mask through tl.where: Triton 3.9's interpreter turns `vector & scalar` into an int32 mask and refuses it
    q = tl.load(Q + b * stride_q[0] + h * stride_q[1] + rows[:, None] * stride_q[2] + d[None, :] * stride_q[3],
                mask=tl.where(runs, row_ok, False)[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * stride_k[0] + hk * stride_k[1]
    # the query rows' documents hold for the whole program; rows past the queries read no id
    doc_row = DocIds + b * stride_doc
    doc_q = pos
    if HAS_DOC:
        doc_q = tl.load(doc_row + pos, mask=row_ok, other=-2)
    v_base = V + b * stride_v[0] + hk * stride_v[1]
    kv = (k_base, v_base, stride_k, stride_v, KDesc, VDesc)
    prog = (b, hk, pos, d, d_ok, seq_k)
    masks = (KeyMask, stride_km, doc_row, doc_q, window)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    EXTRA_MASKS: tl.constexpr = HAS_KEY_MASK or HAS_DOC or HAS_WINDOW
    if FORCE_MODE == FORCE_ONLY:
        # -- the dense walk: keys 0 .. the diagonal (from the window's start with one), no list; steps wholly
        # before the first row and inside the keys need no causal mask
        key_end = tl.where(runs & sees_keys, tl.minimum(pos_hi + 1, seq_k), 0)
        clear_end = tl.minimum(pos_lo + 1, key_end) // BLOCK_N * BLOCK_N
        key_lo = first_key // BLOCK_N * BLOCK_N
        if HAS_WINDOW:  # keys at or before pos_lo - window are out of every row's window
            key_lo = tl.maximum(tl.maximum(pos_lo - window + 1, 0) // BLOCK_N * BLOCK_N, key_lo)
        m_i, l_i, acc = _walk_keys(key_lo, clear_end, q, m_i, l_i, acc, qk_scale, kv, prog, masks, offs_n,
                                   HAS_KEY_MASK, HAS_DOC, HAS_WINDOW, DOT_PRECISION, KV_DESC, CROSSING=False,
                                   APPLY_MASK=EXTRA_MASKS, FULL_TILE=HEAD_DIM == BLOCK_D)
        m_i, l_i, acc = _walk_keys(tl.maximum(clear_end, key_lo), key_end, q, m_i, l_i, acc, qk_scale, kv, prog, masks,
                                   offs_n, HAS_KEY_MASK, HAS_DOC, HAS_WINDOW, DOT_PRECISION, KV_DESC, CROSSING=True,
                                   APPLY_MASK=True, FULL_TILE=False)
    else:
        # -- stage 1: key tiles (TILE keys each), listed or enumerated from the pattern
        last_tile = tl.minimum(pos_hi, seq_k - 1) // TILE
        listed = (pattern == VERTICAL_SLASH) | (pattern == BLOCK_SPARSE)
        sink_budget = tl.load(BudgetA + h)
        sink_tiles = tl.cdiv(sink_budget, TILE)
        win_lo = tl.maximum(list_lo - tl.load(BudgetB + h) + 1, 0)
        # rows past the last key (q_offset + Sq > Skv) may have a window wholly past it: then it holds no tile, and
        # the sinks stop at the last key tile too (they are walked unmasked)
        win_first = tl.where(win_lo < seq_k, win_lo // TILE, tl.cdiv(seq_k, TILE))
        sink_first = 0
        if HAS_KEY_MASK:
            # a left-padded row's sinks are its own first keys: from the tile of the first key the mask keeps.
            # Only here: the same arithmetic without a mask tipped ptxas into serialising the wgmma pipeline
            # (240 registers, not 222; the sparse walk 14% slower at 128K)
            sink_first = first_key // TILE
            sink_tiles = tl.where(sink_budget > 0, tl.cdiv(first_key % TILE + sink_budget, TILE), 0)
            sink_tiles = tl.maximum(tl.minimum(sink_tiles, win_first - sink_first), 0)
        else:
            sink_tiles = tl.minimum(sink_tiles, win_first)
        n_tiles = last_tile + 1  # dense
        if pattern == A_SHAPE:
            n_tiles = sink_tiles + tl.maximum(last_tile - win_first + 1, 0)
        if listed:
            n_tiles = tl.load(BlockCount + pid_bh * stride_tc_bh + m_list)
        n_tiles = tl.where(runs & sees_keys, n_tiles, 0)
        block_list = BlockStart + pid_bh * stride_ti_bh + m_list * stride_ti_m
        # Blocks come in ascending order, and only those from `first_crossing` on can cross the diagonal
        # or the end of the keys: at most last_tile - first_crossing + 1 of them, at the end of the list.
        # The ones before need no causal mask (issue: mask only where a tile crosses the diagonal).
        first_crossing = tl.minimum(pos_lo + 1, seq_k) // TILE
        crossing_last = last_tile
        if BLOCK_M != TILE:
            crossing_last = tl.where(listed, tl.minimum(list_hi, seq_k - 1) // TILE, last_tile)
        n_crossing = tl.maximum(crossing_last - first_crossing + 1, 0)
        # Diagonal blocks lie 64 apart, so one at most crosses the diagonal or the end of the keys (the
        # highest); one at most starts before key 0, and the index lists it after all the others
        diagonal = pattern == VERTICAL_SLASH
        last_start = tl.load(block_list + tl.maximum(n_tiles - 1, 0), mask=diagonal & (n_tiles > 0), other=0)
        n_crossing = tl.where(diagonal, tl.maximum(n_crossing, 1) + (last_start < 0).to(tl.int32), n_crossing)
        n_clear = tl.maximum(n_tiles - n_crossing, 0)
        tiles = (pattern, listed, block_list, sink_first, sink_tiles, win_first)
        m_i, l_i, acc = _walk_tiles(0, n_clear, q, m_i, l_i, acc, qk_scale, tiles, kv, prog, masks, offs_n,
                                    HAS_KEY_MASK, HAS_DOC, HAS_WINDOW, DOT_PRECISION, TILE, KV_DESC,
                                    CROSSING=False, APPLY_MASK=EXTRA_MASKS, FULL_TILE=HEAD_DIM == BLOCK_D)
        m_i, l_i, acc = _walk_tiles(n_clear, n_tiles, q, m_i, l_i, acc, qk_scale, tiles, kv, prog, masks, offs_n,
                                    HAS_KEY_MASK, HAS_DOC, HAS_WINDOW, DOT_PRECISION, TILE, KV_DESC,
                                    CROSSING=True, APPLY_MASK=True, FULL_TILE=False)

        # -- stage 2: leftover columns (vertical-slash only), BLOCK_N at a time
        n_cols = tl.load(ColCount + pid_bh * stride_cc_bh + m_list)
        n_cols = tl.where((pattern == DENSE) | (pattern == SKIP) | ~sees_keys, 0, n_cols)  # dense covers every column
        col_list = ColIndex + pid_bh * stride_ci_bh + m_list * stride_ci_m
        for c0 in range(0, n_cols, BLOCK_N):
            slot_ok = c0 + offs_n < n_cols
            cols = tl.load(col_list + c0 + offs_n, mask=slot_ok, other=0)
            col_ok = slot_ok & (cols >= 0) & (cols < seq_k)
            m_i, l_i, acc = _step(cols, col_ok, q, m_i, l_i, acc, qk_scale, kv, prog, masks, HAS_KEY_MASK, HAS_DOC,
                                  HAS_WINDOW, DOT_PRECISION)

    # epilogue: rows that saw no key are 0, not 0/0
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * stride_o[0] + h * stride_o[1] + rows[:, None] * stride_o[2] + d[None, :] * stride_o[3],
             out.to(Out.dtype.element_ty), mask=tl.where(runs, row_ok, False)[:, None] & d_ok[None, :])
    if RETURN_LSE:
        # m and l live in base 2 with the scale folded in: ln sum exp(scale * s) = ln2 * (m + log2 l)
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(Lse + b * stride_lb + h * stride_lh + rows, lse, mask=tl.where(runs, row_ok, False))



def empty_index(batch: int, heads: int, m_tiles: int, device) -> SparseIndex:
    """An index with nothing listed: for plans of only dense / A-shape heads."""
    zeros = torch.zeros(batch, heads, m_tiles, dtype=torch.int32, device=device)
    no_block = torch.full((batch, heads, m_tiles, 1), NO_BLOCK, dtype=torch.int32, device=device)
    no_column = torch.full((batch, heads, m_tiles, 1), -1, dtype=torch.int32, device=device)
    return SparseIndex(zeros, no_block, zeros, no_column)


def _tma_ok(t: torch.Tensor, block_d: int) -> bool:
    """Whether TMA can copy [block_n, block_d] tiles of ``t`` ``[B, H, S, D]``: sm90+, 16-byte aligned
    base and strides, contiguous head dim (a descriptor's block may run past D: it reads zeros)."""
    if t.stride(-1) != 1 or not _compiles_for_hopper(t):
        return False
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1]) and block_d * size >= 16


def _compiles_for_hopper(t: torch.Tensor) -> bool:
    """Whether a launch on ``t`` compiles for sm90 or later, or runs under the interpreter (which copies descriptor
    tiles too, so CPU tests cover the TMA path)."""
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device)[0] >= 9
    if triton.knobs.runtime.interpret:
        return True
    # CPU tensors compile only under a stand-in driver (kernels.codegen.simulated_gpu): as its target would
    target = driver.active.get_current_target()
    return target.backend == "cuda" and target.arch >= 90


def rows_need_int64(*tensors: torch.Tensor) -> bool:
    """Whether a row's offset within a (batch, head), row x stride(2) + column x stride(3), reaches 2**31 in any of
    ``tensors`` ([B, H, S, D]), past what the kernel's default int32 row arithmetic addresses. Shapes only: no copy."""
    return any((t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3) >= 2**31 for t in tensors if t.numel())


def empty_output(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``q``'s shape ``[B, H, S, D]`` and dtype laid out token-major (memory
    ``[B, S, H, D]``), as the fused SDPA kernels lay out theirs: the ``transpose(1, 2)`` and reshape a model applies
    to attention's output are then views. The op's output has this layout on every path."""
    B, H, S, D = q.shape
    return torch.empty(B, S, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)


def is_output_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` ``[B, H, S, D]`` has exactly :func:`empty_output`'s strides."""
    B, H, S, D = t.shape
    # torch's contiguous strides of [B, S, H, D], which count an empty dim as 1
    head = max(D, 1)
    row = head * max(H, 1)
    return t.stride() == (row * max(S, 1), head, row, 1)


def writes_each_element_once(t: torch.Tensor) -> bool:
    """Whether every index of ``t`` names its own element, with no gaps: a permutation of a contiguous layout
    (``torch.empty_like`` keeps such a layout). The kernel stores through any strides; overlapping ones would
    race, and a gap would leave memory the caller may read as output untouched."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def as_output(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`empty_output`'s layout: itself when it has it, else a copy."""
    return t if is_output_layout(t) else empty_output(t).copy_(t)


def sparse_attention_triton(
    q, k, v, index: SparseIndex, patterns, budget_a, budget_b, *, scale, key_mask=None, doc_ids=None,
    q_offset=0, window=0, force_dense=None, forced="here", out=None, num_warps=4, num_stages=2, block_m=BLOCK,
    block_n=BLOCK, kv_desc=True, return_lse=False, int64_rows=None,
):
    """Run the sparse kernel over ``index`` (dense and A-shape heads need no entries in it).

    Parameters
    ----------
    q : ``[B, Hq, Sq, D]``; k, v : ``[B, Hkv, Skv, D]``; any strides, fp16/bf16 (fp32 too).
    index : :class:`SparseIndex` with ``M = ceil(Sq / BLOCK)`` query tiles.
    patterns, budget_a, budget_b : the plan as int lists (see :mod:`minference_fx.plan`); a pattern of
        ``SKIP_CODE`` leaves the head's rows of ``out`` as they were (another kernel writes them).
    key_mask : optional bool ``[B, Skv]``; doc_ids : optional int ``[B, S >= Skv]``.
    force_dense : optional bool ``[B, Hq]``: (batch, head) pairs to run dense this call; ``forced`` says
        where: ``"here"`` in this launch, ``"skip"`` not in this launch (their rows are left as they were),
        ``"only"`` nothing else (the other rows are left as they were). A "skip" and an "only" launch into
        one ``out`` run every pair once.
    out : optional ``[B, Hq, Sq, D]`` tensor of q's dtype to write into, its dims in any memory order (else a new
        one, laid out as :func:`empty_output`).
    num_warps, num_stages, block_m, block_n : launch config (speed only). ``block_m`` query rows per
        program: 16, 32 or 64 (a part of one of the index's 64-row query tiles), or 128 with
        ``forced="only"`` (dense heads read no list); ``block_n`` keys per step: 32, 64 or 128 (two
        listed tiles gathered side by side).
    kv_desc : read K/V tiles by TMA (Hopper+; ``block_n == 64``, or any ``block_n`` with ``forced="only"``);
        falls back to pointer loads where the layout does not allow it.
    return_lse : also return the natural-log sum of exp(scale * q·k) over the keys each row read,
        fp32 ``[B, Hq, Sq]`` (``-inf`` for a row that read none), e.g. to merge with other attention.
    int64_rows : address rows in int64; ``None``: where q, k, v or ``out`` needs it (:func:`rows_need_int64`), as
        HF's transposed views do past about 2**31 / (heads x head dim) rows. Speed only, never the result.

    Returns
    -------
    ``[B, Hq, Sq, D]``, dtype of q, ``out`` or laid out as :func:`empty_output`; with ``return_lse``, ``(out, lse)``.
    """
    B, Hq, sq, D = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    if forced not in FORCE_MODES or forced is None:
        raise ValueError(f"forced must be 'here', 'skip' or 'only', got {forced!r}")
    if out is None:
        out = empty_output(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not writes_each_element_once(out):
        raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)} in which each index names its "
                         f"own element (any order of its dims, no overlap), got {out.dtype} {tuple(out.shape)} with "
                         f"strides {out.stride()}")
    lse = torch.empty(B, Hq, sq, dtype=torch.float32, device=q.device) if return_lse else None
    if sq == 0:
        return (out, lse) if return_lse else out
    pat_t, a_t, b_t = (int_table(xs, q.device) for xs in (patterns, budget_a, budget_b))
    ti = index.block_start.reshape(B * Hq, index.block_start.shape[2], -1)
    ci = index.col_index.reshape(B * Hq, index.col_index.shape[2], -1)
    tc = index.block_count.reshape(B * Hq, -1)
    cc = index.col_count.reshape(B * Hq, -1)
    key_mask, doc_ids = rows_per_batch(key_mask, B), rows_per_batch(doc_ids, B)
    km = key_mask if key_mask is not None else q  # any pointer; unused when HAS_KEY_MASK is False
    # per row, the first key the mask keeps (0 when it keeps none: the mask alone then hides every key);
    # a byte view of the bool mask, so no copy of it
    first_key = pat_t
    if key_mask is not None:
        first_key = first_kept_keys(key_mask, q.device).to(torch.int32).expand(B).contiguous()
    doc = doc_ids if doc_ids is not None else q
    if block_n not in (32, 64, 128):
        raise ValueError(f"block_n must be 32, 64 or 128, got {block_n}")
    dense_only = force_dense is not None and forced == "only"
    if block_m not in ((16, 32, 64, 128) if dense_only else (16, 32, 64)):
        raise ValueError(f"block_m must be 16, 32 or 64 (or 128 for a launch of forced-dense heads only, "
                         f"forced='only'), got {block_m}")
    block_d = triton.next_power_of_2(D)
    lse_t = lse if return_lse else q  # any pointer; unused without RETURN_LSE
    rows_i64 = rows_need_int64(q, k, v, out) if int64_rows is None else bool(int64_rows)

    def run(config):
        bm, bn, warps, stages = config
        # the sparse walk's 128-key steps gather two listed tiles (no TMA); the dense walk's are contiguous
        use_desc = kv_desc and (bn == BLOCK or dense_only) and _tma_ok(k, block_d) and _tma_ok(v, block_d)
        if use_desc:
            k_desc, v_desc = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bn, block_d]) for t in (k, v))
        else:
            k_desc = v_desc = q  # unused
        _sparse_attn_fwd[(triton.cdiv(sq, bm), B * Hq)](
            q, k, v, out, q.stride(), k.stride(), v.stride(), out.stride(),
            k_desc, v_desc,
            (tc, ti, cc, ci), tc.stride(0), ti.stride(0), ti.stride(1), cc.stride(0), ci.stride(0), ci.stride(1),
            (pat_t, a_t, b_t), force_dense.to(torch.int32).contiguous() if force_dense is not None else pat_t,
            km, km.stride(0) if key_mask is not None else 0, first_key, doc, doc.stride(0) if doc_ids is not None else 0,
            lse_t, Hq * sq if return_lse else 0, sq if return_lse else 0,
            Hq, Hq // Hkv, sq, skv, q_offset, window, scale * LOG2E,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, TILE=BLOCK,
            HAS_KEY_MASK=key_mask is not None, HAS_DOC=doc_ids is not None, HAS_WINDOW=window > 0,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FORCE_MODE=FORCE_MODES[forced if force_dense is not None else None],
            KV_DESC=use_desc, RETURN_LSE=return_lse, ROWS_I64=rows_i64,
            num_warps=warps, num_stages=stages, **fit.COMPILE_OPTIONS,
        )

    # a config tuned on Hopper may need more shared memory than another GPU gives a block: smaller ones follow
    ladder = fit.attention_ladder(block_m, block_n, num_warps, num_stages,
                                  rows=(16, 32, 64, 128) if dense_only else (16, 32, 64), keys=(32, 64, 128))
    specialised = (q.device, q.dtype, k.dtype, block_d, dense_only, key_mask is not None, doc_ids is not None,
                   window > 0, return_lse, rows_i64)
    fit.launch("attention", specialised, ladder, run)
    return (out, lse) if return_lse else out
