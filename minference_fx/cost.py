"""The cost model: which heads a site's next call sends to the device's fused SDPA because they run faster there.

A head whose index keeps a share ``s`` of its causal key tiles costs ``s / walk_rate`` of the fused SDPA's time
for its dense causal attention (:class:`~minference_fx.autotune.cache.WalkCost`, measured per shape by
``minference-fx autotune``): past ``s = walk_rate`` the tile walk is the slower one, though it reads fewer keys.
On the H200 that rate is about 0.8 (d128, 32K: the scattered input family's 88.7 % of tiles took 16.3 ms
against cuDNN's 14.8 ms for all of them, BENCHMARKS.md section 1), so a head between 80 and 90 % (the
near-dense rule's share) was slower than dense. Such a head is marked here, and the routing
(:mod:`minference_fx.routing`) sends it to SDPA from the next call on. Routing one head still leaves the
index to pay: when the call as a whole (the index, the routed heads at 1, the walked ones at ``s /
walk_rate``) would cost at least the dense layer, every head is marked, and the site then skips its index at
most calls (``routing.Router.index_due``). A guarded call then costs at most the index and the cheaper path.

The decision is the previous call's (the host reads it without a sync), so it holds for prompts whose
density changes slowly; a head routed for cost only gains keys, so the model changes speed, never accuracy.
Where no cost was measured, :data:`UNTUNED_COST` reproduces the near-dense rule alone.
"""
from __future__ import annotations

from typing import Optional

import torch

from .autotune.cache import WalkCost
from .dense import head_mask, split_plan
from .kernels.guard import NEAR_DENSE_SHARE
from .kernels.tables import int_table
from .plan import LayerPlan

UNTUNED_COST = WalkCost(walk_rate=NEAR_DENSE_SHARE, index_share=0.0, measured_at=0)
"""Where no cost was measured a head is weighed as before the model existed: the walk at the near-dense share's
rate and a free index, so only a near-dense head is costly and no layer is routed whole for its cost."""


def heads_to_route(ran_dense: Optional[torch.Tensor], share: torch.Tensor, plan: LayerPlan, cost: WalkCost,
                   keys: int) -> torch.Tensor:
    """[B, Hq] bool on the device: the pairs a site's next call should run through the fused SDPA.

    ``ran_dense``: the pairs this call ran dense (near-dense index, quality guard), or None; ``share``: [B, Hq]
    each head's kept share of its causal key tiles (``kernels.guard.kept_share``; the plan's unlisted heads
    are read from the plan, not from it); ``keys``: the call's key count. No host sync."""
    split = split_plan(plan)
    # built on the device from pinned host tables (no sync, and a CUDA graph can capture it)
    listed = int_table(split.listed_mask, share.device).bool()
    dense_heads = int_table(head_mask(split.dense_heads, len(plan.heads)).tolist(), share.device).bool()
    route = listed[None, :] & (share >= cost.walk_rate)
    if ran_dense is not None:
        route = route | ran_dense
    # a listed head walks its share; an A-shape head's few fixed tiles count as free, a dense one as one SDPA
    walked = torch.where(listed[None, :], (share / cost.walk_rate).clamp(max=1.0), dense_heads[None, :].float())
    per_call = torch.where(route, 1.0, walked).mean(-1) + cost.index_share_at(keys)
    return route | (per_call >= 1.0)[:, None]

