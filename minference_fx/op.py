"""``minference::sparse_attention``: the one op the rewrite pass inserts.

It is a functional ``torch.library.custom_op``: opaque to Inductor, a new output
tensor, no host sync and no data-sized allocation, so a CUDA graph can capture it
and a change of prompt length never recompiles (every size is a SymInt).

Semantics, for query row ``i`` at absolute position ``p_i = q_offset + i`` of
batch ``b`` and query head ``h`` (kv head ``h // (Hq // Hkv)``), key ``j`` is
read when all of these hold:

* ``j <= p_i`` (causal, aligned bottom-right when ``q_offset = Skv - Sq``);
* ``key_mask[b, j]`` when a key mask (padding) is given;
* ``doc_ids[b, p_i] == doc_ids[b, j]`` when packed-sequence ids are given;
* ``p_i - j < window`` when ``window > 0`` (sliding-window models);
* ``j`` is in the head's sparse key set (its plan entry), unless that set holds at
  least 90 % of the causal key tiles (``kernels.guard.near_dense``: then the head runs
  dense, which is cheaper and exact) or the quality guard finds it captures too little
  attention mass, or unless the prompt is
  shorter than ``min_sparse_len``, in which case every head is dense and the
  call goes to the device's dense SDPA (cuDNN / flash on GPU). So do a layer
  whose plan is dense on every head and, on GPU, the dense heads of a mixed
  plan (cuDNN is faster than the sparse kernel's tile walk on dense work). A negative
  ``min_sparse_len`` means the tuned crossover of this device and shape
  (``minference-fx autotune``; untuned: from the plan's budgets, ``autotune.dispatch.untuned_crossover``,
  32768 for MInference's default head); so does a call on a GPU that cannot run the sparse path's kernels at
  this head dim and dtype, where even their smallest launch config needs more shared memory than it gives a
  block (:mod:`minference_fx.kernels.fit`: head dim 256 on the 99 KB cards, sm_86/89/120), logged once;
* or unless ``route_site`` names a rewritten site (``routing.new_site``) whose previous call ran the
  head dense in every batch row (near-dense index or guard) or found it cheaper dense (the cost model,
  :mod:`minference_fx.cost`, with the device's measured walk rate), and this call needs no mask that SDPA would
  have to read (:func:`dense.routable`: no documents or window, a prefill aligned at 0 or a decode step; a
  padding mask only with one batch row): then the head runs dense through the device's SDPA this call,
  without the mask, and a row the padding mask hides keys of runs it again with the mask in the kernel's
  dense walk (``minference_fx.routing``: lagged, read without a host sync). A head only ever gains keys
  by it. A site whose every head is routed builds its index only at one call in eight, then in 16, 32 and 64
  while every check routes all heads again, or when the prompt has doubled (``routing.Router.index_due``), to
  see a head stop being near-dense.

A row with no readable key yields zeros, never NaN. With ``grow_from`` > 0, a call of more than ``grow_from``
keys reads its plan's vertical-slash and block-sparse budgets times ``(Skv / grow_from) ** grow_exponent``, the
ratio rounded up to an eighth of an octave (:func:`plan.grown_plan`; the site's constant arguments stay as they
are, so no recompile).

Each call is planned, then run, as FlashInfer's wrappers split ``plan()`` from ``run()``: :func:`plan_call` reads
the shapes, the device's tuned crossover and launch configs and the site's routing, and says which path the call
takes in a frozen :class:`CallPlan`; :func:`run_call` launches it. Which heads run dense, and how, is
:mod:`minference_fx.dense`; the sparse paths are :mod:`minference_fx.sparse_path`.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Optional

import torch

from . import dense, precompile, routing, sparse_path
from .autotune import dispatch
from .autotune.cache import TuneEntry
from .call_masks import CallMasks
from .cost import WalkCost
from .kernels import attend, fit, guard
from .plan import (MAX_BUDGET, LayerPlan, escalated_plan, escalation_of, grown_plan, growth_of, is_budget_growth,
                   is_escalation, layer_plan)

log = logging.getLogger("minference_fx")


def _check_inputs(q, k, v, key_mask, doc_ids, scale, q_offset, window, patterns, budget_a, budget_b):
    problems = []
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        problems.append(f"q, k, v must be 4-D [B, H, S, D]; got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    else:
        if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
            problems.append(f"batch/heads/length disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if q.shape[-1] != k.shape[-1] or v.shape[-1] != q.shape[-1]:
            # the output is q's shape (the fake says so), so a value head dim of its own has no place in it
            problems.append(f"q, k, v head dims must agree, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
        if k.shape[1] == 0 or q.shape[1] == 0:
            problems.append(f"q and k need at least one head each, got {q.shape[1]} query and {k.shape[1]} kv heads")
        elif q.shape[1] % k.shape[1] != 0:
            problems.append(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
        if len(patterns) != q.shape[1]:
            problems.append(f"head plan has {len(patterns)} entries, q has {q.shape[1]} heads")
        batches = (1, q.shape[0])
        if key_mask is not None and (key_mask.dim() != 2 or key_mask.dtype != torch.bool
                                     or key_mask.shape[0] not in batches or key_mask.shape[1] != k.shape[2]):
            problems.append(f"key_mask must be a bool [B or 1, Skv={k.shape[2]}] tensor (B={q.shape[0]}), got "
                            f"{key_mask.dtype} of shape {tuple(key_mask.shape)}")
        if doc_ids is not None and (doc_ids.dim() != 2 or doc_ids.shape[0] not in batches
                                    or doc_ids.shape[1] < k.shape[2]
                                    or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool):
            problems.append(f"doc_ids must be an integer [B or 1, S >= Skv={k.shape[2]}] tensor (B={q.shape[0]}), "
                            f"got {doc_ids.dtype} of shape {tuple(doc_ids.shape)}")
        elif doc_ids is not None and q.shape[2] and (q_offset < 0 or q_offset + q.shape[2] > k.shape[2]):
            # a query's document is the id at its own position, which must be one of the keys' (the index
            # and the kernels read the ids of keys only)
            problems.append(f"with doc_ids every query must sit at a key position 0..{k.shape[2] - 1}, the queries "
                            f"sit at {q_offset}..{q_offset + q.shape[2] - 1}")
    if not (q.dtype == k.dtype == v.dtype):
        problems.append(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    elif q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        problems.append(f"q, k, v must be float16, bfloat16 or float32 (what the kernels compute in), got {q.dtype}")
    if window < 0:
        problems.append(f"window must be >= 0 (0: none), got {window}")
    if not (math.isfinite(scale) and scale > 0):
        problems.append(f"scale must be a finite number > 0, got {scale!r}")
    if not (len(patterns) == len(budget_a) == len(budget_b)):
        problems.append(f"plan lists differ in length: {len(patterns)}, {len(budget_a)}, {len(budget_b)}")
    if problems:
        raise ValueError("minference::sparse_attention: " + "; ".join(problems))


class CallPath(str, enum.Enum):
    """The path one call of the op takes."""

    EMPTY = "empty"
    """no batch row or no query row: an empty output, nothing asked of the index, guard or kernels"""
    DENSE_BY_LENGTH = "dense by length"
    """a prompt shorter than ``min_sparse_len``: the device's dense attention (:func:`dense.dense_attention`)"""
    DENSE_LAYER = "dense layer"
    """a plan dense on every head: the device's fused SDPA, faster than any tile walk"""
    NO_KEYS = "no keys"
    """no key to read: every row is zeros, which the dense path gives (there is no tile to walk)"""
    ALL_ROUTED = "all routed"
    """every head routed to SDPA and the index not due this call (``routing.Router.index_due``)"""
    DENSE_BY_DEVICE = "dense by device"
    """this GPU cannot run the sparse path's kernels at this head dim and dtype (a kernel needs more shared memory
    than it gives a block, :class:`kernels.fit.DoesNotFit`, logged once): the device's dense attention"""
    SPARSE_GPU = "sparse on gpu"
    """the online index and the Triton kernels (:func:`sparse_path.sparse_on_gpu`)"""
    SPARSE_CPU = "sparse on cpu"
    """the reference's index and attention (:func:`sparse_path.sparse_on_cpu`)"""


