"""Kernel exactness: the Triton sparse kernel equals the reference on the same index (interpreter on CPU)."""
import dataclasses

import pytest
import torch
import wide_offsets
from compiling import compiling

from minference_fx.autotune import workload
from minference_fx.kernels import reference
from minference_fx.kernels.attend import rows_need_int64, sparse_attention_triton
from minference_fx.kernels.codegen import ptx_instructions
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

MIXED = [
    HeadPlan(Pattern.VERTICAL_SLASH, 40, 60),
    HeadPlan(Pattern.A_SHAPE, 70, 100),
    HeadPlan(Pattern.BLOCK_SPARSE, 2),
    HeadPlan(Pattern.DENSE),
]


def _inputs(b, hq, hkv, sq, skv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: torch.randn(b, h, s, d, generator=g).to(dtype)  # noqa: E731
    return make(hq, sq), make(hkv, skv), make(hkv, skv)


def _check(q, k, v, plan, atol, launch=None, **mask_args):
    scale = q.shape[-1] ** -0.5
    index = reference.build_index(q, k, plan, scale=scale, **mask_args)
    want = reference.sparse_attention_reference(q, k, v, plan, scale=scale, index=index, **mask_args)
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, **(launch or {}), **mask_args)
    assert got.dtype == q.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


# Launch configs change speed, never the result: key blocks of half a tile, of two listed tiles
# gathered side by side (an odd count leaves half a block empty), and TMA copies of K/V tiles.
LAUNCHES = [dict(block_n=32), dict(block_n=128), dict(kv_desc=True), dict(block_m=32), dict(block_m=16, block_n=128)]
LAUNCH_IDS = ["bn32", "bn128", "tma", "bm32", "bm16-bn128"]


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
@pytest.mark.parametrize("length", [65, 200])
def test_launch_configs_same_result(launch, length):
    # four heads, one of each pattern: a program runs one (batch, head), so the launch config meets every pattern;
    # GQA groups are test_mixed_heads_gqa's (this ran 8 heads, each pattern twice, twice the interpreter time)
    q, k, v = _inputs(1, 4, 2, length, length, 16, torch.float32, seed=length)
    _check(q, k, v, _plan(4), atol=1e-5, launch=launch)


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
def test_launch_configs_with_masks_and_offset(launch):
    q, k, v = _inputs(2, 4, 2, 100, 300, 16, torch.float32)
    key_mask = torch.ones(2, 300, dtype=torch.bool)
    key_mask[1, :70] = False
    _check(q, k, v, _plan(4), atol=1e-5, launch=launch, q_offset=200, window=150, key_mask=key_mask)


def test_tma_request_falls_back_to_pointer_loads_where_the_layout_forbids_it():
    from minference_fx.kernels.attend import _tma_ok

    q, k, v = _inputs(1, 4, 2, 130, 130, 40, torch.float16)
    k_strided = torch.randn(1, 2, 130, 80).to(torch.float16)[..., ::2]  # head dim not contiguous
    k_rows_40b = torch.randn(1, 2, 130, 20).to(torch.float16)  # 40-byte rows: not a multiple of 16
    assert _tma_ok(k, 64) and not _tma_ok(k_strided, 64) and not _tma_ok(k_rows_40b, 32)
    k_strided.copy_(k)
    _check(q, k_strided, v, _plan(4), atol=2e-3, launch=dict(kv_desc=True))
    q20, k20, v20 = _inputs(1, 4, 2, 130, 130, 20, torch.float16)
    _check(q20, k20, v20, _plan(4), atol=2e-3, launch=dict(kv_desc=True))


