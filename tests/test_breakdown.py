"""``bench breakdown``'s arithmetic on CPU: the density a config asks for and the table's totals and bounds."""
import collections
import json
import types

import pytest
import torch

from minference_fx import op, sparse_path
from minference_fx.autotune.cache import DEFAULT_ENTRIES, DEFAULT_ENTRY
from minference_fx.autotune.workload import family_qkv
from minference_fx.call_masks import CallMasks
from minference_fx.kernels import reference
from minference_fx.plan import HeadPlan, LayerPlan, Pattern, escalated_plan
from minference_fx.tools import breakdown
from minference_fx.tools.breakdown import Breakdown, LayerRow, asked_density
from test_guard_escalation import ESCALATION, SCALE, SMALL, _hot_columns_qkv


def test_asked_density_known_answers():
    n = 1000
    causal = n * (n + 1) / 2
    dense = LayerPlan((HeadPlan(Pattern.DENSE),))
    assert asked_density(dense, n) == pytest.approx(1.0)
    # 100 keys a row: rows 0..99 keep all of theirs, the 900 later ones 100 each
    vs = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 60, 40),))
    assert asked_density(vs, n) == pytest.approx((100 * 101 / 2 + 900 * 100) / causal)
    a_shape = LayerPlan((HeadPlan(Pattern.A_SHAPE, 64, 36),))
    assert asked_density(a_shape, n) == pytest.approx(asked_density(vs, n))
    blocks = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 2, 0),))  # 2 blocks of 64 keys
    assert asked_density(blocks, n) == pytest.approx((128 * 129 / 2 + 872 * 128) / causal)
    mixed = LayerPlan((HeadPlan(Pattern.DENSE), HeadPlan(Pattern.VERTICAL_SLASH, 60, 40)))
    assert asked_density(mixed, n) == pytest.approx((1 + asked_density(vs, n)) / 2)
    # budgets past the prompt keep every causal key
    assert asked_density(LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 4000, 4000),)), n) == pytest.approx(1.0)


def _row(call, path, index, dense_heads, dense_layer, physical):
    return LayerRow(call=call, path_ms=path, index_ms=index, dense_heads_ms=dense_heads, dense_layer_ms=dense_layer,
                    physical=physical, logical=physical / 2, asked=physical / 4, plan_dense_heads=1,
                    ran_dense_pairs=0, routed_heads=0)


def test_totals_and_bounds(tmp_path):
    rows = [_row(0, 10.0, 2.0, 3.0, 40.0, 0.25), _row(1, 20.0, 2.0, 3.0, 40.0, 0.5)]
    result = Breakdown({"model": "m", "length": 1024, "config": "c"}, eager_ms=200.0, compiled_ms=100.0, layers=rows)
    t = result.totals()
    assert t["index_ms"] == 4.0 and t["dense_heads_ms"] == 6.0
    assert t["walk_ms"] == pytest.approx(30.0 - 4.0 - 6.0)
    assert t["non_attention_ms"] == pytest.approx(70.0)
    assert t["eager_attention_ms"] == 80.0 and t["eager_non_attention_ms"] == 120.0
    # compiled non-attention + dense attention at the (time-weighted) density
    assert t["bound_physical_ms"] == pytest.approx(70.0 + 0.375 * 80.0)
    assert t["bound_asked_ms"] == pytest.approx(70.0 + 0.375 / 4 * 80.0)
    table = result.table()
    assert "2.00x eager" in table and "index (2 calls)" in table
    path = tmp_path / "b.json"
    result.save(str(path))
    saved = json.loads(path.read_text())
    assert saved["totals"]["walk_ms"] == pytest.approx(20.0) and len(saved["layers"]) == 2


