"""Lagged routing of the heads that ran dense to SDPA (``minference_fx.routing``)."""
import pytest
import torch
import torch.nn.functional as F

import minference_fx.kernels.reference as reference
from minference_fx import recent_reports, routing
from minference_fx.call_masks import CallMasks
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

from routing_helpers import calls_that_checked

OP = torch.ops.minference.sparse_attention.default


@pytest.fixture(autouse=True)
def _fresh_routing():
    routing.ROUTER.reset()
    yield
    routing.ROUTER.reset()


def _qkv(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 16, generator=g)
    k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(2))
    return q, k, v


def test_a_head_is_routed_only_when_it_ran_dense_in_every_batch_row():
    router = routing.Router()
    site = router.new_site()
    assert router.routed_heads(site, 4, torch.device("cpu")) == ()  # nothing observed yet
    ran_dense = torch.tensor([[True, True, False, True], [True, False, False, True]])
    router.observe(site, ran_dense, 100)
    assert router.routed_heads(site, 4, torch.device("cpu")) == (0, 3)
    assert router.routed_heads(site, 8, torch.device("cpu")) == ()  # another head count: not this decision
    assert router.routed_heads(routing.NO_SITE, 4, torch.device("cpu")) == ()
    router.observe(routing.NO_SITE, ran_dense, 100)
    assert router.routed_count() == 2
    assert router.new_site() != site


def test_only_the_most_recently_observed_sites_are_kept():
    router = routing.Router(max_sites=3)
    dense = torch.tensor([[True, False]])
    sites = [router.new_site() for _ in range(5)]
    for site in sites[:3]:
        router.observe(site, dense, 100)
    router.observe(sites[0], dense, 100)  # observed again: now the most recent
    for site in sites[3:]:
        router.observe(site, dense, 100)
    kept = [s for s in sites if router.routed_heads(s, 2, torch.device("cpu"))]
    assert kept == [sites[0], sites[3], sites[4]]
    assert router.routed_count() == 3


def test_an_all_routed_site_checks_its_index_once_in_a_while_and_when_the_prompt_doubles():
    router = routing.Router(recheck_every=3)
    cpu = torch.device("cpu")
    site = router.new_site()
    assert router.index_due(site, 1000, cpu)  # nothing observed yet
    router.observe(site, torch.ones(1, 4, dtype=torch.bool), 1000)
    assert [router.index_due(site, 1500, cpu) for _ in range(3)] == [False, False, True]
    router.observe(site, torch.ones(1, 4, dtype=torch.bool), 1500)
    assert not router.index_due(site, 2999, cpu) and router.index_due(site, 3000, cpu)


def test_each_check_that_routes_every_head_again_doubles_the_calls_to_the_next_up_to_the_cap():
    router = routing.Router(recheck_every=2, recheck_max=8)
    cpu = torch.device("cpu")
    site = router.new_site()
    every, one_sparse = torch.ones(1, 4, dtype=torch.bool), torch.tensor([[True, True, False, True]])

    def calls_to_next_check():
        due = [router.index_due(site, 1000, cpu) for _ in range(20)]
        return due.index(True) + 1

    router.observe(site, every, 1000)
    intervals = []
    for _ in range(4):
        intervals.append(calls_to_next_check())
        router.observe(site, every, 1000)  # the check routed every head again
    assert intervals == [2, 4, 8, 8]
    router.observe(site, one_sparse, 1000)  # a head came back sparse: the streak ends
    assert router.routed_heads(site, 4, cpu) == (0, 1, 3) and router.recheck_interval(site) == 2
    router.observe(site, every, 1000)
    assert calls_to_next_check() == 2  # routed whole again: the count starts over
    with router.index_at_every_call():  # a probe's checks neither lengthen the interval...
        for _ in range(3):
            router.observe(site, every, 1000)
    assert router.recheck_interval(site) == 2
    with router.index_at_every_call():  # ... nor keep it long once a head is sparse
        router.observe(site, one_sparse, 1000)
    router.observe(site, every, 1000)
    assert router.recheck_interval(site) == 2


