"""Pure-PyTorch oracle for minference-fx sparse attention.

Every Triton kernel is tested against this file, so it favours being obviously
right over being fast. It does two things:

1. ``build_index`` turns a :class:`~minference_fx.plan.LayerPlan` and the
   current Q/K into a :class:`SparseIndex`: for each (batch, query head, query
   tile) a list of 64-key tiles plus a list of single leftover key columns.
2. ``sparse_attention_reference`` runs exact attention over the keys that the
   index lists *and* the base mask allows (causal, padding, documents, sliding
   window), chunked over query rows so that 16K tokens fit in CPU memory.

Conventions
-----------
* Query row ``i`` sits at absolute position ``pos_i`` (``q_offset + i`` unless
  ``q_positions`` is given); key ``j`` sits at position ``j``.
* ``BLOCK`` is the index granularity for both query tiles and key tiles.
* The only approximation is in which tiles/columns are listed; inside them
  the arithmetic is exact fp32.
* Ties in every top-k are broken towards the lower index (stable sort), so the
  GPU builders have a rule they can reproduce.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from minference_fx.plan import HeadPlan, LayerPlan, Pattern

BLOCK = 64

# MInference's fixed minima for the vertical-slash estimate.
VS_LAST_Q = 64
VS_FORCED_COLUMNS = 30  # attention sinks
VS_FORCED_DIAGONALS = 100  # local band
VS_MIN_COLUMNS = 30
VS_MIN_DIAGONALS = 50


NO_BLOCK = -32768
"""Padding of ``SparseIndex.block_start`` (a vertical-slash block may start up to 63 keys before key 0, so -1
is a real start); it fits the int16 the GPU index uses up to 32K keys."""


@dataclasses.dataclass
class SparseIndex:
    """Which keys each (batch, query head, query tile) reads, before the base mask.

    Integer tensors on the device of q: int32, except that the GPU index stores ``block_start`` as
    int16 when every start fits (up to 32K keys) to halve the largest buffer. ``M = ceil(Sq / BLOCK)``.

    Keys come in blocks of ``BLOCK`` consecutive keys. A dense, A-shape or block-sparse head's blocks are
    aligned key tiles (start ``64 n``). A vertical-slash head's follow its diagonals: the head has offsets
    ``x`` (:func:`diagonal_blocks`), and query tile m, whose first position is ``lo``, reads keys
    ``lo - x .. lo - x + 63`` for each; keys before 0 do not exist and are never read.

    Attributes
    ----------
    block_count : ``[B, Hq, M]`` number of valid entries in ``block_start``.
    block_start : ``[B, Hq, M, T]`` first key of each block; slots past ``block_count`` hold anything (the GPU
        index leaves them unwritten, the reference pads them with ``NO_BLOCK``, as :meth:`padded` does); the blocks of one
        (b, h, m) never overlap. They come in ascending order, but for a block that starts before key 0 (only a
        vertical-slash head has one, at most one a tile): it comes last, after the block that crosses the
        diagonal, so that the attention kernel finds every block that needs a mask at the end.
    col_count : ``[B, Hq, M]`` number of valid entries in ``col_index``.
    col_index : ``[B, Hq, M, C]`` key positions, ascending; slots past ``col_count`` hold anything (the reference
        pads them with -1, as :meth:`padded` does); a column never lies inside a listed block of the same (b, h, m).
    """

    block_count: torch.Tensor
    block_start: torch.Tensor
    col_count: torch.Tensor
    col_index: torch.Tensor

    def padded(self) -> "SparseIndex":
        """The same index with every slot past its count set to ``NO_BLOCK`` (block starts) or -1 (columns), as the
        reference builds it: the form two indices are compared in."""
        def pad(slots, counts, value):
            return torch.where(listed_slots(slots, counts), slots, value).to(slots.dtype)
        return dataclasses.replace(self, block_start=pad(self.block_start, self.block_count, NO_BLOCK),
                                   col_index=pad(self.col_index, self.col_count, -1))


def listed_slots(slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool, ``slots``' shape: the slots of a table (``[..., T]``) that hold an entry, the first ``counts`` (``[...]``) of
    each row; the others hold anything (see :class:`SparseIndex`)."""
    return torch.arange(slots.shape[-1], device=slots.device) < counts[..., None]


