"""The op boundary: fake shapes, dense dispatch below the crossover, errors that name the problem."""
import pytest
import torch
import torch.nn.functional as F

import minference_fx.kernels.reference as reference
from minference_fx.call_masks import CallMasks
from minference_fx.dense import dense_attention

OP = torch.ops.minference.sparse_attention.default
VS = ([2, 2, 2, 2], [1000] * 4, [6096] * 4)


def _qkv(sq=80, skv=80, b=1):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 4, sq, 16, generator=g), torch.randn(b, 2, skv, 16, generator=g), torch.randn(b, 2, skv, 16, generator=g)


def test_below_crossover_runs_dense_sdpa_not_the_reference(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the sparse path ran below min_sparse_len")

    monkeypatch.setattr(reference, "sparse_attention_reference", boom)
    q, k, v = _qkv()
    out = OP(q, k, v, None, None, 0.25, 0, 0, *VS, 8192)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True))


def test_decode_step_sees_every_cached_key():
    q, k, v = _qkv(sq=1, skv=50)
    out = OP(q, k, v, None, None, 0.25, 49, 0, *VS, 8192)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True))


@pytest.mark.parametrize(("is_cuda", "dtype", "group", "repeats"),
                         [(True, torch.float32, 6, True), (True, torch.bfloat16, 6, False), (True, torch.float32, 1, False),
                          (False, torch.float32, 6, False)])
def test_only_float32_grouped_heads_on_cuda_repeat_their_kv_heads(is_cuda, dtype, group, repeats):
    """SDPA's fused CUDA kernels that take grouped KV heads take no float32 (its math path would build every score):
    only there are the KV heads repeated; bf16 keeps enable_gqa, and the CPU's kernels take either."""
    from types import SimpleNamespace

    from minference_fx.dense import repeats_kv_heads

    assert repeats_kv_heads(SimpleNamespace(is_cuda=is_cuda, dtype=dtype), group) is repeats


def test_cudnn_is_asked_for_only_on_a_gpu_and_the_cpu_keeps_sdpa_as_it_picks(monkeypatch):
    """dense.runs_cudnn asks for cuDNN's kernel on Hopper only (GPU test: whatever order a priority block left); on
    the CPU it says no before it asks the device anything, and fused SDPA runs as before."""
    from minference_fx import dense

    q, k, v = _qkv(sq=64, skv=64)
    asked = []
    monkeypatch.setattr(dense, "_cudnn_first_device", lambda device: asked.append(device) or True)
    assert not dense.runs_cudnn(q, k, v, causal=True, gqa=True) and not asked
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(dense.fused_sdpa(q, k, v, causal=True, scale=0.25), want)


def test_repeated_kv_heads_pair_each_query_head_with_its_group(monkeypatch):
    """The repeating branch (CUDA float32 only) taken on the CPU: each query head reads its own group's KV head, as
    ``enable_gqa`` pairs them, in a prefill and in a decode step."""
    from minference_fx import dense

    q, k, v = _qkv(sq=64, skv=64)
    want = dense_attention(q, k, v, CallMasks(), 0.25)
    want_step = dense_attention(q[:, :, -1:], k, v, CallMasks(q_offset=63), 0.25)
    monkeypatch.setattr(dense, "repeats_kv_heads", lambda q, group: group > 1)
    torch.testing.assert_close(dense_attention(q, k, v, CallMasks(), 0.25), want)
    torch.testing.assert_close(dense_attention(q[:, :, -1:], k, v, CallMasks(q_offset=63), 0.25), want_step)


def test_dense_path_equals_reference_with_padding_window_and_offset():
    q, k, v = _qkv(sq=40, skv=100, b=2)
    key_mask = torch.ones(2, 100, dtype=torch.bool)
    key_mask[1, :70] = False  # left padding that hides every key of some rows
    got = dense_attention(q, k, v, CallMasks(key_mask, None, 60, 17), 0.25)
    want = reference.dense_attention_reference(q, k, v, scale=0.25, key_mask=key_mask, q_offset=60, window=17)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["padding", "window+offset", "documents"])
