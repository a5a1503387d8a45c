"""The on-device index builder (minference_fx/kernels/index.py) against the oracle (minference_fx/kernels/reference.py).

On CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by
conftest), so the same code paths as on the GPU are exercised, only slower.
Indexes are compared as sets (tile masks / column masks per (b, h, m)):
the two builders may allocate different capacities.

About ties: both builders rank by (score desc, index asc). The GPU builder
does so exactly through int64 keys, so *exact* ties (the zero-probability
columns of padded or out-of-window keys, the +inf forced picks) resolve the
same way on both sides. What cannot agree is a *near* tie: the two sides sum
the same probabilities in a different order, so two scores a few ulps apart
may swap. Random normal q/k make that unlikely, and ``assert_no_near_tie``
checks every top-k cut of a case in float64 so that a bad seed fails loudly
as "near tie" rather than as a mismatch.
"""
from __future__ import annotations

import pytest
import torch

from minference_fx.kernels import reference as ref
from minference_fx.kernels.index import build_index_gpu, index_bytes, index_capacity, vs_estimate
from minference_fx.plan import HeadPlan, LayerPlan
from index_helpers import (ASHAPE, BLOCK, BS, DENSE, VS, as_masks, assert_lists_as_taken, assert_no_near_tie, brute_vs,
                           check_format, plan_of, rand_qk)