_DENSE_PATHS = (CallPath.DENSE_BY_LENGTH, CallPath.DENSE_LAYER, CallPath.NO_KEYS, CallPath.DENSE_BY_DEVICE)

_does_not_fit: set = set()
"""(device, q dtype, k dtype, head dim) of the calls whose sparse path's kernels did not fit that GPU (a first call's
:class:`kernels.fit.DoesNotFit`, logged then); such calls now plan :attr:`CallPath.DENSE_BY_DEVICE`"""


def _device_shape(q, k) -> tuple:
    return q.device, q.dtype, k.dtype, q.shape[-1]


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: the masks hold tensors
class CallPlan:
    """What one call of the op runs, decided before any attention work (:func:`plan_call`)."""

    path: CallPath
    masks: CallMasks
    """one row per batch row, the document ids cut to the keys"""
    scale: float
    plan: LayerPlan
    """the site's head plan"""
    min_sparse_len: int
    """the crossover the query length was compared with: the op's argument, or when that is negative the
    device's tuned one (:func:`autotune.dispatch.tuned_min_sparse_len`); not looked up for an empty call"""
    guard_threshold: float = 0.0
    """the quality guard's threshold, 0 where it checks nothing (off, or no vertical-slash head)"""
    escalated: Optional[LayerPlan] = None
    """the plan whose index a weak vertical-slash head tries before it runs dense (:func:`plan.escalated_plan`);
    None where it runs dense at once"""
    route_site: int = routing.NO_SITE
    router: Optional[routing.Router] = None
    """where the site's routing is read and this call's dense heads recorded"""
    routable: bool = False
    """whether routed heads may run through SDPA this call (:func:`dense.routable`); where not, nothing is
    routed or recorded"""
    routed: tuple = ()
    """the query heads the router sends to SDPA this call"""
    sparse_launch: Optional[TuneEntry] = None
    """the sparse walk's launch config (GPU sparse path)"""
    walk_launch: Optional[TuneEntry] = None
    """the dense walk's launch config, where the path launches it"""
    walk_cost: Optional[WalkCost] = None
    """what the cost model weighs the heads with for the next call's routing (measured per device and shape,
    :func:`autotune.dispatch.walk_cost`); None where the call records no routing (no site, or not routable)"""