def test_a_call_whose_every_head_is_routed_is_timed_as_attention(monkeypatch):
    """Such a call skips the sparse path; taken apart at the op's run_call, it is counted (before, its layer's
    attention was left in the non-attention remainder)."""
    monkeypatch.setattr(op, "run_call", lambda call, q, k, v: q)
    monkeypatch.setattr(breakdown, "event_ms", lambda fn: (fn(), 7.0)[1])
    monkeypatch.setattr(breakdown.dense, "dense_attention", lambda *a: None)
    monkeypatch.setattr(breakdown.dense, "every_head_routed", lambda *a: None)
    plan = LayerPlan((HeadPlan(Pattern.DENSE), HeadPlan(Pattern.VERTICAL_SLASH, 60, 40)))
    q = torch.zeros(1, 2, 1000, 8)
    rows = []
    wrapper = breakdown._take_apart(1000, rows)
    call = types.SimpleNamespace(path=op.CallPath.ALL_ROUTED, plan=plan, masks=CallMasks(), scale=1.0, routed=(1,),
                                 walk_launch=None)
    assert wrapper(call, q, q, q) is q
    assert len(rows) == 1 and rows[0].path_ms == rows[0].dense_heads_ms == 7.0 and rows[0].index_ms == 0.0
    # routed, not run dense by an index or guard (none ran)
    assert (rows[0].physical, rows[0].plan_dense_heads, rows[0].routed_heads, rows[0].ran_dense_pairs) == (1.0, 1, 1, 0)
    assert rows[0].asked == pytest.approx(asked_density(plan, 1000)) and rows[0].walk_ms == 0.0
    # the dense paths, and the calls of other lengths, are left alone
    wrapper(types.SimpleNamespace(path=op.CallPath.DENSE_BY_LENGTH), q, q, q)
    wrapper(call, q[:, :, :999], q, q)
    assert len(rows) == 1


def test_a_sparse_call_times_the_index_the_path_builds_and_counts_the_escalated_keys(monkeypatch):
    """The index it times carries the guard's estimate and the escalation's index (before, the plain index alone,
    so their cost was put on the walk), and its densities count the escalated index's keys for a head that took
    it. The Triton path runs under the interpreter here."""
    q, k, v = _hot_columns_qkv()
    escalated = escalated_plan(SMALL, ESCALATION)
    timed, real = [], sparse_path.guarded_index_on_gpu

    def spy(*args):
        timed.append(args[5:])  # (guard_threshold, escalated)
        return real(*args)

    monkeypatch.setattr(sparse_path, "guarded_index_on_gpu", spy)
    monkeypatch.setattr(breakdown, "event_ms", lambda fn: (fn(), 7.0)[1])
    call = types.SimpleNamespace(path=op.CallPath.SPARSE_GPU, plan=SMALL, masks=CallMasks(), scale=SCALE, routed=(),
                                 guard_threshold=0.8, escalated=escalated, sparse_launch=DEFAULT_ENTRY,
                                 walk_launch=DEFAULT_ENTRIES["dense_walk"])
    row = breakdown._layer_row(call, q, k, v, q.shape[-2], 0)
    # the path, its timing, the index's timing, the densities: all four build the path's index (three, were the
    # index timed without the guard's estimate and the escalation)
    assert timed == [(0.8, escalated)] * 4
    assert row.ran_dense_pairs == 0  # the premise: head 0 is weak at its own budgets, not at the escalated ones
    without = types.SimpleNamespace(**{**vars(call), "escalated": None})
    weak_row = breakdown._layer_row(without, q, k, v, q.shape[-2], 0)
    assert weak_row.ran_dense_pairs == 1
    # head 0 reads 128 columns escalated against 30 of its own: more keys than its own index, fewer than dense
    own = breakdown._layer_row(types.SimpleNamespace(**{**vars(call), "escalated": None, "guard_threshold": 0.0}),
                               q, k, v, q.shape[-2], 0)
    assert own.logical < row.logical < weak_row.logical
    # head 0 counted at the escalated plan's picks, head 1 (A-shape, which the escalated plan lists as dense) at its own
    index = real(q, k, SMALL, SCALE, CallMasks(), 0.8, escalated).index
    up = breakdown._density(q, k, escalated, index, 0, SCALE, None)
    mine = breakdown._density(q, k, SMALL, index, 0, SCALE, None)
    assert float(up.logical[0, 1]) == 1.0 and float(mine.logical[0, 1]) < 1.0
    assert row.logical == pytest.approx(float(up.logical[0, 0] + mine.logical[0, 1]) / 2)