@pytest.mark.parametrize("plan_dense", [0, 1], ids=["every head listed", "one head dense in the plan"])
def test_op_backs_off_the_index_checks_of_a_site_that_stays_routed(monkeypatch, plan_dense):
    """Through the op: every listed head near-dense at every check, so the checks come at calls 0, 2, 6 and 10 with
    ``recheck_every`` 2 and ``recheck_max`` 4 (a check is a call that records a decision: ``skipped`` back at 0).
    The plan's own dense heads are never routed, yet they back off alike: with the routed ones they are the layer."""
    monkeypatch.setattr(routing.ROUTER, "recheck_every", 2)
    monkeypatch.setattr(routing.ROUTER, "recheck_max", 4)
    plan = LayerPlan((HeadPlan(Pattern.DENSE),) * plan_dense + (HeadPlan(Pattern.BLOCK_SPARSE, 8),) * (4 - plan_dense))
    site = routing.new_site()
    q, k, v = _qkv(640)
    run = lambda: OP(q, k, v, None, None, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)  # noqa: E731
    assert calls_that_checked(run, site) == [0, 2, 6, 10]


def test_index_at_every_call_makes_its_own_threads_calls_check_and_no_others():
    import threading

    cpu = torch.device("cpu")
    router = routing.Router()
    site = router.new_site()
    router.observe(site, torch.ones(1, 4, dtype=torch.bool), 1000)
    seen_elsewhere = []
    with router.index_at_every_call():
        assert all(router.index_due(site, 1000, cpu) for _ in range(2 * router.recheck_every))
        other = threading.Thread(target=lambda: seen_elsewhere.append(router.index_due(site, 1000, cpu)))
        other.start()
        other.join()
    assert seen_elsewhere == [False]  # the other thread's call skipped, and counted
    assert [router.index_due(site, 1000, cpu) for _ in range(router.recheck_every - 1)][-1]


def test_op_skips_the_index_of_an_all_routed_site_between_checks(monkeypatch):
    """Every head near-dense at 640 tokens routes all of them: the next seven calls of that length run dense
    attention with no index built, the eighth builds it again (and still runs dense: routed); a prompt of twice
    the length builds it at once. A padding mask is still read."""
    from minference_fx.dense import dense_attention

    built = []
    real_build = reference.build_index
    monkeypatch.setattr(reference, "build_index", lambda *a, **kw: built.append(a[0].shape[-2]) or real_build(*a, **kw))
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 8),) * 4)
    site = routing.new_site()
    call = lambda qkv, mask=None: OP(*qkv, mask, None, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)
    call(_qkv(640))
    assert built == [640] and routing.ROUTER.routed_heads(site, 4, torch.device("cpu")) == (0, 1, 2, 3)
    q, k, v = _qkv(640, seed=6)
    mask = _left_padded(640, 200)
    for i in range(routing.ROUTER.recheck_every - 1):
        masked = i % 2 == 1
        got = call((q, k, v), mask if masked else None)
        torch.testing.assert_close(got, dense_attention(q, k, v, CallMasks(mask if masked else None), 0.25),
                                   atol=2e-5, rtol=2e-5)
        assert bool(got[0, :, :200].any()) is not masked  # rows that see no key are zeros
    assert built == [640]
    torch.testing.assert_close(call((q, k, v)), dense_attention(q, k, v, CallMasks(), 0.25), atol=2e-5, rtol=2e-5)
    assert built == [640, 640]
    call(_qkv(640))
    assert built == [640, 640]
    call(_qkv(1280))
    assert built == [640, 640, 1280]