def call_masks(q, k, key_mask, doc_ids, q_offset: int, window: int) -> CallMasks:
    """The op's mask arguments as the paths read them: one row per batch row, entries adjacent, and the document
    ids past the keys cut (they belong to no key and no query: ``_check_inputs``)."""
    if doc_ids is not None:
        doc_ids = doc_ids[:, :k.shape[2]]
    return CallMasks(key_mask, doc_ids, q_offset, window).rows_per_batch(q.shape[0])


def dense_walk_launch(q, k, masks: CallMasks) -> Optional[TuneEntry]:
    """The dense walk's launch config for :func:`dense.dense_attention` of this call, where it launches one
    (:func:`dense.runs_dense_walk`); None elsewhere, so nothing is looked up."""
    return dispatch.launch_config(q, k, "dense_walk") if dense.runs_dense_walk(q, k, masks) else None


def plan_call(q, k, masks: CallMasks, scale: float, plan: LayerPlan, min_sparse_len: int, guard_threshold: float = 0.0,
              route_site: int = routing.NO_SITE, router: Optional[routing.Router] = None,
              escalation: tuple = (), listed: Optional[LayerPlan] = None) -> CallPlan:
    """Decide the path of one call from metadata and the host's state alone (no host sync, nothing sized by the
    data): the tuned crossover and launch configs (``autotune.dispatch``), and the site's routing in ``router``
    (default: the process's, :data:`routing.ROUTER`). Reading the routing counts a call that skips its index.
    ``listed``: the site's plan before a budget growth made ``plan`` (default ``plan``), whose budgets set the
    crossover of a device without a measured one (grown budgets would push it past the very lengths they grow at)."""
    router = routing.ROUTER if router is None else router
    call = CallPlan(CallPath.EMPTY, masks, scale, plan, min_sparse_len, route_site=route_site, router=router)
    if q.numel() == 0:
        # nothing to attend for: an empty batch or no query rows. The output is as empty as q; the index, the
        # guard and the kernels are never asked about a call with no rows (the reference's index and the guard
        # failed on them)
        return call
    if min_sparse_len < 0:
        call = dataclasses.replace(call, min_sparse_len=dispatch.tuned_min_sparse_len(q, k, listed or plan))
    split = dense.split_plan(plan)
    dense_path = (CallPath.DENSE_BY_LENGTH if q.shape[-2] < call.min_sparse_len else CallPath.DENSE_LAYER
                  if split.all_dense else CallPath.NO_KEYS if k.shape[-2] == 0 else None)
    if dense_path is None and _device_shape(q, k) in _does_not_fit:
        dense_path = CallPath.DENSE_BY_DEVICE
    if dense_path is not None:
        return dataclasses.replace(call, path=dense_path, walk_launch=dense_walk_launch(q, k, masks))
    # routing sends heads to the fused SDPA; with documents or a window to read it has none to send them to
    can_route = dense.routable(q.shape[0], q.shape[-2], k.shape[-2], masks)
    guarded = guard_threshold > 0 and split.n_listed
    call = dataclasses.replace(call, guard_threshold=guard_threshold if guarded else 0.0,
                               escalated=escalated_plan(plan, tuple(escalation)) if guarded and escalation else None,
                               routable=can_route,
                               routed=router.routed_heads(route_site, q.shape[1], q.device) if can_route else ())
    if dense.all_routed(plan, call.routed) and not router.index_due(route_site, q.shape[-2], q.device):
        # the CPU's SDPA reads the mask itself; the GPU's runs again in the dense walk the rows it hides keys of
        walk = dispatch.launch_config(q, k, "dense_walk") if q.is_cuda and masks.key_mask is not None else None
        return dataclasses.replace(call, path=CallPath.ALL_ROUTED, walk_launch=walk)
    if can_route and route_site != routing.NO_SITE:
        call = dataclasses.replace(call, walk_cost=dispatch.walk_cost(q, k))
    if q.is_cuda:
        return dataclasses.replace(call, path=CallPath.SPARSE_GPU, sparse_launch=dispatch.launch_config(q, k),
                                   walk_launch=dispatch.launch_config(q, k, "dense_walk"))
    return dataclasses.replace(call, path=CallPath.SPARSE_CPU)