def test_dense_walk_equals_the_masked_dense_path(case):
    """The GPU's masked dense path past MASKED_SDPA_MAX_PAIRS (the kernel's dense walk, under the interpreter
    here) reads exactly what the mask-building SDPA path reads: padding that hides whole rows, a window, a
    query offset, packed documents."""
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, TuneEntry
    from minference_fx.dense import dense_walk

    q, k, v = _qkv(sq=150, skv=150, b=2)
    key_mask = doc_ids = None
    offset = window = 0
    if case == "padding":
        key_mask = torch.ones(2, 150, dtype=torch.bool)
        key_mask[1, :70] = False  # left padding: rows 0-69 of batch 1 read nothing (zeros, not NaN)
    elif case == "window+offset":
        q, offset, window = q[:, :, :90], 60, 33
    else:
        doc_ids = torch.tensor([[0] * 40 + [1] * 110, [0] * 100 + [1] * 50])
    masks = CallMasks(key_mask, doc_ids, offset, window)
    want = dense_attention(q, k, v, masks, 0.25)
    for launch in (DEFAULT_ENTRIES["dense_walk"], TuneEntry(64, 128, 4, 2)):
        got = dense_walk(q, k, v, masks, 0.25, launch)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padded_rows", [(), (0,), (1,)])
def test_dense_walk_over_an_unmasked_sdpa_output_runs_only_the_padded_rows_again(padded_rows):
    """dense_walk(out=...), the GPU's masked prefill of one prompt: SDPA wrote every row without the padding
    mask; the rows the mask hides keys of run again with it, the others keep what SDPA wrote (a sentinel here)."""
    from minference_fx.autotune.dispatch import launch_config
    from minference_fx.dense import dense_walk

    q, k, v = _qkv(sq=150, skv=150, b=2)
    key_mask = torch.ones(2, 150, dtype=torch.bool)
    for r in padded_rows:
        key_mask[r, :70] = False
    walk = launch_config(q, k, "dense_walk")  # the default dense_walk looked up before it took one
    sdpa = dense_attention(q, k, v, CallMasks(), 0.25)
    sdpa[1] += 100.0  # what a re-run would overwrite
    got = dense_walk(q, k, v, CallMasks(key_mask), 0.25, walk, out=sdpa.clone())
    want = dense_attention(q, k, v, CallMasks(key_mask), 0.25)
    for r in range(2):
        if r in padded_rows:
            torch.testing.assert_close(got[r], want[r], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got[r], sdpa[r])
    with pytest.raises(ValueError, match="with documents or a window"):  # rows SDPA wrote unmasked would stand
        dense_walk(q, k, v, CallMasks(key_mask, window=7), 0.25, walk, out=sdpa.clone())


