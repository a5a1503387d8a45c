"""Physical against logical density of one call's sparse index: the work the walk does against the keys it keeps.

* **Logical density** of a (batch, head): the (query, key) pairs its pattern keeps, counted once each and only
  where causal, over the causal pairs. Vertical-slash: the union of its vertical columns and slash diagonals;
  A-shape: its sink and window tiles; block-sparse: its listed tiles; dense: every causal pair.
* **Physical density**: the BLOCK x BLOCK tile steps the attention walk runs, over the (query tile, key tile)
  pairs that hold a causal pair. A listed tile counts whole even where the causal mask or the end of the keys
  leaves part of it unused, and the leftover columns count one step per BLOCK of them (the kernel gathers them
  BLOCK at a time), as ``minference_fx/kernels/attend.py`` walks them.

Their ratio is the waste of the layout: about 1 when the kept keys fill whole tiles (a wide local band, tiles
of a block-sparse head), up to 2 * BLOCK / (rows in a tile) per far slash diagonal, which crosses two key tiles
of every query tile while keeping one key per row of them.

The :class:`~minference_fx.kernels.reference.SparseIndex` lists tiles, not the diagonals they came from, so the
logical count of a vertical-slash head needs its picks too: :func:`key_selection` ranks the index's own
estimate scores (:func:`vs_scores`) with the index's rules (forced sinks and local diagonals, budgets floored
at MInference's minima, ties to the lower index), so its picks are the ones both index builders turn into
tiles. :func:`index_density` then works on either builder's index (the reference lists dense and A-shape
tiles, the GPU index leaves them to the kernel: both are counted from the plan).

Everything is torch on the index's device with sizes from shapes: no host sync until a caller reads a number
(:meth:`Density.overall`). The base masks other than causal (padding, documents, window) are not modelled:
densities are against the causal pairs of contiguous query positions ``q_offset + i``. A measurement helper,
never on the op's path: its file is not one of the kernel sources that key the tuned tables.
"""
from __future__ import annotations

import dataclasses

import torch

from minference_fx.plan import PATTERN_CODES, LayerPlan, Pattern

from .index import vs_estimate
from . import reference as ref
from .reference import BLOCK, SparseIndex, _masked_softmax, check_index_inputs
from .tables import int_table

# Above any position (padding of the ascending diagonal lists, for searchsorted).
_PAST_EVERY_KEY = torch.iinfo(torch.int64).max


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class KeySelection:
    """The keys vertical-slash heads keep, before the index turns them into tiles and leftover columns.

    Attributes
    ----------
    columns : int64 ``[B, Hq, C]`` vertical key columns, ascending, padded with -1 (heads of other patterns: all -1).
    diagonals : int64 ``[B, Hq, S]`` slash offsets ``pos_row - key``, ascending, padded with -1.
    """

    columns: torch.Tensor
    diagonals: torch.Tensor


@dataclasses.dataclass
class Density:
    """One call's kept keys and walked tiles per (batch, head), with the causal counts they are shares of.

    Attributes
    ----------
    logical_keys : float64 ``[B, Hq]`` causal (query, key) pairs the pattern keeps.
    causal_keys : causal (query, key) pairs of one head.
    physical_tiles : float64 ``[B, Hq]`` BLOCK x BLOCK steps the walk runs (listed tiles, column groups).
    causal_tiles : (query tile, key tile) pairs of one head that hold a causal pair.
    """

    logical_keys: torch.Tensor
    causal_keys: int
    physical_tiles: torch.Tensor
    causal_tiles: int

    @property
    def logical(self) -> torch.Tensor:
        """float64 ``[B, Hq]``: kept keys over causal keys."""
        return self.logical_keys / max(self.causal_keys, 1)

    @property
    def physical(self) -> torch.Tensor:
        """float64 ``[B, Hq]``: walked tiles over causal tiles."""
        return self.physical_tiles / max(self.causal_tiles, 1)

    def overall(self) -> tuple[float, float]:
        """(physical, logical) density of the whole call, every (batch, head) pooled; reads the device (a sync)."""
        heads = self.logical_keys.numel()
        return (float(self.physical_tiles.sum()) / max(heads * self.causal_tiles, 1),
                float(self.logical_keys.sum()) / max(heads * self.causal_keys, 1))


