"""The cost model that routes heads to the fused SDPA when their walk is slower (``minference_fx.cost``)."""
import pytest
import torch
import torch.nn.functional as F

import minference_fx.kernels.reference as reference
from minference_fx import cost, routing
from minference_fx.autotune import cache, dispatch
from minference_fx.autotune.cache import Table
from minference_fx.cost import WalkCost
from minference_fx.call_masks import CallMasks
from minference_fx.kernels import guard
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

OP = torch.ops.minference.sparse_attention.default
VS = HeadPlan(Pattern.VERTICAL_SLASH, 64, 64)
FOUR_VS = LayerPlan((VS,) * 4)


@pytest.fixture(autouse=True)
def _fresh_routing():
    routing.ROUTER.reset()
    yield
    routing.ROUTER.reset()


def _route(shares, plan=FOUR_VS, walk_cost=WalkCost(0.8, 0.0, 0), ran_dense=None, keys=1000, padded=None):
    got = cost.heads_to_route(ran_dense, torch.tensor([shares]), plan, walk_cost, keys, padded)
    return [False] * len(shares) if got is None else got[0].tolist()


def test_untuned_cost_routes_only_what_ran_dense():
    """Where no rate was measured the model adds nothing to the near-dense rule: a head at 85 % stays, and
    even a layer of them is not routed whole."""
    assert _route([0.85, 0.85, 0.85, 0.85], walk_cost=cost.UNTUNED_COST) == [False] * 4
    ran = torch.tensor([[True, False, False, False]])
    assert _route([0.95, 0.85, 0.2, 0.1], walk_cost=cost.UNTUNED_COST, ran_dense=ran) == [True, False, False, False]


def test_a_head_keeping_more_than_the_walk_rate_routes():
    assert _route([0.85, 0.79, 0.2, 0.1]) == [True, False, False, False]


def test_a_layer_whose_walk_and_index_cost_more_than_dense_routes_whole():
    """Shares 0.85 (routed: 1), 0.7, 0.72, 0.75 at rate 0.8 cost 0.875, 0.9 and 0.9375: a mean of 0.928. With
    the index at a tenth of the dense layer that is more than dense, and every head routes; at four times the
    keys the index costs a quarter as much (it grows with the keys, dense with their square) and only the
    first head routes."""
    shares = [0.85, 0.7, 0.72, 0.75]
    walk_cost = WalkCost(0.8, 0.1, 1000)
    assert _route(shares, walk_cost=walk_cost, keys=1000) == [True] * 4
    assert _route(shares, walk_cost=walk_cost, keys=4000) == [True, False, False, False]
    assert walk_cost.index_share_at(4000) == pytest.approx(0.025)


def test_unlisted_heads_are_weighed_by_their_plan_and_never_routed_for_cost_alone():
    """An A-shape head's share in the reference index means nothing to the walk (it reads fixed keys); a dense
    head runs SDPA on either side, so it weighs one. The index estimates the two listed heads of four, so it
    costs half its measured share. A layer routed whole marks its A-shape head too (else the site would still
    build its index), not its dense one (it runs SDPA anyway)."""
    mixed = LayerPlan((VS, HeadPlan(Pattern.A_SHAPE, 4, 64), HeadPlan(Pattern.DENSE), VS))
    assert _route([0.5, 0.99, 0.99, 0.5], plan=mixed) == [False] * 4
    # 0.625 + 0 + 1 + 0.625 = 2.25 of 4 heads, plus half an index of 0.8: 0.96, under the dense layer's cost
    assert _route([0.5, 0.99, 0.99, 0.5], plan=mixed, walk_cost=WalkCost(0.8, 0.8, 1000)) == [False] * 4
    assert _route([0.5, 0.99, 0.99, 0.5], plan=mixed, walk_cost=WalkCost(0.8, 0.9, 1000)) == [True, True, False, True]


def test_a_row_a_padding_mask_hides_keys_of_is_not_routed_for_cost():
    """A routed head runs such a row twice (SDPA unmasked, then the masked dense walk), so only the rules that ran
    it dense route it."""
    shares = torch.tensor([[0.85, 0.1, 0.1, 0.1], [0.85, 0.1, 0.1, 0.1]])
    ran = torch.tensor([[False, False, False, False], [False, True, False, False]])
    padded = torch.tensor([[False], [True]])
    got = cost.heads_to_route(ran, shares, FOUR_VS, WalkCost(0.8, 0.0, 0), 1000, padded)
    assert got.tolist() == [[True, False, False, False], [False, True, False, False]]