def diagonal_blocks(diagonals, width: int = BLOCK) -> list[int]:
    """The block offsets ``x`` (ascending) that read every selected diagonal of a vertical-slash head whole.

    Block x of a query tile whose rows sit at ``lo .. lo + 63`` holds keys ``lo - x .. lo - x + 63``, so
    it holds diagonal x whole, and blocks x and x + 64 together hold every diagonal between them whole.
    Greedy over the diagonals in ascending order: one inside the last run of blocks is held already;
    one within 64 past its last block extends the run by a block (a block of its own would overlap the
    run's last); any other starts a run at itself. Blocks end up at least 64 apart: they never overlap.
    Against aligned key tiles, a lone diagonal costs one block, not two (MInference reads diagonals as
    unaligned key ranges for the same reason).

    ``width``: the rows of a query tile and the keys of a block (the index's are 64; others only for arithmetic
    on other layouts, ``scripts/explore_layouts.py``)."""
    blocks: list[int] = []
    for d in sorted(int(d) for d in diagonals):
        if blocks and d <= blocks[-1]:
            continue
        blocks.append(blocks[-1] + width if blocks and d <= blocks[-1] + width else d)
    return blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- masks


def query_positions(sq: int, q_offset: int, q_positions, device) -> torch.Tensor:
    """Absolute position of every query row.

    Parameters
    ----------
    sq : number of query rows.
    q_offset : position of row 0 when ``q_positions`` is None (keys already cached).
    q_positions : optional int tensor ``[Sq]`` (like HF ``cache_position``); wins over ``q_offset``.
    device : device of the result.

    Returns
    -------
    LongTensor ``[Sq]``.
    """
    if q_positions is None:
        return torch.arange(sq, device=device, dtype=torch.long) + int(q_offset)
    q_positions = torch.as_tensor(q_positions)
    if q_positions.shape != (sq,):
        raise ValueError(f"q_positions must have shape [{sq}], got {list(q_positions.shape)}")
    return q_positions.to(device=device, dtype=torch.long)