def test_gpu_path_runs_routed_heads_dense_and_reports_what_their_index_said():
    """sparse_on_gpu (Triton under the interpreter): block-sparse with 7 tiles per query tile keeps 49 of the
    55 causal tiles of 640 tokens, not near-dense. Routed heads 0 and 2 still equal dense attention, the others
    the reference on their index; ``ran_dense`` comes from the index (False), not from the routing."""
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.sparse_path import sparse_on_gpu

    walk = DEFAULT_ENTRIES["dense_walk"]
    q, k, v = _qkv(640)
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 7),) * 4)
    masks = CallMasks()
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    on_index = reference.sparse_attention_reference(q, k, v, plan, scale=0.25,
                                                    index=reference.build_index(q, k, plan, scale=0.25))
    got = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRY, walk, routed=(0, 2))
    assert not got.ran_dense.any()
    torch.testing.assert_close(got.out[:, [0, 2]], dense[:, [0, 2]], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.out[:, [1, 3]], on_index[:, [1, 3]], atol=2e-5, rtol=2e-5)
    assert (on_index[:, [0, 2]] - dense[:, [0, 2]]).abs().max() > 1e-3  # routing changed those heads

    every = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRY, walk, routed=(0, 1, 2, 3))
    torch.testing.assert_close(every.out, dense, atol=2e-5, rtol=2e-5)
    assert every.ran_dense is not None and not every.ran_dense.any()


@pytest.mark.parametrize("route", [True, False])
def test_op_routes_a_head_that_was_near_dense_at_the_previous_call(route):
    """8 tiles per query tile are near-dense at 640 tokens (52 of 55 causal tiles) and sparse at 1280
    (at most 160 of 210). After a 640-token call the routed op runs 1280 tokens dense; unrouted it runs
    the index."""
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 8),) * 4)
    site = routing.new_site() if route else routing.NO_SITE
    OP(*_qkv(640), None, None, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)
    q, k, v = _qkv(1280, seed=6)
    got = OP(q, k, v, None, None, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    on_index = reference.sparse_attention_reference(q, k, v, plan, scale=0.25,
                                                    index=reference.build_index(q, k, plan, scale=0.25))
    assert (on_index - dense).abs().max() > 1e-3
    torch.testing.assert_close(got, dense if route else on_index, atol=2e-5, rtol=2e-5)
    # the 1280-token call was sparse by its own index, so the call after it routes nothing
    assert routing.ROUTER.routed_heads(site, 4, q.device) == ()


def _left_padded(n, pad, batch=1):
    """[batch, n] key mask, the last row left-padded by ``pad`` (the others all valid, as generate passes)."""
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[-1, :pad] = False
    return mask


def _batch_of_two(n, seed):
    q, k, v = _qkv(n, seed)
    q2, k2, v2 = _qkv(n, seed + 100)
    return torch.cat([q, q2]), torch.cat([k, k2]), torch.cat([v, v2])


def test_one_prompt_under_a_padding_mask_routes_and_a_padded_row_reads_the_mask():
    """Under a padding mask (generate always passes one) a call of one batch row routes: a head near-dense
    at the site's previous call runs dense, and a left-padded row still reads its mask (masked dense
    attention, rows that see no key 0). The CPU op runs the reference; the GPU path's launches are checked
    below."""
    from minference_fx.dense import dense_attention

    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 8),) * 4)
    site = routing.new_site()
    OP(*_qkv(640), _left_padded(640, 0), None, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)
    assert routing.ROUTER.routed_heads(site, 4, torch.device("cpu")) == (0, 1, 2, 3)  # near-dense at 640 tokens
    q, k, v = _qkv(1280, seed=6)
    mask = _left_padded(1280, 300)
    got = OP(q, k, v, mask, None, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)
    want = dense_attention(q, k, v, CallMasks(mask), 0.25)
    on_index = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, key_mask=mask,
                                                    index=reference.build_index(q, k, plan, scale=0.25, key_mask=mask))
    assert (on_index - want).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert not got[0, :, :300].any()


@pytest.mark.parametrize("mask", ["padded batch", "documents"])
def test_a_padded_batch_or_documents_neither_route_nor_record(mask):
    """Routed heads run SDPA without a mask: in a padded batch most rows would then run twice, and packed
    documents are a mask SDPA would have to read, so there the op runs each head by its own index and keeps
    no state."""
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 8),) * 4)
    site = routing.new_site()
    if mask == "padded batch":
        OP(*_batch_of_two(640, 5), _left_padded(640, 100, batch=2), None, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)
    else:
        docs = (torch.arange(640) >= 320).long()[None]
        OP(*_qkv(640), None, docs, 0.25, 0, 0, *plan.op_arguments(), 0, 0.0, site)
    assert routing.ROUTER.routed_count() == 0 and site not in routing.ROUTER.states


