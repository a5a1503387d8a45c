"""The cost model: which heads a site's next call sends to the device's fused SDPA because they run faster there.

A head whose index keeps a share ``s`` of its causal key tiles costs ``s / walk_rate`` of the fused SDPA's time
for its dense causal attention (:class:`WalkCost`, measured per shape by
``minference-fx autotune``): past ``s = walk_rate`` the tile walk is the slower one, though it reads fewer keys.
On the H200 that rate is 0.72-0.82 (BENCHMARKS.md sections 1 and 6), so a head between it and the near-dense
rule's 90 % was slower walked than dense: the scattered input family's heads at 32K keep 73-99 % of their tiles,
and their walk took 15.97 ms against cuDNN's 14.61 ms for every tile. Such a head is marked here, and the routing
(:mod:`minference_fx.routing`) sends it to SDPA from the next call on. Routing one head still leaves the
index to pay: when the call as a whole (the index, the routed heads at 1, the walked ones at ``s /
walk_rate``) would cost at least the dense layer, every head is marked, and the site then skips its index at
most calls (``routing.Router.index_due``). A guarded call then costs at most the index and the cheaper path.

Not weighed: a guard escalation's second index (the measured index share is one index of the default plan), and
a row a padding mask hides keys of, which a routed head runs twice (SDPA unmasked, then the masked dense walk):
such rows are never marked for cost, only by the rules that ran them dense.

The decision is the previous call's (the host reads it without a sync), so it holds for prompts whose
density changes slowly; a head routed for cost only gains keys, so the model changes speed, never accuracy.
Where this GPU measured no cost for the shape, the slowest one measured for it on other GPUs is used
(``autotune.cache.cautious_cost``); where none was measured anywhere, :data:`UNTUNED_COST` reproduces the near-dense
rule alone.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from .dense import split_plan
from .kernels.guard import NEAR_DENSE_SHARE
from .kernels.tables import int_table
from .plan import LayerPlan


@dataclasses.dataclass(frozen=True)
class WalkCost:
    """The sparse path's speed against the device's fused SDPA at one shape, as the cost model reads it (the
    autotune cache's ``costs`` table holds one per measured device and shape): a head whose index keeps a share
    ``s`` of its causal key tiles walks them in ``s / walk_rate`` of the time the fused SDPA takes for that
    head's dense causal attention, and the index of a call of ``n`` keys costs ``index_share * measured_at / n``
    of the dense layer (it grows with the keys, dense attention with their square)."""

    walk_rate: float
    """the sparse walk's speed per walked key tile over the fused SDPA's per causal key tile"""
    index_share: float
    """the index's time over the dense layer's at ``measured_at`` keys"""
    measured_at: int
    """the prompt length both were timed at (0: not measured)"""

    def index_share_at(self, keys: int) -> float:
        return self.index_share * self.measured_at / keys if keys > 0 and self.measured_at > 0 else 0.0


UNTUNED_COST = WalkCost(walk_rate=NEAR_DENSE_SHARE, index_share=0.0, measured_at=0)
"""Where no GPU measured a cost for the shape, a head is weighed as before the model existed: the walk at the near-dense share's
rate and a free index, so only a near-dense head is costly and no layer is routed whole for its cost."""


_OTHER, _LISTED, _DENSE = 0, 1, 2
"""what :func:`_head_kinds` says of a head: A-shape (fixed keys), listed (vertical-slash, block-sparse), dense"""


@functools.lru_cache(maxsize=4096)
def _head_kinds(plan: LayerPlan) -> tuple:
    split = split_plan(plan)
    return tuple(_DENSE if h in split.dense_heads else _LISTED if listed else _OTHER
                 for h, listed in enumerate(split.listed_mask))


def heads_to_route(ran_dense: Optional[torch.Tensor], share: torch.Tensor, plan: LayerPlan, cost: WalkCost,
                   keys: int, padded: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """[B, Hq] bool on the device: the pairs a site's next call should run through the fused SDPA.

    ``ran_dense``: the pairs this call ran dense (near-dense index, quality guard), or None; ``share``: [B, Hq]
    each head's kept share of its causal key tiles (``kernels.guard.kept_share``; the plan's unlisted heads
    are read from the plan, not from it); ``keys``: the call's key count; ``padded``: [B, 1] the rows a padding
    mask hides keys of (``CallMasks.padded_rows``), never marked for cost. No host sync."""
    index_share = cost.index_share_at(keys)
    if index_share == 0 and cost.walk_rate >= NEAR_DENSE_SHARE:
        return ran_dense  # every head past the rate is near-dense already, and nothing makes a whole layer dearer
    head_kinds = _head_kinds(plan)
    # one table a call, built on the device from a pinned host copy (no sync, and a CUDA graph can capture it)
    kinds = int_table(head_kinds, share.device)
    listed, dense_heads = kinds == _LISTED, kinds == _DENSE
    costly = listed[None, :] & (share >= cost.walk_rate)
    route = costly if ran_dense is None else costly | ran_dense
    # a listed head walks its share; an A-shape head's few fixed tiles count as free, a dense one as one SDPA
    walked = torch.where(listed[None, :], (share / cost.walk_rate).clamp(max=1.0), dense_heads[None, :].float())
    # the index estimates only the listed heads; its share was measured with every head listed
    index = index_share * head_kinds.count(_LISTED) / len(head_kinds)
    whole = torch.where(route, 1.0, walked).double().mean(-1, keepdim=True) + index >= 1.0
    # the plan's dense heads run SDPA either way: marking them would only miscount the routed heads
    for_cost = costly | (whole & ~dense_heads[None, :])
    if padded is not None:
        for_cost = for_cost & ~padded
    return for_cost if ran_dense is None else for_cost | ran_dense
