"""The op's sparse paths: on the GPU the online index and the Triton kernels, on the CPU the pure-torch reference.

Both run one call whose plan the op made (``op.plan_call``): the index, the (batch, head) pairs the run-time
rules send dense (:mod:`minference_fx.dense`), the attention. They take the launch configs as arguments and
never look one up: the op does (``autotune.dispatch``), and the tuner and the background precompile pass their
own.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import cost, dense
from .call_masks import CallMasks
from .cost import WalkCost
from .kernels import attend, guard, reference
from .kernels.index import build_index_escalated_gpu, build_index_gpu
from .plan import LayerPlan


class SparseResult(NamedTuple):
    out: torch.Tensor
    weak: Optional[torch.Tensor]
    """[B, Hq] bool: the pairs the quality guard forced dense; None without a guard"""
    ran_dense: Optional[torch.Tensor]
    """[B, Hq] bool: the pairs this call's index or guard ran dense (routed heads by their own index, not by
    the routing); None when the plan lists no head and there is no guard"""
    route_next: Optional[torch.Tensor]
    """[B, Hq] bool: the pairs the site's next call should send to the fused SDPA: ``ran_dense`` and those the
    cost model (:func:`cost.heads_to_route`) finds slower walked; None where ``ran_dense`` is"""


def sparse_on_gpu(q, k, v, plan: LayerPlan, scale: float, masks: CallMasks, guard_threshold: float, tuned, walk,
                  routed: tuple = (), escalated: Optional[LayerPlan] = None,
                  walk_cost: Optional[WalkCost] = None) -> SparseResult:
    """The op's GPU path with launch configs ``tuned`` (the sparse walk) and ``walk`` (the dense walk): index, the
    heads to run dense this call (quality guard, near-dense index), kernel; the plan's dense heads and the
    ``routed`` ones through the device's fused SDPA without a mask (the whole layer in one call when that is
    every head) where :func:`dense.routable` (under a padding mask, one batch row: run again in the masked dense
    walk when padded), else in the kernel's dense walk (routing then changes nothing). The index still
    covers routed heads, so ``ran_dense`` says whether they would have run dense. With an ``escalated`` plan
    (:func:`~minference_fx.plan.escalated_plan`) the heads the guard finds weak take its index, and only those
    still under the threshold there run dense (no host sync: both indexes are built, from one vertical-slash
    estimate, and the rows chosen on the device). ``walk_cost`` weighs the heads for the next call's routing
    (:func:`_route_next`)."""
    split = dense.split_plan(plan)
    index, weak, _ = guarded_index_on_gpu(q, k, plan, scale, masks, guard_threshold, escalated)
    share = (guard.kept_share(index, q.shape[-2], k.shape[-2], masks.q_offset, masks.key_mask) if split.n_listed
             else None)
    force = ran_dense = dense.forced_on_gpu(share, plan, weak)
    padded = masks.padded_rows()
    route_next = _route_next(ran_dense, share, plan, walk_cost, k.shape[-2], padded)
    by_sdpa = dense.routable(q.shape[0], q.shape[-2], k.shape[-2], masks)
    if routed and by_sdpa:
        split = dense.split_plan(dense.with_dense_heads(plan, routed))
        if split.all_dense:
            return SparseResult(dense.every_head_routed(q, k, v, masks, scale, walk), weak, ran_dense, route_next)
    walk_launch = walk.launch()
    kernel_args, sdpa_heads = split.kernel_args, split.dense_heads
    if sdpa_heads and not by_sdpa:
        # With documents, a window or a padded batch SDPA would read a materialised mask (or run padded rows
        # twice), or the dense walk would run on copies of these heads (a kernel variant of its own, compiled
        # at the first such call): the plan's dense heads join this call's dense walk.
        kernel_args, sdpa_heads = split.op_args, ()
        pairs = dense.dense_pairs(split.dense_heads, q)
        force = pairs if force is None else force | pairs
    args = (q, k, v, index, *kernel_args)
    if force is None and padded is None:
        out = attend.sparse_attention_triton(*args, scale=scale, **tuned.launch(), **masks.kwargs())
    else:
        # Launches into one output, whatever the device decided: the sparse walk skips the forced pairs, the
        # dense walk (programs of up to two query tiles, no list reads) runs only them.
        skip = force if force is not None else torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
        out = dense.launch_by_rows(args, masks, padded, skip, "skip", scale=scale, **tuned.launch())
        if force is not None:
            dense.launch_by_rows(args, masks, padded, force, "only", scale=scale, out=out, **walk_launch)
    if sdpa_heads:
        dense.dense_heads_by_sdpa(q, k, v, out, sdpa_heads, dense.kv_heads_of(sdpa_heads, q.shape[1] // k.shape[1]),
                                  scale, masks.without_key_mask())
        dense.padded_rows_again((q, k, v, index, *split.op_args), out, sdpa_heads, padded, masks, scale=scale,
                                **walk_launch)
    return SparseResult(out, weak, ran_dense, route_next)


class GuardedIndex(NamedTuple):
    index: reference.SparseIndex
    weak: Optional[torch.Tensor]
    """[B, Hq] bool: the pairs the quality guard forces dense; None without a guard"""
    escalated_pairs: Optional[torch.Tensor]
    """[B, Hq] bool: the pairs that took the escalated plan's index rows; None without an escalation"""


