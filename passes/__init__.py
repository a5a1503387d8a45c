"""FX passes that find causal attention in a Dynamo graph and rewrite it.

Order matters and is fixed:

0. ``unfuse``  – open ``nn.MultiheadAttention``'s fused call into projections + SDPA where it is causal
   self-attention (with ``einsum``, the passes that edit the graph before the rewrite; they compute the same);
   ``einsum``  – write attention's einsums as the matmul chain ``find`` reads (it computes the same);
   ``inplace`` – write in-place ops on the scores (``masked_fill_``, ``mul_``) out of place where nothing else sees them;
   ``bmm``     – write attention on 3-D [B·H, S, D] views of 4-D tensors as that chain too;
1. ``find``    – every SDPA call and manual matmul→softmax→matmul chain;
2. ``masks``   – what each mask means (unknown → the site stays dense);
3. ``gqa``     – look through repeat_kv, after masks so a blocked site keeps its K/V;
4. ``layout``  – shapes the op can read (after gqa: K/V may have fewer heads now);
5. ``layers``  – layer index for the config lookup;
   ``unread``  – softmax calls that look like attention but no site holds, with why (for the report);
6. ``rewrite`` – last, since it erases the nodes the others read.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from ..plan import LayerPlan
from . import bmm, einsum, find, gqa, inplace, layers, layout, masks, rewrite, unfuse, unread
from .site import AttentionSite, MaskInfo, MaskKind

__all__ = ["AttentionSite", "MaskInfo", "MaskKind", "analyse", "apply"]


def analyse(gm: fx.GraphModule) -> list[AttentionSite]:
    """Sites with everything the passes learned; the graph is untouched but for ``unfuse``, ``einsum``, ``inplace`` and ``bmm``."""
    unfuse.run(gm)
    einsum.run(gm)
    inplace.run(gm)
    bmm.run(gm)
    sites = find.run(gm)
    for step in (masks.run, gqa.run, layout.run):
        sites = step(sites)
    return layers.run(sites, layers.module_tree(gm))


def apply(gm: fx.GraphModule, sites: list[AttentionSite], plan_for: Callable[[AttentionSite], LayerPlan], min_sparse_len: int,
          observer: int | None = None, guard_threshold: float = 0.0, route_dense: bool = True) -> list[AttentionSite]:
    return rewrite.run(gm, sites, plan_for, min_sparse_len, observer, guard_threshold, route_dense)