# --------------------------------------------------------------------------- the vertical-slash picks


def _vs_scores_torch(q, k, scale, q_offset):
    """The reference builder's estimate (``reference._vertical_slash``) for every head, causal only."""
    B, Hq, sq, _ = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    dev = q.device
    last = min(ref.VS_LAST_Q, sq)
    pos = q_offset + torch.arange(sq - last, sq, device=dev)
    j = torch.arange(skv, device=dev)
    allowed = j[None, :] <= pos[:, None]  # [last, Skv]
    delta = pos[:, None] - j[None, :]
    on_diag = (delta >= 0) & (delta < skv)
    slot = delta.clamp(0, skv - 1).reshape(1, -1).expand(B, -1)
    vertical = torch.zeros(B, Hq, skv, dtype=torch.float32, device=dev)
    slash = torch.zeros(B, Hq, skv, dtype=torch.float32, device=dev)
    for h in range(Hq):  # one head at a time: [B, last, Skv] of scratch
        scores = torch.einsum("bqd,bkd->bqk", q[:, h, sq - last:].float(), k[:, h // group].float()) * scale
        prob = _masked_softmax(scores, allowed.expand_as(scores))
        vertical[:, h] = prob.sum(dim=1)
        slash[:, h].scatter_add_(1, slot, (prob * on_diag).reshape(B, -1))
    return vertical, slash


def vs_scores(q, k, *, scale, q_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(vertical, slash) fp32 ``[B, Hq, Skv]``: the vertical-slash estimate of every head, before forcing.

    On CUDA the GPU index's own kernels (``index.vs_estimate``); elsewhere the reference builder's torch code,
    so each builder's index comes from the same scores as the picks measured against it.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if q.is_cuda:
        return vs_estimate(q, k, scale=scale, q_offset=q_offset)
    return _vs_scores_torch(q, k, scale, int(q_offset))


def _top_picks(scores: torch.Tensor, forced: int, counts: list[int]) -> torch.Tensor:
    """int64 ``[B, H, max(counts)]``: per head its ``counts[h]`` best entries (the first ``forced`` always, then
    score desc, ties to the lower index; scores not > 0 rank as 0, as the GPU index ranks them), ascending, -1
    padded."""
    B, H, length = scores.shape
    width = max(counts)
    if width == 0:
        return torch.full((B, H, 0), -1, dtype=torch.int64, device=scores.device)
    j = torch.arange(length, device=scores.device)
    ranked = torch.where(scores > 0, scores, torch.zeros_like(scores))
    ranked = torch.where(j < forced, float("inf"), ranked)
    top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :width]
    keep = torch.arange(width, device=scores.device) < int_table(counts, scores.device)[:, None]
    picked = torch.where(keep, top, _PAST_EVERY_KEY).sort(dim=-1).values
    return torch.where(picked == _PAST_EVERY_KEY, -1, picked)


def key_selection(vertical: torch.Tensor, slash: torch.Tensor, plan: LayerPlan) -> KeySelection:
    """The columns and diagonals each vertical-slash head of ``plan`` keeps, from its estimate scores.

    Parameters
    ----------
    vertical, slash : fp32 ``[B, Hq, Skv]`` from :func:`vs_scores` (no padding mask: the forced columns are the
        first keys).
    plan : one head plan per query head; heads of other patterns keep no columns and no diagonals here.
    """
    B, Hq, skv = vertical.shape
    if slash.shape != vertical.shape:
        raise ValueError(f"vertical {list(vertical.shape)} and slash {list(slash.shape)} scores must have one shape")
    if len(plan.heads) != Hq:
        raise ValueError(f"plan has {len(plan.heads)} heads, the scores have {Hq}")
    vs = [hp.pattern is Pattern.VERTICAL_SLASH for hp in plan.heads]
    n_cols = [min(max(hp.budget_a, ref.VS_MIN_COLUMNS), skv) if v else 0 for hp, v in zip(plan.heads, vs)]
    n_diags = [min(max(hp.budget_b, ref.VS_MIN_DIAGONALS), skv) if v else 0 for hp, v in zip(plan.heads, vs)]
    return KeySelection(_top_picks(vertical, ref.VS_FORCED_COLUMNS, n_cols), _top_picks(slash, ref.VS_FORCED_DIAGONALS, n_diags))


def selection_of(q, k, plan: LayerPlan, *, scale, q_offset: int = 0) -> KeySelection:
    """:func:`key_selection` of the scores :func:`vs_scores` estimates from ``q`` and ``k``."""
    check_index_inputs(q, k, plan)
    return key_selection(*vs_scores(q, k, scale=scale, q_offset=q_offset), plan)


# --------------------------------------------------------------------------- counting


def _ramp_sum(x: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """``sum_{t=1..x} clamp(t, 0, width)`` (0 for x <= 0), elementwise, int64."""
    x = x.clamp(min=0)
    inside = torch.minimum(x, width)
    return inside * (inside + 1) // 2 + (x - inside) * width


def causal_pairs(row_lo, row_hi, key_lo, key_hi, skv: int) -> torch.Tensor:
    """int64: (i, j) with ``row_lo <= i <= row_hi``, ``key_lo <= j < min(key_hi, skv)`` and ``j <= i``, elementwise
    over broadcastable int tensors (rows are positions, ascending and contiguous)."""
    row_lo, row_hi, key_lo, key_hi = (torch.as_tensor(x).long() for x in (row_lo, row_hi, key_lo, key_hi))
    width = (torch.clamp(key_hi, max=skv) - key_lo).clamp(min=0)
    # row i holds clamp(i + 1 - key_lo, 0, width) of them
    return _ramp_sum(row_hi + 1 - key_lo, width) - _ramp_sum(row_lo - key_lo, width)


def _query_tiles(sq: int, skv: int, q_offset: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query tile: its first and last position and the last key tile it can read (int64 ``[M]``)."""
    m = torch.arange(_cdiv(sq, BLOCK), device=device)
    lo = q_offset + m * BLOCK
    hi = q_offset + torch.clamp(m * BLOCK + BLOCK - 1, max=sq - 1)
    return lo, hi, torch.clamp(hi, max=skv - 1) // BLOCK


def selection_pairs(selection: KeySelection, sq: int, skv: int, q_offset: int) -> torch.Tensor:
    """float64 ``[B, H]``: causal pairs on the columns or the diagonals, each pair once."""
    cols, diags = selection.columns, selection.diagonals
    q_end = q_offset + sq
    col_ok, diag_ok = cols >= 0, diags >= 0
    # a column c is read by the rows at or after it; a diagonal d by the rows whose key i - d exists
    on_cols = torch.where(col_ok, (q_end - torch.clamp(cols, min=q_offset)).clamp(min=0), 0).sum(-1)
    on_diags = torch.where(diag_ok, (torch.clamp(diags + skv, max=q_end) - torch.clamp(diags, min=q_offset)).clamp(min=0),
                           0).sum(-1)
    # pair (row c + d, key c) sits on both: count the diagonals that put a row of the call on each column
    ordered = torch.where(diag_ok, diags, _PAST_EVERY_KEY).contiguous()
    first = torch.searchsorted(ordered, (q_offset - cols).contiguous())
    past = torch.searchsorted(ordered, (q_end - cols).contiguous())
    both = torch.where(col_ok, past - first, 0).sum(-1)
    return (on_cols + on_diags - both).double()


def _listed_logical(index: SparseIndex, lo: torch.Tensor, hi: torch.Tensor, skv: int) -> torch.Tensor:
    """float64 ``[B, H]``: causal pairs inside the listed blocks (block-sparse heads' kept keys)."""
    start = index.block_start.long()
    listed = ref.listed_slots(start, index.block_count)
    pairs = causal_pairs(lo[:, None], hi[:, None], start.clamp(min=0), start + BLOCK, skv)
    return torch.where(listed, pairs, 0).sum((-1, -2)).double()


def index_density(index: SparseIndex, plan: LayerPlan, selection: KeySelection | None = None, *, sq: int,
                  skv: int | None = None, q_offset: int = 0, force_dense: torch.Tensor | None = None) -> Density:
    """Kept keys and walked tiles of every (batch, head) of one call.

    Parameters
    ----------
    index : the call's :class:`SparseIndex`, from ``reference.build_index`` or ``index.build_index_gpu``.
    plan : one head plan per query head (dense and A-shape heads are counted from it, not from the index).
    selection : the vertical-slash heads' picks (:func:`selection_of`); needed when the plan has such heads.
    sq, skv : query rows and keys (``skv`` defaults to ``sq``); q_offset : position of row 0.
    force_dense : optional bool ``[B, Hq]``: (batch, head) pairs that run dense this call (the guard's,
        near-dense ones): they keep and walk every causal tile.

    Returns
    -------
    :class:`Density`, tensors on the index's device; nothing is read back to the host.
    """
    skv = sq if skv is None else skv
    B, Hq, M = index.block_count.shape
    if M != _cdiv(sq, BLOCK):
        raise ValueError(f"index has {M} query tiles, a call of {sq} rows has {_cdiv(sq, BLOCK)}")
    if len(plan.heads) != Hq:
        raise ValueError(f"plan has {len(plan.heads)} heads, the index has {Hq}")
    has_vs = any(hp.pattern is Pattern.VERTICAL_SLASH for hp in plan.heads)
    if has_vs and selection is None:
        raise ValueError("the logical density of vertical-slash heads needs their picks: pass "
                         "selection=selection_of(q, k, plan, scale=...)")
    if selection is not None and tuple(selection.columns.shape[:2]) != (B, Hq):
        raise ValueError(f"selection is for {list(selection.columns.shape[:2])} (B, Hq), the index for {[B, Hq]}")
    dev = index.block_count.device
    lo, hi, last_tile = _query_tiles(sq, skv, q_offset, dev)
    # on the host from shapes alone, so the denominators cost no sync
    host_lo, host_hi, host_last = _query_tiles(sq, skv, q_offset, "cpu")
    causal_tiles = int((host_last + 1).sum())
    causal_keys = int(causal_pairs(host_lo, host_hi, 0, skv, skv).sum())

    # per head: what its pattern keeps and walks when the index does not list it (dense, A-shape)
    codes = int_table([PATTERN_CODES[hp.pattern] for hp in plan.heads], dev)[None]  # [1, Hq]
    sinks = int_table([_cdiv(hp.budget_a, BLOCK) for hp in plan.heads], dev).long()[:, None]  # [Hq, 1]
    window = int_table([hp.budget_b for hp in plan.heads], dev).long()[:, None]
    # A-shape, as the kernel enumerates it: sink tiles, then the tiles from the query tile's window start on
    win_first = torch.clamp(lo[None] - window + 1, min=0) // BLOCK  # [Hq, M]
    sink_tiles = torch.minimum(sinks, win_first)
    a_tiles = (sink_tiles + (last_tile[None] - win_first + 1).clamp(min=0)).sum(-1)
    a_keys = (causal_pairs(lo[None], hi[None], 0, sink_tiles * BLOCK, skv)
              + causal_pairs(lo[None], hi[None], win_first * BLOCK, skv, skv)).sum(-1)

    listed_tiles = (index.block_count.long() + (index.col_count.long() + BLOCK - 1) // BLOCK).sum(-1).double()
    physical = torch.where(codes == PATTERN_CODES[Pattern.A_SHAPE], a_tiles.double()[None], listed_tiles)
    physical = torch.where(codes == PATTERN_CODES[Pattern.DENSE], float(causal_tiles), physical)

    logical = torch.where(codes == PATTERN_CODES[Pattern.A_SHAPE], a_keys.double()[None],
                          torch.full((B, Hq), float(causal_keys), dtype=torch.float64, device=dev))
    if has_vs:
        logical = torch.where(codes == PATTERN_CODES[Pattern.VERTICAL_SLASH],
                              selection_pairs(selection, sq, skv, q_offset).to(dev), logical)
    bs = [h for h, hp in enumerate(plan.heads) if hp.pattern is Pattern.BLOCK_SPARSE]
    if bs:
        # only the block-sparse heads' lists: a vertical-slash head's list is far wider
        heads = int_table(bs, dev).long()
        bs_index = SparseIndex(*(t.index_select(1, heads) for t in (index.block_count, index.block_start,
                                                                     index.col_count, index.col_index)))
        logical = logical.index_copy(1, heads, _listed_logical(bs_index, lo, hi, skv))
    if force_dense is not None:
        forced = force_dense.to(device=dev, dtype=torch.bool)
        physical = torch.where(forced, float(causal_tiles), physical)
        logical = torch.where(forced, float(causal_keys), logical)
    return Density(logical, causal_keys, physical, causal_tiles)