def test_routed_heads_of_a_sparse_call_count_whole(monkeypatch):
    """Fused SDPA runs a routed head whole, but it was counted at its index's share (``ran_dense`` leaves the
    routing out): every head routed read 0.27 physical where the same site's all-routed calls read 1.0."""
    monkeypatch.setattr(breakdown, "event_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(sparse_path, "sparse_on_gpu", lambda q, k, v, plan, scale, masks, threshold, tuned, walk, routed=(),
                        escalated=None, walk_cost=None: sparse_path.sparse_on_cpu(q, k, v, plan, scale, masks, threshold,
                                                                                  routed, escalated))
    monkeypatch.setattr(sparse_path, "guarded_index_on_gpu", lambda q, k, plan, scale, masks, threshold, escalated=None:
                        sparse_path.GuardedIndex(reference.build_index(q, k, plan, scale=scale), None, None))
    q, k, v = family_qkv("structured", 1024, num_q_heads=4, num_kv_heads=1, head_dim=32, dtype=torch.float32,
                         device="cpu")
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 64, 128),) * 4)
    rows = {}
    for routed in ((), (0, 1, 2, 3)):
        call = op.CallPlan(op.CallPath.SPARSE_GPU, CallMasks(), 32 ** -0.5, plan, 0, routable=bool(routed), routed=routed)
        rows[routed] = breakdown._layer_row(call, q, k, v, 1024, 0)
    assert rows[()].physical < 0.6
    assert rows[(0, 1, 2, 3)].physical == rows[(0, 1, 2, 3)].logical == 1.0


def test_a_length_with_no_sparse_call_prints_a_table():
    """Below the crossover no call is taken apart, and the table raised on the missing densities."""
    result = Breakdown({"model": "m", "length": 32768, "config": "c"}, eager_ms=350.0, compiled_ms=310.0, layers=[])
    assert "no call took the sparse path" in result.table() and "1.13x eager" in result.table()


class _Clock:
    """Events that read a clock the test advances: a stand-in for CUDA events on the stream."""

    def __init__(self):
        self.now = 0.0

    def advance(self, ms: float) -> None:
        self.now += ms

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()


def test_timeline_parts_count_their_own_time_and_add_up_to_the_wall():
    """A stage that calls another counts only its own time (outer 1 + 2, inner 4, twice 4 + 4 over two calls);
    what no stage covers is the rest; the stages' modules get their functions back afterwards."""
    clock = _Clock()
    stages_module = types.SimpleNamespace()
    stages_module.inner = lambda ms: clock.advance(ms)

    def outer():
        clock.advance(1)
        stages_module.inner(4)  # by attribute, as the op's modules call their stages
        clock.advance(2)

    stages_module.outer = outer
    original_inner = stages_module.inner
    stages = (("outer", stages_module, "outer"), ("inner", stages_module, "inner"))

    def forward():
        clock.advance(5)
        stages_module.outer()
        clock.advance(3)
        stages_module.inner(4)
        clock.advance(0.5)

    got = breakdown.timeline(forward, stages, clock.event, sync=lambda: None)
    assert got.wall_ms == pytest.approx(19.5)
    assert got.parts_ms == {"outer": pytest.approx(3.0), "inner": pytest.approx(8.0)}
    assert got.rest_ms() == pytest.approx(8.5) and got.attention_ms() == pytest.approx(11.0)
    assert got.calls_ms == [pytest.approx(7.0), pytest.approx(4.0)] and got.op_calls == 2  # outer, then inner alone
    assert stages_module.outer is outer and stages_module.inner is original_inner


def test_a_stage_that_raises_still_closes_its_span_and_restores_the_module():
    clock = _Clock()
    stages_module = types.SimpleNamespace(fail=lambda: 1 / 0)
    original = stages_module.fail
    recorder = breakdown.SpanRecorder(clock.event)
    with pytest.raises(ZeroDivisionError), breakdown.recording((("fail", stages_module, "fail"),), recorder):
        stages_module.fail()
    assert stages_module.fail is original and recorder.own_ms() == {"fail": 0.0}


