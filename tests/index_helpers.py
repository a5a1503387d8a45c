"""Helpers of the index builder's tests (test_index.py, test_index_edges.py): plans, random inputs, an index's key
masks, its format checks, and the float64 guard against near ties at a top-k cut (see test_index.py)."""
from __future__ import annotations

import torch

from minference_fx.kernels import reference as ref
from minference_fx.kernels.index import index_capacity, index_start_dtype
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

BLOCK = 64
VS, BS, DENSE, ASHAPE = Pattern.VERTICAL_SLASH, Pattern.BLOCK_SPARSE, Pattern.DENSE, Pattern.A_SHAPE


def plan_of(*heads) -> LayerPlan:
    return LayerPlan(tuple(HeadPlan(*h) for h in heads))


def rand_qk(b, hq, hkv, sq, skv, d, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(b, hkv, skv, d, generator=g).to(device=device, dtype=dtype)
    return q, k


def as_masks(index, skv):
    """(keys of the listed blocks bool [B, Hq, M, Skv], columns bool [B, Hq, M, Skv]) of an index."""
    def scatter(idx, length):
        idx = idx.long()
        out = torch.zeros(*idx.shape[:3], length + 1, dtype=torch.bool, device=idx.device)
        return out.scatter_(-1, torch.where(idx >= 0, idx, length), True)[..., :length]

    return ref.block_keys(index, skv), scatter(index.padded().col_index, skv)


def check_format(index, plan, sq, skv):
    """dtypes, `count` entries then padding, blocks ascending and apart (a block before key 0 last), capacities
    as promised, no column inside a listed block."""
    B, Hq, M = index.block_count.shape
    assert M == -(-sq // BLOCK)
    tile_cap, col_cap = index_capacity(plan, skv)
    assert index.block_start.shape == (B, Hq, M, tile_cap) and index.col_index.shape == (B, Hq, M, col_cap)
    assert index.block_start.dtype == index_start_dtype(skv) and index.col_index.dtype == torch.int32
    # slots past the counts are left unwritten (SparseIndex): checked in the padded form
    index = index.padded()
    for lists, counts, pad in ((index.block_start, index.block_count, ref.NO_BLOCK),
                               (index.col_index, index.col_count, -1)):
        assert counts.dtype == torch.int32
        valid = torch.arange(lists.shape[-1], device=lists.device) < counts[..., None].long()
        assert torch.equal(lists != pad, valid), "entries must fill the first `count` slots, then padding"
        assert bool((lists[~valid] == pad).all()) and bool((lists[valid] > -BLOCK).all())
    steps = index.col_index[..., 1:].int() - index.col_index[..., :-1].int()
    assert bool((steps[(index.col_index[..., 1:] >= 0)] > 0).all()), "columns must be strictly ascending"
    starts = index.block_start.int()
    # every step between listed blocks ascends by a block at least, but into a last entry before key 0
    slot = torch.arange(1, starts.shape[-1], device=starts.device)
    count = index.block_count[..., None].long()
    wrapped_last = (slot == count - 1) & (starts[..., 1:] < 0)
    steps = (starts[..., 1:] - starts[..., :-1])[(slot < count) & ~wrapped_last]
    assert bool((steps >= BLOCK).all()), "blocks must ascend and never overlap"
    keys, cols = as_masks(index, skv)
    assert not bool((keys & cols).any()), "a column inside a listed block"


def base_rows(pos, skv, B, key_mask, doc_ids, window):
    return ref.base_allowed(pos, skv, key_mask, doc_ids, window)[:, 0].expand(B, -1, -1)


def brute_vs(q, k, scale, key_mask=None, doc_ids=None, q_offset=0, window=0):
    """(vertical, slash) [B, Hq, Skv] in float64 straight from the definition."""
    B, Hq, sq, _ = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    last = min(64, sq)
    pos = torch.arange(sq - last, sq) + q_offset
    allowed = base_rows(pos, skv, B, key_mask, doc_ids, window)  # [B, last, Skv]
    kk = k.double().repeat_interleave(group, dim=1)
    scores = q[:, :, sq - last :].double() @ kk.transpose(-1, -2) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    prob = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing allowed: zeros
    vertical = prob.sum(2)
    delta = pos[:, None] - torch.arange(skv)[None, :]
    on = (delta >= 0) & (delta < skv)
    slash = torch.zeros(B, Hq, skv + 1, dtype=torch.float64)
    slash.scatter_add_(2, torch.where(on, delta, skv).reshape(1, 1, -1).expand(B, Hq, -1), prob.reshape(B, Hq, -1))
    return vertical, slash[..., :skv]


def _cut_ok(values, k, what):
    """The k-th and (k+1)-th largest (stable order) are equal exactly or clearly apart."""
    if not 0 < k < values.shape[-1]:
        return
    top = values.sort(dim=-1, descending=True).values
    a, b = top[..., k - 1], top[..., k]
    exact = a == b  # both builders break exact ties by index alike
    apart = (a > b) & (torch.isinf(a) | ((a - b) > 1e-5 * a.abs()))
    assert bool((exact | apart).all()), f"{what}: near tie at the top-k cut; change the seed"


def assert_no_near_tie(q, k, plan, scale, key_mask=None, doc_ids=None, q_offset=0, window=0):
    B, Hq, sq, _ = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    vertical, slash = brute_vs(q, k, scale, key_mask, doc_ids, q_offset, window)
    j = torch.arange(skv)
    vertical = vertical.masked_fill(j < 30, float("inf"))
    slash = slash.masked_fill(j < 100, float("inf"))
    M, N = -(-sq // BLOCK), -(-skv // BLOCK)
    for h, hp in enumerate(plan.heads):
        if hp.pattern is VS:
            _cut_ok(vertical[:, h], min(max(hp.budget_a, 30), skv), f"vertical of head {h}")
            _cut_ok(slash[:, h], min(max(hp.budget_b, 50), skv), f"slash of head {h}")
        elif hp.pattern is BS:
            def pool(x, tiles):
                return torch.stack([x[:, t * BLOCK : (t + 1) * BLOCK].double().mean(1) for t in range(tiles)], 1)

            score = pool(q[:, h], M) @ pool(k[:, h // group], N).transpose(1, 2)  # [B, M, N]
            for m in range(M):
                hi = q_offset + min(m * BLOCK + BLOCK - 1, sq - 1)
                lo = q_offset + m * BLOCK
                n = torch.arange(N)
                allowed = n * BLOCK <= hi
                forced = allowed & ((n == 0) | ((n >= lo // BLOCK) & (n <= hi // BLOCK)))
                free = allowed & ~forced
                want = max(min(hp.budget_a, int(allowed.sum())), int(forced.sum())) - int(forced.sum())
                _cut_ok(score[:, m, free], want, f"block scores of head {h}, tile {m}")


def assert_lists_as_taken(got, want, vs_heads: torch.Tensor) -> None:
    """``got`` (index.build_index_escalated_gpu) equals ``want`` (dense.take_index of the pair) slot for slot, but
    for the slots of rows that are not vertical-slash (``vs_heads``, [Hq] bool): a weak block-sparse row lists
    nothing in both, and its slots past that count of 0 are free. Slots past the counts are never written, so they
    compare padded."""
    got, want = got.padded(), want.padded()
    for name in ("block_count", "col_count", "block_start", "col_index"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, name
        same = a == b
        if name in ("block_start", "col_index"):
            same = same | ~vs_heads[None, :, None, None]
        assert bool(same.all()), name