@pytest.mark.parametrize("launch", [dict(), dict(block_n=128)], ids=["tiles", "gathered"])
def test_skipped_heads_are_left_alone_and_the_others_unchanged(launch):
    """SKIP_CODE (the op's dense heads, written by SDPA afterwards) reads and writes nothing, even where the
    index lists tiles and columns for that head, and every other head's rows are as the plan gives them."""
    from minference_fx.kernels.attend import SKIP_CODE

    q, k, v = _inputs(2, 8, 2, 200, 200, 16, torch.float32, seed=3)
    plan = _plan(8)
    scale = 0.25
    index = reference.build_index(q, k, plan, scale=scale)
    patterns, budget_a, budget_b = plan.op_arguments()
    skipped = [0, 2, 3]  # a vertical-slash head (its lists are in the index), a block-sparse and a dense head
    assert index.block_count[:, 0].sum() > 0 and index.col_count[:, 0].sum() > 0
    patterns = [SKIP_CODE if h in skipped else p for h, p in enumerate(patterns)]
    before = torch.full_like(q, 7.0)
    got = sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale, out=before.clone(),
                                  **launch)
    want = reference.sparse_attention_reference(q, k, v, plan, scale=scale, index=index)
    kept = [h for h in range(8) if h not in skipped]
    assert (got[:, skipped] == 7.0).all()
    torch.testing.assert_close(got[:, kept], want[:, kept], atol=1e-5, rtol=0)


def test_launch_config_rejects_other_block_sizes():
    q, k, v = _inputs(1, 4, 2, 64, 64, 16, torch.float32)
    index = reference.build_index(q, k, _plan(4), scale=0.25)
    with pytest.raises(ValueError, match="block_n must be 32, 64 or 128"):
        sparse_attention_triton(q, k, v, index, *_plan(4).op_arguments(), scale=0.25, block_n=96)
    with pytest.raises(ValueError, match="block_m must be 16, 32 or 64"):
        sparse_attention_triton(q, k, v, index, *_plan(4).op_arguments(), scale=0.25, block_m=128)
    # 128-row programs would read one 64-row tile's lists: only a launch of forced-dense heads takes them
    forced = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="block_m must be"):
        sparse_attention_triton(q, k, v, index, *_plan(4).op_arguments(), scale=0.25, block_m=128, force_dense=forced,
                                forced="skip")
    with pytest.raises(ValueError, match="forced must be"):
        sparse_attention_triton(q, k, v, index, *_plan(4).op_arguments(), scale=0.25, force_dense=forced, forced="all")
    with pytest.raises(ValueError, match="out must be"):
        sparse_attention_triton(q, k, v, index, *_plan(4).op_arguments(), scale=0.25, out=q.transpose(1, 2))
    # every head writing into one head's memory would race
    with pytest.raises(ValueError, match="each index names its own element"):
        sparse_attention_triton(q, k, v, index, *_plan(4).op_arguments(), scale=0.25,
                                out=torch.empty_like(q[:, :1]).expand_as(q))


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3), (0, 1, 3, 2)],
                         ids=["head-major", "token-major", "sequence-first", "dim-major"])
def test_the_walk_writes_into_an_out_of_any_memory_order(order):
    """What the dense path hands the walk is SDPA's output in q's memory order, whatever that is: the walk writes
    through its strides, no copy into one layout first."""
    q, k, v = _inputs(1, 4, 2, 70, 70, 16, torch.float32, seed=3)
    plan = _plan(4)
    index = reference.build_index(q, k, plan, scale=0.25)
    want = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, index=index)
    shape = [q.shape[d] for d in order]
    out = torch.full(shape, float("nan")).permute(*[order.index(d) for d in range(4)])
    assert out.shape == q.shape
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=0.25, out=out)
    assert got.data_ptr() == out.data_ptr() and got.stride() == out.stride()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("launch", [dict(block_m=128), dict(block_m=128, block_n=128), dict(block_m=64)],
                         ids=["bm128", "bm128-bn128", "bm64"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "padded-window"])