def test_dense_walk_reads_a_one_row_or_strided_mask_as_the_masked_sdpa_does():
    """Callers past the op's entry (observe's dense path) hand dense_walk the mask as they got it: a [1, S] mask
    over a batch of 2 and a strided one read as the mask-building path reads them (errors of 3 before)."""
    from minference_fx.autotune.dispatch import launch_config
    from minference_fx.dense import dense_walk, masked_sdpa

    q, k, v = _qkv(sq=150, skv=150, b=2)
    one_row = torch.ones(1, 150, dtype=torch.bool)
    one_row[0, :70] = False
    strided = torch.ones(2, 300, dtype=torch.bool)
    strided[1, :140] = False
    for key_mask in (one_row, strided[:, ::2]):
        torch.testing.assert_close(dense_walk(q, k, v, CallMasks(key_mask), 0.25, launch_config(q, k, "dense_walk")),
                                   masked_sdpa(q, k, v, CallMasks(key_mask), 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_layout", ["token-major", "contiguous"])
@pytest.mark.parametrize("min_sparse_len", [0, 10**6], ids=["sparse", "dense"])
def test_fake_and_real_outputs_are_token_major(q_layout, min_sparse_len):
    # Inductor lays out what follows the op by the fake's strides (and asserts the real ones): both token-major,
    # as fused SDPA returns, so a model's transpose(1, 2) + reshape after attention copies nothing
    from torch._subclasses.fake_tensor import FakeTensorMode

    def qkv():
        q = torch.randn(1, 80, 4, 16).transpose(1, 2) if q_layout == "token-major" else torch.randn(1, 4, 80, 16)
        return q, torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 16)

    with FakeTensorMode():
        fake = OP(*qkv(), None, None, 0.25, 0, 0, *VS, min_sparse_len)
    real = OP(*qkv(), None, None, 0.25, 0, 0, *VS, min_sparse_len)
    token_major = (80 * 4 * 16, 16, 4 * 16, 1)
    assert fake.shape == real.shape == (1, 4, 80, 16)
    assert fake.stride() == real.stride() == token_major
    assert real.transpose(1, 2).is_contiguous()


def test_bad_inputs_are_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head plan has 3 entries, q has 4 heads"):
        OP(q, k, v, None, None, 0.25, 0, 0, [2, 2, 2], [1] * 3, [1] * 3, 0)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of kv heads \(3\)"):
        OP(q, torch.randn(1, 3, 80, 16), torch.randn(1, 3, 80, 16), None, None, 0.25, 0, 0, *VS, 0)
    no_heads = torch.randn(1, 0, 80, 16)
    with pytest.raises(ValueError, match="q and k need at least one head each, got 0 query and 0 kv heads"):
        OP(no_heads, no_heads, no_heads, None, None, 0.25, 0, 0, [], [], [], 0)
    with pytest.raises(ValueError, match="key_mask must be a bool"):
        OP(q, k, v, torch.ones(1, 80), None, 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match=r"key_mask must be a bool \[B or 1, Skv=80\]"):
        OP(q, k, v, torch.ones(1, 79, dtype=torch.bool), None, 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match=r"got torch.bool of shape \(3, 80\)"):
        OP(q, k, v, torch.ones(3, 80, dtype=torch.bool), None, 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match="doc_ids must be an integer"):
        OP(q, k, v, None, torch.zeros(1, 80), 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match=r"S >= Skv=80\] tensor \(B=1\), got torch.int64 of shape \(1, 79\)"):
        OP(q, k, v, None, torch.zeros(1, 79, dtype=torch.long), 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match=r"every query must sit at a key position 0..79, the queries sit at 10..89"):
        OP(q, k, v, None, torch.zeros(1, 90, dtype=torch.long), 0.25, 10, 0, *VS, 0)
    with pytest.raises(ValueError, match="q, k, v must share a dtype"):
        OP(q.half(), k, v, None, None, 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match="must be float16, bfloat16 or float32"):  # int64 came back truncated
        OP(q.long(), k.long(), v.long(), None, None, 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match=r"head dims must agree, got 16, 16, 32"):  # the fake said [..., 16]
        OP(q, k, torch.randn(1, 2, 80, 32), None, None, 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match=r"window must be >= 0 \(0: none\), got -1"):  # it zeroed every row
        OP(q, k, v, None, None, 0.25, 0, -1, *VS, 0)
    with pytest.raises(ValueError, match=r"unknown pattern code\(s\) \(head, code\) \[\(1, 7\)\]"):
        OP(q, k, v, None, None, 0.25, 0, 0, [2, 7, 2, 2], [30] * 4, [50] * 4, 0)
    with pytest.raises(ValueError, match=r"budgets must be <= 1073741824"):  # 2**31 - 1 wrapped in the kernel
        OP(q, k, v, None, None, 0.25, 0, 0, [1] * 4, [2**31 - 1] * 4, [64] * 4, 0)
    for scale in (0.0, -0.25, float("nan"), float("inf")):  # the kernels' -inf scores times a scale <= 0: NaN
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            OP(q, k, v, None, None, scale, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match=r"A-shape head's local window \(budget_b\) must be >= 1"):
        OP(q, k, v, None, None, 0.25, 0, 0, [1] * 4, [4] * 4, [0] * 4, 0)
    for escalation in ((0, 6096), (-1, -1), (1000, 2**31)):  # half an escalation, or one the kernels cannot hold
        with pytest.raises(ValueError, match=r"escalate_a and escalate_b must both be 0"):
            OP(q, k, v, None, None, 0.25, 0, 0, *VS, 0, 0.5, -1, *escalation)
    for threshold in (-1.0, 1.5, float("nan")):  # NaN and below 0 turned the guard off; past 1 the paths disagreed
        with pytest.raises(ValueError, match=r"guard_threshold must be in \[0, 1\]"):
            OP(q, k, v, None, None, 0.25, 0, 0, *VS, 0, threshold)


def test_a_document_table_longer_than_the_keys_and_no_keys_at_all():
    """The op takes doc_ids [B, S >= Skv]: the sparse path read the whole table and failed to broadcast it; with
    no keys the sparse path raised where the dense one gives the zeros the op promises."""
    q, k, v = _qkv()
    doc = torch.zeros(1, 95, dtype=torch.long)
    doc[0, 50:] = 1
    sparse = OP(q, k, v, None, doc, 0.25, 0, 0, *VS, 0)
    assert torch.equal(sparse, OP(q, k, v, None, doc[:, :80], 0.25, 0, 0, *VS, 0))
    dense = OP(q, k, v, None, doc, 0.25, 0, 0, *VS, 10**9)
    assert torch.allclose(sparse, dense, atol=1e-5)  # the budgets cover 80 keys
    no_keys = OP(q, k[:, :, :0], v[:, :, :0], None, None, 0.25, 0, 0, *VS, 0)
    assert no_keys.shape == q.shape and not no_keys.any()


def test_the_kernels_get_one_mask_row_per_batch_row_with_adjacent_entries(monkeypatch):
    """The kernels read row b of a key mask or document table at b * stride(0), its entries adjacent: the op
    broadcasts a [1, S] table over the batch and copies a strided one, so both read what the reference reads
    (a probe found batch row 1 read out of bounds and a strided mask misread: errors of 2-4)."""
    from minference_fx import op
    from minference_fx.autotune.cache import DEFAULT_ENTRIES
    from minference_fx.plan import LayerPlan
    from minference_fx.sparse_path import sparse_on_gpu

    q, k, v = _qkv(sq=130, skv=130, b=2)
    seen = []
    monkeypatch.setattr(op, "run_call", lambda call, q, k, v: seen.append((call.masks.key_mask, call.masks.doc_ids)))
    one_row = torch.ones(1, 130, dtype=torch.bool)
    one_row[0, :40] = False
    strided = torch.ones(2, 260, dtype=torch.bool)[:, ::2]
    docs = torch.zeros(1, 130, dtype=torch.long)
    docs[0, 64:] = 1
    for key_mask, doc_ids in ((one_row, None), (strided, None), (None, docs)):
        OP(q, k, v, key_mask, doc_ids, 0.25, 0, 0, *VS, 0)
    for key_mask, doc_ids in seen:
        for t in (key_mask, doc_ids):
            assert t is None or (t.shape == (2, 130) and t.stride(-1) == 1), t.stride()
    monkeypatch.undo()
    # what the kernels then read (the GPU path under the interpreter) is what the CPU op's reference reads
    plan = LayerPlan.from_op_arguments(*VS)
    for key_mask, doc_ids in ((one_row, None), (None, docs)):
        masks = CallMasks(key_mask, doc_ids).rows_per_batch(2)
        got = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRIES["sparse_attention"],
                            DEFAULT_ENTRIES["dense_walk"]).out
        want = OP(q, k, v, key_mask, doc_ids, 0.25, 0, 0, *VS, 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# The sink cases ran at 700 tokens; at 400 (6 tiles and 16 rows, still a partial last tile) the old behaviour (sinks
# counted from the padding) is off by 0.85 (A-shape), 0.76 (vertical-slash), 3.0 (block-sparse), as at 700, and
# the interpreter's GPU path walks half the causal tile pairs.
@pytest.mark.parametrize("pattern, L, P", [("a_shape", 400, 128), ("vertical_slash", 400, 128), ("block_sparse", 400, 128),
                                           ("block_sparse", 384, 64)])
def test_a_prompt_left_padded_by_whole_tiles_reads_the_keys_it_reads_unpadded(pattern, L, P):
    """Batched generate pads prompts on the left. Attention sinks (A-shape budgets, vertical-slash forced
    columns, the block-sparse first tile) count from a row's first kept key, and block-sparse never picks a
    tile of padding: padded by whole tiles, the prompt's rows come out as unpadded, on the CPU op and on the
    GPU path (interpreted). Before, the sinks were the padding's: off by 0.91 (A-shape), 0.70 (vertical-slash), 3.2
    (block-sparse). At 384 + 64 block-sparse keeps most tiles: the near-dense rule counted the padding's tiles, so
    the unpadded prompt ran dense and the padded one sparse (off by 0.46)."""
    from minference_fx.autotune.cache import DEFAULT_ENTRIES
    from minference_fx.plan import PATTERN_CODES, LayerPlan, Pattern
    from minference_fx.sparse_path import sparse_on_gpu

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, L, 32, generator=g) for h in (4, 2, 2))
    k[:, :, 0] = 4 * q.mean(2).view(1, 2, 2, -1).mean(2)  # a sink on the prompt's first token, as in LLMs
    qp, kp, vp = (torch.cat([torch.randn(1, t.shape[1], P, 32, generator=g), t], 2) for t in (q, k, v))
    key_mask = torch.ones(1, L + P, dtype=torch.bool)
    key_mask[0, :P] = False
    budgets = {"a_shape": ([64, 4, 100, 0], [64, 128, 30, 70]), "vertical_slash": ([30, 40, 0, 300], [50, 150, 100, 20]),
               "block_sparse": ([1, 2, 3, 0] if L == 400 else [5] * 4, [0] * 4)}[pattern]
    plan_args = ([PATTERN_CODES[Pattern(pattern)]] * 4, *budgets)
    unpadded = OP(q, k, v, None, None, 0.2, 0, 0, *plan_args, 0)
    padded = OP(qp, kp, vp, key_mask, None, 0.2, 0, 0, *plan_args, 0)[:, :, P:]
    torch.testing.assert_close(padded, unpadded, rtol=0, atol=1e-5)
    on_gpu_path = sparse_on_gpu(qp, kp, vp, LayerPlan.from_op_arguments(*plan_args), 0.2, CallMasks(key_mask), 0.0,
                                DEFAULT_ENTRIES["sparse_attention"], DEFAULT_ENTRIES["dense_walk"]).out
    torch.testing.assert_close(on_gpu_path[:, :, P:], unpadded, rtol=0, atol=1e-5)
    if L == 400:  # sparse, so the keys read are the plan's
        assert (unpadded - reference.dense_attention_reference(q, k, v, scale=0.2)).abs().max() > 1e-2


