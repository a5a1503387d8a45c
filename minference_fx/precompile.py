"""Compile the op's Triton kernels in a background thread while Inductor compiles the rest of the graph.

On a cold cache the index, guard and attention kernels take about 10 s to JIT on an H200 host, and the
first sparse call would pay that after Inductor's compile, in series. Triton's compile mostly runs
outside the GIL (measured: pure-Python work in the main thread slowed by about a fifth while it ran; see
``scripts/explore_compile.py``), so it overlaps Inductor's own work when started as soon as the graph
is rewritten.

The thread runs the op's GPU path once per distinct (site shape, launch config) on small zero inputs
laid out like the site's query, key and value, so each kernel is compiled with the specialisation
the real call will ask for (dtype, head dim, stride divisibility, mask flags, launch config). A guess
that misses costs nothing but the thread's time: the real call compiles what it lacks. The op's first
GPU call, dense or sparse, waits for the thread, so the two never compile the same kernel at once and
none of the thread's GPU work can overlap a CUDA-graph capture that follows (cudagraph trees warm a
graph up eagerly before they capture it).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Optional

import torch

from .autotune import cache, dispatch
from .call_masks import CallMasks
from .plan import escalated_plan, escalation_of, layer_plan
from .sparse_path import sparse_on_gpu

log = logging.getLogger("minference_fx")

# Query length of the dummy call: long enough that every index kernel runs (several query tiles and
# key chunks), short enough to cost milliseconds. Lengths are never specialised on, so any will do.
DUMMY_LEN = 4096

_threads: list[threading.Thread] = []
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What one rewritten site's sparse call specialises the Triton kernels on."""

    device: torch.device
    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    head_dim: int
    q_order: tuple
    """dims of q [B, H, S, D] from outermost to innermost in memory; likewise k_order, v_order"""
    k_order: tuple
    v_order: tuple
    has_key_mask: bool
    has_doc_ids: bool
    window: int
    scale: float
    patterns: tuple
    budget_a: tuple
    budget_b: tuple
    guard_threshold: float
    min_sparse_len: int
    escalation: tuple = ()
    """the guard's escalation budgets (the op's escalate_a/escalate_b), () for none: their index kernels compile too"""


def _hint(x) -> int:
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.hint is not None else 8192
    return int(x)


def _scale_hint(scale, head_dim: int) -> float:
    """The scale to warm the kernels with: a graph input's (a SymFloat node) is a runtime argument, not
    compiled in, so any positive value compiles the same kernels."""
    if isinstance(scale, (int, float)):
        return float(scale)
    return head_dim ** -0.5


def _order(val: torch.Tensor) -> tuple:
    strides = [_hint(s) for s in val.stride()]
    # outermost first; among equal strides (size-1 dims) keep the logical order
    return tuple(sorted(range(val.dim()), key=lambda d: (-strides[d], d)))


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def spec_of(node) -> Optional[KernelSpec]:
    """The spec of a ``minference::sparse_attention`` call node, or None when its inputs are not on a GPU."""
    q, k, v, key_mask, doc_ids, scale, _q_offset, window, patterns, budget_a, budget_b, min_len, guard = node.args[:13]
    # the rewrite appends (route_site, escalate_a, escalate_b) only with an escalation or a budget growth; the
    # growth's (grow_from, grow_exponent) after them change nothing here: the kernels read budgets from tables
    # and keep the counts they derive out of their specialisation, so a grown plan runs the kernels compiled here
    escalation = escalation_of(*node.args[14:16]) if len(node.args) >= 16 else ()
    vals = [x.meta.get("example_value", x.meta.get("val")) if hasattr(x, "meta") else None for x in (q, k, v)]
    if any(not isinstance(t, torch.Tensor) for t in vals) or not _on_gpu(vals[0]):
        return None
    qv, kv, vv = vals
    return KernelSpec(qv.device, qv.dtype, _hint(qv.shape[1]), _hint(kv.shape[1]), _hint(qv.shape[-1]),
                      _order(qv), _order(kv), _order(vv), key_mask is not None, doc_ids is not None, int(window),
                      _scale_hint(scale, _hint(qv.shape[-1])), tuple(patterns), tuple(budget_a), tuple(budget_b), float(guard), int(min_len),
                      escalation)