def test_a_skip_launch_and_a_dense_walk_write_one_output_that_equals_the_densified_reference(launch, masked):
    """The op's two launches: the sparse walk skips the forced (batch, head) pairs, the dense walk (128-row
    programs allowed) runs only them; together each pair is run once, the forced ones dense under the base
    mask (padding, window), and the plan's SKIP heads keep what was in ``out``."""
    from minference_fx.kernels import guard
    from minference_fx.kernels.attend import SKIP_CODE

    # four heads, one of each pattern (two of them forced in one batch row and run by the sparse walk in the other):
    # this ran 8 heads, the last four unforced repeats of the first, twice the interpreter time
    q, k, v = _inputs(2, 4, 2, 300, 300, 16, torch.float32, seed=4)
    plan = _plan(4)
    scale = 0.25
    mask_args = {}
    if masked:
        key_mask = torch.ones(2, 300, dtype=torch.bool)
        key_mask[1, :70] = False
        mask_args = dict(key_mask=key_mask, window=150)
    index = reference.build_index(q, k, plan, scale=scale, **mask_args)
    patterns, budget_a, budget_b = plan.op_arguments()
    patterns = [SKIP_CODE if h == 3 else p for h, p in enumerate(patterns)]
    force = torch.zeros(2, 4, dtype=torch.bool)
    force[0, [0, 2]] = True  # a vertical-slash and a block-sparse head of batch 0
    force[1, [1, 3]] = True  # batch 1: a head and the skipped one (stays skipped)
    out = torch.full_like(q, 7.0)
    sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale, force_dense=force,
                            forced="skip", out=out, **mask_args)
    sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale, force_dense=force,
                            forced="only", out=out, **launch, **mask_args)
    want = reference.sparse_attention_reference(q, k, v, plan, scale=scale, index=guard.densify(index, force, 300, 300, 0),
                                                **mask_args)
    others = [h for h in range(4) if h != 3]
    assert (out[:, 3] == 7.0).all()
    torch.testing.assert_close(out[:, others], want[:, others], atol=1e-5, rtol=0)


@pytest.mark.parametrize("launch", [dict(block_m=128), dict(block_m=128, block_n=128), dict(block_m=64, block_n=128),
                                    dict(block_m=128, block_n=128, kv_desc=False)],
                         ids=["bm128", "bm128-bn128-tma", "bm64-bn128-tma", "bm128-bn128-pointers"])
