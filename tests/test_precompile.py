"""Background compile of the sparse kernels: the specs it reads off a graph, the layouts and launch
configs it guesses (CPU), and that the first real call finds its kernels compiled (GPU)."""
import dataclasses
import threading
import time

import pytest
import torch
import torch.fx as fx

from minference_fx import precompile
from minference_fx.autotune import cache
from minference_fx.options import BackendOptions
from minference_fx.plan import HeadPlan, LayerPlan, Pattern, escalated_plan

OP = torch.ops.minference.sparse_attention.default


def _layouts(seq):
    """q-like tensors [B, H, S, D] in the layouts a traced model hands the op."""
    b, h, d = 2, 4, 64
    return {
        "contiguous": torch.zeros(b, h, seq, d),
        "from [B, S, H, D]": torch.zeros(b, seq, h, d).transpose(1, 2),
        "from [S, B, H, D]": torch.zeros(seq, b, h, d).permute(1, 2, 0, 3),
    }


def _flags(t):
    # what Triton specialises an int argument on: == 1 and divisibility by 16
    return [(s == 1, s % 16 == 0) for s in t.stride()]


@pytest.mark.parametrize("layout", list(_layouts(8)))
def test_dummy_inputs_specialise_like_the_real_ones(layout):
    real = _layouts(3001)[layout]  # a prompt length that is not a multiple of anything
    spec = _spec(order=precompile._order(real))
    dummy = precompile._dummy(tuple(real.shape[:2]) + (precompile.DUMMY_LEN, real.shape[3]), spec.q_order, spec)
    assert precompile._order(dummy) == precompile._order(real)
    assert _flags(dummy) == _flags(real)


def _spec(order=(0, 1, 2, 3), **kw):
    fields = dict(device=torch.device("cpu"), dtype=torch.float16, q_heads=8, kv_heads=2, head_dim=64,
                  q_order=order, k_order=order, v_order=order, has_key_mask=False, has_doc_ids=False, window=0,
                  scale=0.125, patterns=(2,) * 8, budget_a=(1000,) * 8, budget_b=(6096,) * 8, guard_threshold=0.5,
                  min_sparse_len=-1)
    fields.update(kw)
    return precompile.KernelSpec(**fields)


def _op_node():
    """A sparse call node over meta tensors (no GPU), q contiguous and k from a [B, S, H, D] layout."""
    g = fx.Graph()
    q, k, v, km = (g.placeholder(n) for n in ("q", "k", "v", "km"))
    q.meta["example_value"] = torch.empty(1, 8, 4096, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2).transpose(1, 2)
    k.meta["example_value"] = torch.empty(1, 4096, 2, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    v.meta["example_value"] = torch.empty(1, 2, 4096, 64, dtype=torch.bfloat16, device="meta")
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 100, 200),) * 4 + (HeadPlan(Pattern.DENSE),) * 4)
    return g.call_function(OP, (q, k, v, km, None, 0.125, 0, 512, *plan.op_arguments(), 32768, 0.5)), plan


def test_spec_is_read_off_the_op_node(monkeypatch):
    node, plan = _op_node()
    assert precompile.spec_of(node) is None  # meta tensors are not on a GPU: nothing to compile for
    monkeypatch.setattr(precompile, "_on_gpu", lambda t: True)
    spec = precompile.spec_of(node)
    assert (spec.q_heads, spec.kv_heads, spec.head_dim, spec.dtype) == (8, 2, 64, torch.bfloat16)
    assert (spec.q_order, spec.k_order, spec.v_order) == ((0, 1, 2, 3), (0, 2, 1, 3), (0, 1, 2, 3))
    assert (spec.has_key_mask, spec.has_doc_ids, spec.window, spec.min_sparse_len, spec.guard_threshold) == (True, False, 512, 32768, 0.5)
    assert [list(spec.patterns), list(spec.budget_a), list(spec.budget_b)] == [list(x) for x in plan.op_arguments()]


def test_spec_reads_the_escalation_and_compiles_its_index(monkeypatch):
    node, plan = _op_node()
    monkeypatch.setattr(precompile, "_on_gpu", lambda t: True)
    assert precompile.spec_of(node).escalation == ()  # the rewrite appends nothing without an escalation
    node.args = (*node.args, 7, 1000, 6096)  # route site, then the escalation budgets
    spec = precompile.spec_of(node)
    assert spec.escalation == (1000, 6096)
    calls = []
    monkeypatch.setattr(precompile, "launch_configs", lambda spec, q, k: [("tuned", "walk")])
    monkeypatch.setattr(precompile, "sparse_on_gpu", lambda *a, escalated=None: calls.append(escalated))
    monkeypatch.setattr(precompile, "_dummy", lambda shape, order, spec: torch.zeros(shape))
    precompile.compile_spec(dataclasses.replace(spec, device=torch.device("cpu")))
    assert calls == [escalated_plan(plan, (1000, 6096))] and calls[0] is not None
    calls.clear()  # the guard off: no weak head, so no escalated index to compile
    precompile.compile_spec(dataclasses.replace(spec, device=torch.device("cpu"), guard_threshold=0.0))
    assert calls == [None]