def test_gpu_path_under_a_padding_mask_runs_routed_heads_by_sdpa_without_it_then_the_padded_row_masked(monkeypatch):
    """sparse_on_gpu (Triton under the interpreter) on one left-padded row: routed heads 0 and 2 go to SDPA
    without the mask, then the masked dense walk runs them again; they equal masked dense attention, the others
    the reference on their own index. Every head routed: the layer is one maskless SDPA call plus that launch,
    and under an all-ones mask exactly SDPA's causal result. In a padded batch of two nothing is routed."""
    from minference_fx import dense
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.sparse_path import sparse_on_gpu

    walk = DEFAULT_ENTRIES["dense_walk"]
    sdpa_masks = []
    real_heads, real_dense = dense.dense_heads_by_sdpa, dense.dense_attention
    monkeypatch.setattr(dense, "dense_heads_by_sdpa", lambda *a: sdpa_masks.append(a[-1].key_mask) or real_heads(*a))
    monkeypatch.setattr(dense, "dense_attention",
                        lambda q, k, v, masks, *a, **kw: sdpa_masks.append(masks.key_mask) or real_dense(q, k, v, masks, *a, **kw))
    # 384 tokens, 150 of them padding (640 before, BS(5): 30 of 36 tiles; the interpreter's time grows with the causal
    # tile pairs): 7 of the 10 causal tiles past the padding (they start at the first kept key), not near-dense; in the
    # batch of two the unpadded row keeps 11 of 21, not near-dense either
    q, k, v = _qkv(384, seed=5)
    mask = _left_padded(384, 150)
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 2),) * 4)
    masks = CallMasks(mask)
    want_dense = real_dense(q, k, v, masks, 0.25)
    sdpa_masks.clear()
    on_index = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, key_mask=mask,
                                                    index=reference.build_index(q, k, plan, scale=0.25, key_mask=mask))
    got = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRY, walk, routed=(0, 2))
    torch.testing.assert_close(got.out[:, [0, 2]], want_dense[:, [0, 2]], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.out[:, [1, 3]], on_index[:, [1, 3]], atol=2e-5, rtol=2e-5)
    unmasked = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert (unmasked - want_dense).abs().max() > 1e-3  # the mask changed the result: the launch after SDPA read it
    every = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRY, walk, routed=(0, 1, 2, 3))
    torch.testing.assert_close(every.out, want_dense, atol=2e-5, rtol=2e-5)
    assert not every.out[0, :, :150].any()
    ones = CallMasks(_left_padded(384, 0))
    assert torch.equal(sparse_on_gpu(q, k, v, plan, 0.25, ones, 0.0, DEFAULT_ENTRY, walk, routed=(0, 1, 2, 3)).out, unmasked)
    assert len(sdpa_masks) == 4 and all(m is None for m in sdpa_masks)  # SDPA (heads 0, 2, then two layers) never read the mask

    two = _batch_of_two(384, 5)
    batch_masks = CallMasks(_left_padded(384, 150, batch=2))
    unrouted = reference.sparse_attention_reference(*two, plan, scale=0.25, key_mask=batch_masks.key_mask,
                                                    index=reference.build_index(*two[:2], plan, scale=0.25,
                                                                                key_mask=batch_masks.key_mask))
    got = sparse_on_gpu(*two, plan, 0.25, batch_masks, 0.0, DEFAULT_ENTRY, walk, routed=(0, 1, 2, 3))
    torch.testing.assert_close(got.out, unrouted, atol=2e-5, rtol=2e-5)