@pytest.mark.parametrize("case", ["offset-padded", "narrow-window", "documents"])
def test_the_dense_walk_equals_dense_attention_under_every_base_mask(launch, case):
    """The dense walk steps through keys 0 .. the diagonal without a list, BLOCK_N at a time (TMA copies at
    128 keys too), starting at the window's first key: it must equal dense attention under the base mask for
    chunked prefill (queries after a prefix of keys), windows narrower than a program's rows and packed
    documents. Heads not forced stay as they were."""
    q, k, v = _inputs(2, 4, 2, 200, 330, 16, torch.float32, seed=6)
    scale = 0.25
    masks = dict(q_offset=130)
    if case == "offset-padded":
        key_mask = torch.ones(2, 330, dtype=torch.bool)
        key_mask[1, :150] = False  # batch 1: the first query rows see no key at all
        masks.update(key_mask=key_mask)
    elif case == "narrow-window":
        masks.update(window=40)
    else:
        masks.update(doc_ids=(torch.arange(330) // 90).repeat(2, 1))
    dense = LayerPlan((HeadPlan(Pattern.DENSE),) * 4)
    index = reference.build_index(q, k, dense, scale=scale, **masks)
    force = torch.ones(2, 4, dtype=torch.bool)
    force[0, 1] = False
    out = torch.full_like(q, 7.0)
    sparse_attention_triton(q, k, v, index, *dense.op_arguments(), scale=scale, force_dense=force, forced="only",
                            out=out, **launch, **masks)
    want = reference.sparse_attention_reference(q, k, v, dense, scale=scale, index=index, **masks)
    assert (out[0, 1] == 7.0).all()
    torch.testing.assert_close(out[force], want[force], atol=1e-5, rtol=0)


@pytest.mark.parametrize("launch", [dict(), dict(block_m=32, block_n=128)], ids=["default", "bm32-bn128"])
def test_lse_is_the_log_sum_exp_over_the_keys_each_row_read(launch):
    """The LSE over exactly the index's keys under the base mask; -inf where a row read nothing."""
    q, k, v = _inputs(2, 4, 2, 100, 300, 16, torch.float32, seed=5)
    key_mask = torch.ones(2, 300, dtype=torch.bool)
    key_mask[1, :260] = False  # batch 1: its first query rows see no key at all
    plan, scale = _plan(4), 0.25
    masks = dict(q_offset=200, window=150, key_mask=key_mask)
    index = reference.build_index(q, k, plan, scale=scale, **masks)
    out, lse = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, return_lse=True,
                                       **launch, **masks)
    torch.testing.assert_close(out, reference.sparse_attention_reference(q, k, v, plan, scale=scale, index=index,
                                                                         **masks), atol=1e-5, rtol=0)
    listed = reference.index_to_mask(index, range(0, 100), 300)
    pos = 200 + torch.arange(100)[:, None]
    j = torch.arange(300)[None, :]
    base = (j <= pos) & (pos - j < 150)
    allowed = listed & base & key_mask[:, None, None, :]
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    want = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
    assert lse.shape == (2, 4, 100) and lse.dtype == torch.float32
    assert torch.isneginf(want[1, :, :5]).all()  # the case the kernel must not turn into NaN
    torch.testing.assert_close(lse, want, atol=1e-5, rtol=0)


def _plan(hq):
    return LayerPlan(tuple(MIXED[h % len(MIXED)] for h in range(hq)))


@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_heads_gqa(group):
    q, k, v = _inputs(1, 2 * group, 2, 200, 200, 16, torch.float32)
    _check(q, k, v, _plan(2 * group), atol=1e-5)


@pytest.mark.parametrize("length", [1, 63, 65, 129])
def test_odd_lengths(length):
    q, k, v = _inputs(1, 4, 2, length, length, 16, torch.float32, seed=length)
    _check(q, k, v, _plan(4), atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_fp16_model_head_dims(head_dim):
    """The head dims real models use (Llama/Qwen 128, SmolLM2/Phi 64, StableLM 80, Gemma-2B 256, 96)."""
    q, k, v = _inputs(1, 4, 2, 130, 130, head_dim, torch.float16, seed=head_dim)
    _check(q, k, v, _plan(4), atol=2e-3)


def test_fp16_head_dim_not_power_of_two():
    q, k, v = _inputs(1, 4, 1, 192, 192, 24, torch.float16)
    _check(q, k, v, _plan(4), atol=2e-3)


def test_batch_two_padding_and_documents():
    q, k, v = _inputs(2, 4, 2, 160, 160, 16, torch.float32)
    key_mask = torch.ones(2, 160, dtype=torch.bool)
    key_mask[1, :50] = False
    doc_ids = torch.zeros(2, 160, dtype=torch.long)
    doc_ids[0, 90:] = 1
    _check(q, k, v, _plan(4), atol=1e-5, key_mask=key_mask, doc_ids=doc_ids)


def test_masks_as_views_into_longer_tables_keep_the_reference():
    """The rewrite hands a sliding cache's padding and document tables as views ``table[:, start:start + Skv]``
    (rows a stride wider than the keys): the first kept key and every mask load read them in place. The
    queries (150, not a multiple of the 64-row tile) end where the document table ends."""
    q, k, v = _inputs(2, 4, 2, 150, 200, 16, torch.float32, seed=5)
    padding = torch.ones(2, 260, dtype=torch.bool)
    padding[1, :110] = False  # the view starts at 37: batch 1's first kept key is 73
    docs = torch.zeros(2, 260, dtype=torch.int32)
    docs[:, 137:] = 1
    docs[0, 200:] = 2
    masks = dict(key_mask=padding[:, 37:237], doc_ids=docs[:, 37:237], q_offset=50)
    assert not masks["key_mask"].is_contiguous() and not masks["doc_ids"].is_contiguous()
    _check(q, k, v, _plan(4), atol=1e-5, **masks)
    scale = q.shape[-1] ** -0.5
    plan = _plan(4)
    index = reference.build_index(q, k, plan, scale=scale, **masks)
    copies = {**masks, "key_mask": masks["key_mask"].contiguous(), "doc_ids": masks["doc_ids"].contiguous()}
    args = (q, k, v, index, *plan.op_arguments())
    torch.testing.assert_close(sparse_attention_triton(*args, scale=scale, **masks),
                               sparse_attention_triton(*args, scale=scale, **copies), atol=0, rtol=0)


@pytest.mark.parametrize("launch", [{}, dict(block_m=32, block_n=128), dict(block_n=32)], ids=["default", "bm32-bn128", "bn32"])
def test_left_padded_rows_skip_their_padding_and_keep_the_reference(launch):
    """Rows whose first kept key comes tiles in (left padding, then a hole) skip the query tiles that see no key
    and, in the dense walk, the keys before it: the same output as the reference, padding rows exactly 0; a
    row the mask keeps nothing of, and one it keeps everything of, too."""
    # 202 tokens (it was 330; the interpreter's time grows with the causal tile pairs): four query tiles, the last of
    # 10 rows. Row 1's first kept key, 136, is two tiles and 8 keys in (inside a block of every BLOCK_N), its hole
    # crosses the tile boundary at 192; row 3's first kept key is the tile boundary 64.
    q, k, v = _inputs(4, 4, 2, 202, 202, 16, torch.float32, seed=3)
    key_mask = torch.ones(4, 202, dtype=torch.bool)
    key_mask[1, :136] = False
    key_mask[1, 186:196] = False
    key_mask[2, :] = False
    key_mask[3, :64] = False
    _check(q, k, v, _plan(4), atol=1e-5, launch=launch, key_mask=key_mask)
    scale = q.shape[-1] ** -0.5
    plan = _plan(4)
    index = reference.build_index(q, k, plan, scale=scale, key_mask=key_mask)
    walked = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, key_mask=key_mask,
                                     force_dense=torch.ones(4, 4, dtype=torch.bool), forced="only", **launch)
    dense_plan = LayerPlan((HeadPlan(Pattern.DENSE),) * 4)
    dense = reference.sparse_attention_reference(q, k, v, dense_plan, scale=scale, key_mask=key_mask,
                                                 index=reference.build_index(q, k, dense_plan, scale=scale, key_mask=key_mask))
    torch.testing.assert_close(walked, dense, atol=1e-5, rtol=0)
    assert walked[1, :, :136].abs().max() == 0 and walked[2].abs().max() == 0


def test_query_offset_and_window():
    q, k, v = _inputs(1, 4, 2, 100, 300, 16, torch.float32)
    _check(q, k, v, _plan(4), atol=1e-5, q_offset=200, window=90)


@pytest.mark.parametrize("launch", [dict(), dict(block_n=128), dict(block_m=32)], ids=["bn64", "bn128", "bm32"])
@pytest.mark.parametrize("sq,skv,offset", [(300, 500, 400), (200, 640, 448), (333, 400, 100)])
def test_diagonal_blocks_at_key_0_and_past_the_last_key(launch, sq, skv, offset):
    # scattered diagonals give blocks that start before key 0 (listed last, masked) and, with query positions past
    # the keys (640 = 10 tiles: a block straddles the end where no aligned tile does), blocks that cross the end
    q, k, v = (t.contiguous() for t in workload.scattered_qkv(max(sq, skv), num_q_heads=2, num_kv_heads=1, head_dim=16,
                                                             dtype=torch.float32, device="cpu"))
    q, k, v = q[:, :, :sq], k[:, :, :skv], v[:, :, :skv]
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 40, 200), HeadPlan(Pattern.VERTICAL_SLASH, 30, 120)))
    index = reference.build_index(q, k, plan, scale=0.25, q_offset=offset)
    listed = torch.arange(index.block_start.shape[-1]) < index.block_count[..., None]
    assert bool(((index.block_start < 0) & listed).any()), "the case must have a block before key 0"
    _check(q, k, v, plan, atol=1e-5, launch=launch, q_offset=offset)