def _fake_table(monkeypatch, crossover, entries, walks=None):
    """cache lookups answered from ``entries`` {bucket: TuneEntry} of the sparse walk and ``walks`` of the
    dense walk, crossover ``crossover``."""
    from minference_fx.autotune import dispatch

    def key(kernel, bucket):
        return cache.TuneKey("src", "NVIDIA H200", "9.0", "3.6.0", "bfloat16", 64, 4, kernel, bucket)

    monkeypatch.setattr(dispatch, "crossover_key", lambda *a: "shape")
    monkeypatch.setattr(dispatch, "tune_key", lambda kernel, dev, dtype, d, g, bucket: key(kernel, bucket))
    # crossover None: none stored, so the lookup answers what the plan's budgets give
    monkeypatch.setattr(cache, "lookup_crossover", lambda key, untuned: untuned if crossover is None else crossover)
    table = cache.Table({**{key("sparse_attention", bucket): entry for bucket, entry in entries.items()},
                         **{key("dense_walk", bucket): entry for bucket, entry in (walks or {}).items()}})
    monkeypatch.setattr(cache, "_tables", lambda path=None: [table])


def test_launch_configs_are_those_of_the_buckets_the_sparse_path_runs_at(monkeypatch):
    small, big = cache.TuneEntry(BLOCK_M=32), cache.TuneEntry(num_stages=3)
    walk = cache.DEFAULT_ENTRIES["dense_walk"]  # the dense walk, untuned in most tables here
    every_bucket = {1 << b: big for b in range(22)}
    q = torch.zeros(1, 8, 64, 64)
    _fake_table(monkeypatch, 32768, {**every_bucket, 8192: small})
    assert precompile.launch_configs(_spec(), q, q) == [(big, walk)]  # 8K is below the crossover: never launched
    _fake_table(monkeypatch, 4096, {**every_bucket, 8192: small})
    assert sorted(precompile.launch_configs(_spec(), q, q)) == sorted([(small, walk), (big, walk)])
    _fake_table(monkeypatch, 4096, {1 << 14: big, 1 << 12: small})  # untuned buckets run their nearest's
    assert sorted(precompile.launch_configs(_spec(), q, q)) == sorted([(small, walk), (big, walk)])
    _fake_table(monkeypatch, 4096, {})  # an untuned shape runs the defaults
    assert precompile.launch_configs(_spec(), q, q) == [(cache.DEFAULT_ENTRY, walk)]
    tuned_walk = cache.TuneEntry(128, 64, 8, 3)  # a tuned dense walk pairs with each bucket's sparse config
    _fake_table(monkeypatch, 4096, {1 << 14: big, 1 << 12: small}, {1 << 17: tuned_walk})
    assert sorted(precompile.launch_configs(_spec(), q, q)) == sorted([(small, tuned_walk), (big, tuned_walk)])
    _fake_table(monkeypatch, cache.DENSE_ALWAYS, every_bucket)
    assert precompile.launch_configs(_spec(), q, q) == []
    # no crossover stored: VS(1000, 6096) runs sparse from 64K, VS(250, 500) from 8K
    _fake_table(monkeypatch, None, {**every_bucket, 8192: small})
    assert precompile.launch_configs(_spec(), q, q) == [(big, walk)]
    assert sorted(precompile.launch_configs(_spec(budget_a=(250,) * 8, budget_b=(500,) * 8), q, q)) == sorted(
        [(small, walk), (big, walk)])
    # an explicit min_sparse_len wins over the stored crossover
    _fake_table(monkeypatch, cache.DENSE_ALWAYS, {**every_bucket, 8192: small})
    assert sorted(precompile.launch_configs(_spec(min_sparse_len=8192), q, q)) == sorted([(small, walk), (big, walk)])