def run_call(call: CallPlan, q, k, v) -> torch.Tensor:
    """Run the call ``call`` planned for ``q``, ``k``, ``v``: the attention, then the guard's counters and the
    routing's record of the heads this call's index or guard ran dense. The output is token-major
    (:func:`attend.empty_output`: what the op's fake promises), copied into that layout only where a path gave
    another (the CPU's reference, the masked SDPA of short calls)."""
    return attend.as_output(_attention(call, q, k, v))


def _attention(call: CallPlan, q, k, v) -> torch.Tensor:
    if call.path is CallPath.EMPTY:
        return attend.empty_output(q)
    if call.path is CallPath.ALL_ROUTED and q.is_cuda:
        return dense.every_head_routed(q, k, v, call.masks, call.scale, call.walk_launch)
    if call.path in _DENSE_PATHS or call.path is CallPath.ALL_ROUTED:  # the CPU's SDPA reads the mask itself
        return dense.dense_attention(q, k, v, call.masks, call.scale, walk=call.walk_launch)
    if call.path is CallPath.SPARSE_GPU:
        try:
            result = sparse_path.sparse_on_gpu(q, k, v, call.plan, call.scale, call.masks, call.guard_threshold,
                                               call.sparse_launch, call.walk_launch, call.routed, call.escalated,
                                               call.walk_cost)
        except fit.DoesNotFit as exc:  # at a kernel's first launch, before it queued anything
            _does_not_fit.add(_device_shape(q, k))
            log.warning("minference: this GPU (%s) cannot run the sparse path at head_dim %d in %s, so such calls run "
                        "dense: %s", q.device, q.shape[-1], q.dtype, exc)
            return dense.dense_attention(q, k, v, call.masks, call.scale, walk=dense_walk_launch(q, k, call.masks))
    else:
        result = sparse_path.sparse_on_cpu(q, k, v, call.plan, call.scale, call.masks, call.guard_threshold,
                                           call.routed, call.escalated, call.walk_cost)
    split = dense.split_plan(call.plan)
    if result.weak is not None:
        guard.record(result.weak, q.shape[0] * split.n_listed)
    if result.route_next is not None and call.routable:
        call.router.observe(call.route_site, result.route_next, q.shape[-2], split.dense_heads)
    return result.out