@pytest.mark.parametrize("launch", [dict(), dict(block_n=128), dict(block_m=32)], ids=["bn64", "bn128", "bm32"])
def test_slots_past_the_counts_are_never_read(launch):
    # the GPU index leaves them unwritten (SparseIndex): any value there, a real key's start or column included, must
    # change nothing, and neither may a block before key 0 (read ahead of its slot) or a forced-dense head
    q, k, v = (t.contiguous() for t in workload.scattered_qkv(400, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                             dtype=torch.float32, device="cpu"))
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 40, 200), HeadPlan(Pattern.BLOCK_SPARSE, 2),
                      HeadPlan(Pattern.VERTICAL_SLASH, 30, 120), HeadPlan(Pattern.VERTICAL_SLASH, 20, 60)))
    index = reference.build_index(q, k, plan, scale=0.25, q_offset=100)
    listed = torch.arange(index.block_start.shape[-1]) < index.block_count[..., None]
    listed_cols = torch.arange(index.col_index.shape[-1]) < index.col_count[..., None]
    assert not bool(listed.all()) and not bool(listed_cols.all()), "the case must leave slots past some count"
    g = torch.Generator().manual_seed(3)
    junk = torch.randint(-63, 400, index.block_start.shape, generator=g).int()
    junk_cols = torch.randint(0, 400, index.col_index.shape, generator=g).int()
    dirty = reference.SparseIndex(index.block_count, torch.where(listed, index.block_start, junk),
                                  index.col_count, torch.where(listed_cols, index.col_index, junk_cols))
    force = torch.tensor([[False, False, False, True]])
    for idx_force in (None, force):
        clean_out, dirty_out = (sparse_attention_triton(q, k, v, ix, *plan.op_arguments(), scale=0.25, q_offset=100,
                                                        force_dense=idx_force, **launch) for ix in (index, dirty))
        assert torch.equal(clean_out, dirty_out)
    assert all(torch.equal(a, b) for a, b in zip(dataclasses.astuple(dirty.padded()), dataclasses.astuple(index)))