def base_allowed(pos: torch.Tensor, skv: int, key_mask=None, doc_ids=None, window: int = 0) -> torch.Tensor:
    """The base set A: which keys each query row may read regardless of the pattern.

    Parameters
    ----------
    pos : LongTensor ``[R]``, absolute positions of the rows asked about.
    skv : number of keys.
    key_mask : optional bool ``[B, Skv]``, True where a key may be read.
    doc_ids : optional int ``[B, Skv]``; a row reads only keys of its own document,
        the row's document being ``doc_ids[b, pos]`` (so ``0 <= pos < Skv`` is required).
    window : 0 for none, else key ``j`` needs ``pos - j < window``.

    Returns
    -------
    bool ``[B, 1, R, Skv]`` (``B`` is 1 when neither mask is given; it broadcasts).
    """
    j = torch.arange(skv, device=pos.device)
    allowed = j[None, :] <= pos[:, None]  # [R, Skv]
    if window:
        allowed = allowed & (pos[:, None] - j[None, :] < window)
    allowed = allowed[None]
    if key_mask is not None:
        allowed = allowed & key_mask.to(device=pos.device, dtype=torch.bool)[:, None, :]
    if doc_ids is not None:
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= skv):
            raise ValueError(f"doc_ids needs every query position in [0, {skv}), got [{int(pos.min())}, {int(pos.max())}]")
        doc_ids = doc_ids.to(pos.device)
        allowed = allowed & (doc_ids[:, pos][:, :, None] == doc_ids[:, None, :])
    return allowed[:, None]


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    # A row with nothing allowed must give zeros, not the NaN of softmax(all -inf).
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def _tile_bounds(pos: torch.Tensor, m_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    # q_positions may be arbitrary, so a tile's span is min/max, not first/last row.
    # The rows past Sq in the last tile repeat its last real row, so they change no min/max.
    rows = torch.clamp(torch.arange(m_tiles * BLOCK, device=pos.device), max=pos.numel() - 1)
    tiled = pos[rows].view(m_tiles, BLOCK)
    return tiled.amin(-1), tiled.amax(-1)


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last dim, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _stable_topk_mask(scores: torch.Tensor, k) -> torch.Tensor:
    """bool mask of the ``k`` (int, or a tensor per leading row) largest entries, ties to the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    limit = k if isinstance(k, int) else k[..., None]
    rank_ok = (torch.arange(scores.shape[-1], device=scores.device) < limit).expand_as(order)
    return torch.zeros_like(rank_ok).scatter(-1, order, rank_ok)


# --------------------------------------------------------------------------- per-pattern index


def first_kept_keys(key_mask, device) -> torch.Tensor:
    """int64 ``[B or 1]``: per batch row, the first key the padding mask keeps (0 without a mask, or when it
    keeps none). A left-padded prompt's sinks and forced columns are counted from there, so that its sparse
    keys are its own, not the padding's."""
    if key_mask is None:
        return torch.zeros(1, dtype=torch.int64, device=device)
    key_mask = key_mask.to(device=device, dtype=torch.bool)
    return key_mask.view(torch.uint8).argmax(1)  # a byte view of the mask: no copy of it


def _a_shape_tiles(lo, hi, n_tiles, skv, sink, window, first_key):
    """bool ``[B or 1, M, N]``: the tiles holding the ``sink`` keys from each row's ``first_key`` on, and the
    tiles the query tile's window touches."""
    n_start = torch.arange(n_tiles, device=lo.device) * BLOCK
    n_end = torch.clamp(n_start + BLOCK - 1, max=skv - 1)
    w_lo, w_hi = (lo - window + 1)[:, None], hi[:, None]
    in_window = (w_lo <= w_hi) & (n_end[None] >= w_lo) & (n_start[None] <= w_hi)
    fk = first_key[:, None]
    sinks = (n_end[None] >= fk) & (n_start[None] < fk + sink) & (sink > 0)
    return sinks[:, None, :] | in_window[None]


def _vertical_slash(q_h, k_g, pos, lo, hi, v_budget, s_budget, scale, key_mask, doc_ids, window):
    """One head's blocks as (count ``[B, M]``, starts ``[B, M, X]``) and its leftover-column mask ``[B, M, Skv]``."""
    B, sq, _ = q_h.shape
    skv = k_g.shape[1]
    dev = q_h.device
    last_q = min(VS_LAST_Q, sq)
    est_pos = pos[sq - last_q :]
    scores = torch.einsum("bqd,bkd->bqk", q_h[:, sq - last_q :].float(), k_g.float()) * scale
    allowed = base_allowed(est_pos, skv, key_mask, doc_ids, window)[:, 0]
    prob = _masked_softmax(scores, allowed.expand_as(scores))  # [B, last_q, Skv]

    vertical = prob.sum(dim=1)
    j = torch.arange(skv, device=dev)
    fk = first_kept_keys(key_mask, dev)[:, None]  # the sinks of a left-padded row start at its first key
    vertical = torch.where((j >= fk) & (j < fk + VS_FORCED_COLUMNS), float("inf"), vertical)

    delta = est_pos[:, None] - j[None, :]  # [last_q, Skv]
    on_diag = (delta >= 0) & (delta < skv)
    slash = torch.zeros(B, skv, device=dev, dtype=torch.float32)
    slash.scatter_add_(1, delta.clamp(0, skv - 1).reshape(1, -1).expand(B, -1), (prob * on_diag).reshape(B, -1))
    slash[:, :VS_FORCED_DIAGONALS] = float("inf")

    n_cols = min(max(v_budget, VS_MIN_COLUMNS), skv)
    n_diags = min(max(s_budget, VS_MIN_DIAGONALS), skv)
    col_sel = _stable_topk_mask(vertical, n_cols)  # [B, Skv]
    deltas = _stable_topk(slash, n_diags)  # [B, S']

    # Each query tile reads the head's diagonal blocks that hold a key in 0 .. min(hi, skv - 1); a block's keys
    # are the same whatever the tile's span (arbitrary q_positions may widen it past 64 rows)
    starts, counts = [], []
    covered = torch.zeros(B, lo.numel(), skv + 1, device=dev, dtype=torch.int32)
    for bi in range(B):
        x = torch.tensor(diagonal_blocks(deltas[bi].tolist()), device=dev, dtype=torch.long)
        start = lo[:, None] - x.flip(0)[None, :]  # [M, X], ascending along X
        ok = (start + BLOCK - 1 >= 0) & (start <= torch.clamp(hi, max=skv - 1)[:, None])
        ones = ok.to(torch.int32)
        covered[bi].scatter_add_(1, torch.where(ok, start.clamp(min=0), skv), ones)
        covered[bi].scatter_add_(1, torch.where(ok, (start + BLOCK).clamp(max=skv), skv), -ones)
        count = ok.sum(-1)
        start = torch.where(ok, start, skv).sort(-1).values
        # a block that starts before key 0 (the first) goes last
        wraps = (count > 0) & (start[:, 0] < 0)
        slot = torch.arange(start.shape[-1], device=dev)[None, :]
        take = torch.where(wraps[:, None] & (slot < count[:, None]), (slot + 1) % count.clamp(min=1)[:, None], slot)
        counts.append(count)
        starts.append(start.gather(1, take))
    width = max(s.shape[-1] for s in starts)
    start = torch.stack([F.pad(s, (0, width - s.shape[-1]), value=skv) for s in starts])
    count = torch.stack(counts)
    start = torch.where(torch.arange(width, device=dev) < count[..., None], start, NO_BLOCK)
    in_block = covered.cumsum(-1)[..., :skv] > 0
    cols = col_sel[:, None, :] & ~in_block & (j[None, :] <= hi[:, None])[None]
    return count, start, cols


def _block_sparse(q_h, k_g, lo, hi, n_tiles, k_budget, first_key):
    """Tile mask ``[B, M, N]`` of one block-sparse head: the tile of each row's ``first_key`` (its sink) and
    the diagonal tiles, then the best-scoring others; tiles wholly before ``first_key`` (padding) are none."""
    B, _, D = q_h.shape
    m_tiles = lo.numel()

    def pool(x, tiles):
        # Mean over the rows a tile really has, so a short last tile is not diluted.
        n = x.shape[1]
        x = torch.nn.functional.pad(x.float(), (0, 0, 0, tiles * BLOCK - n)).view(B, tiles, BLOCK, D).sum(2)
        counts = torch.clamp(n - torch.arange(tiles, device=x.device) * BLOCK, max=BLOCK)
        return x / counts[None, :, None]

    score = pool(q_h, m_tiles) @ pool(k_g, n_tiles).transpose(1, 2)  # [B, M, N]
    n = torch.arange(n_tiles, device=q_h.device)
    skv = k_g.shape[1]
    fk = first_key[:, None, None]
    past_padding = torch.clamp(n * BLOCK + BLOCK - 1, max=skv - 1)[None, None] >= fk  # [B or 1, 1, N]
    allowed = (n[None] * BLOCK <= hi[:, None])[None] & past_padding  # [B or 1, M, N]
    diagonal = (n[None] >= (lo // BLOCK)[:, None]) & (n[None] <= (hi // BLOCK)[:, None])
    forced = allowed & ((n[None, None] == fk // BLOCK) | diagonal[None])
    score = torch.where(forced, float("inf"), torch.where(allowed, score, float("-inf")))
    k_eff = torch.maximum(torch.clamp(allowed.sum(-1), max=k_budget), forced.sum(-1))  # [B or 1, M]
    return _stable_topk_mask(score, k_eff.expand(B, -1))


def _pack(mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[..., L]`` -> (count int32 ``[...]``, ascending int32 ``[..., capacity]`` padded -1)."""
    length = mask.shape[-1]
    count = mask.sum(-1)
    capacity = max(capacity, int(count.max()) if count.numel() else 0)
    key = torch.where(mask, torch.arange(length, device=mask.device), length)
    take = min(capacity, length)
    idx = torch.topk(key, take, dim=-1, largest=False, sorted=True).values if take else key[..., :0]
    idx = torch.where(idx < length, idx, -1)
    idx = torch.nn.functional.pad(idx, (0, capacity - take), value=-1)
    return count.to(torch.int32), idx.to(torch.int32)


def diagonal_block_bound(n_diags: int) -> int:
    """The most diagonal blocks (:func:`diagonal_blocks`) a head can have for ``n_diags`` selected diagonals:
    each adds at most one, and the forced ones 0 .. F - 1 (F = min(100, n_diags), always selected) make a single
    run of 1 + ceil((F - 1) / 64)."""
    forced = min(VS_FORCED_DIAGONALS, n_diags)
    return 1 + _cdiv(forced - 1, BLOCK) + n_diags - forced


def _capacity(head, n_tiles: int, skv: int) -> tuple[int, int]:
    """(tiles, columns) a head needs at most when query positions are contiguous."""
    p, a, b = head.pattern, head.budget_a, head.budget_b
    if p is Pattern.DENSE:
        return n_tiles, 0
    if p is Pattern.A_SHAPE:
        # window span of a full tile is b + 63 keys, touching at most ceil(b/64) + 2 tiles; sinks from an
        # unaligned first key touch ceil(a/64) + 1
        return min(n_tiles, _cdiv(a, BLOCK) + _cdiv(b, BLOCK) + 3), 0
    if p is Pattern.VERTICAL_SLASH:
        # diagonal blocks lie 64 apart at offsets 0 .. lo + 63: at most n_tiles + 1
        return (min(n_tiles + 1, diagonal_block_bound(min(max(b, VS_MIN_DIAGONALS), skv))),
                min(max(a, VS_MIN_COLUMNS), skv))
    # block sparse: tile 0 plus up to two diagonal tiles are forced beyond k
    return min(n_tiles, max(a, 3)), 0


def check_index_inputs(q, k, plan: LayerPlan) -> None:
    """Raise ValueError naming the mismatch when q [B,Hq,Sq,D], k [B,Hkv,Skv,D] and the plan do not fit."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if len(plan.heads) != q.shape[1]:
        raise ValueError(f"plan has {len(plan.heads)} heads, the call has {q.shape[1]} query heads")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k {list(k.shape)} does not fit q {list(q.shape)}")


def build_index(q, k, plan: LayerPlan, *, scale, key_mask=None, doc_ids=None, q_positions=None, q_offset=0, window=0) -> SparseIndex:
    """Build the sparse index of one attention call.

    Parameters
    ----------
    q : ``[B, Hq, Sq, D]``.
    k : ``[B, Hkv, Skv, D]``, ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq // Hkv)``.
    plan : one :class:`HeadPlan` per query head.
    scale : softmax scale (used by the vertical-slash estimate).
    key_mask, doc_ids, q_positions, q_offset, window : see :func:`base_allowed`
        and :func:`query_positions`; they shape the vertical-slash estimate only.

    Returns
    -------
    SparseIndex with ``M = ceil(Sq / BLOCK)``. No listed block starts after
    ``pos_hi(m)`` and no column exceeds it: such keys can never be read, so even
    DENSE and A-shape sink tiles are clipped there.
    """
    check_index_inputs(q, k, plan)
    B, Hq, sq, _ = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    dev = q.device
    pos = query_positions(sq, q_offset, q_positions, dev)
    m_tiles, n_tiles = _cdiv(sq, BLOCK), _cdiv(skv, BLOCK)
    lo, hi = _tile_bounds(pos, m_tiles)
    reachable = torch.arange(n_tiles, device=dev)[None] * BLOCK <= hi[:, None]  # [M, N]
    first_key = first_kept_keys(key_mask, dev)

    counts, starts, col_masks = [], [], []
    for h, head in enumerate(plan.heads):
        q_h, k_g = q[:, h], k[:, h // group]
        cols = torch.zeros(B, m_tiles, skv, dtype=torch.bool, device=dev)
        if head.pattern is Pattern.VERTICAL_SLASH:
            count, start, cols = _vertical_slash(
                q_h, k_g, pos, lo, hi, head.budget_a, head.budget_b, scale, key_mask, doc_ids, window
            )
        else:
            if head.pattern is Pattern.DENSE:
                tiles = reachable[None].expand(B, -1, -1)
            elif head.pattern is Pattern.A_SHAPE:
                tiles = (_a_shape_tiles(lo, hi, n_tiles, skv, head.budget_a, head.budget_b, first_key)
                         & reachable).expand(B, -1, -1)
            elif head.pattern is Pattern.BLOCK_SPARSE:
                tiles = _block_sparse(q_h, k_g, lo, hi, n_tiles, head.budget_a, first_key)
            else:  # pragma: no cover - Pattern is closed
                raise ValueError(f"unknown pattern {head.pattern}")
            count, tile = _pack(tiles, 0)
            start = torch.where(tile >= 0, tile * BLOCK, NO_BLOCK)
        counts.append(count.to(torch.int32))
        starts.append(start)
        col_masks.append(cols)

    caps = [_capacity(head, n_tiles, skv) for head in plan.heads]
    width = max([c[0] for c in caps] + [s.shape[-1] for s in starts])
    block_start = torch.stack([F.pad(s, (0, width - s.shape[-1]), value=NO_BLOCK) for s in starts], 1)
    col_count, col_index = _pack(torch.stack(col_masks, 1), max(c[1] for c in caps))
    return SparseIndex(torch.stack(counts, 1), block_start.to(torch.int32), col_count, col_index)


def block_keys(index: SparseIndex, skv: int, tiles=slice(None)) -> torch.Tensor:
    """bool ``[B, Hq, M', Skv]``: the keys the blocks of query tiles ``tiles`` (a slice or an index tensor) hold."""
    start = index.block_start[:, :, tiles].long()
    listed = listed_slots(start, index.block_count[:, :, tiles])
    ones = listed.to(torch.int32)
    diff = torch.zeros(*start.shape[:3], skv + 1, dtype=torch.int32, device=start.device)
    diff.scatter_add_(-1, torch.where(listed, start.clamp(0, skv), skv), ones)
    diff.scatter_add_(-1, torch.where(listed, (start + BLOCK).clamp(0, skv), skv), -ones)
    return diff.cumsum(-1)[..., :skv] > 0


def listed_keys(index: SparseIndex, skv: int, tiles=slice(None)) -> torch.Tensor:
    """bool ``[B, Hq, M', Skv]``: the keys query tiles ``tiles`` (a slice or an index tensor) list, in blocks or as
    leftover columns (no base mask)."""
    cols = index.col_index[:, :, tiles].long()
    listed = listed_slots(cols, index.col_count[:, :, tiles])
    # slots past the count go to a spare key that is dropped afterwards
    in_cols = torch.zeros(*cols.shape[:3], skv + 1, dtype=torch.bool, device=cols.device)
    in_cols.scatter_(-1, torch.where(listed, cols, skv), True)
    return block_keys(index, skv, tiles) | in_cols[..., :skv]


def covering_tiles(index: SparseIndex, skv: int) -> torch.Tensor:
    """bool ``[B, Hq, M, N]``: the aligned key tiles of 64 that hold a key of some listed block (a diagonal block
    touches two, or one when aligned): the index in the layout of an aligned block-sparse kernel."""
    n_tiles = _cdiv(skv, BLOCK)
    start = index.block_start.long()
    listed = listed_slots(start, index.block_count)
    tiles = torch.zeros(*start.shape[:3], n_tiles + 1, dtype=torch.bool, device=start.device)
    # unlisted entries go to a spare tile that is dropped afterwards
    for edge in (start.clamp(min=0), (start + BLOCK - 1).clamp(max=skv - 1)):
        tiles.scatter_(-1, torch.where(listed, edge // BLOCK, n_tiles), True)
    return tiles[..., :n_tiles]


def index_to_mask(index: SparseIndex, rows, skv: int) -> torch.Tensor:
    """Expand an index to the keys each query row's pattern lists (no base mask).

    Parameters
    ----------
    index : a :class:`SparseIndex`.
    rows : ``slice`` or ``range`` of query rows (step 1), e.g. ``range(512, 1024)``.
    skv : number of keys.

    Returns
    -------
    bool ``[B, Hq, len(rows), Skv]``.
    """
    r0, r1 = (rows.start or 0), rows.stop
    if r1 is None:
        r1 = index.block_start.shape[2] * BLOCK
    if (rows.step or 1) != 1:
        raise ValueError("rows must be contiguous (step 1)")
    B, Hq = index.block_start.shape[:2]
    if r1 <= r0:
        return torch.zeros(B, Hq, 0, skv, dtype=torch.bool, device=index.block_start.device)
    m0, m1 = r0 // BLOCK, _cdiv(r1, BLOCK)
    start = index.block_start[:, :, m0:m1].long()
    listed = listed_slots(start, index.block_count[:, :, m0:m1])
    if listed.any() and (int(start[listed].min()) <= -BLOCK or int(start[listed].max()) >= skv):
        raise ValueError(f"index block starts [{int(start[listed].min())}, {int(start[listed].max())}] hold no key "
                         f"of [0, {skv})")
    cols = index.col_index[:, :, m0:m1].long()
    cols = cols[listed_slots(cols, index.col_count[:, :, m0:m1])]
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= skv):
        raise ValueError(f"index columns [{int(cols.min())}, {int(cols.max())}] out of range [0, {skv})")
    per_tile = listed_keys(index, skv, slice(m0, m1))  # [B, Hq, m1-m0, Skv]
    row_tile = torch.arange(r0, r1, device=per_tile.device) // BLOCK - m0
    return per_tile[:, :, row_tile]


# --------------------------------------------------------------------------- attention


def sparse_attention_reference(
    q, k, v, plan: LayerPlan, *, scale, key_mask=None, doc_ids=None, q_positions=None, q_offset=0, window=0,
    index: SparseIndex | None = None, rows_per_chunk: int = 512,
) -> torch.Tensor:
    """Exact attention over the keys in ``index`` that the base mask allows.

    Parameters
    ----------
    q : ``[B, Hq, Sq, D]``; k, v : ``[B, Hkv, Skv, D]``; any strides, fp32/fp16/bf16.
    plan : one head plan per query head.
    scale : softmax scale.
    key_mask : optional bool ``[B, Skv]`` (True = may be read).
    doc_ids : optional int ``[B, Skv]`` packed-document ids.
    q_positions : optional int ``[Sq]``; else positions are ``q_offset + i``.
    window : sliding window (0 = none).
    index : a prebuilt index; built from q/k when None.
    rows_per_chunk : query rows per step; memory is ``O(B * group * rows_per_chunk * Skv)``.

    Returns
    -------
    ``[B, Hq, Sq, D]`` contiguous, dtype of q. Math in fp32; a row that may read
    no key is exactly 0.
    """
    B, Hq, sq, D = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must agree in [B, Hkv, Skv]")
    group = Hq // Hkv
    if index is None:
        index = build_index(
            q, k, plan, scale=scale, key_mask=key_mask, doc_ids=doc_ids, q_positions=q_positions, q_offset=q_offset, window=window
        )
    if tuple(index.block_start.shape[:3]) != (B, Hq, _cdiv(sq, BLOCK)):
        raise ValueError(f"index is for {list(index.block_start.shape[:3])} (B, Hq, M), the call needs {[B, Hq, _cdiv(sq, BLOCK)]}")
    pos = query_positions(sq, q_offset, q_positions, q.device)
    kf, vf = k.float(), v.float()
    out = torch.empty(B, Hq, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    chunk = max(1, rows_per_chunk)
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        # Keys past the chunk's last position are never readable: skip them (halves causal work).
        kmax = max(0, min(skv, int(pos[r0:r1].max()) + 1))
        if kmax == 0:
            out[:, :, r0:r1] = 0
            continue
        base = base_allowed(pos[r0:r1], skv, key_mask, doc_ids, window)[..., :kmax]  # [B|1, 1, R, kmax]
        allowed = index_to_mask(index, range(r0, r1), skv)[..., :kmax] & base  # [B, Hq, R, kmax]
        for g in range(Hkv):
            heads = slice(g * group, (g + 1) * group)
            scores = q[:, heads, r0:r1].float() @ kf[:, g : g + 1, :kmax].transpose(-1, -2) * scale
            prob = _masked_softmax(scores, allowed[:, heads])
            out[:, heads, r0:r1] = prob @ vf[:, g : g + 1, :kmax]
    return out.to(q.dtype)


def dense_attention_reference(
    q, k, v, *, scale, key_mask=None, doc_ids=None, q_positions=None, q_offset=0, window=0, rows_per_chunk: int = 512
) -> torch.Tensor:
    """Exact attention over the base mask alone (every head DENSE); same arguments as the sparse one."""
    plan = LayerPlan(tuple(HeadPlan(Pattern.DENSE) for _ in range(q.shape[1])))
    return sparse_attention_reference(
        q, k, v, plan, scale=scale, key_mask=key_mask, doc_ids=doc_ids, q_positions=q_positions,
        q_offset=q_offset, window=window, rows_per_chunk=rows_per_chunk,
    )