def _dummy(shape: tuple, order: tuple, spec: KernelSpec) -> torch.Tensor:
    physical = torch.zeros([shape[d] for d in order], dtype=spec.dtype, device=spec.device)
    return physical.permute([order.index(d) for d in range(len(order))])


def launch_configs(spec: KernelSpec, q: torch.Tensor, k: torch.Tensor) -> list:
    """Distinct launch configs the sparse path can use for this shape, as (sparse walk, dense walk) pairs: one
    per length bucket it runs at."""
    group = spec.q_heads // spec.kv_heads
    # the stored crossover, never an on-miss tuning run from this thread
    min_len = spec.min_sparse_len
    if min_len < 0:
        plan = layer_plan(spec.patterns, spec.budget_a, spec.budget_b)
        min_len = cache.lookup_crossover(dispatch.crossover_key(q.device, q.dtype, spec.head_dim, group),
                                         untuned=dispatch.untuned_crossover(plan))
    if min_len >= cache.DENSE_ALWAYS:
        return []
    configs = set()
    for bits in range(max(min_len, 1).bit_length() - 1, 22):  # buckets up to 2M tokens
        # what the op's lookups will answer (a fallback's log line may come from this thread first)
        configs.add(tuple(cache.resolve(dispatch.tune_key(kernel, q.device, q.dtype, spec.head_dim, group, 1 << bits))[0]
                          for kernel in ("sparse_attention", "dense_walk")))
    return sorted(configs)


def compile_spec(spec: KernelSpec) -> int:
    """Run the op's GPU path for ``spec`` at every launch config it may use; returns how many ran."""
    # batch 1 whatever the real batch: only the batch stride's divisibility is specialised on, and it matches
    n, b = DUMMY_LEN, 1
    q = _dummy((b, spec.q_heads, n, spec.head_dim), spec.q_order, spec)
    k = _dummy((b, spec.kv_heads, n, spec.head_dim), spec.k_order, spec)
    v = _dummy((b, spec.kv_heads, n, spec.head_dim), spec.v_order, spec)
    masks = CallMasks(key_mask=torch.ones(b, n, dtype=torch.bool, device=spec.device) if spec.has_key_mask else None,
                      doc_ids=torch.zeros(b, n, dtype=torch.int64, device=spec.device) if spec.has_doc_ids else None,
                      q_offset=0, window=spec.window)
    plan = layer_plan(spec.patterns, spec.budget_a, spec.budget_b)  # the op's own plan, cached
    escalated = escalated_plan(plan, spec.escalation) if spec.escalation and spec.guard_threshold > 0 else None
    configs = launch_configs(spec, q, k)
    for tuned, walk in configs:
        sparse_on_gpu(q, k, v, plan, spec.scale, masks, spec.guard_threshold, tuned, walk, escalated=escalated)
    return len(configs)


def _run(specs: list[KernelSpec]) -> None:
    for spec in specs:
        try:
            with torch.cuda.device(spec.device), torch.cuda.stream(torch.cuda.Stream(spec.device)):
                ran = compile_spec(spec)
                torch.cuda.current_stream().synchronize()
            log.debug("minference: precompiled the sparse kernels for %s (%d launch configs)", spec, ran)
        except Exception as exc:  # a failed guess only means the first call compiles for itself
            log.debug("minference: background precompile failed for %s: %s", spec, exc)


def start(nodes) -> Optional[threading.Thread]:
    """Start compiling the kernels the sparse call nodes ``nodes`` will launch; None when there is nothing to do."""
    specs = list(dict.fromkeys(s for s in map(spec_of, nodes) if s is not None))
    if not specs:
        return None
    thread = threading.Thread(target=_run, args=(specs,), name="minference-precompile", daemon=True)
    with _lock:  # started before another thread's wait() can take it from the list and join it
        thread.start()
        _threads.append(thread)
    return thread


def wait() -> None:
    """Block until every background compile has finished (at once when none is running)."""
    if not _threads:
        return
    with _lock:
        pending, _threads[:] = list(_threads), []
    for thread in pending:
        thread.join()