@pytest.mark.parametrize("launch", [dict(), dict(kv_desc=True), dict(block_m=32)], ids=["pointer", "tma", "bm32"])
@pytest.mark.parametrize("sq,skv,offset,sink,window", [
    (1, 100, 110, 0, 1),  # the window lies wholly past the last key: the row reads nothing
    (117, 74, 62, 64, 1),  # some rows inside the keys, some past them
    (1, 100, 300, 1000, 1),  # the sink budget reaches past the last key tile
    (64, 100, 200, 129, 1),
    (64, 100, 150, 40, 90),  # rows past the keys whose window reaches back into them
], ids=["window-past", "straddling", "sinks-past", "sinks-past-tile", "window-into-keys"])
def test_a_shape_heads_with_rows_past_the_last_key(launch, sq, skv, offset, sink, window):
    # query positions past the keys (q_offset + Sq > Skv): the kernel walked a window tile the reference does not
    # list, and sink tiles past the last key (read unmasked: zeros with TMA, memory past K/V without)
    q, k, v = _inputs(1, 2, 1, sq, skv, 16, torch.float32, seed=sq + skv)
    plan = LayerPlan((HeadPlan(Pattern.A_SHAPE, sink, window), HeadPlan(Pattern.A_SHAPE, 0, window)))
    _check(q, k, v, plan, atol=1e-5, launch=launch, q_offset=offset)