def test_each_batch_row_is_weighed_on_its_own():
    shares = torch.tensor([[0.85, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]])
    got = cost.heads_to_route(None, shares, FOUR_VS, WalkCost(0.8, 0.0, 0), 1000)
    assert got.tolist() == [[True, False, False, False], [False] * 4]


def _qkv(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 16, generator=g)
    k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(2))
    return q, k, v


# 7 tiles per query tile keep 49 of the 55 causal tiles of 640 tokens (0.89: not near-dense), 2 keep 19 (0.35)
COSTLY_AND_CHEAP = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 7), HeadPlan(Pattern.BLOCK_SPARSE, 2)) * 2)


@pytest.mark.parametrize("measured", [True, False])
def test_op_routes_a_head_the_device_walks_slower_than_dense(monkeypatch, measured):
    """With a measured walk rate of 0.8 the 89 % heads route at the next call and run dense there, the 35 %
    ones keep their index; unmeasured, nothing routes (the near-dense rule alone)."""
    q0, k0, v0 = _qkv(640)
    index = reference.build_index(q0, k0, COSTLY_AND_CHEAP, scale=0.25)
    assert guard.kept_share(index, 640, 640, 0)[0].tolist() == pytest.approx([49 / 55, 19 / 55] * 2)
    walk_cost = WalkCost(0.8, 0.0, 0) if measured else cost.UNTUNED_COST
    monkeypatch.setattr(dispatch, "walk_cost", lambda q, k: walk_cost)
    site = routing.new_site()
    call = lambda q, k, v: OP(q, k, v, None, None, 0.25, 0, 0, *COSTLY_AND_CHEAP.op_arguments(), 0, 0.0, site)  # noqa: E731
    call(q0, k0, v0)
    assert routing.ROUTER.routed_heads(site, 4, q0.device) == ((0, 2) if measured else ())
    q, k, v = _qkv(640, seed=6)
    got = call(q, k, v)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    on_index = reference.sparse_attention_reference(q, k, v, COSTLY_AND_CHEAP, scale=0.25,
                                                    index=reference.build_index(q, k, COSTLY_AND_CHEAP, scale=0.25))
    assert (on_index[:, [0, 2]] - dense[:, [0, 2]]).abs().max() > 1e-3  # the premise: routing shows
    want = dense if measured else on_index
    torch.testing.assert_close(got[:, [0, 2]], want[:, [0, 2]], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[:, [1, 3]], on_index[:, [1, 3]], atol=2e-5, rtol=2e-5)


def test_gpu_path_reports_the_heads_to_route_beside_those_it_ran_dense():
    """sparse_on_gpu (Triton under the interpreter): the 89 % heads run on their index this call (walking
    them is cheaper than the dense walk), and are marked for the fused SDPA at the next."""
    from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
    from minference_fx.sparse_path import sparse_on_gpu

    q, k, v = _qkv(640)
    got = sparse_on_gpu(q, k, v, COSTLY_AND_CHEAP, 0.25, CallMasks(), 0.0, DEFAULT_ENTRY, DEFAULT_ENTRIES["dense_walk"],
                        walk_cost=WalkCost(0.8, 0.0, 0))
    on_index = reference.sparse_attention_reference(q, k, v, COSTLY_AND_CHEAP, scale=0.25,
                                                    index=reference.build_index(q, k, COSTLY_AND_CHEAP, scale=0.25))
    assert not got.ran_dense.any()
    assert got.route_next.tolist() == [[True, False, True, False]]
    torch.testing.assert_close(got.out, on_index, atol=2e-5, rtol=2e-5)


def test_dispatch_reads_the_measured_cost_of_this_device_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(cache, "shipped_paths", lambda: [])
    cache.forget()
    q, k = torch.empty(1, 4, 64, 16), torch.empty(1, 2, 64, 16)
    try:
        assert dispatch.walk_cost(q, k) == cost.UNTUNED_COST
        measured = WalkCost(0.8, 0.03, 65536)
        key = dispatch.crossover_key(torch.device("cpu"), torch.float32, 16, 2)
        (tmp_path / cache.FILE_NAME).write_text(Table(costs={key: measured}).to_json())
        cache.forget()
        assert dispatch.walk_cost(q, k) == measured
        assert dispatch.walk_cost(q, torch.empty(1, 4, 64, 16)) == cost.UNTUNED_COST  # another group: not measured
    finally:
        cache.forget()


