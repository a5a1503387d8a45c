"""FX passes that find causal attention in a Dynamo graph and rewrite it.

Each pass matches a form, checks it (a check is a small function giving the reason a site must stay dense, or
None; a site keeps the first reason) and rewrites what passed. One runner takes them in a fixed order, as named
stages, and counts what each did (:class:`PassStats`, :func:`stats`):

0. ``unfuse``  – open ``nn.MultiheadAttention``'s fused call into projections + SDPA where it is causal
   self-attention (with ``einsum``, the passes that edit the graph before the rewrite; they compute the same);
   ``einsum``  – write attention's einsums as the matmul chain ``find`` reads (it computes the same);
   ``inplace`` – write in-place ops on the scores (``masked_fill_``, ``mul_``) out of place where nothing else sees them;
   ``bmm``     – write attention on 3-D [B·H, S, D] views of 4-D tensors as that chain too;
1. ``find``    – every SDPA call and manual matmul→softmax→matmul chain;
2. ``masks``   – what each mask means (unknown → the site stays dense), checked against its values (``mask_values``);
3. ``gqa``     – look through repeat_kv, after masks so a blocked site keeps its K/V;
4. ``layout``  – shapes the op can read (after gqa: K/V may have fewer heads now);
5. ``layers``  – layer index for the config lookup;
   ``unread``  – softmax calls that look like attention but no site holds, with why (for the report);
6. ``rewrite`` – last, since it erases the nodes the others read: its checks (dtypes, shapes, scale), then the
   rewrite of every site that passed.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional

import torch.fx as fx

from ..plan import LayerPlan
from . import bmm, einsum, find, gqa, inplace, layers, layout, masks, rewrite, unfuse, unread
from .site import AttentionSite, MaskInfo, MaskKind

__all__ = ["AttentionSite", "MaskInfo", "MaskKind", "PassStats", "StageStats", "analyse", "apply", "stats"]


@dataclasses.dataclass
class StageStats:
    """What one stage did."""

    rewritten: int = 0
    """graph nodes written in another form (``unfuse``, ``einsum``, ``inplace``, ``bmm``), or sites rewritten
    into the op (``rewrite``)"""
    found: int = 0
    """sites found (``find``), or softmax calls noted as not read (``unread``)"""
    blocked: int = 0
    """sites this stage kept dense (the first reason a site has is its stage's)"""


@dataclasses.dataclass
class PassStats:
    """What the stages did to one graph, stage by stage in the order they ran."""

    stages: dict = dataclasses.field(default_factory=dict)
    """stage name -> :class:`StageStats`"""
    unread: tuple = ()
    """the ``unread`` stage's notes: one line per softmax that looks like attention but no site holds"""

    def __getitem__(self, stage: str) -> StageStats:
        return self.stages[stage]

    def as_dict(self) -> dict:
        """stage name -> {"rewritten": n, "found": n, "blocked": n}"""
        return {name: dataclasses.asdict(counts) for name, counts in self.stages.items()}


_STATS: "weakref.WeakKeyDictionary[fx.GraphModule, PassStats]" = weakref.WeakKeyDictionary()

GRAPH_EDITS: tuple = (("unfuse", unfuse.run), ("einsum", einsum.run), ("inplace", inplace.run), ("bmm", bmm.run))
"""The stages that write the graph in the forms ``find`` reads, in order; each returns how many it rewrote."""


def stats(gm: fx.GraphModule) -> Optional[PassStats]:
    """What the stages did to ``gm`` (:func:`analyse`, then :func:`apply`), or None before :func:`analyse`."""
    return _STATS.get(gm)


def _newly_blocked(before: list, after: list) -> int:
    return sum(1 for old, new in zip(before, after) if new.blocker and not old.blocker)


def _site_stage(record: PassStats, name: str, step: Callable[[list], list], sites: list) -> list:
    """``step`` run on the sites, with the sites it blocked counted under ``name``."""
    out = step(sites)
    record.stages[name] = StageStats(blocked=_newly_blocked(sites, out))
    return out


def analyse(gm: fx.GraphModule) -> list[AttentionSite]:
    """Sites with everything the passes learned; the graph is untouched but for ``unfuse``, ``einsum``, ``inplace`` and ``bmm``."""
    record = PassStats()
    for name, edit in GRAPH_EDITS:
        record.stages[name] = StageStats(rewritten=edit(gm))
    sites = find.run(gm)
    record.stages["find"] = StageStats(found=len(sites), blocked=sum(1 for s in sites if s.blocker))
    tree = layers.module_tree(gm)
    for name, step in (("masks", masks.run), ("gqa", gqa.run), ("layout", layout.run),
                       ("layers", lambda s: layers.run(s, tree))):
        sites = _site_stage(record, name, step, sites)
    record.unread = tuple(unread.run(gm, sites))
    record.stages["unread"] = StageStats(found=len(record.unread))
    _STATS[gm] = record
    return sites


def apply(gm: fx.GraphModule, sites: list[AttentionSite], plan_for: Callable[[AttentionSite], LayerPlan], min_sparse_len: int,
          observer: int | None = None, guard_threshold: float = 0.0, route_dense: bool = True,
          escalation: tuple = (), growth: tuple = ()) -> list[AttentionSite]:
    """The ``rewrite`` stage: every site its checks leave unblocked is rewritten into the op."""
    record = _STATS.setdefault(gm, PassStats())
    out = rewrite.run(gm, sites, plan_for, min_sparse_len, observer, guard_threshold, route_dense, escalation, growth)
    record.stages["rewrite"] = StageStats(rewritten=sum(1 for s in out if not s.blocker),
                                          blocked=_newly_blocked(sites, out))
    return out