def assert_matches_reference(q, k, plan, *, scale=None, **kw):
    """The GPU index lists exactly the reference's tiles and columns for VS/BS heads, nothing for the others."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sq, skv = q.shape[2], k.shape[2]
    got = build_index_gpu(q, k, plan, scale=scale, **kw)
    check_format(got, plan, sq, skv)
    want = ref.build_index(q, k, plan, scale=scale, **kw)
    assert_no_near_tie(q.cpu(), k.cpu(), plan, scale, **{n: (v.cpu() if torch.is_tensor(v) else v) for n, v in kw.items()})
    got_tiles, got_cols = as_masks(got, skv)
    want_tiles, want_cols = as_masks(want, skv)
    for h, hp in enumerate(plan.heads):
        if hp.pattern in (VS, BS):
            for b in range(q.shape[0]):
                for m in range(got.block_count.shape[2]):
                    assert torch.equal(got_tiles[b, h, m], want_tiles[b, h, m]), (
                        f"tiles of (b={b}, h={h} {hp}, m={m}): got {got_tiles[b, h, m].nonzero().flatten().tolist()}, "
                        f"want {want_tiles[b, h, m].nonzero().flatten().tolist()}"
                    )
                    assert torch.equal(got_cols[b, h, m], want_cols[b, h, m]), (
                        f"columns of (b={b}, h={h} {hp}, m={m}): got {got_cols[b, h, m].nonzero().flatten().tolist()}, "
                        f"want {want_cols[b, h, m].nonzero().flatten().tolist()}"
                    )
        else:
            assert int(got.block_count[:, h].abs().sum()) == 0 and int(got.col_count[:, h].abs().sum()) == 0, h
    return got


# (100, 20): fewer diagonals than the 100 forced ones, so the forced tie rule (lowest delta) decides;
# (0, 0): only the forced minima
MIXED = plan_of(
    (VS, 40, 60), (DENSE,), (BS, 2), (ASHAPE, 64, 128),
    (VS, 100, 20), (BS, 5), (VS, 0, 0), (BS, 0),
)


# --------------------------------------------------------------------------- index == reference


@pytest.mark.parametrize("dtype,d", [(torch.float32, 16), (torch.float16, 32)], ids=["fp32-d16", "fp16-d32"])
def test_mixed_plan_matches_reference(dtype, d):
    q, k = rand_qk(1, 8, 2, 384, 384, d, dtype, seed=1)
    assert_matches_reference(q, k, MIXED)


@pytest.mark.parametrize("hq,hkv", [(3, 3), (6, 2), (8, 2)], ids=["group1", "group3", "group4"])
def test_gqa_groups(hq, hkv):
    heads = [(VS, 50, 80), (BS, 3), (VS, 200, 150), (BS, 1), (DENSE,), (VS, 30, 50), (BS, 4), (ASHAPE, 1, 64)][:hq]
    q, k = rand_qk(1, hq, hkv, 256, 256, 16, seed=hq)
    assert_matches_reference(q, k, plan_of(*heads))


def test_left_padding_differs_per_batch():
    # Padded keys have probability exactly 0 for every row; the vertical budget 300
    # exceeds the keys that carry probability in batch 1, so its last picks are
    # zero-probability ties, which both builders give to the lowest indices.
    sq = 320
    key_mask = torch.ones(2, sq, dtype=torch.bool)
    key_mask[0, :10] = False
    key_mask[1, :100] = False
    q, k = rand_qk(2, 4, 2, sq, sq, 16, seed=3)
    plan = plan_of((VS, 300, 60), (BS, 2), (VS, 40, 120), (DENSE,))
    assert_matches_reference(q, k, plan, key_mask=key_mask)


@pytest.mark.parametrize("s", [1, 63, 65, 129])
def test_odd_lengths(s):
    q, k = rand_qk(2, 4, 2, s, s, 16, seed=s)
    assert_matches_reference(q, k, plan_of((VS, 30, 50), (BS, 2), (VS, 64, 10), (ASHAPE, 4, 16)))


def test_an_odd_count_of_rank_keys():
    # B x vertical-slash heads x Skv odd: the diagonals' rank keys start one slot past the columns' (16-byte
    # aligned), and the one top-k over both kinds reads them through strides
    q, k = rand_qk(1, 3, 1, 129, 129, 16, seed=129)
    assert_matches_reference(q, k, plan_of((VS, 30, 50), (BS, 2), (DENSE,)))


@pytest.mark.parametrize("sq,skv", [(100, 356), (65, 200)], ids=["aligned", "unaligned"])
def test_query_offset(sq, skv):
    # unaligned: q_offset 135 puts each query tile across two key tiles, so diagonals hit two tiles
    # and block-sparse tiles have two diagonal tiles forced
    q, k = rand_qk(1, 4, 2, sq, skv, 32, torch.float16, seed=7)
    plan = plan_of((VS, 40, 60), (BS, 2), (BS, 6), (VS, 120, 30))
    assert_matches_reference(q, k, plan, q_offset=skv - sq)


@pytest.mark.parametrize(
    "sq,skv,offset",
    [(100, 300, 0), (70, 200, 40), (260, 130, 40)],
    ids=["keys-past-last-row", "keys-past-unaligned", "rows-past-last-key"],
)
def test_rows_and_keys_not_ending_together(sq, skv, offset):
    # Only here do the clipping rules show: a short last query tile must end at its real last row
    # (with an unaligned offset the next key tile exists but may not be read), and a diagonal whose
    # keys all lie past Skv-1 must touch no tile (rows far past the keys, only forced diagonals).
    q, k = rand_qk(1, 4, 2, sq, skv, 16, seed=43)
    plan = plan_of((VS, 40, 60), (BS, 2), (VS, 150, 20), (BS, 7))
    assert_matches_reference(q, k, plan, q_offset=offset)


@pytest.mark.parametrize(
    "sq,skv,delta",
    [(512, 512, 192), (512, 512, 256), (500, 500, 380), (300, 430, 250)],
    ids=["tile-start", "tile-end", "short-last-tile", "unaligned-offset"],
)
def test_planted_diagonal(sq, skv, delta):
    # Random data rarely puts a lone selected diagonal right at a tile boundary, where an
    # off-by-one in "which key tiles does diagonal delta cross" would show. Here every row
    # attends strongly to the key delta positions back, and a slash budget of 101 keeps
    # the 100 forced diagonals plus exactly that one: the diagonal sits at the first or
    # last offset that reaches a key tile, or only inside a short last query tile's span.
    offset = skv - sq
    q, k = rand_qk(1, 2, 2, sq, skv, 32, seed=47)
    rows = torch.arange(skv) + delta - offset  # the query row that should read key j
    ok = (rows >= 0) & (rows < sq)
    k[:, :, ok] = 3 * q[:, :, rows[ok]] + 0.1 * k[:, :, ok]
    plan = plan_of((VS, 30, 101), (VS, 40, 101))
    got = assert_matches_reference(q, k, plan, q_offset=offset)
    vertical, slash = vs_estimate(q, k, scale=32 ** -0.5, q_offset=offset)
    assert int(slash[0, 0, 100:].argmax()) + 100 == delta  # the planted diagonal is the one picked
    assert int(got.block_count.sum()) > 0


def test_window_padding_and_documents():
    sq, skv = 200, 320
    key_mask = torch.ones(2, skv, dtype=torch.bool)
    key_mask[1, :50] = False
    doc = torch.zeros(2, skv, dtype=torch.long)
    doc[0, 180:] = 1
    doc[1, 250:] = 1
    q, k = rand_qk(2, 4, 1, sq, skv, 16, seed=11)
    plan = plan_of((VS, 60, 70), (BS, 3), (VS, 30, 200), (DENSE,))
    assert_matches_reference(q, k, plan, q_offset=skv - sq, window=100)
    assert_matches_reference(q, k, plan, q_offset=skv - sq, key_mask=key_mask, doc_ids=doc, window=150)


def test_strided_inputs():
    # [B, S, H, D] storage seen as [B, H, S, D], as the layout pass hands it over
    q, k = rand_qk(1, 4, 2, 192, 192, 16, seed=13)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert_matches_reference(q, k, plan_of((VS, 30, 60), (BS, 2), (VS, 50, 50), (BS, 1)))


@pytest.mark.slow
def test_longer_mixed_plan():
    q, k = rand_qk(2, 4, 2, 512, 512, 32, torch.float16, seed=17)
    key_mask = torch.ones(2, 512, dtype=torch.bool)
    key_mask[1, :77] = False
    assert_matches_reference(q, k, plan_of((VS, 100, 200), (BS, 3), (VS, 30, 400), (ASHAPE, 64, 64)), key_mask=key_mask)


def test_only_dense_heads_and_empty_inputs():
    q, k = rand_qk(1, 2, 1, 100, 100, 16)
    idx = build_index_gpu(q, k, plan_of((DENSE,), (ASHAPE, 4, 64)), scale=0.25)
    assert idx.block_start.shape == (1, 2, 2, 0) and int(idx.block_count.abs().sum()) == 0
    idx = build_index_gpu(q[:, :, :0], k, plan_of((VS, 30, 50), (BS, 2)), scale=0.25)
    assert idx.block_count.shape == (1, 2, 0)


def test_tile_capacity_reached_exactly():
    # The capacity is the worst case: the forced run 0..99 takes 3 diagonal blocks (offsets 0, 64, 128), and
    # each other diagonal, far from the rest, one of its own. With 3 such diagonals the last query tile lists
    # exactly 3 + 3 = index_capacity slots: one fewer would drop a block and differ from the reference.
    sq, offset = 1920, 98
    skv = sq + offset
    deltas = [400, 910, 1420]
    q, k = rand_qk(1, 1, 1, sq, skv, 32, seed=53)
    for delta in deltas:
        rows = torch.arange(skv) + delta - offset
        ok = (rows >= 0) & (rows < sq)
        k[:, :, ok] += 3 * q[:, :, rows[ok]]
    plan = plan_of((VS, 30, 100 + len(deltas)))
    assert index_capacity(plan, skv)[0] == 3 + len(deltas) < -(-skv // BLOCK)
    got = assert_matches_reference(q, k, plan, q_offset=offset)
    assert int(got.block_count.max()) == index_capacity(plan, skv)[0]


def test_attention_on_the_gpu_index_equals_the_reference_index():
    # the attention kernel widens the int16 block starts on load: same output as on the int32 reference index
    from minference_fx.kernels.attend import sparse_attention_triton

    q, k = rand_qk(1, 4, 2, 256, 256, 16, seed=59)
    v = torch.randn(1, 2, 256, 16, generator=torch.Generator().manual_seed(61))
    plan = plan_of((VS, 40, 60), (BS, 2), (VS, 30, 120), (BS, 3))
    got = build_index_gpu(q, k, plan, scale=0.25)
    want = ref.build_index(q, k, plan, scale=0.25)
    assert got.block_start.dtype == torch.int16 and want.block_start.dtype == torch.int32
    args = (*plan.op_arguments(),)
    out_got = sparse_attention_triton(q, k, v, got, *args, scale=0.25)
    out_want = sparse_attention_triton(q, k, v, want, *args, scale=0.25)
    torch.testing.assert_close(out_got, out_want, atol=1e-6, rtol=0)


def test_index_bytes_counts_what_is_allocated():
    plan = MIXED
    q, k = rand_qk(2, 8, 2, 200, 264, 16, seed=67)
    got = build_index_gpu(q, k, plan, scale=0.25, q_offset=64)
    nbytes = index_bytes(plan, 2, 200, 264, head_dim=16)
    assert nbytes["block_start"] == got.block_start.nbytes
    assert nbytes["col_index"] == got.col_index.nbytes
    assert nbytes["counts"] == got.block_count.nbytes + got.col_count.nbytes
    assert nbytes["total"] == sum(v for name, v in nbytes.items() if name != "total") and nbytes["scratch"] > 0


LLAMA3_8B_VS = LayerPlan((HeadPlan(VS, 1000, 6096),) * 32)


@pytest.mark.parametrize("seq,limit_gb", [(131072, 1.5), (524288, 8.5), (1 << 20, 16.0)])
def test_llama3_8b_index_memory(seq, limit_gb):
    # MInference's default VS(1000, 6096) on every head of a Llama-3-8B layer. At 1M tokens the block
    # lists are 32 heads x 16384 query tiles x 5999 worst-case slots of int32 starts (12.6 GB; aligned
    # tiles needed twice the slots at half the width). With q/k/v and the output (20 GB) that leaves a
    # 141 GB GPU most of its memory.
    nbytes = index_bytes(LLAMA3_8B_VS, 1, seq)
    assert nbytes["total"] < limit_gb * 1e9, {name: round(v / 1e9, 2) for name, v in nbytes.items()}
    assert nbytes["scratch"] < 1.5e9  # scores, rank keys and prefix counts of 32 heads x 1M keys: about 1.1 GB


# --------------------------------------------------------------------------- the estimate itself


@pytest.mark.parametrize(
    "dtype,kw",
    [
        (torch.float32, {}),
        (torch.float16, dict(q_offset=100, window=90)),
        (torch.float32, dict(q_offset=60, key_mask=True, doc=True)),
        # on CPU bf16 goes through an fp32 dot (the interpreter's bf16 tl.dot is wrong)
        (torch.bfloat16, {}),
    ],
    ids=["fp32-causal", "fp16-window", "fp32-masks", "bf16-cpu"],
)
def test_vs_estimate_equals_brute_force(dtype, kw):
    sq = 160
    skv = sq + kw.get("q_offset", 0)
    key_mask = doc = None
    if kw.pop("key_mask", False):
        key_mask = torch.ones(2, skv, dtype=torch.bool)
        key_mask[1, :33] = False
    if kw.pop("doc", False):
        doc = torch.zeros(2, skv, dtype=torch.long)
        doc[0, 150:] = 1
    q, k = rand_qk(2, 6, 2, sq, skv, 32, dtype, seed=19)
    vertical, slash = vs_estimate(q, k, scale=0.2, key_mask=key_mask, doc_ids=doc, **kw)
    want_v, want_s = brute_vs(q, k, 0.2, key_mask, doc, **kw)
    assert vertical.dtype == torch.float32 and vertical.shape == (2, 6, skv)
    torch.testing.assert_close(vertical.double(), want_v, atol=1e-5, rtol=0)
    torch.testing.assert_close(slash.double(), want_s, atol=1e-5, rtol=0)


def test_vs_estimate_sees_the_interpreter_by_any_spelling(monkeypatch):
    # Triton interprets with TRITON_INTERPRET=true as with 1: the estimate must then take its fp32 dot for bf16 too
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    q, k = rand_qk(2, 6, 2, 160, 160, 32, torch.bfloat16, seed=19)
    vertical, slash = vs_estimate(q, k, scale=0.2)
    want_v, want_s = brute_vs(q, k, 0.2, None, None)
    torch.testing.assert_close(vertical.double(), want_v, atol=1e-5, rtol=0)
    torch.testing.assert_close(slash.double(), want_s, atol=1e-5, rtol=0)


def test_vs_estimate_short_prompt():
    # fewer than 64 rows: only the real rows count, padded rows of the kernel's block add nothing
    q, k = rand_qk(1, 2, 2, 5, 5, 16, seed=23)
    vertical, slash = vs_estimate(q, k, scale=0.25)
    want_v, want_s = brute_vs(q, k, 0.25)
    torch.testing.assert_close(vertical.double(), want_v, atol=1e-5, rtol=0)
    torch.testing.assert_close(slash.double(), want_s, atol=1e-5, rtol=0)
    assert abs(float(vertical.sum()) - 2 * 5) < 1e-4  # every row's probabilities sum to 1


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    dev = "cuda"
    plan = plan_of((VS, 100, 200), (BS, 4), (DENSE,), (VS, 300, 60), (ASHAPE, 64, 256), (BS, 8), (VS, 30, 500), (BS, 2))
    sq = skv = 2048 + 37
    q, k = rand_qk(2, 8, 2, sq, skv, 64, torch.bfloat16, seed=29, device=dev)
    key_mask = torch.ones(2, skv, dtype=torch.bool, device=dev)
    key_mask[1, :300] = False
    kw = dict(scale=0.125, key_mask=key_mask, window=0)
    static_q, static_k = q.clone(), k.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels and caches the head tables
        build_index_gpu(static_q, static_k, plan, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_index_gpu(static_q, static_k, plan, **kw)
    for seed in (31, 37):
        new_q, new_k = rand_qk(2, 8, 2, sq, skv, 64, torch.bfloat16, seed=seed, device=dev)
        static_q.copy_(new_q)
        static_k.copy_(new_k)
        graph.replay()
        fresh = build_index_gpu(new_q, new_k, plan, **kw)
        torch.cuda.synchronize()
        for name in ("block_count", "block_start", "col_count", "col_index"):
            a, b = getattr(captured.padded(), name), getattr(fresh.padded(), name)
            # slash sums come from atomics in any order: allow a rare near-tie swap, nothing more
            assert (a != b).float().mean().item() <= 1e-3, name


@pytest.mark.gpu
def test_16k_bf16_close_to_reference():
    dev = "cuda"
    sq = skv = 16384
    plan = plan_of((VS, 1000, 2000), (BS, 16), (VS, 100, 800), (DENSE,), (VS, 3000, 100), (BS, 40), (ASHAPE, 64, 512), (VS, 30, 50))
    q, k = rand_qk(1, 8, 2, sq, skv, 128, torch.bfloat16, seed=41, device=dev)
    got = build_index_gpu(q, k, plan, scale=128 ** -0.5)
    check_format(got, plan, sq, skv)
    want = ref.build_index(q, k, plan, scale=128 ** -0.5)
    got_t, got_c = as_masks(got, skv)
    want_t, want_c = as_masks(want, skv)
    sparse = torch.tensor([hp.pattern in (VS, BS) for hp in plan.heads], device=dev)
    # bf16 scores are summed in another order (and with atomics): near-ties may flip a few picks
    tiles_diff = (got_t ^ want_t)[:, sparse].sum().item()
    cols_diff = (got_c ^ want_c)[:, sparse].sum().item()
    assert tiles_diff <= 0.005 * want_t[:, sparse].sum().item(), tiles_diff
    assert cols_diff <= 0.005 * max(1, want_c[:, sparse].sum().item()), cols_diff
    assert int(got.block_count[:, ~sparse].abs().sum()) == 0


@pytest.mark.parametrize("masked", [False, True])
def test_the_index_pair_equals_two_builds_from_one_estimate(masked):
    """build_index_pair_gpu (the guard's escalation) gives exactly build_index_gpu of the plan and of its
    escalated plan, the guard's estimates included; a padding mask moves the sinks of both alike."""
    from minference_fx.kernels.index import build_index_pair_gpu
    from minference_fx.plan import escalated_plan

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 400, 16, generator=g), torch.randn(2, 2, 400, 16, generator=g)
    plan = plan_of((VS, 30, 100), (BS, 3), (VS, 64, 150), (ASHAPE, 16, 64))
    up = escalated_plan(plan, (96, 250))
    kw = {"key_mask": torch.arange(400)[None].expand(2, -1) >= torch.tensor([[0], [70]])} if masked else {}
    masses = [torch.ones(2, 4) for _ in range(4)]
    one = build_index_gpu(q, k, plan, scale=0.25, mass_out=masses[0], **kw)
    two = build_index_gpu(q, k, up, scale=0.25, mass_out=masses[1], **kw)
    got, got_up = build_index_pair_gpu(q, k, plan, up, scale=0.25, mass_out=masses[2], escalated_mass_out=masses[3], **kw)
    for want, have in ((one, got), (two, got_up)):
        for name in ("block_count", "block_start", "col_count", "col_index"):
            assert torch.equal(getattr(want.padded(), name), getattr(have.padded(), name)), name
    assert torch.equal(masses[0], masses[2]) and torch.equal(masses[1], masses[3])
    # both estimates written (heads 0 and 1 miss mass at their budgets), the escalated one capturing more
    assert (masses[0][:, :2] < 1).all() and (masses[1][:, 0] > masses[0][:, 0]).all()
    with pytest.raises(ValueError, match="escalated plan lists exactly the plan's vertical-slash heads"):
        build_index_pair_gpu(q, k, plan, plan, scale=0.25)