def test_wait_returns_after_the_background_compile(monkeypatch):
    done = threading.Event()

    def slow_run(specs):
        time.sleep(0.3)
        done.set()

    monkeypatch.setattr(precompile, "spec_of", lambda node: _spec())
    monkeypatch.setattr(precompile, "_run", slow_run)
    assert precompile.start(["node", "node"]) is not None  # one spec after de-duplication
    precompile.wait()
    assert done.is_set()
    precompile.wait()  # nothing pending: returns at once


def test_a_wait_from_another_thread_never_joins_a_thread_not_yet_started(monkeypatch):
    """The thread went into the list before it started: an op's wait() in that gap raised 'cannot join thread
    before it is started'. Here the op's wait() runs inside the gap by construction: the thread's start holds until
    the wait has returned (the timeouts only keep a regression from hanging the suite)."""
    in_start, waited = threading.Event(), threading.Event()
    plain_thread = threading.Thread  # the patch below swaps the threading module's class, the caller's too

    class SlowStart(threading.Thread):
        def start(self):
            in_start.set()
            waited.wait(timeout=10)
            super().start()

    monkeypatch.setattr(precompile, "spec_of", lambda node: _spec())
    monkeypatch.setattr(precompile, "_run", lambda specs: None)
    monkeypatch.setattr(precompile.threading, "Thread", SlowStart)
    errors = []

    def op_call():
        try:
            if not in_start.wait(timeout=10):
                errors.append("the precompile thread never started")
            precompile.wait()
        except RuntimeError as exc:
            errors.append(exc)
        finally:
            waited.set()

    caller = plain_thread(target=op_call)
    caller.start()
    precompile.start(["node"])
    caller.join()
    precompile.wait()
    assert errors == []


def test_a_failing_guess_is_logged_not_raised(monkeypatch, caplog):
    def broken(spec):
        raise RuntimeError("no such kernel variant")

    monkeypatch.setattr(precompile, "compile_spec", broken)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: None)
    with caplog.at_level("DEBUG", logger="minference_fx"):
        precompile._run([_spec(), _spec(window=8)])  # the second spec still runs after the first failed
    failures = [r for r in caplog.records if "background precompile failed" in r.getMessage()]
    assert len(failures) == 2 and "no such kernel variant" in failures[0].getMessage()


def test_nothing_starts_without_a_gpu_spec():
    node, _ = _op_node()
    assert precompile.start([]) is None
    assert precompile.start([node, node]) is None and not precompile._threads


def test_precompile_option_is_validated():
    assert BackendOptions.from_user({}).precompile is True
    assert BackendOptions.from_user({"precompile": False}).precompile is False
    with pytest.raises(ValueError, match="precompile"):
        BackendOptions.from_user({"precompile": "yes"})


@pytest.mark.gpu
@pytest.mark.parametrize("escalation", [None, (2048, 8192)])  # the guard's fallback index is compiled there too
def test_first_call_finds_its_kernels_compiled_by_the_background_thread(escalation):
    import os
    import sys

    import triton

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import tiny_model

    from minference_fx.kernels import attend, guard, index

    # forget what earlier tests compiled in this process, so every kernel this call needs is compiled anew
    for module in (attend, index, guard):
        for fn in vars(module).values():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                fn.device_caches.clear()
    compiled_by = []

    def hook(*, fn, **_):
        if fn.module.startswith("minference_fx."):
            compiled_by.append((threading.current_thread().name, fn.name))
        return None

    model = tiny_model("llama", hidden_size=256, intermediate_size=512).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 3001), device="cuda")  # batch 2: the dummy call runs batch 1
    before = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        with torch.no_grad():
            compiled = torch.compile(model, backend="minference",
                                     options={"min_sparse_len": 0, "guard_escalation": escalation})
            compiled(ids, use_cache=False)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before
    in_background = {name for thread, name in compiled_by if thread == "minference-precompile"}
    in_call = {name for thread, name in compiled_by if thread != "minference-precompile"}
    assert "_sparse_attn_fwd" in in_background, compiled_by
    assert not in_call, f"the first call compiled {in_call} itself: the background guess missed its specialisation"


@pytest.mark.parametrize("enabled", [True, False])
def test_backend_hands_the_rewritten_calls_to_the_background_compile(monkeypatch, enabled):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import tiny_model

    handed = []
    monkeypatch.setattr(precompile, "start", lambda nodes: handed.append([n.target for n in nodes]))
    torch._dynamo.reset()
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="minference", options={"inner": "aot_eager", "precompile": enabled})
    with torch.no_grad():
        compiled(torch.randint(0, 128, (1, 32)), use_cache=False)
    assert handed == ([[OP, OP]] if enabled else [])  # the two layers' sparse calls, once per compiled graph
