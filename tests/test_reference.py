"""Tests of the pure-PyTorch oracle (minference_fx/kernels/reference.py).

The expected key sets are rebuilt here from the written definitions with plain
loops and float64 scores; nothing but the public functions of the reference is
used, so a shared bug would have to be made twice.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from minference_fx.kernels import reference as ref
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

BLOCK = 64


def plan_of(*heads) -> LayerPlan:
    return LayerPlan(tuple(HeadPlan(*h) for h in heads))


def dense_plan(hq: int) -> LayerPlan:
    return plan_of(*[(Pattern.DENSE,)] * hq)


def rand_qkv(b, hq, hkv, sq, skv, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --------------------------------------------------------------------------- brute force


def brute_base(pos, skv, b, key_mask=None, doc_ids=None, window=0):
    """bool [B, Sq, Skv], one row at a time."""
    j = torch.arange(skv)
    out = torch.zeros(b, len(pos), skv, dtype=torch.bool)
    for bi in range(b):
        for i, p in enumerate(pos):
            row = j <= p
            if window:
                row &= (p - j) < window
            if key_mask is not None:
                row &= key_mask[bi]
            if doc_ids is not None:
                row &= doc_ids[bi] == doc_ids[bi, p]
            out[bi, i] = row
    return out


def pick_top(scores, k, what):
    """Top-k indices by (score desc, index asc); refuses data whose k-th pick is a near tie."""
    order = sorted(range(len(scores)), key=lambda x: (-scores[x], x))
    if 0 < k < len(order):
        a, b = scores[order[k - 1]], scores[order[k]]
        if a != b and a != float("inf"):
            # the reference ranks in fp32; a closer call than this could flip
            assert a - b > 1e-5 * abs(a), f"{what}: near tie at the top-k boundary ({a} vs {b}); change the seed"
    return order[:k]


def softmax_rows64(scores, allowed):
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.zeros_like(scores)
    for r in range(scores.shape[0]):
        if allowed[r].any():
            out[r] = torch.softmax(scores[r], dim=-1)
    return out


def diagonal_blocks(diags):
    """Block offsets from the definition: each diagonal must be whole in the blocks (itself a block, or strictly
    between two blocks 64 apart); one that is not extends the last run when within 64 of its last block, else
    starts a run at itself."""
    blocks = []
    for d in sorted(diags):
        whole = d in blocks or any(x < d < x + BLOCK and x + BLOCK in blocks for x in blocks)
        if not whole:
            blocks.append(blocks[-1] + BLOCK if blocks and d - blocks[-1] <= BLOCK else d)
    return blocks


def expected_index(q, k, plan, scale, pos, base, key_mask=None):
    """{(b, h, m): (block starts in the index's order, sorted leftover columns)} from the definitions. A row's
    attention sinks (A-shape) and forced columns (vertical-slash) start at the first key its padding mask keeps."""
    B, Hq, sq, _ = q.shape
    Hkv, skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    M, N = -(-sq // BLOCK), -(-skv // BLOCK)
    lo = [min(pos[m * BLOCK : (m + 1) * BLOCK]) for m in range(M)]
    hi = [max(pos[m * BLOCK : (m + 1) * BLOCK]) for m in range(M)]
    result = {}
    for b in range(B):
        first = 0
        if key_mask is not None and bool(key_mask[b % key_mask.shape[0]].any()):
            first = int(key_mask[b % key_mask.shape[0]].nonzero()[0])
        for h, head in enumerate(plan.heads):
            qh, kh = q[b, h].double(), k[b, h // group].double()
            if head.pattern is Pattern.VERTICAL_SLASH:
                last = min(64, sq)
                rows = list(range(sq - last, sq))
                prob = softmax_rows64(qh[rows] @ kh.T * scale, base[b, rows])
                vertical = prob.sum(0).tolist()
                # slash[d] sums prob[r, j] over j = pos[row] - d: one row's keys at a time (each diagonal once per
                # row, rows in order: the same float64 sums as a loop over (r, j), without a Python step per key)
                slash = torch.zeros(skv, dtype=torch.float64)
                for r, row in enumerate(rows):
                    j = torch.arange(0, min(pos[row], skv - 1) + 1)
                    j = j[pos[row] - j < skv]
                    slash.index_add_(0, pos[row] - j, prob[r, j])
                slash = slash.tolist()
                for j in range(first, min(first + 30, skv)):
                    vertical[j] = float("inf")
                for d in range(min(100, skv)):
                    slash[d] = float("inf")
                cols = pick_top(vertical, min(max(head.budget_a, 30), skv), "vertical")
                diags = pick_top(slash, min(max(head.budget_b, 50), skv), "slash")
            if head.pattern is Pattern.BLOCK_SPARSE:
                pq = [qh[m * BLOCK : (m + 1) * BLOCK].mean(0) for m in range(M)]
                pk = [kh[n * BLOCK : (n + 1) * BLOCK].mean(0) for n in range(N)]
            for m in range(M):
                if head.pattern is Pattern.DENSE:
                    tiles, leftover = set(range(N)), []
                elif head.pattern is Pattern.A_SHAPE:
                    sink, win = head.budget_a, head.budget_b
                    w_lo, w_hi = lo[m] - win + 1, hi[m]
                    tiles = {
                        n for n in range(N)
                        if (sink > 0 and min(n * BLOCK + BLOCK, skv) - 1 >= first and n * BLOCK < first + sink)
                        or (w_lo <= w_hi and n * BLOCK <= w_hi and min(n * BLOCK + BLOCK, skv) - 1 >= w_lo)
                    }
                    leftover = []
                elif head.pattern is Pattern.VERTICAL_SLASH:
                    # a block holds keys lo - x .. lo - x + 63; a tile lists those holding a key in 0 .. min(hi, skv-1)
                    starts = sorted(lo[m] - x for x in diagonal_blocks(diags)
                                    if lo[m] - x + BLOCK - 1 >= 0 and lo[m] - x <= min(hi[m], skv - 1))
                    keys = {j for a in starts for j in range(a, a + BLOCK)}
                    leftover = sorted(j for j in cols if j not in keys and j <= hi[m])
                    if starts and starts[0] < 0:  # a block before key 0 is listed last
                        starts = starts[1:] + starts[:1]
                    result[b, h, m] = (starts, leftover)
                    continue
                else:
                    allowed = [n for n in range(N) if n * BLOCK <= hi[m] and min(n * BLOCK + BLOCK, skv) - 1 >= first]
                    forced = [n for n in allowed if n == first // BLOCK or lo[m] // BLOCK <= n <= hi[m] // BLOCK]
                    want = max(min(head.budget_a, len(allowed)), len(forced))
                    rest = [n for n in allowed if n not in forced]
                    scores = [float(pq[m] @ pk[n]) for n in rest]
                    top = pick_top(scores, want - len(forced), "block")
                    tiles, leftover = set(forced) | {rest[t] for t in top}, []
                # keys past pos_hi(m) can never be read, so the index never lists their tiles
                result[b, h, m] = (sorted(n * BLOCK for n in tiles if n * BLOCK <= hi[m]), leftover)
    return result


def check_structure(index, expected, B, Hq, M, hi):
    for name in ("block_count", "block_start", "col_count", "col_index"):
        assert getattr(index, name).dtype == torch.int32, name
    assert index.block_start.shape[:3] == (B, Hq, M) and index.col_index.shape[:3] == (B, Hq, M)
    for lists, counts, pad in ((index.block_start, index.block_count, ref.NO_BLOCK),
                               (index.col_index, index.col_count, -1)):
        valid = torch.arange(lists.shape[-1]) < counts[..., None].long()
        assert torch.equal(lists != pad, valid), "entries must be the first `count` slots, then padding"
        assert bool((lists[~valid] == pad).all())
    for (b, h, m), (starts, cols) in expected.items():
        got_starts = index.block_start[b, h, m, : index.block_count[b, h, m]].tolist()
        got_cols = index.col_index[b, h, m, : index.col_count[b, h, m]].tolist()
        assert got_starts == starts, (b, h, m)
        assert got_cols == cols, (b, h, m)
        in_order = got_starts[:-1] if got_starts and got_starts[-1] < 0 else got_starts
        assert all(y - x >= BLOCK for x, y in zip(in_order, in_order[1:])), "blocks ascending, never overlapping"
        keys = {j for a in got_starts for j in range(a, a + BLOCK)}
        assert not set(got_cols) & keys, "a column inside a listed block"
        assert all(a <= hi[m] for a in got_starts) and all(c <= hi[m] for c in got_cols), "listed past pos_hi"


# --------------------------------------------------------------------------- index fidelity

PLANS = {
    Pattern.DENSE: [(Pattern.DENSE,)] * 4,
    Pattern.A_SHAPE: [(Pattern.A_SHAPE, 100, 200), (Pattern.A_SHAPE, 64, 64), (Pattern.A_SHAPE, 0, 1), (Pattern.A_SHAPE, 5000, 30)],
    # (100, 20): fewer diagonals than the 100 forced ones, so the tie rule (lowest delta) decides;
    # (0, 100): exactly the forced diagonals and columns
    Pattern.VERTICAL_SLASH: [
        (Pattern.VERTICAL_SLASH, 40, 150), (Pattern.VERTICAL_SLASH, 100, 20),
        (Pattern.VERTICAL_SLASH, 0, 100), (Pattern.VERTICAL_SLASH, 300, 400),
    ],
    Pattern.BLOCK_SPARSE: [(Pattern.BLOCK_SPARSE, 1), (Pattern.BLOCK_SPARSE, 3), (Pattern.BLOCK_SPARSE, 8), (Pattern.BLOCK_SPARSE, 0)],
}


def _case(name):
    """(sq, skv, mask kwargs) for an index-fidelity case."""
    if name.startswith("causal"):
        s = int(name[len("causal") :])
        return s, s, {}
    if name == "masked":  # continued prefill with padding, documents and a window
        # offset 290: pos_lo(m) - 98 is tile-aligned, so diagonal 99 reaches a key tile that 0..98 do not
        sq, skv = 700, 1000
        key_mask = torch.ones(2, skv, dtype=torch.bool)
        key_mask[1, :37] = False
        doc = torch.zeros(2, skv, dtype=torch.long)
        doc[0, 450:] = 1
        doc[1, 130:] = 1
        doc[1, 800:] = 2
        return sq, skv, dict(key_mask=key_mask, doc_ids=doc, q_offset=290, window=400)
    if name == "gappy":  # q_positions with gaps: one query tile spans several key tiles
        g = torch.Generator().manual_seed(5)
        pos = torch.randperm(1500, generator=g)[:500].sort().values
        return 500, 1500, dict(q_positions=pos)
    raise KeyError(name)


@pytest.mark.parametrize("case", ["causal256", "causal1000", "causal2048", "masked", "gappy"])
@pytest.mark.parametrize("pattern", list(PLANS), ids=lambda p: p.value)
def test_index_matches_definition(pattern, case):
    sq, skv, kw = _case(case)
    B, Hq, Hkv = 2, 4, 2
    q, k, _ = rand_qkv(B, Hq, Hkv, sq, skv, seed=sq + len(case))
    plan = plan_of(*PLANS[pattern])
    scale = 16**-0.5
    pos = ref.query_positions(sq, kw.get("q_offset", 0), kw.get("q_positions"), "cpu")
    base = brute_base(pos.tolist(), skv, B, kw.get("key_mask"), kw.get("doc_ids"), kw.get("window", 0))

    index = ref.build_index(q, k, plan, scale=scale, **kw)
    expected = expected_index(q, k, plan, scale, pos.tolist(), base, kw.get("key_mask"))
    M = -(-sq // BLOCK)
    hi = [int(pos[m * BLOCK : (m + 1) * BLOCK].max()) for m in range(M)]
    check_structure(index, expected, B, Hq, M, hi)

    # the same, row by row, as the key set that attention reads
    got = ref.index_to_mask(index, range(0, sq), skv) & base[:, None]
    want = torch.zeros(B, Hq, sq, skv, dtype=torch.bool)
    for (b, h, m), (starts, cols) in expected.items():
        keys = torch.zeros(skv, dtype=torch.bool)
        for a in starts:
            keys[max(a, 0) : a + BLOCK] = True
        keys[cols] = True
        want[b, h, m * BLOCK : (m + 1) * BLOCK] = keys & base[b, m * BLOCK : (m + 1) * BLOCK]
    assert torch.equal(got, want)
    assert not bool((got & ~(torch.arange(skv)[None, :] <= pos[:, None])).any()), "a key after the query"


@pytest.mark.parametrize("seed", range(6))
def test_diagonal_blocks_hold_each_diagonal_whole_in_fewer_blocks_than_aligned_tiles(seed):
    """For a query tile of 64 contiguous rows at any position, the blocks hold every row's key on every
    selected diagonal, never overlap, and number at most what aligned key tiles would."""
    g = torch.Generator().manual_seed(seed)
    span = [200, 2000, 20000][seed % 3]
    diags = sorted(set(torch.randint(0, span, (int(torch.randint(1, 300, (1,), generator=g)),), generator=g).tolist()))
    blocks = ref.diagonal_blocks(diags)
    assert blocks == diagonal_blocks(diags) and blocks == sorted(blocks)
    assert all(y - x >= BLOCK for x, y in zip(blocks, blocks[1:])), "blocks overlap"
    lo = span + 64 * int(torch.randint(0, 8, (1,), generator=g)) + int(torch.randint(0, 64, (1,), generator=g))
    keys = {lo - x + c for x in blocks for c in range(BLOCK)}
    assert all(r - d in keys for d in diags for r in range(lo, lo + BLOCK)), "a selected diagonal is not whole"
    aligned = {n for d in diags for n in range((lo - d) // BLOCK, (lo + BLOCK - 1 - d) // BLOCK + 1)}
    assert len(blocks) <= len(aligned)


def test_base_allowed_matches_definition():
    sq, skv, kw = _case("masked")
    pos = ref.query_positions(sq, kw["q_offset"], None, "cpu")
    got = ref.base_allowed(pos, skv, kw["key_mask"], kw["doc_ids"], kw["window"])
    assert got.shape == (2, 1, sq, skv)
    assert torch.equal(got[:, 0], brute_base(pos.tolist(), skv, 2, kw["key_mask"], kw["doc_ids"], kw["window"]))
    assert ref.base_allowed(pos, skv).shape == (1, 1, sq, skv)


def test_index_to_mask_row_slices_agree():
    q, k, _ = rand_qkv(1, 4, 2, 300, 300)
    index = ref.build_index(q, k, plan_of(*PLANS[Pattern.VERTICAL_SLASH]), scale=0.25)
    whole = ref.index_to_mask(index, slice(0, 300), 300)
    assert torch.equal(ref.index_to_mask(index, range(70, 201), 300), whole[:, :, 70:201])


# --------------------------------------------------------------------------- attention outputs


def sdpa_masked(q, k, v, allowed, scale):
    """Dense fp32 SDPA with a bool [B|1, 1, Sq, Skv] mask and GQA."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("s", [300, 777])
def test_covering_budgets_equal_dense(s):
    q, k, v = rand_qkv(1, 6, 2, s, s, seed=s)
    n = -(-s // BLOCK)
    plan = plan_of(
        (Pattern.DENSE,), (Pattern.A_SHAPE, 0, s), (Pattern.A_SHAPE, s, 1),
        (Pattern.VERTICAL_SLASH, s, s), (Pattern.BLOCK_SPARSE, n), (Pattern.BLOCK_SPARSE, n + 5),
    )
    out = ref.sparse_attention_reference(q, k, v, plan, scale=0.25)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_small_budgets_are_sparse():
    # guards against an index that quietly lists everything
    q, k, v = rand_qkv(1, 3, 1, 1024, 1024)
    plan = plan_of((Pattern.A_SHAPE, 64, 64), (Pattern.VERTICAL_SLASH, 30, 50), (Pattern.BLOCK_SPARSE, 2))
    mask = ref.index_to_mask(ref.build_index(q, k, plan, scale=0.25), range(0, 1024), 1024)
    causal = torch.ones(1024, 1024, dtype=torch.bool).tril()
    for h in range(3):
        assert (mask[0, h] & causal).sum() < 0.5 * causal.sum()
    dense = ref.dense_attention_reference(q, k, v, scale=0.25)
    assert not torch.allclose(ref.sparse_attention_reference(q, k, v, plan, scale=0.25), dense, atol=1e-3)


@pytest.mark.parametrize("group", [1, 3, 4])
def test_gqa_groups(group):
    q, k, v = rand_qkv(2, 2 * group, 2, 200, 200, seed=group)
    out = ref.dense_attention_reference(q, k, v, scale=0.3)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_left_padding_batch2():
    s, pads = 300, [0, 77]
    q, k, v = rand_qkv(2, 4, 2, s, s, seed=3)
    key_mask = torch.ones(2, s, dtype=torch.bool)
    for b, p in enumerate(pads):
        key_mask[b, :p] = False
    out = ref.dense_attention_reference(q, k, v, scale=0.25, key_mask=key_mask)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & key_mask[:, None, None, :]
    want = sdpa_masked(q, k, v, allowed, 0.25)
    for b, p in enumerate(pads):
        torch.testing.assert_close(out[b, :, p:], want[b, :, p:], atol=1e-5, rtol=0)
        assert bool((out[b, :, :p] == 0).all()), "padding query rows read nothing"


@pytest.mark.parametrize("positions", [False, True])
def test_query_offset(positions):
    sq, skv, off = 130, 400, 270
    q, k, v = rand_qkv(1, 4, 2, sq, skv, seed=7)
    kw = dict(q_positions=torch.arange(sq) + off) if positions else dict(q_offset=off)
    allowed = (torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + off)[None, None]
    want = sdpa_masked(q, k, v, allowed, 0.25)
    torch.testing.assert_close(ref.dense_attention_reference(q, k, v, scale=0.25, **kw), want, atol=1e-5, rtol=0)
    covering = plan_of((Pattern.VERTICAL_SLASH, skv, skv), (Pattern.BLOCK_SPARSE, 99), (Pattern.A_SHAPE, 0, skv), (Pattern.DENSE,))
    torch.testing.assert_close(ref.sparse_attention_reference(q, k, v, covering, scale=0.25, **kw), want, atol=1e-5, rtol=0)


def test_non_contiguous_positions():
    sq, skv = 200, 600
    pos = torch.randperm(skv, generator=torch.Generator().manual_seed(1))[:sq]  # unsorted, with gaps
    q, k, v = rand_qkv(1, 2, 1, sq, skv, seed=9)
    allowed = (torch.arange(skv)[None, :] <= pos[:, None])[None, None]
    out = ref.dense_attention_reference(q, k, v, scale=0.25, q_positions=pos)
    torch.testing.assert_close(out, sdpa_masked(q, k, v, allowed, 0.25), atol=1e-5, rtol=0)


def test_window():
    s, w = 300, 100
    q, k, v = rand_qkv(1, 4, 2, s, s, seed=11)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    want = sdpa_masked(q, k, v, ((j <= i) & (i - j < w))[None, None], 0.25)
    torch.testing.assert_close(ref.dense_attention_reference(q, k, v, scale=0.25, window=w), want, atol=1e-5, rtol=0)


def test_doc_ids():
    s = 300
    q, k, v = rand_qkv(2, 4, 2, s, s, seed=13)
    doc = torch.zeros(2, s, dtype=torch.long)
    doc[0, 90:], doc[0, 200:] = 1, 2
    doc[1, 150:] = 1
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = ((j <= i)[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]
    want = sdpa_masked(q, k, v, allowed, 0.25)
    torch.testing.assert_close(ref.dense_attention_reference(q, k, v, scale=0.25, doc_ids=doc), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("s", [1, 63, 65, 129])
def test_odd_lengths(s):
    q, k, v = rand_qkv(1, 4, 2, s, s, seed=s)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    covering = plan_of((Pattern.VERTICAL_SLASH, s, s), (Pattern.BLOCK_SPARSE, 9), (Pattern.A_SHAPE, 0, s), (Pattern.DENSE,))
    torch.testing.assert_close(ref.sparse_attention_reference(q, k, v, covering, scale=0.25), want, atol=1e-5, rtol=0)
    small = plan_of((Pattern.VERTICAL_SLASH, 0, 0), (Pattern.BLOCK_SPARSE, 0), (Pattern.A_SHAPE, 1, 1), (Pattern.A_SHAPE, 0, 1))
    out = ref.sparse_attention_reference(q, k, v, small, scale=0.25)
    assert out.shape == q.shape and bool(out.isfinite().all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    q, k, v = rand_qkv(1, 4, 2, 200, 200, seed=17, dtype=dtype)
    plan = plan_of(*PLANS[Pattern.VERTICAL_SLASH][:2], *PLANS[Pattern.BLOCK_SPARSE][:2])
    out = ref.sparse_attention_reference(q, k, v, plan, scale=0.25)
    assert out.dtype == dtype and out.is_contiguous() and bool(out.isfinite().all())
    # fp32 math on the same rounded inputs: only the final rounding differs
    want = ref.sparse_attention_reference(q.float(), k.float(), v.float(), plan, scale=0.25)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


def test_row_without_keys_is_zero():
    s = 200
    q, k, v = rand_qkv(2, 4, 2, s, s, seed=19)
    key_mask = torch.ones(2, s, dtype=torch.bool)
    key_mask[1] = False  # a whole sequence of padding
    plan = plan_of(*PLANS[Pattern.VERTICAL_SLASH][:1], *PLANS[Pattern.BLOCK_SPARSE][:1], *PLANS[Pattern.A_SHAPE][:1], (Pattern.DENSE,))
    out = ref.sparse_attention_reference(q, k, v, plan, scale=0.25, key_mask=key_mask)
    assert bool(out.isfinite().all())
    assert bool((out[1] == 0).all())
    # positions before the first key (continued prefill never does this, but it must not be NaN)
    out = ref.dense_attention_reference(q, k, v, scale=0.25, q_positions=torch.arange(s) - 5)
    assert bool((out[:, :, :5] == 0).all()) and bool(out.isfinite().all())


def test_chunking_and_prebuilt_index_agree():
    q, k, v = rand_qkv(1, 4, 2, 333, 333, seed=23)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    plan = plan_of(*PLANS[Pattern.VERTICAL_SLASH][:2], (Pattern.A_SHAPE, 64, 100), (Pattern.BLOCK_SPARSE, 2))
    index = ref.build_index(q, k, plan, scale=0.25)
    a = ref.sparse_attention_reference(q, k, v, plan, scale=0.25)
    b = ref.sparse_attention_reference(q_strided, k, v, plan, scale=0.25, index=index, rows_per_chunk=37)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        ref.sparse_attention_reference(q[:, :, :64], k, v, plan, scale=0.25, index=index)


@pytest.mark.slow
def test_16k_tokens():
    """The oracle at 16K tokens (256 key tiles, chunked rows): finite and the right shape. One call with
    an A-shape and a vertical-slash head sharing a KV head (GQA group 2) runs both patterns there; they ran as two
    calls of two heads each before, twice the CPU time for the same code paths."""
    s = 16384
    q, k, v = rand_qkv(1, 2, 1, s, s, seed=29)
    plan = plan_of((Pattern.A_SHAPE, 128, 1024), (Pattern.VERTICAL_SLASH, 1000, 200))
    out = ref.sparse_attention_reference(q, k, v, plan, scale=0.25)
    assert out.shape == q.shape and bool(out.isfinite().all())