def test_an_all_routed_layer_launches_the_same_with_its_index_built_or_skipped(monkeypatch):
    """A CUDA graph is recorded at the call after a warm-up; with every head routed the warm-up may build the
    index and the recorded call skip it. Both must then launch the same attention work (the same kernel
    arguments' shapes and modes), or the capture would meet a kernel variant, or a cuDNN shape, first."""
    from minference_fx import dense
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.kernels import attend
    from minference_fx.sparse_path import sparse_on_gpu

    launches = []
    real = attend.sparse_attention_triton

    def record(*args, **kw):
        index = args[3]
        shapes = tuple(t.shape for t in (index.block_count, index.block_start, index.col_count, index.col_index))
        launches.append((shapes, kw.get("forced"), kw.get("key_mask") is not None))
        return real(*args, **kw)

    monkeypatch.setattr(attend, "sparse_attention_triton", record)
    sdpa = []
    real_dense = dense.dense_attention
    monkeypatch.setattr(dense, "dense_attention",
                        lambda q, k, v, masks, *a, **kw: sdpa.append((q.shape, masks.key_mask)) or real_dense(q, k, v, masks, *a, **kw))
    # the padded prompt of the test above (384 tokens, 150 padding, 7 of 10 tiles: not near-dense)
    q, k, v = _qkv(384, seed=5)
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 2),) * 4)
    masks = CallMasks(_left_padded(384, 150))
    walk = DEFAULT_ENTRIES["dense_walk"]
    built = sparse_on_gpu(q, k, v, plan, 0.25, masks, 0.0, DEFAULT_ENTRY, walk, routed=(0, 1, 2, 3)).out
    with_index, sdpa_with_index = launches[:], sdpa[:]
    launches.clear()
    sdpa.clear()
    skipped = dense.every_head_routed(q, k, v, masks, 0.25, walk)
    assert launches == with_index and len(launches) == 1 and launches[0][1:] == ("only", True)
    assert sdpa == sdpa_with_index == [(q.shape, None)]
    torch.testing.assert_close(skipped, built, atol=0, rtol=0)


class _TwoLayers(torch.nn.Module):
    def forward(self, q, k, v):
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(x, k, v, is_causal=True)


@pytest.mark.parametrize("route_dense", [True, False])
def test_each_rewritten_site_gets_its_own_routing_state_unless_turned_off(route_dense):
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    opts = {"inner": "eager", "min_sparse_len": 0, "route_dense": route_dense}
    out = torch.compile(_TwoLayers(), backend="minference", options=opts)(q, k, v)
    assert len(routing.ROUTER.states) == (2 if route_dense else 0)
    assert ("routing off" in recent_reports()[-1].table()) is not route_dense
    # attention fed straight into attention: the second op reads the first op's output; the default budgets
    # cover all 128 keys, so the result is dense attention twice
    torch.testing.assert_close(out, _TwoLayers()(q, k, v), atol=1e-5, rtol=1e-5)


def test_route_dense_must_be_a_bool():
    from minference_fx.options import BackendOptions

    with pytest.raises(ValueError, match="route_dense='yes'; expected True or False"):
        BackendOptions.from_user({"route_dense": "yes"})


def test_plan_call_reads_and_run_call_records_the_router_it_is_given():
    """A router of its own: calls planned with it route by it and are recorded in it; the process's router
    (the op's) never hears of them."""
    from minference_fx import op

    router = routing.Router()
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 8),) * 4)  # near-dense at 640 tokens
    site = router.new_site()

    def call(q, k, v):
        planned = op.plan_call(q, k, CallMasks(), 0.25, plan, 0, 0.0, site, router)
        return planned, op.run_call(planned, q, k, v)

    first, _ = call(*_qkv(640))
    assert first.path is op.CallPath.SPARSE_CPU and first.routed == ()
    assert router.routed_heads(site, 4, torch.device("cpu")) == (0, 1, 2, 3) and not routing.ROUTER.states
    q, k, v = _qkv(640, seed=6)
    second, out = call(q, k, v)
    assert second.path is op.CallPath.ALL_ROUTED and second.routed == (0, 1, 2, 3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True))
    assert not routing.ROUTER.states