def test_opcheck():
    q, k, v = _qkv(sq=70, skv=70)
    torch.library.opcheck(OP, (q, k, v, None, None, 0.25, 0, 0, *VS, 0), test_utils=("test_schema", "test_faketensor"))


def test_layer_dense_on_every_head_runs_sdpa_not_the_reference(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the sparse path ran for a wholly dense layer")

    monkeypatch.setattr(reference, "sparse_attention_reference", boom)
    q, k, v = _qkv()
    out = OP(q, k, v, None, None, 0.25, 0, 0, [0] * 4, [0] * 4, [0] * 4, 0)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True))


@pytest.mark.parametrize("padded", [False, True])
def test_gpu_path_sends_dense_heads_to_sdpa_and_matches_the_reference(padded, monkeypatch):
    """sparse_on_gpu (Triton under the interpreter here): the plan's dense heads come from SDPA (in a padded
    batch of two from the kernel's dense walk: SDPA could only read the mask materialised, or run the padded
    row twice), the others from the kernel, and together they equal the reference on the same plan."""
    from minference_fx import dense
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.kernels import guard
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern
    from minference_fx.sparse_path import sparse_on_gpu

    by_sdpa = []
    real = dense.dense_heads_by_sdpa
    monkeypatch.setattr(dense, "dense_heads_by_sdpa", lambda *a: by_sdpa.append(a[4]) or real(*a))

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 200, 32, generator=g)
    k, v = (torch.randn(2, 2, 200, 32, generator=g) for _ in range(2))
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 30, 40), HeadPlan(Pattern.DENSE),
                      HeadPlan(Pattern.A_SHAPE, 16, 64), HeadPlan(Pattern.DENSE)))
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 200, dtype=torch.bool)
        key_mask[1, :90] = False  # left padding: the first rows of batch 1 read nothing
    masks = CallMasks(key_mask)
    got, force, *_ = sparse_on_gpu(q, k, v, plan, 0.2, masks, 0.0, DEFAULT_ENTRY, DEFAULT_ENTRIES["dense_walk"])
    index = reference.build_index(q, k, plan, scale=0.2, **masks.kwargs())
    near = dense.near_dense_heads(index, plan, 200, 200, 0, key_mask)  # the op runs these dense (batch 1's VS head)
    index = guard.densify(index, near, 200, 200, 0) if bool(near.any()) else index
    want = reference.sparse_attention_reference(q, k, v, plan, scale=0.2, index=index, **masks.kwargs())
    assert force is None and torch.isfinite(got).all()
    torch.testing.assert_close(got, want.to(got.dtype), atol=2e-5, rtol=2e-5)
    assert by_sdpa == ([] if padded else [(1, 3)])