def guarded_index_on_gpu(q, k, plan: LayerPlan, scale: float, masks: CallMasks, guard_threshold: float,
                         escalated: Optional[LayerPlan] = None) -> GuardedIndex:
    """The GPU path's index and the quality guard's verdict: with an ``escalated`` plan, weak heads take its
    index, and stay weak only if still under the threshold there."""
    guarded = guard_threshold > 0
    mass = _full_mass(q) if guarded else None
    if guarded and escalated is not None:
        # the escalated plan lists only vertical-slash heads: a weak head it does not estimate (block-sparse)
        # takes the empty row it leaves, but stays weak (its mass_up stays 0), so it runs dense and that row is
        # never walked
        mass_up = torch.zeros_like(mass)
        index, took = build_index_escalated_gpu(q, k, plan, escalated, scale=scale, take_below=guard_threshold,
                                                mass_out=mass, escalated_mass_out=mass_up, **masks.kwargs())
        return GuardedIndex(index, took & (mass_up < guard_threshold), took)
    index = build_index_gpu(q, k, plan, scale=scale, mass_out=mass, **masks.kwargs())  # dense heads list nothing
    return GuardedIndex(index, mass < guard_threshold if guarded else None, None)


def sparse_on_cpu(q, k, v, plan: LayerPlan, scale: float, masks: CallMasks, guard_threshold: float,
                  routed: tuple = (), escalated: Optional[LayerPlan] = None,
                  walk_cost: Optional[WalkCost] = None) -> SparseResult:
    """The op's CPU path: the reference is the implementation (the Triton interpreter is for tests, not speed).
    Its index lists every head, the run-time rules (:func:`dense.dense_rules`) and the ``routed`` heads densify
    it, and the reference attends over it; ``ran_dense`` leaves the routing out, as on the GPU. With an
    ``escalated`` plan, weak heads first take its index, as on the GPU; ``walk_cost`` as there."""
    split = dense.split_plan(plan)
    index = reference.build_index(q, k, plan, scale=scale, **masks.kwargs())
    near, weak = dense.dense_rules(q, k, plan, index, scale, masks, guard_threshold)
    if weak is not None and escalated is not None and bool(weak.any()):  # CPU: a host check is free
        index_up = reference.build_index(q, k, escalated, scale=scale, **masks.kwargs())
        index = dense.take_index(index, index_up, weak)
        near, weak = dense.dense_rules(q, k, plan, index, scale, masks, guard_threshold)
    guard.record(near, q.shape[0] * split.n_listed, dense.NEAR_DENSE_STATS)
    ran_dense = near if weak is None else near | weak
    # the reference's index lists every head, so the share is only needed for the cost model
    share = None if walk_cost is None else guard.kept_share(index, q.shape[-2], k.shape[-2], masks.q_offset,
                                                            masks.key_mask)
    route_next = _route_next(ran_dense, share, plan, walk_cost, k.shape[-2], masks.padded_rows())
    force = ran_dense | dense.head_mask(routed, q.shape[1])[None, :]
    if bool(force.any()):  # CPU: a host check is free, and densify copies the index
        index = guard.densify(index, force, q.shape[-2], k.shape[-2], masks.q_offset)
    out = reference.sparse_attention_reference(q, k, v, plan, scale=scale, index=index, **masks.kwargs())
    return SparseResult(out.to(q.dtype).contiguous(), weak, ran_dense, route_next)


def _route_next(ran_dense, share, plan: LayerPlan, walk_cost: Optional[WalkCost], keys: int, padded):
    """What the site's next call should route: ``ran_dense`` and, with a ``walk_cost`` (a call whose routing is
    recorded) and a listed head (a ``share``), the heads the cost model marks (:func:`cost.heads_to_route`)."""
    if walk_cost is None or share is None:
        return ran_dense
    return cost.heads_to_route(ran_dense, share, plan, walk_cost, keys, padded)


def _full_mass(q) -> torch.Tensor:
    """[B, Hq] fp32 ones: what the index's ``mass_out`` leaves for the heads it does not estimate."""
    return torch.ones(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
