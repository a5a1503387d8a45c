"""On-device builder of the sparse index (the GPU twin of ``reference.build_index``).

It produces the same key tiles and leftover columns as the reference for
VERTICAL_SLASH and BLOCK_SPARSE heads; DENSE and A_SHAPE heads get empty lists
because the attention kernel enumerates their tiles from positions alone.

Everything runs on the device of ``q`` with sizes fixed by shapes and the plan,
never by tensor values, so the whole build can be captured in a CUDA graph:
no ``.item()``, no ``nonzero``, no boolean indexing, no host-to-device copy
(even the small per-head tables are written by device kernels).

Top-k ties
----------
The reference ranks with a stable descending sort: equal scores go to the
lower index, and so do forced picks (+inf) among themselves.

* Vertical-slash: ``torch.topk`` promises no tie order, so it ranks an int64
  key ``(order-preserving bits of the fp32 score) << 32 | (2**32 - 1 - index)``.
  All keys are distinct and ordered exactly by (score desc, index asc), which
  reproduces the forced picks (+inf itself) and also the exact ties that occur
  in practice: zero-probability columns of padding, or of keys outside a window.
* Block-sparse: forced tiles get distinct finite scores above any real one,
  decreasing with the tile number, and the top-k runs on fp32 (the int64 key
  doubled the cost of the heaviest step at 1M tokens). Two real pooled scores
  that are exactly equal may be picked in another order than the reference's.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# absolute imports, so that a saved older copy loads outside the package (scripts/explore_kernels.py --old-index)
from minference_fx.kernels.reference import (
    check_index_inputs,
    diagonal_block_bound,
    BLOCK,
    VS_FORCED_COLUMNS,
    VS_FORCED_DIAGONALS,
    VS_LAST_Q,
    VS_MIN_COLUMNS,
    VS_MIN_DIAGONALS,
    NO_BLOCK,
    SparseIndex,
    first_kept_keys,
)
from minference_fx.kernels import fit
from minference_fx.kernels.tables import int_table
from minference_fx.plan import LayerPlan, Pattern

__all__ = ["build_index_gpu", "build_index_pair_gpu", "build_index_escalated_gpu", "vs_estimate", "index_capacity",
           "index_start_dtype", "index_bytes"]

# Keys per program of the row-statistics pass: long prompts get many programs,
# short ones one per head.
_STATS_CHUNK = 1024
# Triton's default pipeline depth, which the row statistics were tuned with on Hopper
_STATS_STAGES = 3
# Keys a loop step of the row statistics: 128 took 13.7 ms against 14.1 for 64 (the index at 1M on an H100), with the
# same picks; 64 remains where 128 does not fit the device's shared memory
_STATS_STEPS = (128, 64)
_KEY_BLOCK = 64
_TILE_VEC = 256
_COL_VEC = 128
_KEY_VEC = 1024
# Elements of one block-sparse score chunk [B*heads, query tiles, key tiles]:
# about 128 MB of fp32 scores plus top-k scratch, whatever the length.
_BS_CHUNK_ELEMS = 1 << 25
# Above any real pooled score, and 1/N apart stays distinct in fp32 for N < 2**22 key tiles.
_FORCED_SCORE = 1e30


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)




@triton.jit(do_not_specialize=["total", "skv", "per_batch"])
def _rank_keys_kernel(VERT, SLASH_PARTS, KEY_V, KEY_S, FirstKey, total, skv, per_batch, forced_cols, forced_diags,
                      HAS_KEY_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """int64 top-k keys of the vertical and slash scores: descending order is (score desc, index asc).

    Scores that are not > 0 (+0, -0, NaN from inf inputs) rank as +0; the forced columns (from the batch
    row's first kept key: ``FirstKey``, ``per_batch`` scores a row) / diagonals rank as +inf. Every key is
    then >= +0, whose fp32 bits order like the values, and the low word ``2**32 - 1 - j`` makes ties go to
    the lower index, as the reference's stable sort does."""
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = off < total
    j = off % skv
    v = tl.load(VERT + off, mask=ok, other=0.0)
    s = tl.load(SLASH_PARTS + off, mask=ok, other=0.0) + tl.load(SLASH_PARTS + total + off, mask=ok, other=0.0)
    forced = j < forced_cols
    if HAS_KEY_MASK:  # a left-padded row's sinks: from its first kept key
        first = tl.load(FirstKey + off // per_batch, mask=ok, other=0)
        forced = (j >= first) & (j < first + forced_cols)
    v = tl.where(forced, float("inf"), tl.where(v > 0, v, 0.0))
    s = tl.where(j < forced_diags, float("inf"), tl.where(s > 0, s, 0.0))
    low = tl.full([BLOCK], 4294967295, tl.int64) - j
    tl.store(KEY_V + off, (v.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low, mask=ok)
    tl.store(KEY_S + off, (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low, mask=ok)


# --------------------------------------------------------------------------- vertical-slash estimate


@triton.jit
def _vs_scores_block(q, K_base, KM_b, DOC_b, doc_row, pos, row_ok, j, stride_k, skv, head_dim, window, scale,
                     HAS_KM: tl.constexpr, HAS_DOC: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_D: tl.constexpr):
    """Scaled scores [ROWS, BLOCK_N] of the estimate rows against keys ``j`` and where the base mask allows them.

    ``stride_k``: K's strides (batch, head, key, dim)."""
    d = tl.arange(0, BLOCK_D)
    key_ok = j < skv
    kt = tl.load(K_base + j.to(tl.int64)[None, :] * stride_k[2] + d[:, None] * stride_k[3],
                 mask=key_ok[None, :] & (d[:, None] < head_dim), other=0.0)
    if DOT_F32:
        # fp32 inputs must not drop to tf32; mixed or bf16-on-CPU inputs go through fp32
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * scale
    allowed = row_ok[:, None] & key_ok[None, :] & (j[None, :] <= pos[:, None])
    allowed = allowed & ((window == 0) | (pos[:, None] - j[None, :] < window))
    if HAS_KM:
        km = tl.load(KM_b + j, mask=key_ok, other=0)
        allowed = allowed & (km != 0)[None, :]
    if HAS_DOC:
        dk = tl.load(DOC_b + j, mask=key_ok, other=0)
        allowed = allowed & (dk[None, :] == doc_row[:, None])
    return s, allowed


@triton.jit
def _vs_load_rows(Q, KM, DOC, HEADS, slot_row, n_vs, group, stride_q, stride_k, skmb, sdb,
                  sq, last_q, q_offset, head_dim,
                  HAS_DOC: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The estimate rows of one (batch, head): q [ROWS, BLOCK_D], positions, validity, doc ids, base pointers.

    ``stride_q``, ``stride_k``: Q's and K's strides (batch, head, row, dim)."""
    b = slot_row // n_vs
    h = tl.load(HEADS + slot_row % n_vs)
    kvh = h // group
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    row_ok = r < last_q
    qrow = sq - last_q + r
    pos = q_offset + qrow
    q_base = Q + b.to(tl.int64) * stride_q[0] + h.to(tl.int64) * stride_q[1]
    q = tl.load(q_base + qrow.to(tl.int64)[:, None] * stride_q[2] + d[None, :] * stride_q[3],
                mask=row_ok[:, None] & (d[None, :] < head_dim), other=0.0)
    K_base = b.to(tl.int64) * stride_k[0] + kvh.to(tl.int64) * stride_k[1]
    KM_b = KM + b.to(tl.int64) * skmb
    DOC_b = DOC + b.to(tl.int64) * sdb
    if HAS_DOC:
        doc_row = tl.load(DOC_b + pos, mask=row_ok, other=0)
    else:
        doc_row = pos
    return q, pos, row_ok, K_base, KM_b, DOC_b, doc_row


@triton.jit(do_not_specialize=["n_vs", "group", "sq", "skv", "last_q", "q_offset", "window", "n_chunks"])
def _vs_row_stats_kernel(
    Q, K, KM, DOC, HEADS, M_OUT, L_OUT,
    stride_q, stride_k, skmb, sdb,
    n_vs, group, sq, skv, last_q, q_offset, window, scale, n_chunks, head_dim,
    HAS_KM: tl.constexpr, HAS_DOC: tl.constexpr, DOT_F32: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """Per estimate row, max and sum of exp(score - max) over one chunk of keys."""
    chunk = tl.program_id(0)
    slot_row = tl.program_id(1)
    q, pos, row_ok, K_off, KM_b, DOC_b, doc_row = _vs_load_rows(
        Q, KM, DOC, HEADS, slot_row, n_vs, group, stride_q, stride_k, skmb, sdb,
        sq, last_q, q_offset, head_dim, HAS_DOC, ROWS, BLOCK_D)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    start = chunk * CHUNK
    # keys after the last estimate row are never allowed: skip them
    stop = tl.minimum(tl.minimum(start + CHUNK, skv), q_offset + sq)
    for j0 in tl.range(start, stop, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        s, allowed = _vs_scores_block(q, K + K_off, KM_b, DOC_b, doc_row, pos, row_ok, j, stride_k, skv, head_dim,
                                      window, scale, HAS_KM, HAS_DOC, DOT_F32, BLOCK_D)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing allowed so far keeps max -inf; subtract 0 instead so exp gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_sub) + tl.sum(tl.exp(s - m_sub[:, None]), 1)
        m_i = m_new
    out = (slot_row.to(tl.int64) * n_chunks + chunk) * ROWS + tl.arange(0, ROWS)
    tl.store(M_OUT + out, m_i)
    tl.store(L_OUT + out, l_i)


@triton.jit(do_not_specialize=["n_vs", "group", "sq", "skv", "last_q", "q_offset", "window"])
def _vs_colsum_kernel(
    Q, K, KM, DOC, HEADS, ROW_MAX, ROW_SUM, VERT, SLASH,
    stride_q, stride_k, skmb, sdb,
    n_vs, group, sq, skv, last_q, q_offset, window, scale, head_dim,
    HAS_KM: tl.constexpr, HAS_DOC: tl.constexpr, DOT_F32: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Softmax probabilities of one key block: its column sums and its share of the diagonal sums."""
    tl.static_assert(ROWS == BLOCK_N, "the diagonal gather pairs estimate rows with key columns")
    kblk = tl.program_id(0)
    slot_row = tl.program_id(1)
    q, pos, row_ok, K_off, KM_b, DOC_b, doc_row = _vs_load_rows(
        Q, KM, DOC, HEADS, slot_row, n_vs, group, stride_q, stride_k, skmb, sdb,
        sq, last_q, q_offset, head_dim, HAS_DOC, ROWS, BLOCK_D)
    r = tl.arange(0, ROWS)
    row_max = tl.load(ROW_MAX + slot_row.to(tl.int64) * ROWS + r)
    row_sum = tl.load(ROW_SUM + slot_row.to(tl.int64) * ROWS + r)
    j = kblk * BLOCK_N + tl.arange(0, BLOCK_N)
    s, allowed = _vs_scores_block(q, K + K_off, KM_b, DOC_b, doc_row, pos, row_ok, j, stride_k, skv, head_dim,
                                  window, scale, HAS_KM, HAS_DOC, DOT_F32, BLOCK_D)
    # same arithmetic as the reference's masked softmax: exp(s - max) / total
    p = tl.where(allowed, tl.exp(s - row_max[:, None]) / row_sum[:, None], 0.0)
    out = slot_row.to(tl.int64) * skv
    tl.store(VERT + out + j, tl.sum(p, 0), mask=j < skv)
    # Diagonal sums without atomics. Rows sit at consecutive positions, so element (r, c) lies on
    # diagonal d0 + (r - c), d0 = pos[0] - j[0]. Diagonals d0..d0+63 (r >= c) are summed by this key
    # block alone and go to LOWER; d0-63..d0-1 (r < c) likewise to UPPER: the key blocks split both
    # ranges without overlap, so each slot is written once and slash = LOWER + UPPER.
    # One gather serves both: column u of rotated[r, u] = p[r, (r - u) mod 64] holds diagonal d0 + u in
    # its rows r >= u and diagonal d0 + u - 64 in its rows r < u (a gather is the costly step here).
    c = tl.arange(0, BLOCK_N)
    rotated = tl.gather(p, (r[:, None] - c[None, :] + BLOCK_N) % BLOCK_N, 1)
    on_lower = r[:, None] >= c[None, :]
    lower = tl.sum(tl.where(on_lower, rotated, 0.0), 0)
    upper = tl.sum(tl.where(on_lower, 0.0, rotated), 0)
    d0 = q_offset + sq - last_q - kblk * BLOCK_N
    # a diagonal below 0 holds nothing; one at skv or more (a position past the keys) the reference drops
    d_lo = d0 + c
    tl.store(SLASH + out + d_lo, lower, mask=(d_lo >= 0) & (d_lo < skv))
    d_up = d0 + c - BLOCK_N
    tl.store(SLASH + tl.num_programs(1).to(tl.int64) * skv + out + d_up, upper, mask=(c > 0) & (d_up >= 0) & (d_up < skv))


@triton.jit(do_not_specialize=["n_chunks"])
def _vs_row_reduce_kernel(M_PART, L_PART, ROW_MAX, ROW_SUM, n_chunks, ROWS: tl.constexpr):
    """Combine the per-chunk (max, sum) of each estimate row: the max (0 if no key was allowed) and the
    sum of exp(score - max) (1 if nothing was allowed, so the probabilities come out 0, not NaN)."""
    slot_row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, ROWS)
    base = slot_row * n_chunks * ROWS
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for c in range(0, n_chunks):
        m = tl.maximum(m, tl.load(M_PART + base + c * ROWS + r))
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([ROWS], tl.float32)
    for c in range(0, n_chunks):
        total += tl.load(L_PART + base + c * ROWS + r) * tl.exp(tl.load(M_PART + base + c * ROWS + r) - m)
    tl.store(ROW_MAX + slot_row * ROWS + r, m)
    tl.store(ROW_SUM + slot_row * ROWS + r, tl.where(total > 0, total, 1.0))


def _mask_args(key_mask, doc_ids, B: int, skv: int, sq: int, q_offset: int, dummy: torch.Tensor):
    """(key-mask tensor, its batch stride, doc tensor, its batch stride) for the kernels."""
    dev = dummy.device
    if key_mask is not None:
        if key_mask.dim() != 2 or key_mask.shape[-1] != skv or key_mask.shape[0] not in (1, B):
            raise ValueError(f"key_mask must be [B or 1, {skv}], got {list(key_mask.shape)}")
        km = key_mask.to(device=dev, dtype=torch.bool).to(torch.int8).contiguous()
        kmb = km.stride(0) if km.shape[0] == B and B > 1 else 0
    else:
        km, kmb = dummy, 0
    if doc_ids is not None:
        if doc_ids.dim() != 2 or doc_ids.shape[-1] != skv or doc_ids.shape[0] not in (1, B):
            raise ValueError(f"doc_ids must be [B or 1, {skv}], got {list(doc_ids.shape)}")
        if sq and (q_offset < 0 or q_offset + sq > skv):
            raise ValueError(f"doc_ids needs every query position in [0, {skv}), got [{q_offset}, {q_offset + sq - 1}]")
        dt = doc_ids.dtype if doc_ids.dtype in (torch.int32, torch.int64) else torch.int64
        doc = doc_ids.to(device=dev, dtype=dt).contiguous()
        docb = doc.stride(0) if doc.shape[0] == B and B > 1 else 0
    else:
        doc, docb = dummy, 0
    return km, kmb, doc, docb


def _vs_scores(q, k, heads: torch.Tensor, n_vs: int, *, scale, key_mask, doc_ids, q_offset, window):
    """Raw vertical scores ``[B, n_vs, Skv]`` fp32 of the query heads listed in ``heads``, and their
    slash scores as two halves ``[2, B, n_vs, Skv]`` whose sum is the score."""
    B, Hq, sq, D = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    dev = q.device
    rows = B * n_vs
    vertical = torch.zeros(rows, skv, dtype=torch.float32, device=dev)
    # the two halves of every diagonal sum (see _vs_colsum_kernel), added at the end
    slash_parts = torch.zeros(2, rows, skv, dtype=torch.float32, device=dev)
    if rows == 0 or skv == 0 or sq == 0:
        return vertical.view(B, n_vs, skv), slash_parts.view(2, B, n_vs, skv)
    last_q = min(VS_LAST_Q, sq)
    km, kmb, doc, docb = _mask_args(key_mask, doc_ids, B, skv, sq, q_offset, q)
    # tl.dot cannot mix dtypes, the interpreter multiplies bf16 wrongly (a CPU tensor compiled for a simulated GPU,
    # kernels.codegen, takes a GPU's bf16 dots), and fp32 must stay ieee
    interpreted = triton.knobs.runtime.interpret
    dot_f32 = q.dtype != k.dtype or q.dtype == torch.float32 or (interpreted and q.dtype == torch.bfloat16)
    block_d = max(16, triton.next_power_of_2(D))
    common = dict(
        stride_q=q.stride(), stride_k=k.stride(), skmb=kmb, sdb=docb,
        n_vs=n_vs, group=group, sq=sq, skv=skv, last_q=last_q, q_offset=q_offset, window=window,
        scale=float(scale), head_dim=D,
        HAS_KM=key_mask is not None, HAS_DOC=doc_ids is not None, DOT_F32=dot_f32,
        ROWS=VS_LAST_Q, BLOCK_N=_KEY_BLOCK, BLOCK_D=block_d, **fit.COMPILE_OPTIONS,
    )
    n_chunks = _cdiv(skv, _STATS_CHUNK)
    m_part = torch.empty(rows, n_chunks, VS_LAST_Q, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    # Triton's default pipeline (3 stages) of 64-key steps needs 97 KB at d256 in bf16, and 192 KB in fp32 (past an
    # A100's 163 KB), 128-key steps about twice that: shallower pipelines follow, then 64-key steps
    specialised = (q.device, q.dtype, k.dtype, block_d, key_mask is not None, doc_ids is not None)
    ladder = tuple((step, stages) for step in _STATS_STEPS for stages in fit.stage_ladder(_STATS_STAGES))
    fit.launch("index row statistics", specialised, ladder,
               lambda config: _vs_row_stats_kernel[(n_chunks, rows)](
                   q, k, km, doc, heads, m_part, l_part, n_chunks=n_chunks, CHUNK=_STATS_CHUNK, num_stages=config[1],
                   **{**common, "BLOCK_N": config[0]}))
    row_max = torch.empty(rows, VS_LAST_Q, dtype=torch.float32, device=dev)
    row_sum = torch.empty_like(row_max)
    _vs_row_reduce_kernel[(rows,)](m_part, l_part, row_max, row_sum, n_chunks, ROWS=VS_LAST_Q,
                                  **fit.COMPILE_OPTIONS)
    # one key block and no loop: nothing smaller to try (at d256: 64 KB in bf16, 128 KB in fp32, past the 99 KB
    # cards' limit)
    fit.launch("index column sums", specialised, (None,),
               lambda _: _vs_colsum_kernel[(_cdiv(skv, _KEY_BLOCK), rows)](
                   q, k, km, doc, heads, row_max, row_sum, vertical, slash_parts, **common))
    return vertical.view(B, n_vs, skv), slash_parts.view(2, B, n_vs, skv)


def vs_estimate(q, k, *, scale, key_mask=None, doc_ids=None, q_offset=0, window=0):
    """Vertical and slash scores of every query head, as the reference computes them before forcing.

    Parameters
    ----------
    q : ``[B, Hq, Sq, D]``; k : ``[B, Hkv, Skv, D]``, any strides.
    scale, key_mask, doc_ids, q_offset, window : as in :func:`build_index_gpu`.

    Returns
    -------
    (vertical, slash), fp32 ``[B, Hq, Skv]``: over the last ``min(64, Sq)`` query
    rows, the column sums of the base-masked softmax, and its sums along each
    diagonal ``delta = pos_row - j``.
    """
    B, Hq = q.shape[:2]
    if Hq % k.shape[1]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({k.shape[1]})")
    heads = int_table(range(Hq), q.device)
    vertical, slash_parts = _vs_scores(q, k, heads, Hq, scale=scale, key_mask=key_mask, doc_ids=doc_ids,
                                       q_offset=q_offset, window=window)
    return vertical, slash_parts[0] + slash_parts[1]


# --------------------------------------------------------------------------- vertical-slash -> tiles


@triton.jit
def _count_below(values, n, bound):
    """How many of the ``n`` ascending values at ``values`` lie below ``bound``: a scalar binary search."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        below = tl.load(values + mid) < bound
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _cover_len(skv, BLOCK_K: tl.constexpr):
    """A head's bytes in the cover map: an offset o's mark sits at ``o + BLOCK_K - 1``, and a tile's lookup reads
    up to ``skv + BLOCK_K - 1`` (the host allocates ``skv + 2 * BLOCK`` a head)."""
    return skv + 2 * BLOCK_K


@triton.jit(do_not_specialize=["skv", "n_sorted", "cap"])
def _diag_blocks_kernel(SORTED, BLOCKS, COUNT, COVER, skv, n_sorted, cap, BLOCK_K: tl.constexpr):
    """One head's diagonal blocks (``reference.diagonal_blocks``), ascending, into ``BLOCKS`` and their count;
    and into ``COVER`` (zeroed, :func:`_cover_len` bytes a head) a 1 at ``o + BLOCK_K - 1`` for every
    offset o whose 64-wide window ``o .. o + 63`` holds a block: a column j of a tile starting at ``lo`` lies in
    one of the tile's blocks iff ``COVER[lo - j + 63]`` is set.

    ``SORTED``: the selected diagonals ascending, the dropped picks after them as ``skv``. A scalar walk from
    block to block: a head has at most one block a selected diagonal, and the heads run side by side. Each step
    consumes the diagonals the block holds, at most ``BLOCK_K`` of them (they are distinct, and lie in the 64
    offsets past the last block, or are the block's own)."""
    row = tl.program_id(0).to(tl.int64)
    picks = SORTED + row * n_sorted
    cover = COVER + row * _cover_len(skv, BLOCK_K)
    lanes = tl.arange(0, BLOCK_K)
    x = tl.load(picks)
    more = x < skv
    p = 0
    i = 0
    while more:
        tl.store(BLOCKS + row * cap + i, x, mask=i < cap)
        tl.store(cover + x + lanes, tl.full([BLOCK_K], 1, tl.int8))
        i += 1
        ahead = tl.load(picks + p + lanes, mask=p + lanes < n_sorted, other=skv + 2 * BLOCK_K)
        p += tl.sum((ahead <= x).to(tl.int32), 0)
        after = tl.load(picks + p, mask=p < n_sorted, other=skv)
        # the next selected diagonal within 64 past the block extends the run by a block; else it starts a run
        hit = (after < skv) & (after <= x + BLOCK_K)
        x = tl.where(hit, x + BLOCK_K, after)
        more = after < skv
    tl.store(COUNT + row, tl.minimum(i, cap))


@triton.jit(do_not_specialize=["n_vs", "hq", "m_tiles", "sq", "skv", "q_offset", "cap", "n_cols", "tile_cap",
                               "col_cap"])
def _vs_to_blocks_kernel(
    BLOCKS, N_BLOCKS, COVER, COLS, HEADS, OUT, TAKE,
    n_vs, hq, m_tiles, sq, skv, q_offset, cap, n_cols, tile_cap, col_cap,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_TAKE: tl.constexpr,
):
    """One (query tile, vertical-slash head) of the index: its block starts and leftover columns, written into
    ``OUT = (BLOCK_START, BLOCK_CNT, COL_IDX, COL_CNT)`` (the index's tables, in :class:`SparseIndex` order).

    The tile reads the head's blocks with offsets in ``lo - min(hi, skv - 1) .. lo + 63`` (those holding a key it
    can read), from the largest offset (the lowest keys) down, so the starts come out ascending (but for one
    before key 0). With ``HAS_TAKE`` only the (batch, head) rows ``TAKE`` ([B, Hq] int8) marks are written, over a
    row another pass wrote; slots past the new counts keep whatever they held (no reader looks past the counts)."""
    BLOCK_START, BLOCK_CNT, COL_IDX, COL_CNT = OUT
    m = tl.program_id(0)
    slot_row = tl.program_id(1)
    b = slot_row // n_vs
    h = tl.load(HEADS + slot_row % n_vs)
    lo = q_offset + m * BLOCK_K
    hi = q_offset + tl.minimum(m * BLOCK_K + BLOCK_K - 1, sq - 1)
    out_row = (b.to(tl.int64) * hq + h) * m_tiles + m
    blocks = BLOCKS + slot_row.to(tl.int64) * cap
    n_blocks = tl.load(N_BLOCKS + slot_row)
    if HAS_TAKE:  # a row left out reads no block and no column, so it stores nothing
        taken = tl.load(TAKE + b.to(tl.int64) * hq + h) != 0
        n_blocks = tl.where(taken, n_blocks, 0)
    else:
        taken = True
    first = _count_below(blocks, n_blocks, lo - tl.minimum(hi, skv - 1))
    stop = _count_below(blocks, n_blocks, lo + BLOCK_K)
    n = stop - first
    # a block starting before key 0 (the largest offset, so the first start) goes last: see SparseIndex
    wraps = (n > 0) & (lo - tl.load(blocks + tl.maximum(stop - 1, 0), mask=n > 0, other=0) < 0)
    for t0 in tl.range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        x = tl.load(blocks + stop - 1 - t, mask=t < n, other=0)
        dest = tl.where(wraps, tl.where(t == 0, n - 1, t - 1), t)
        tl.store(BLOCK_START + out_row * tile_cap + dest, lo - x, mask=(t < n) & (dest < tile_cap))
    tl.store(BLOCK_CNT + out_row, tl.minimum(n, tile_cap), mask=taken)

    # leftover columns: the selected ones (ascending) up to hi, in no block of the tile
    cols = COLS + slot_row.to(tl.int64) * n_cols
    cover_len = _cover_len(skv, BLOCK_K)
    cover = COVER + slot_row.to(tl.int64) * cover_len
    ccount = 0
    col_end = tl.where(taken, _count_below(cols, n_cols, hi + 1), 0)
    for c0 in tl.range(0, col_end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        j = tl.load(cols + c, mask=c < col_end, other=skv)
        valid = (j < skv) & (j <= hi)
        covered = tl.load(cover + tl.minimum(lo - j + BLOCK_K - 1, cover_len - 1), mask=valid, other=0)
        keep = valid & (covered == 0)
        keep_i = keep.to(tl.int32)
        dest = ccount + tl.cumsum(keep_i, 0) - 1
        tl.store(COL_IDX + out_row * col_cap + dest, j, mask=keep & (dest < col_cap))
        ccount += tl.sum(keep_i, 0)
    tl.store(COL_CNT + out_row, tl.minimum(ccount, col_cap), mask=taken)


def _vs_budgets(vs_plans, skv: int) -> tuple[list[int], list[int]]:
    """Each vertical-slash head's (columns, diagonals) as the index keeps them: at least the forced ones, at most
    every key."""
    return ([min(max(hp.budget_a, VS_MIN_COLUMNS), skv) for hp in vs_plans],
            [min(max(hp.budget_b, VS_MIN_DIAGONALS), skv) for hp in vs_plans])


def _vs_picks(vertical, slash_parts, max_picks: int, *, key_mask, first_key) -> torch.Tensor:
    """int64 ``[2, B, n_vs, max_picks]``: each vertical-slash head's best ``max_picks`` columns (row 0) and
    diagonals (row 1), best first, from its raw scores (:func:`_vs_scores`: ``vertical`` ``[B, n_vs, Skv]``,
    ``slash_parts`` ``[2, B, n_vs, Skv]``). The rank keys are unique, so the first n picks are the picks at budget
    n: one estimate serves several budgets, and one top-k both kinds (its launches, a radix select of many small
    kernels over 64-bit keys, bound the index by the host at 32K)."""
    B, n_vs, skv = vertical.shape
    # the rank kernel reads both as flat rows: with the guard's block-sparse rows after them, the slash halves
    # (and, past one batch row, the vertical scores) are strided slices, copied here (a few MB at 128K)
    vertical, slash_parts = vertical.contiguous(), slash_parts.contiguous()
    total = B * n_vs * skv
    # the diagonals' keys start 16-byte aligned, as a tensor of their own would, so the rank kernel's pointers keep
    # the specialisation they always had
    second = total + total % 2
    keys = torch.empty(second + total, dtype=torch.int64, device=vertical.device).as_strided(
        (2, B, n_vs, skv), (second, n_vs * skv, skv, 1))
    first_key = first_key.expand(B).contiguous() if key_mask is not None else keys  # keys: any pointer
    _rank_keys_kernel[(_cdiv(total, _KEY_VEC),)](vertical, slash_parts, keys[0], keys[1], first_key, total, skv,
                                                 n_vs * skv, VS_FORCED_COLUMNS, VS_FORCED_DIAGONALS,
                                                 HAS_KEY_MASK=key_mask is not None, BLOCK=_KEY_VEC,
                                                 **fit.COMPILE_OPTIONS)
    return keys.topk(max_picks, dim=-1, sorted=True).indices


def _ascending_picks(top: torch.Tensor, plans: list, skv: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each plan of ``plans`` (one vertical-slash :class:`HeadPlan` per estimated head), its columns and its
    diagonals, int32 ``[B, n_vs, W]``: each head's first picks of ``top`` (:func:`_vs_picks`, best first) up to
    its budget, ascending, then ``skv``. W is ``top``'s width (the largest budget of any plan and kind) rounded up to
    a multiple of 4, so one sort serves them all; the tile kernels read ``skv`` as the end of a row's picks."""
    _, _, n_vs, width = top.shape
    if width % 4:  # every plan's and kind's rows then start 16-byte aligned, as the tensors they once were
        top = F.pad(top, (0, 4 - width % 4), value=skv)
        width = top.shape[-1]
    budgets = [n for plan in plans for per_head in _vs_budgets(plan, skv) for n in per_head]
    keep = torch.arange(width, device=top.device) < int_table(budgets, top.device).view(len(plans), 2, 1, n_vs, 1)
    ascending = torch.where(keep, top, skv).to(torch.int32).sort(dim=-1).values  # [plans, 2, B, n_vs, W]
    return [(ascending[i, 0], ascending[i, 1]) for i in range(len(plans))]


def _vs_tiles(q, k, ascending: tuple, heads: torch.Tensor, vs_plans, out: SparseIndex, *, q_offset, take=None):
    """Write the tiles and columns of the vertical-slash heads ``heads`` at the budgets of ``vs_plans`` into
    ``out``, from their columns and diagonals at those budgets (:func:`_ascending_picks`). ``take``: optional bool
    ``[B, Hq]`` on the device; only its marked rows are written (over what ``out`` holds), the others left as
    they are."""
    B, Hq, sq, _ = q.shape
    skv = k.shape[2]
    dev = q.device
    n_vs = len(vs_plans)
    m_tiles, n_tiles = _cdiv(sq, BLOCK), _cdiv(skv, BLOCK)
    cols, picked = ascending
    _, n_diags = _vs_budgets(vs_plans, skv)
    cap = min(max(diagonal_block_bound(n) for n in n_diags), n_tiles + 1)
    blocks = torch.empty(B, n_vs, cap, dtype=torch.int32, device=dev)
    n_blocks = torch.empty(B, n_vs, dtype=torch.int32, device=dev)
    cover = torch.zeros(B, n_vs, skv + 2 * BLOCK, dtype=torch.int8, device=dev)  # _cover_len
    _diag_blocks_kernel[(B * n_vs,)](picked, blocks, n_blocks, cover, skv, picked.shape[-1], cap, BLOCK_K=BLOCK,
                                     **fit.COMPILE_OPTIONS)
    take_t = take.to(torch.int8).contiguous() if take is not None else heads  # heads: any pointer
    _vs_to_blocks_kernel[(m_tiles, B * n_vs)](
        blocks, n_blocks, cover, cols, heads,
        (out.block_start, out.block_count, out.col_index, out.col_count), take_t,
        n_vs, Hq, m_tiles, sq, skv, q_offset, cap, cols.shape[-1],
        out.block_start.shape[-1], out.col_index.shape[-1],
        BLOCK_K=BLOCK, BLOCK_T=_TILE_VEC, BLOCK_C=_COL_VEC, HAS_TAKE=take is not None, **fit.COMPILE_OPTIONS,
    )


@triton.jit(do_not_specialize=["n_est", "hq", "m_tiles", "skv", "tile_cap", "col_cap", "stride_vb", "stride_vh",
                               "stride_mb", "inv_rows"])
def _last_tile_mass_kernel(VERT, HEADS, INDEX, MASS, n_est, hq, m_tiles, skv, tile_cap, col_cap,
                           stride_vb, stride_vh, stride_vk, stride_mb, inv_rows,
                           BLOCK_K: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr, BLOCK_C: tl.constexpr):
    """One (batch, estimated head): the share of its last rows' mass (``VERT``: their column sums) inside the
    last query tile's blocks and columns of ``INDEX = (BLOCK_START, BLOCK_CNT, COL_IDX, COL_CNT)``, into
    ``MASS[b, h]``. Blocks and columns never overlap, so each key is summed once; fp32 sums of at most a row's
    keys lose nothing the guard's threshold could see."""
    BLOCK_START, BLOCK_CNT, COL_IDX, COL_CNT = INDEX
    slot_row = tl.program_id(0)
    b = slot_row // n_est
    h = tl.load(HEADS + slot_row % n_est)
    row = (b.to(tl.int64) * hq + h) * m_tiles + m_tiles - 1
    vert = VERT + b.to(tl.int64) * stride_vb + (slot_row % n_est).to(tl.int64) * stride_vh
    keys = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCKS_AT_ONCE)
    total = tl.zeros([BLOCKS_AT_ONCE, BLOCK_K], tl.float32)
    n_blocks = tl.load(BLOCK_CNT + row)
    for t0 in tl.range(0, n_blocks, BLOCKS_AT_ONCE):
        listed = t0 + slots < n_blocks
        start = tl.load(BLOCK_START + row * tile_cap + t0 + slots, mask=listed, other=0).to(tl.int32)
        j = start[:, None] + keys[None, :]
        total += tl.load(vert + j * stride_vk, mask=listed[:, None] & (j >= 0) & (j < skv), other=0.0)
    n_cols = tl.load(COL_CNT + row)
    lanes = tl.arange(0, BLOCK_C)
    in_cols = tl.zeros([BLOCK_C], tl.float32)
    for c0 in tl.range(0, n_cols, BLOCK_C):
        j = tl.load(COL_IDX + row * col_cap + c0 + lanes, mask=c0 + lanes < n_cols, other=-1)
        in_cols += tl.load(vert + j * stride_vk, mask=j >= 0, other=0.0)
    mass = (tl.sum(tl.sum(total, 1), 0) + tl.sum(in_cols, 0)) * inv_rows
    tl.store(MASS + b.to(tl.int64) * stride_mb + h, mass)


def _last_tile_mass(vertical, heads: torch.Tensor, out: SparseIndex, mass_out: torch.Tensor, sq: int) -> None:
    """The runtime guard's estimate into ``mass_out[:, heads]`` (:func:`guard.captured_mass` on the device, one
    launch): the last rows' mass (``vertical``, their column sums, ``[B, len(heads), Skv]``, any
    strides) inside the last query tile's key set of ``out``, for every head the estimate scored, whatever its
    pattern."""
    B, n_est, skv = vertical.shape
    if mass_out.stride(-1) != 1:
        raise ValueError("mass_out must have unit stride over heads")
    _last_tile_mass_kernel[(B * n_est,)](
        vertical, heads, (out.block_start, out.block_count, out.col_index, out.col_count), mass_out,
        n_est, out.block_count.shape[1], out.block_count.shape[-1], skv, out.block_start.shape[-1],
        out.col_index.shape[-1], vertical.stride(0), vertical.stride(1), vertical.stride(2), mass_out.stride(0),
        1.0 / max(min(VS_LAST_Q, sq), 1), BLOCK_K=BLOCK, BLOCKS_AT_ONCE=16, BLOCK_C=_COL_VEC,
        **fit.COMPILE_OPTIONS,
    )


# --------------------------------------------------------------------------- block sparse


def _pool(x: torch.Tensor, tiles: int) -> torch.Tensor:
    """Mean over each 64-row tile of ``[B, H, S, D]`` in fp32, dividing a short last tile by its real rows."""
    B, H, s, D = x.shape
    full = s // BLOCK
    # a strided view and fp32 accumulation: no fp32 copy of the whole of x
    parts = [x.narrow(2, 0, full * BLOCK).unflatten(2, (full, BLOCK)).sum(3, dtype=torch.float32)]
    if full < tiles:
        parts.append(x.narrow(2, full * BLOCK, s - full * BLOCK).sum(2, keepdim=True, dtype=torch.float32))
    counts = torch.clamp(s - torch.arange(tiles, device=x.device) * BLOCK, max=BLOCK)
    return torch.cat(parts, dim=2) / counts[:, None]


def _bs_index(q, k, bs_heads, bs_plans, out: SparseIndex, *, q_offset, first_key):
    B, Hq, sq, D = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    dev = q.device
    n_bs = len(bs_heads)
    m_tiles, n_tiles = _cdiv(sq, BLOCK), _cdiv(skv, BLOCK)
    heads = int_table(bs_heads, dev).long()
    budgets = int_table([hp.budget_a for hp in bs_plans], dev)
    cap = max(min(n_tiles, max(hp.budget_a, 3)) for hp in bs_plans)
    pq = _pool(q, m_tiles).index_select(1, heads).flatten(0, 1)  # [B*nbs, M, D]
    pk_t = _pool(k, n_tiles).index_select(1, heads // group).flatten(0, 1).transpose(1, 2)  # [B*nbs, D, N]

    n = torch.arange(n_tiles, device=dev)
    # Forced tiles get finite scores above any real one. They never compete among themselves
    # (a row keeps at least as many picks as it has forced tiles), but distinct values
    # decreasing with n would still give the reference's lower-index-first order.
    forced_score = _FORCED_SCORE * (2.0 - n.float() / n_tiles)
    rank = torch.arange(cap, device=dev)
    # a left-padded row's sink tile is its first key's, and the tiles wholly before it are padding
    first_key = first_key[:, None, None]  # [B or 1, 1, 1]
    m_chunk = max(1, min(m_tiles, _BS_CHUNK_ELEMS // max(1, B * n_bs * n_tiles)))
    for m0 in range(0, m_tiles, m_chunk):
        m1 = min(m_tiles, m0 + m_chunk)
        # Key tiles past the chunk's last row are never allowed: leave them out of the scores
        # (halves the work of a causal prefill; the width depends on shapes only).
        n_lim = min(n_tiles, (q_offset + min(m1 * BLOCK, sq) - 1) // BLOCK + 1)
        if n_lim <= 0:  # every row of the chunk sits before key 0: no picks, as the index was made
            continue
        take = min(cap, n_lim)
        m = torch.arange(m0, m1, device=dev)
        lo = q_offset + m * BLOCK
        hi = q_offset + torch.clamp(m * BLOCK + BLOCK - 1, max=sq - 1)
        nn = n[:n_lim]
        past_padding = torch.clamp(nn * BLOCK + BLOCK - 1, max=skv - 1)[None, None] >= first_key
        allowed = (nn[None] * BLOCK <= hi[:, None])[None] & past_padding  # [B or 1, mc, n_lim]
        diagonal = (nn[None] >= (lo // BLOCK)[:, None]) & (nn[None] <= (hi // BLOCK)[:, None])
        forced = allowed & ((nn[None, None] == first_key // BLOCK) | diagonal[None])
        # the bias rides in the GEMM: -inf where not allowed, the forced score where forced (one row of it, a
        # view, unless a padding mask gives each batch row its own)
        bias = torch.where(forced, forced_score[:n_lim], torch.where(allowed, 0.0, float("-inf")))
        bias = bias[:, None].expand(B, n_bs, -1, -1).reshape(B * n_bs, m1 - m0, n_lim)
        score = torch.baddbmm(bias, pq[:, m0:m1], pk_t[:, :, :n_lim])
        top = score.topk(take, dim=-1, sorted=True).indices.view(B, n_bs, m1 - m0, take)
        # a row keeps max(min(allowed, k), forced) picks: never a disallowed one
        want = torch.maximum(torch.minimum(allowed.sum(-1)[:, None], budgets[None, :, None]),
                             forced.sum(-1)[:, None])  # [B or 1, nbs, mc]
        # int32 before the sort: half the radix passes of int64
        picked = torch.where(rank[:take] < want[..., None], top, n_tiles).to(torch.int32).sort(dim=-1).values
        picked = torch.where(picked < n_tiles, picked * BLOCK, NO_BLOCK).to(out.block_start.dtype)
        out.block_start[:, :, m0:m1, :take].index_copy_(1, heads, picked)
        out.block_count[:, :, m0:m1].index_copy_(1, heads, want.to(torch.int32).expand(B, -1, -1))


# --------------------------------------------------------------------------- entry point


def index_capacity(plan: LayerPlan, skv: int) -> tuple[int, int]:
    """(block slots, column slots) per (batch, head, query tile) that :func:`build_index_gpu` allocates.

    The slots are the worst case over any input of the shapes (no data-dependent size, so the
    build can be captured in a CUDA graph). A block-sparse head lists at most the key tiles that exist;
    a vertical-slash head at most ``reference.diagonal_block_bound`` blocks, and its blocks lie 64 apart at
    offsets 0 .. lo + 63 of a tile starting at ``lo``: at most one more than the key tiles.
    """
    n_tiles = _cdiv(skv, BLOCK)
    tiles, cols = 0, 0
    for hp in plan.heads:
        if hp.pattern is Pattern.VERTICAL_SLASH:
            tiles = max(tiles, min(n_tiles + 1, diagonal_block_bound(min(max(hp.budget_b, VS_MIN_DIAGONALS), skv))))
            cols = max(cols, min(max(hp.budget_a, VS_MIN_COLUMNS), skv))
        elif hp.pattern is Pattern.BLOCK_SPARSE:
            tiles = max(tiles, min(n_tiles, max(hp.budget_a, 3)))  # tile 0 and two diagonal tiles are forced
    return tiles, cols


def index_start_dtype(skv: int) -> torch.dtype:
    """dtype of ``block_start``: int16 while every start (-63 .. skv - 1) and the ``NO_BLOCK`` padding fit,
    else int32. Up to 32K keys int16 halves the largest buffer of the index. Readers widen on load (the
    attention kernel, ``.long()`` before scatters); counts and columns stay int32.
    """
    return torch.int16 if skv <= torch.iinfo(torch.int16).max + 1 else torch.int32


def index_bytes(plan: LayerPlan, batch: int, sq: int, skv: int | None = None, *, head_dim: int = 128) -> dict[str, int]:
    """Bytes :func:`build_index_gpu` allocates for one call, computed from shapes alone (no device).

    Returns a dict: ``block_start``, ``col_index``, ``counts`` (the returned index, exact),
    ``scratch`` (an estimate of the temporaries alive at the worst moment of the build, freed when
    it returns; library scratch inside ``topk``/``sort`` is not counted) and ``total`` (their sum).
    ``mass_out`` adds the block-sparse heads' rows to the last rows' estimate (``raw`` counts the vertical-slash
    heads' only).
    """
    skv = sq if skv is None else skv
    hq = len(plan.heads)
    m_tiles = _cdiv(sq, BLOCK)
    tile_cap, col_cap = index_capacity(plan, skv)
    out = {
        "block_start": batch * hq * m_tiles * tile_cap * index_start_dtype(skv).itemsize,
        "col_index": batch * hq * m_tiles * col_cap * 4,
        "counts": 2 * batch * hq * m_tiles * 4,
    }
    vs = [hp for hp in plan.heads if hp.pattern is Pattern.VERTICAL_SLASH]
    bs = [hp for hp in plan.heads if hp.pattern is Pattern.BLOCK_SPARSE]
    scratch = 0
    if vs and m_tiles and skv:
        rows = batch * len(vs)
        n_cols = min(max(max(hp.budget_a, VS_MIN_COLUMNS) for hp in vs), skv)
        n_diags = min(max(max(hp.budget_b, VS_MIN_DIAGONALS) for hp in vs), skv)
        raw = 3 * rows * skv * 4  # vertical scores and the slash scores' two halves, alive throughout
        # the worst moment: both int64 rank keys and their one top-k (int64 indices and values, both rows)
        rank = rows * skv * 16 + 2 * rows * max(n_cols, n_diags) * 16
        # later: the one sort over the columns and diagonals of the plan and an escalation, at the larger budget
        # rounded up to 4 (beside the top-k's int64 indices of both kinds: its int32 input, values and int64
        # indices), then the blocks and the int8 map of the offsets they cover
        width = _cdiv(max(n_cols, n_diags), 4) * 4
        tiles = rows * (width * (2 * 8 + 2 * 2 * (4 + 4 + 8)) + diagonal_block_bound(n_diags) * 4 + skv + 2 * BLOCK)
        stats = 2 * rows * _cdiv(skv, _STATS_CHUNK) * VS_LAST_Q * 4
        scratch = raw + stats + max(rank, tiles)
    if bs and m_tiles and skv:
        n_tiles = _cdiv(skv, BLOCK)
        rows = batch * len(bs)
        cap = max(min(n_tiles, max(hp.budget_a, 3)) for hp in bs)
        # pooled q of every head and k of every kv head (<= hq), then the selected heads' copies
        pooled = (batch * hq + rows) * (m_tiles + n_tiles) * head_dim * 4
        m_chunk = max(1, min(m_tiles, _BS_CHUNK_ELEMS // max(1, rows * n_tiles)))
        # per chunk: scores and bias (fp32), top-k values and indices, the int32 picks and their sort
        chunk = rows * m_chunk * (n_tiles * 4 * 2 + cap * (4 + 8 + 8 + 4 + 4 + 8))
        scratch = max(scratch, pooled + chunk)
    out["scratch"] = scratch
    out["total"] = sum(out.values())
    return out


def build_index_gpu(q, k, plan: LayerPlan, *, scale, key_mask=None, doc_ids=None, q_offset=0, window=0,
                    mass_out=None) -> SparseIndex:
    """Build the sparse index of one attention call on the device of ``q``, without a host sync.

    Parameters
    ----------
    q : ``[B, Hq, Sq, D]``; k : ``[B, Hkv, Skv, D]``, any strides, ``Hq % Hkv == 0``;
        query head ``h`` reads kv head ``h // (Hq // Hkv)``.
    plan : one :class:`HeadPlan` per query head; patterns may be mixed.
    scale : softmax scale of the vertical-slash estimate.
    key_mask : optional bool ``[B, Skv]`` (True = may be read).
    doc_ids : optional int ``[B, Skv]`` packed-document ids (needs ``q_offset + Sq <= Skv``).
    q_offset : position of query row 0; row ``i`` sits at ``q_offset + i``.
    window : sliding window (0 = none).
    mass_out : optional fp32 ``[B, Hq]`` to receive, for vertical-slash and block-sparse heads, the runtime
        guard's captured-mass estimate (other heads are left as they are).

    Returns
    -------
    SparseIndex, ``M = ceil(Sq / 64)``: counts and columns int32, ``block_start`` of
    :func:`index_start_dtype` (int16 up to 2M keys). VERTICAL_SLASH and BLOCK_SPARSE
    heads list exactly the tiles and columns of ``reference.build_index``;
    DENSE and A_SHAPE heads have zero counts. Capacities come from
    :func:`index_capacity`.
    """
    return _build(q, k, plan, None, scale=scale, key_mask=key_mask, doc_ids=doc_ids, q_offset=q_offset,
                  window=window, mass_out=mass_out)[0]


def build_index_pair_gpu(q, k, plan: LayerPlan, escalated: LayerPlan, *, scale, key_mask=None, doc_ids=None,
                         q_offset=0, window=0, mass_out=None,
                         escalated_mass_out=None) -> tuple[SparseIndex, SparseIndex]:
    """:func:`build_index_gpu` of ``plan`` and of ``escalated``, its guard's escalation
    (:func:`~minference_fx.plan.escalated_plan`: the same vertical-slash heads at larger budgets, every other
    head dense), from one vertical-slash estimate: the two indexes differ only in how many of its picks a head
    keeps. ``escalated_mass_out`` receives the escalated index's guard estimate."""
    return _build(q, k, plan, escalated, scale=scale, key_mask=key_mask, doc_ids=doc_ids, q_offset=q_offset,
                  window=window, mass_out=mass_out, escalated_mass_out=escalated_mass_out)


def build_index_escalated_gpu(q, k, plan: LayerPlan, escalated: LayerPlan, *, scale, take_below: float,
                              mass_out: torch.Tensor, escalated_mass_out: torch.Tensor, key_mask=None, doc_ids=None,
                              q_offset=0, window=0) -> tuple[SparseIndex, torch.Tensor]:
    """The guard's escalation in one index: :func:`build_index_gpu` of ``plan``, whose vertical-slash rows that
    capture less than ``take_below`` of the estimated mass (``mass_out``) are written over with ``escalated``'s
    (:func:`build_index_pair_gpu`'s second index), in place. Both tables are sized for the wider of the two plans,
    so nothing is padded or copied: :func:`minference_fx.dense.take_index` of the pair, less its copies (at 128K
    on Qwen2.5-Coder's plans the copies and fills were about half the index's device time). A weak row the
    escalation does not list (block-sparse) lists nothing, as ``take_index`` gives it (only its slots past that
    count of 0 keep what they held). ``escalated_mass_out`` receives, for every vertical-slash head, the guard's
    estimate over its row as it now stands: the escalated rows' for those taken, the plan's for the others (other
    heads: left as they are). Returns the index and the rows taken (every weak row), ``[B, Hq]`` bool."""
    return _build(q, k, plan, escalated, scale=scale, key_mask=key_mask, doc_ids=doc_ids, q_offset=q_offset,
                  window=window, mass_out=mass_out, escalated_mass_out=escalated_mass_out, take_below=take_below)


def _empty_index(q, k, plan: LayerPlan, wider: LayerPlan | None = None) -> SparseIndex:
    """A fresh index for ``plan``, with room for ``wider``'s rows too when given. Its slots are not filled (no reader
    looks past the counts): filling the block starts' 11.7 GB took the index at 1M tokens on Llama-3-8B's heads from
    15.6 to 19.4 ms (H100, scripts/explore_index_long.py); the columns' 2 GB fill was about 0.6 ms of the same profile."""
    B, Hq, sq, _ = q.shape
    skv, dev = k.shape[2], q.device
    m_tiles = _cdiv(sq, BLOCK)
    tile_cap, col_cap = index_capacity(plan, skv)
    if wider is not None:
        tile_cap, col_cap = (max(a, b) for a, b in zip((tile_cap, col_cap), index_capacity(wider, skv)))
    return SparseIndex(
        block_count=torch.zeros(B, Hq, m_tiles, dtype=torch.int32, device=dev),
        block_start=torch.empty((B, Hq, m_tiles, tile_cap), dtype=index_start_dtype(skv), device=dev),
        col_count=torch.zeros(B, Hq, m_tiles, dtype=torch.int32, device=dev),
        col_index=torch.empty((B, Hq, m_tiles, col_cap), dtype=torch.int32, device=dev),
    )


def _build(q, k, plan: LayerPlan, escalated, *, scale, key_mask, doc_ids, q_offset, window, mass_out,
           escalated_mass_out=None, take_below=None) -> tuple:
    """The index of ``plan`` and, with ``escalated``: that plan's index too (a pair), or with ``take_below`` the
    rows of it that :func:`build_index_escalated_gpu` takes, written into the first (the index and those rows)."""
    check_index_inputs(q, k, plan)
    skv = k.shape[2]
    q_offset, window = int(q_offset), int(window)
    vs = [(h, hp) for h, hp in enumerate(plan.heads) if hp.pattern is Pattern.VERTICAL_SLASH]
    bs = [(h, hp) for h, hp in enumerate(plan.heads) if hp.pattern is Pattern.BLOCK_SPARSE]
    if escalated is not None:
        check_index_inputs(q, k, escalated)
        listed = [h for h, hp in enumerate(escalated.heads) if hp.pattern is not Pattern.DENSE]
        as_vs = all(escalated.heads[h].pattern is Pattern.VERTICAL_SLASH for h in listed)
        if listed != [h for h, _ in vs] or not as_vs:
            raise ValueError("an escalated plan lists exactly the plan's vertical-slash heads, as vertical-slash; "
                             f"got {escalated} for {plan}")
    merge = take_below is not None
    if merge and (escalated is None or mass_out is None or escalated_mass_out is None):
        raise ValueError("take_below needs an escalated plan, mass_out and escalated_mass_out")
    out = _empty_index(q, k, plan, escalated if merge else None)
    out_up = _empty_index(q, k, escalated) if escalated is not None and not merge else None
    if out.block_count.shape[-1] == 0 or skv == 0:  # nothing to list: no row is taken
        return out, torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device) if merge else out_up
    first_key = first_kept_keys(key_mask, q.device)  # once for both patterns
    # One estimate of the last rows serves the vertical-slash picks and the guard's mass of every head it checks:
    # the vertical-slash heads first, then, for the guard only, the block-sparse ones (their picks come from
    # pooled tiles; their slash sums are not needed, but come with the same two passes).
    estimated = [h for h, _ in vs] + ([h for h, _ in bs] if mass_out is not None else [])
    if estimated:
        heads = int_table(estimated, q.device)
        vertical, slash_parts = _vs_scores(q, k, heads, len(estimated), scale=scale, key_mask=key_mask,
                                           doc_ids=doc_ids, q_offset=q_offset, window=window)
    if vs:
        n_vs = len(vs)
        plans = [[hp for _, hp in vs]] + ([[escalated.heads[h] for h, _ in vs]] if escalated is not None else [])
        n_cols, n_diags = _vs_budgets([hp for p in plans for hp in p], skv)
        picks = _vs_picks(vertical[:, :n_vs], slash_parts[:, :, :n_vs], max(n_cols + n_diags),
                          key_mask=key_mask, first_key=first_key)
        del slash_parts
        ascending = _ascending_picks(picks, plans, skv)
        del picks
        _vs_tiles(q, k, ascending[0], heads[:n_vs], plans[0], out, q_offset=q_offset)
        if out_up is not None:
            _vs_tiles(q, k, ascending[1], heads[:n_vs], plans[1], out_up, q_offset=q_offset)
            if escalated_mass_out is not None:
                _last_tile_mass(vertical[:, :n_vs], heads[:n_vs], out_up, escalated_mass_out, q.shape[2])
    if bs:
        _bs_index(q, k, [h for h, _ in bs], [hp for _, hp in bs], out, q_offset=q_offset, first_key=first_key)
    if mass_out is not None and estimated:
        _last_tile_mass(vertical, heads, out, mass_out, q.shape[2])
    if not merge:
        return out, out_up
    # the weak rows, decided on the device; the kernel writes the vertical-slash ones (the escalation lists no other)
    taken = mass_out < take_below
    if vs:
        _vs_tiles(q, k, ascending[1], heads[:n_vs], plans[1], out, q_offset=q_offset, take=taken)
        _last_tile_mass(vertical[:, :n_vs], heads[:n_vs], out, escalated_mass_out, q.shape[2])
    if bs:
        # a weak block-sparse row takes the escalation's empty row, as take_index gives it: no tile is listed
        is_bs = int_table([hp.pattern is Pattern.BLOCK_SPARSE for hp in plan.heads], q.device).bool()
        out.block_count.masked_fill_((taken & is_bs)[..., None], 0)
    return out, taken