def test_with_the_timelines_every_time_is_theirs_and_the_compiled_parts_add_up_to_its_wall():
    """With both timelines, the parts, non-attention and the bounds are the forwards on the device clock, not the
    calls re-timed alone (which disagreed with bench prefill); densities stay the calls' own."""
    rows = [_row(0, 10.0, 2.0, 3.0, 40.0, 0.25), _row(1, 20.0, 2.0, 3.0, 40.0, 0.5)]
    parts = {breakdown.INDEX: 5.0, breakdown.WALK: 20.0, breakdown.SDPA: 3.0, breakdown.COPIES: 1.0, breakdown.GLUE: 1.0}
    compiled = breakdown.Timeline(90.0, parts, calls_ms=[12.0, 18.0])
    eager = breakdown.Timeline(210.0, {"fused SDPA": 100.0}, calls_ms=[40.0, 45.0])
    result = Breakdown({"model": "m", "length": 1024, "config": "c", "reps": 3}, eager_ms=200.0, compiled_ms=100.0,
                       layers=rows, compiled_timeline=compiled, eager_timeline=eager)
    t = result.totals()
    assert (t["index_ms"], t["walk_ms"], t["dense_heads_ms"], t["glue_ms"]) == (5.0, 20.0, 4.0, 1.0)
    assert t["index_ms"] + t["walk_ms"] + t["dense_heads_ms"] + t["glue_ms"] + t["non_attention_ms"] == 90.0
    assert t["eager_attention_ms"] == 100.0 and t["eager_non_attention_ms"] == 110.0
    assert t["bound_physical_ms"] == pytest.approx(60.0 + 0.375 * 100.0)
    table = result.table()
    assert "wall (this forward)" in table and "2.33x eager" in table and "re-timed" not in table
    assert f"{breakdown.REST:<52}{60.0:>12.1f}" in table and "2 op calls" in table
    assert "CUDA graph" not in table
    assert "(compiled / eager ms): 1: 18.0 / 45.0, 0: 12.0 / 40.0" in table  # layer 1 kept 40 %, layer 0 30 %
    no_calls = Breakdown(result.meta, 200.0, 100.0, rows, breakdown.Timeline(90.0, parts), eager)
    assert "CUDA graph replay" in no_calls.table()


def test_the_op_calls_its_stages_through_their_modules_so_the_timeline_sees_them():
    """The GPU path under the interpreter, with a dense head (SDPA through the copies) and two listed ones: each
    stage of COMPILED_STAGES but the all-routed one is seen, nested in the op's call. A stage imported by name
    instead of called through its module would read 0 on the GPU."""
    clock = _Clock()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 16, generator=g) for _ in range(3))
    plan = LayerPlan((HeadPlan(Pattern.DENSE),) + (HeadPlan(Pattern.VERTICAL_SLASH, 64, 64),) * 3)
    call = types.SimpleNamespace(path=op.CallPath.SPARSE_GPU, plan=plan, scale=0.25, masks=CallMasks(),
                                 guard_threshold=0.0, sparse_launch=DEFAULT_ENTRY,
                                 walk_launch=DEFAULT_ENTRIES["dense_walk"], routed=(), escalated=None, walk_cost=None,
                                 routable=False, router=None, route_site=-1)
    recorder = breakdown.SpanRecorder(clock.event)
    with breakdown.recording(breakdown.COMPILED_STAGES, recorder):
        out = op.run_call(call, q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    seen, pending = collections.Counter(), list(recorder.spans)
    while pending:
        span = pending.pop()
        seen[span.part] += 1
        pending.extend(span.inner)
    # two walk launches into one output: the sparse tiles skipping the pairs forced dense, the dense walk only those
    assert seen == {breakdown.GLUE: 1, breakdown.INDEX: 1, breakdown.WALK: 2, breakdown.COPIES: 1, breakdown.SDPA: 1}
    assert len(recorder.spans) == 1 and recorder.spans[0].part == breakdown.GLUE