@pytest.mark.parametrize("masked", [False, True])
def test_the_escalated_index_is_the_pair_with_the_weak_rows_taken_and_nothing_copied(masked):
    """build_index_escalated_gpu writes the escalation's rows over the weak vertical-slash rows of one index sized
    for both plans: what the guard took from the pair with dense.take_index before, every slot and count alike
    (the taken rows' old slots padded again), and the escalated rows' mass. A weak block-sparse row lists
    nothing, as take_index gave it; only its slots past that count may differ."""
    from minference_fx import dense
    from minference_fx.kernels.index import build_index_escalated_gpu, build_index_pair_gpu
    from minference_fx.plan import escalated_plan

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 400, 16, generator=g), torch.randn(2, 2, 400, 16, generator=g)
    plan = plan_of((VS, 30, 100), (BS, 3), (VS, 64, 150), (ASHAPE, 16, 64))
    up = escalated_plan(plan, (96, 250))
    kw = {"key_mask": torch.arange(400)[None].expand(2, -1) >= torch.tensor([[0], [70]])} if masked else {}
    mass, mass_up = torch.ones(2, 4), torch.zeros(2, 4)
    one, two = build_index_pair_gpu(q, k, plan, up, scale=0.25, mass_out=mass, escalated_mass_out=mass_up, **kw)
    # a threshold between the rows' masses, so that some rows are taken and some are not
    threshold = float(mass[:, :3].flatten().sort().values[3])
    taken_want = mass < threshold
    assert taken_want[:, [0, 2]].any() and (~taken_want[:, [0, 2]]).any()
    want = dense.take_index(one, two, taken_want)
    got_mass, got_mass_up = torch.ones(2, 4), torch.zeros(2, 4)
    got, taken = build_index_escalated_gpu(q, k, plan, up, scale=0.25, take_below=threshold, mass_out=got_mass,
                                           escalated_mass_out=got_mass_up, **kw)
    assert torch.equal(taken, taken_want) and torch.equal(got_mass, mass)
    vs = torch.tensor([True, False, True, False])
    assert_lists_as_taken(got, want, vs)
    assert torch.equal(got.block_count[:, 1][taken[:, 1]], torch.zeros_like(got.block_count[:, 1][taken[:, 1]]))
    assert torch.equal(got_mass_up[taken & vs], mass_up[taken & vs])