@torch.library.custom_op("minference::sparse_attention", mutates_args=())
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    doc_ids: Optional[torch.Tensor],
    scale: float,
    q_offset: int,
    window: int,
    patterns: list[int],
    budget_a: list[int],
    budget_b: list[int],
    min_sparse_len: int,
    guard_threshold: float = 0.0,
    route_site: int = -1,
    escalate_a: int = 0,
    escalate_b: int = 0,
    grow_from: int = 0,
    grow_exponent: float = 0.0,
) -> torch.Tensor:
    _check_inputs(q, k, v, key_mask, doc_ids, scale, q_offset, window, patterns, budget_a, budget_b)
    escalation = escalation_of(escalate_a, escalate_b)
    if not is_escalation(escalation):
        raise ValueError(f"minference::sparse_attention: escalate_a and escalate_b must both be 0 (a weak head runs "
                         f"dense at once) or both in [1, {MAX_BUDGET}], got {escalate_a}, {escalate_b}")
    if not 0.0 <= guard_threshold <= 1.0:  # NaN fails too; past 1, the paths would disagree on heads they do not estimate
        raise ValueError(f"minference::sparse_attention: guard_threshold must be in [0, 1] (0: no guard), got "
                         f"{guard_threshold!r}")
    growth = growth_of(grow_from, grow_exponent)
    if not is_budget_growth(growth):
        raise ValueError(f"minference::sparse_attention: grow_from must be >= 0 (0: budgets do not grow) and, when "
                         f"positive, grow_exponent in (0, 1]; got {grow_from}, {grow_exponent}")
    if q.is_cuda:
        # the first call, dense or sparse, waits for the kernels compiling in the background (at once when
        # none is): no CUDA work of that thread can then overlap a graph capture that follows this call
        precompile.wait()
    listed = layer_plan(tuple(patterns), tuple(budget_a), tuple(budget_b))
    call = plan_call(q, k, call_masks(q, k, key_mask, doc_ids, q_offset, window), scale,
                     grown_plan(listed, growth, k.shape[-2]), min_sparse_len, guard_threshold, route_site,
                     escalation=escalation, listed=listed)
    return run_call(call, q, k, v)


_TENSOR_ARGS = ("q", "k", "v", "key_mask", "doc_ids")


def _inference_only_message(needs_grad) -> str:
    return (f"minference::sparse_attention is inference-only (it has no backward), but {', '.join(needs_grad)} "
            "require grad with grad mode on; call it under torch.inference_mode() or torch.no_grad(), or pass "
            "detached tensors (torch.compile with the minference backend leaves such sites dense by itself)")


def _refuse_autograd(ctx, inputs, output):
    # runs at the call (autograd only calls it when grad mode is on and an input requires grad), so the error
    # comes where the op is used, not at a later .backward()
    needs_grad = [name for name, x in zip(_TENSOR_ARGS, inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    raise RuntimeError(_inference_only_message(needs_grad or ["inputs"]))


def _no_backward(ctx, grad):  # unreachable: _refuse_autograd raised at the call
    raise RuntimeError(_inference_only_message(["inputs"]))


sparse_attention.register_autograd(_no_backward, setup_context=_refuse_autograd)


@sparse_attention.register_fake
def _sparse_attention_fake(q, k, v, key_mask, doc_ids, scale, q_offset, window, patterns, budget_a, budget_b, min_sparse_len,
                           guard_threshold=0.0, route_site=-1, escalate_a=0, escalate_b=0, grow_from=0,
                           grow_exponent=0.0):
    return attend.empty_output(q)