def test_gpu_path_runs_rows_whose_keys_are_all_valid_without_the_mask(monkeypatch):
    """With a padding mask, the rows whose keys are all valid (generate's all-ones mask) run the sparse walk
    and the dense walk without the mask and the padded rows with it, each launch leaving the other's rows
    alone. Together they equal the reference, rows that see no key included."""
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.kernels import attend
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern
    from minference_fx.sparse_path import sparse_on_gpu

    launches = []
    real = attend.sparse_attention_triton

    def spy(*a, **kw):
        forced = kw.get("force_dense").bool()
        runs = forced if kw.get("forced") == "only" else ~forced  # "only" runs the forced pairs, "skip" the rest
        launches.append((kw.get("forced"), kw.get("key_mask") is not None, runs.any(1).tolist()))  # rows it runs
        return real(*a, **kw)

    monkeypatch.setattr(attend, "sparse_attention_triton", spy)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 640, 16, generator=g)
    k, v = (torch.randn(2, 2, 640, 16, generator=g) for _ in range(2))
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 30, 60), HeadPlan(Pattern.BLOCK_SPARSE, 8),
                      HeadPlan(Pattern.VERTICAL_SLASH, 20, 40), HeadPlan(Pattern.DENSE)))
    key_mask = torch.ones(2, 640, dtype=torch.bool)
    key_mask[1, :300] = False
    masks = CallMasks(key_mask)
    got = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRY, DEFAULT_ENTRIES["dense_walk"]).out
    # head 1 (block-sparse, 8 tiles a query tile: 52 of 55 causal tiles at 640 tokens) is near-dense and head 3
    # the plan's dense head: in a padded batch they run in the dense walk
    assert launches == [("skip", False, [True, False]), ("skip", True, [False, True]),
                        ("only", False, [True, False]), ("only", True, [False, True])]
    index = reference.build_index(q, k, plan, scale=0.25, **masks.kwargs())
    index = _densify_near_dense(index, q, k, plan)
    want = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, index=index, **masks.kwargs())
    assert torch.isfinite(got).all() and not got[1, :, :300].any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _densify_near_dense(index, q, k, plan):
    """The reference index with the near-dense (batch, head) pairs densified, as the op runs them."""
    from minference_fx.kernels import guard
    from minference_fx.dense import near_dense_heads

    near = near_dense_heads(index, plan, q.shape[-2], k.shape[-2], 0)
    return guard.densify(index, near, q.shape[-2], k.shape[-2], 0)