def test_covering_budgets_equal_dense_sdpa():
    q, k, v = _inputs(2, 4, 2, 130, 130, 16, torch.float32)
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1 << 20, 1 << 20), HeadPlan(Pattern.A_SHAPE, 0, 1 << 20),
                      HeadPlan(Pattern.BLOCK_SPARSE, 1 << 20), HeadPlan(Pattern.DENSE)))
    index = reference.build_index(q, k, plan, scale=0.25)
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_ptx_instructions_drop_debug_records_and_keep_every_instruction():
    """What the table's re-key rests on (scripts/explore_ptx_identity.py): code moved to other lines or into a
    jit helper changes line records and inlined-scope labels, never an instruction."""

    def ptx(line, labels, reg):
        return ("\t.file\t1 \"/x/attend.py\"\n.visible .entry k()\n{\n" + labels +
                f"\t.loc\t1 {line} 0\n\tld.global.b32 %r1, [%rd1];\n\tadd.s32 %{reg}, %r1, 1;\n}}\n"
                "\t.section\t.debug_info\n\t{\n.b32 42\n\t}\n")

    moved = ptx_instructions(ptx(244, "", "r2")), ptx_instructions(ptx(404, "$L__tmp1:\n$L__tmp2:\n", "r2"))
    assert moved[0] == moved[1] and "ld.global.b32 %r1, [%rd1];" in moved[0] and ".b32 42" not in moved[0]
    assert ptx_instructions(ptx(244, "", "r3")) != moved[0]  # another register is another instruction


def test_the_sparse_walk_compiles_for_hopper_at_the_shipped_long_prompt_configs_without_serialised_wgmma():
    """ptxas's report for sm_90a, taken on this CPU (kernels.codegen): at the shipped H200 table's 32K and 128K
    configs the sparse walk, with and without a padding mask, neither serialises its wgmma pipeline nor spills.
    An edit of two scalar ops once tipped the unmasked walk into both C7515 and 240 registers (from 222): 14%
    slower at 128K, found only by a GPU re-tune (git show 6fb579a:results/autotune_warmup_h200_2026-12-01_v13.txt)."""
    import json

    from minference_fx.autotune import cache

    table = json.loads(next(p for p in cache.shipped_paths() if p.name == "h200.json").read_text())
    fields = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")  # sparse_walk_codegen's order
    configs = sorted({(c["key"]["head_dim"], *(c["entry"][f] for f in fields)) for c in table["configs"]
                      if c["key"]["kernel"] == "sparse_attention" and c["key"]["bucket"] in (32768, 131072)})
    assert configs
    code = ("import json, sys\nfrom minference_fx.kernels.codegen import sparse_walk_codegen\n"
            "print(json.dumps([[vars(sparse_walk_codegen(*c, key_mask=m)) for m in (False, True)] "
            "for c in json.loads(sys.argv[1])]))")
    for config, variants in zip(configs, json.loads(compiling(code, json.dumps(configs)).strip().splitlines()[-1])):
        for masked, report in zip((False, True), variants):
            assert not report["wgmma_serialized"] and report["spill_bytes"] == 0, (config, masked, report)


def test_the_listed_walk_copies_kv_as_far_ahead_as_the_dense_walk_on_hopper():
    """The TTGIR Triton makes for sm_90a on this CPU (kernels.codegen): at the shipped 64 x 64, 4-warp, 3-stage launch the
    sparse walk's first key loop holds three K/V blocks, as the dense walk's does. Read in its own step, the listed block
    start took a pipeline stage, so the loop held two (K/V copied one step ahead, not two) and walked 1.06-1.18x slower at
    128K on an H100 (scripts/explore_list_prefetch.py, BENCHMARKS section 1)."""
    code = ("from minference_fx.kernels.codegen import first_loop_kv_depth, sparse_walk_asm\n"
            "print(*(first_loop_kv_depth(sparse_walk_asm(128, 64, 64, 4, 3, dense_walk=d)['ttgir']) for d in (False, True)))")
    sparse, dense = map(int, compiling(code).split()[-2:])
    assert (sparse, dense) == (3, 3)