def _cost_key(gpu: str, capability: str = "9.0", group: int = 4, source_hash: str = "h") -> cache.CrossoverKey:
    return cache.CrossoverKey(source_hash, gpu, capability, "3.6.0", "bfloat16", 128, group)


def test_a_gpu_with_no_measured_cost_weighs_heads_by_the_slowest_rate_and_dearest_index_measured_elsewhere(
        tmp_path, monkeypatch):
    """An untuned GPU borrows the most cautious cost of its shape from other GPUs' records (and other kernel hashes'):
    the lowest walk rate, the index dearest at a given key count. Another group's records, a CPU key and a shape no
    GPU measured get nothing, so the near-dense rule alone applies there; the GPU's own measurement wins."""
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    shipped = tmp_path / "shipped.json"
    shipped.write_text(Table(costs={
        _cost_key("GPU A"): WalkCost(0.72, 0.03, 65536),
        _cost_key("GPU B", source_hash="old"): WalkCost(0.70, 0.08, 32768),  # dearer than A's: 0.08 x 32K > 0.03 x 64K
        _cost_key("GPU C"): WalkCost(0.82, 0.02, 65536),
        _cost_key("GPU A", group=6): WalkCost(0.50, 0.90, 65536),  # another shape: not borrowed
    }).to_json())
    monkeypatch.setattr(cache, "shipped_paths", lambda: [shipped])
    cache.forget()
    try:
        untuned = _cost_key("GPU D")
        assert cache.lookup_cost(untuned) is None
        assert cache.cautious_cost(untuned) == WalkCost(0.70, 0.08, 32768)
        assert dispatch._measured_or_cautious(untuned) == WalkCost(0.70, 0.08, 32768)
        assert dispatch._measured_or_cautious(_cost_key("GPU C")) == WalkCost(0.82, 0.02, 65536)  # its own
        assert cache.cautious_cost(_cost_key("cpu", capability="none")) is None
        assert dispatch._measured_or_cautious(_cost_key("GPU D", group=8)) == cost.UNTUNED_COST
    finally:
        cache.forget()


def test_the_op_s_lookup_borrows_for_a_gpu_key_and_logs_it_once(tmp_path, monkeypatch, caplog):
    """dispatch.walk_cost, as the op calls it, on a GPU whose table lacks the shape: the cautious cost, logged once."""
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    shipped = tmp_path / "shipped.json"
    shipped.write_text(Table(costs={_cost_key("GPU A"): WalkCost(0.72, 0.03, 65536)}).to_json())
    monkeypatch.setattr(cache, "shipped_paths", lambda: [shipped])
    monkeypatch.setattr(dispatch, "crossover_key", lambda device, dtype, head_dim, group: _cost_key("GPU D", group=group))
    cache.forget()
    caplog.set_level("WARNING", "minference_fx.autotune")
    try:
        q, k = torch.empty(1, 8, 64, 128), torch.empty(1, 2, 64, 128)
        assert dispatch.walk_cost(q, k) == WalkCost(0.72, 0.03, 65536) == dispatch.walk_cost(q, k)
        assert dispatch.walk_cost(q, torch.empty(1, 1, 64, 128)) == cost.UNTUNED_COST  # group 8: measured nowhere
        logged = [r.getMessage() for r in caplog.records if "slowest measured" in r.getMessage()]
        assert len(logged) == 1 and "walk rate 0.720" in logged[0]
    finally:
        cache.forget()


def test_the_borrowed_rate_routes_heads_the_near_dense_rule_alone_leaves_on_the_slower_walk():
    """The scattered family's heads at 32K keep 73-99 % of their tiles: with the near-dense rule alone the 80 %
    head stayed on the walk (0.83x cuDNN on an untuned H100); at a borrowed rate of 0.70 it routes."""
    shares = [0.80, 0.75, 0.95, 0.30]
    assert _route(shares, walk_cost=cost.UNTUNED_COST) == [False, False, False, False]
    assert _route(shares, walk_cost=WalkCost(0.70, 0.0, 0)) == [True, True, True, False]