@pytest.mark.parametrize("path", ["cpu", "gpu-path"])
def test_a_head_whose_index_keeps_nearly_every_tile_runs_dense(path):
    """Block-sparse with 8 tiles per query tile keeps 52 of the 55 causal tiles of 640 tokens (>= 90 %):
    the head runs dense, so the op equals dense SDPA, which the index alone would not give. With 7 tiles
    (49 of 55) it stays sparse and equals the reference on its index."""
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.kernels import guard
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern
    from minference_fx.sparse_path import sparse_on_gpu

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 640, 16, generator=g)
    k, v = (torch.randn(1, 2, 640, 16, generator=g) for _ in range(2))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    masks = CallMasks()
    assert guard.causal_tiles(640, 640, 0) == 55
    for tiles, promoted in ((8, True), (7, False)):
        plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, tiles),) * 4)
        index = reference.build_index(q, k, plan, scale=0.25)
        assert (guard.near_dense(index, 640, 640, 0) == promoted).all()
        if path == "cpu":
            got = OP(q, k, v, None, None, 0.25, 0, 0, *plan.op_arguments(), 0)
        else:
            got = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRY, DEFAULT_ENTRIES["dense_walk"]).out
        on_index = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, index=index)
        assert (on_index - dense).abs().max() > 1e-3  # the index alone misses keys that matter
        torch.testing.assert_close(got, dense if promoted else on_index, atol=2e-5, rtol=2e-5)


