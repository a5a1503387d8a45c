"""Which (batch, head) pairs run dense this call, decided on the device with no host sync.

* quality: a vertical-slash or block-sparse head that captures too little attention mass (``captured_mass``);
* speed: a head whose index keeps nearly every causal tile (``near_dense``): walking them all is
  cheaper than walking the list, and exact.

The vertical-slash estimate already has the softmax of the last ``min(64, Sq)``
query rows over every key (its column sums are the vertical scores). The mass
those rows keep under the index is the column sums over the last query tile's
key set: exact for rows inside that tile, a close estimate when the last rows
straddle two tiles. A head under the threshold is switched to dense for that
call — per (batch, head), on the device, with no host sync.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F

from .reference import (BLOCK, NO_BLOCK, VS_LAST_Q, SparseIndex, _masked_softmax, base_allowed, first_kept_keys,
                        listed_slots, query_positions)

# A head whose index keeps this share of its causal key tiles (leftover columns counted as tiles of
# BLOCK) runs dense: at most 1/0.9 = 1.11x the tiles, at 1.24x the speed per tile (the dense walk against the
# sparse walk on the same diffuse heads at 128K on an H200, 263.7 ms for every tile vs 326.5 ms for 99.8 % of
# them: git show 6fb579a:results/explore_dense_h200_2026-11-30_v4.txt), and exact. Random-weight models (diffuse attention)
# land here; real heads rarely do.
NEAR_DENSE_SHARE = 0.9

# Counting on the GPU needs a host sync per call, so there it is opt-in.
STATS_ON_GPU = os.environ.get("MINFERENCE_FX_GUARD_STATS", "") == "1"


@dataclasses.dataclass
class GuardStats:
    calls: int = 0
    heads_checked: int = 0
    heads_forced_dense: int = 0


STATS = GuardStats()


def record(force: torch.Tensor, checked: int, stats: GuardStats = STATS) -> None:
    """Add one call's firing to ``stats``, the guard's process-wide counters unless told otherwise (a host sync
    on GPU: only when asked for)."""
    if force.is_cuda and not STATS_ON_GPU:
        return
    stats.calls += 1
    stats.heads_checked += checked
    stats.heads_forced_dense += int(force.sum())


def captured_mass(vertical: torch.Tensor, index: SparseIndex, rows: int) -> torch.Tensor:
    """[B, H]: share of the last ``rows`` rows' attention mass inside the last query tile's key set.

    vertical : ``[B, H, Skv]`` column sums of those rows' probabilities; index : the heads' index (same H).
    """
    B, H, skv = vertical.shape
    # a block's mass is a difference of prefix sums, in float64 so that one 64-key block of a 1M row keeps its digits
    prefix = F.pad(vertical.double().cumsum(-1), (1, 0))
    start = index.block_start[:, :, -1].long()
    listed = listed_slots(start, index.block_count[:, :, -1])
    block_mass = prefix.gather(-1, (start + BLOCK).clamp(0, skv)) - prefix.gather(-1, start.clamp(0, skv))
    in_tiles = (block_mass * listed).sum(-1).to(vertical.dtype)
    cols = index.col_index[:, :, -1].long()
    listed_cols = listed_slots(cols, index.col_count[:, :, -1])
    cols = torch.where(listed_cols, cols, 0)
    in_cols = (vertical.gather(-1, cols) * listed_cols).sum(-1) if cols.shape[-1] else 0.0
    return (in_tiles + in_cols) / max(rows, 1)


def vertical_scores(q, k, *, scale, key_mask=None, doc_ids=None, q_offset=0, window=0) -> torch.Tensor:
    """[B, Hq, Skv] column sums of the last rows' masked softmax (the reference's vertical estimate, unforced)."""
    B, Hq, sq, _ = q.shape
    group = Hq // k.shape[1]
    last = min(VS_LAST_Q, sq)
    pos = query_positions(sq, q_offset, None, q.device)[sq - last:]
    allowed = base_allowed(pos, k.shape[2], key_mask, doc_ids, window)  # [B|1, 1, last, Skv]
    k_rep = k.float().repeat_interleave(group, 1)
    scores = q[:, :, sq - last:].float() @ k_rep.transpose(-1, -2) * scale
    return _masked_softmax(scores, allowed.expand_as(scores)).sum(2)


def densify(index: SparseIndex, force: torch.Tensor, sq: int, skv: int, q_offset: int) -> SparseIndex:
    """The index with every forced (b, h) listing all causal tiles and no columns (reference path)."""
    n = -(-skv // BLOCK)
    B, H, M, T = index.block_start.shape
    cap = max(T, n)
    last = torch.clamp(q_offset + torch.clamp(torch.arange(M) * BLOCK + BLOCK - 1, max=sq - 1), max=skv - 1) // BLOCK
    dense_idx = torch.arange(cap).expand(M, cap)
    dense_idx = torch.where(dense_idx <= last[:, None], dense_idx * BLOCK, NO_BLOCK).to(torch.int32).to(index.block_start.device)
    dense_cnt = (last + 1).to(torch.int32).to(index.block_count.device)
    f = force[:, :, None]
    block_start = F.pad(index.block_start.to(torch.int32), (0, cap - T), value=NO_BLOCK)
    return SparseIndex(
        block_count=torch.where(f, dense_cnt.expand(B, H, M), index.block_count),
        block_start=torch.where(f[..., None], dense_idx.expand(B, H, M, cap), block_start),
        col_count=torch.where(f, 0, index.col_count),
        col_index=index.col_index,
    )


@functools.lru_cache(maxsize=64)
def causal_tiles(sq: int, skv: int, q_offset: int) -> int:
    """How many (query tile, key tile) pairs hold at least one causal (query, key) pair."""
    m_tiles = -(-sq // BLOCK)
    return sum(min(q_offset + min(m * BLOCK + BLOCK - 1, sq - 1), skv - 1) // BLOCK + 1 for m in range(m_tiles))


def kept_share(index: SparseIndex, sq: int, skv: int, q_offset: int, key_mask=None) -> torch.Tensor:
    """[B, H] fp32: the share of the causal key tiles each head's index keeps (its columns counted as tiles of
    ``BLOCK``), the work the sparse walk does for that head against the work of a dense one.

    With a padding mask both counts start at each row's first kept key: a left-padded prompt's padding query
    tiles read nothing and its padding key tiles hold no key it reads, so counting them decided a head of the
    same prompt one way padded and the other unpadded (output off by 0.46-0.67). Computed on the device: no sync."""
    if key_mask is None:
        kept = index.block_count.sum(-1, dtype=torch.float32) + index.col_count.sum(-1, dtype=torch.float32) / BLOCK
        return kept / max(causal_tiles(sq, skv, q_offset), 1)
    dev = index.block_count.device
    first = first_kept_keys(key_mask, dev)[:, None]  # [B or 1, 1]
    m = torch.arange(index.block_count.shape[-1], device=dev)
    hi = q_offset + torch.clamp(m * BLOCK + BLOCK - 1, max=sq - 1)  # each query tile's last position
    sees = hi[None] >= first  # [B or 1, M]
    causal = torch.where(sees, torch.clamp(hi, max=skv - 1)[None] // BLOCK - first // BLOCK + 1, 0).sum(-1)
    kept = (index.block_count * sees[:, None]).sum(-1, dtype=torch.float32)
    kept = kept + (index.col_count * sees[:, None]).sum(-1, dtype=torch.float32) / BLOCK
    causal = causal[:, None].to(torch.float32)
    # a row that sees no key has nothing to skip: as good as dense (it attends to nothing either way)
    return torch.where(causal > 0, kept / causal.clamp(min=1), 1.0)


def near_dense(index: SparseIndex, sq: int, skv: int, q_offset: int, key_mask=None) -> torch.Tensor:
    """[B, H] bool: the heads whose index keeps at least ``NEAR_DENSE_SHARE`` of the causal tiles
    (:func:`kept_share`)."""
    return kept_share(index, sq, skv, q_offset, key_mask) >= NEAR_DENSE_SHARE