def test_a_one_row_padding_mask_applies_to_every_batch_row_of_a_direct_call():
    """sparse_attention_triton takes key_mask [1, Skv] for a batch too (the op broadcast it first; called
    directly, batch row 1 read past the mask's end: off by 2.2)."""
    q, k, v = _inputs(2, 4, 2, 200, 200, 16, torch.float32, seed=4)
    one_row = torch.ones(1, 200, dtype=torch.bool)
    one_row[0, :70] = False
    plan = _plan(4)
    index = reference.build_index(q, k, plan, scale=0.25, key_mask=one_row)
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=0.25, key_mask=one_row)
    want = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, key_mask=one_row, index=index)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_views_whose_row_offsets_pass_int32_are_addressed_in_int64():
    """HF's [B, S, H, D].transpose(1, 2) view (stride(2) = H x D) passes 2**31 from 2**31 / (H x D) rows on (512K
    at H x D = 4096): int32 row offsets read wrong rows there. Such launches address rows in int64 instead of
    copying the view contiguous (a data-sized allocation inside the op); the decision reads shapes only."""
    view = lambda rows: torch.empty(1, rows, 32, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)  # noqa: E731
    assert rows_need_int64(view(600_000)) and not rows_need_int64(view(400_000))
    assert rows_need_int64(view(400_000), view(600_000))  # any one of q, k, v and out
    assert not rows_need_int64(torch.empty(1, 32, 600_000, 128, device="meta"))  # contiguous: 2**26 a head
    assert rows_need_int64(torch.empty(1, 1, 2**24 + 1, 128, device="meta"))  # past 2**31 even contiguous
    assert not rows_need_int64(view(0))


WIDE_LAUNCHES = {"pointers": dict(kv_desc=False), "tma": dict(kv_desc=True), "bn128": dict(block_n=128),
                 "bm32": dict(block_m=32)}


@pytest.fixture(scope="module")
def wide_cases(tmp_path_factory):
    """The 2**31 cases below, all in one child process (``wide_offsets.run_cases_in_a_child``): one start-up for the
    five rather than five (each 3-4 s of imports). Each test still passes or fails on its own case's outcome."""
    cases = {f"packed-{name}": (wide_offsets.packed_views_case, (launch, _plan(4))) for name, launch in WIDE_LAUNCHES.items()}
    cases["head-dim-stride"] = (wide_offsets.head_dim_stride_case, ())
    return wide_offsets.run_cases_in_a_child(cases, tmp_path_factory.mktemp("wide") / "cases.jsonl")


@pytest.mark.parametrize("launch", list(WIDE_LAUNCHES))
def test_views_past_2_31_elements_a_head_read_what_contiguous_copies_read(launch, wide_cases):
    """Packed HF-style views ([B, S, H, D] transposed) whose rows from 300 on lie past 2**31 elements, in q, k and v,
    every pattern: the launch addresses them in int64 and writes the contiguous copies' int32 launch's bits. An
    int32 row offset there wraps and reads outside the buffer: the interpreter then dies of a segmentation fault,
    in a child process (``wide_offsets``), so the test fails and the run goes on."""
    wide_offsets.outcome(wide_cases[f"packed-{launch}"], f"packed-{launch}")


def test_a_head_dim_stride_past_2_31_is_addressed_in_int64_too(wide_cases):
    """Rows are not the only term: a q whose head-dim stride is 2**28 puts its columns past 2**31 elements."""
    wide_offsets.outcome(wide_cases["head-dim-stride"], "head-dim-stride")