def test_gpu_path_without_listed_heads_runs_one_launch_and_matches_the_reference(monkeypatch):
    """A plan of A-shape and dense heads lists nothing, so nothing can be near-dense: one sparse launch, no
    force table, and the result is the reference's."""
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.kernels import attend
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern
    from minference_fx.sparse_path import sparse_on_gpu

    launches = []
    real = attend.sparse_attention_triton
    monkeypatch.setattr(attend, "sparse_attention_triton", lambda *a, **kw: launches.append(kw.get("forced")) or real(*a, **kw))
    q, k, v = _qkv(200, 200)
    plan = LayerPlan((HeadPlan(Pattern.A_SHAPE, 16, 64), HeadPlan(Pattern.DENSE)) * 2)
    got, weak, *_ = sparse_on_gpu(q, k, v, plan, 0.25, CallMasks(), 0.0, DEFAULT_ENTRY, DEFAULT_ENTRIES["dense_walk"])
    want = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, index=reference.build_index(q, k, plan, scale=0.25))
    assert launches == [None] and weak is None
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_plan_call_names_the_path_of_each_call():
    """The op plans a call before any attention work (op.plan_call): the path, the crossover it compared the
    length with, the guard threshold it runs with (0 where no head is vertical-slash or block-sparse)."""
    from minference_fx import op, routing
    from minference_fx.plan import LayerPlan

    q, k, _ = _qkv()
    plan = LayerPlan.from_op_arguments(*VS)

    def planned(q, k, plan=plan, min_sparse_len=0, guard_threshold=0.0):
        return op.plan_call(q, k, CallMasks(), 0.25, plan, min_sparse_len, guard_threshold, router=routing.Router())

    assert planned(q[:0], k[:0]).path is op.CallPath.EMPTY
    assert planned(q, k, min_sparse_len=8192).path is op.CallPath.DENSE_BY_LENGTH
    assert planned(q, k, plan=LayerPlan.from_op_arguments([0] * 4, [0] * 4, [0] * 4)).path is op.CallPath.DENSE_LAYER
    assert planned(q, k[:, :, :0]).path is op.CallPath.NO_KEYS
    sparse = planned(q, k, guard_threshold=0.8)
    assert (sparse.path, sparse.min_sparse_len, sparse.guard_threshold) == (op.CallPath.SPARSE_CPU, 0, 0.8)
    assert sparse.sparse_launch is None and sparse.walk_launch is None  # the CPU path launches no kernel
    block_sparse = LayerPlan.from_op_arguments([3] * 4, [1] * 4, [0] * 4)
    assert planned(q, k, plan=block_sparse, guard_threshold=0.8).guard_threshold == 0.8  # checked too
    a_shape = LayerPlan.from_op_arguments([1] * 4, [16] * 4, [64] * 4)
    assert planned(q, k, plan=a_shape, guard_threshold=0.8).guard_threshold == 0.0
