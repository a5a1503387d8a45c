"""Replace each accepted site with ``minference::sparse_attention``.

The head plan, scale, window and the dense/sparse crossover become constant
arguments; the query offset stays symbolic (past length) so continued prefill
and decode do not recompile. The mask construction and ``repeat_kv`` nodes
then die, and are removed.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..observe import observed_attention  # noqa: F401  (registers the search-mode op)
from .. import routing
from ..op import sparse_attention  # noqa: F401  (registers the op)
from ..plan import LayerPlan, escalation_arguments
from .site import AttentionSite, first_reason, in_memory_order, is_lifted_scalar, memory_order, writes_in_place

_OP = torch.ops.minference.sparse_attention.default
_OBSERVE_OP = torch.ops.minference.observed_attention.default


def _offset_arg(graph: fx.Graph, offset):
    if isinstance(offset, int):
        return offset
    base, const = offset
    return graph.call_function(operator.add, (base, const)) if const else base


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0


def _q_offset_arg(graph: fx.Graph, info, keys: fx.Node) -> object:
    """The op's query offset: query row 0's position less key 0's (a SymInt expression when either is symbolic)."""
    if info.q_at_last_key:
        length = keys.meta["example_value"].shape[-2] if "example_value" in keys.meta else None
        if isinstance(length, int):
            return length - 1
        return graph.call_function(operator.sub, (graph.call_method("size", (keys, 2)), 1))
    q_pos = _offset_arg(graph, info.q_offset)
    if _is_zero(info.k_offset):
        return q_pos
    return graph.call_function(operator.sub, (q_pos, _offset_arg(graph, info.k_offset)))


def _from_key_start(graph: fx.Graph, table, start, keys: fx.Node):
    """``table[:, start : start + Skv]``: the op reads key j's entry at j, from a [B, Skv] table (HF's may run past
    the keys, or be read from a sliding cache's window start). A slice: a view, at most a [B, Skv] copy."""
    if table is None:
        return table
    first = _offset_arg(graph, start)
    stop = graph.call_function(operator.add, (first, graph.call_method("size", (keys, 2))))
    return graph.call_function(operator.getitem, (table, (slice(None), slice(first, stop))))


def _remove_dead(graph: fx.Graph, roots):
    """Erase nodes that only fed the replaced attention (mask construction, repeat_kv)."""
    work = [n for n in roots if isinstance(n, fx.Node)]
    erased = set()
    while work:
        node = work.pop()
        if node in erased or node.users or node.op not in ("call_function", "call_method"):
            continue
        if writes_in_place(node):
            continue  # has effects beyond its users
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)
        work.extend(inputs)


def _values(site: AttentionSite) -> tuple:
    """The traced query and attention output (None when the output node has no traced value)."""
    return site.query.meta["example_value"], site.node.meta.get("example_value")


def _scale(site: AttentionSite):
    """The op's scale: the site's, or SDPA's default from the query's head dim."""
    return site.scale if site.scale is not None else 1.0 / math.sqrt(site.query.meta["example_value"].shape[-1])


def _output_dtype_differs(site: AttentionSite) -> Optional[str]:
    q_val, old_val = _values(site)
    if old_val is not None and old_val.dtype != q_val.dtype:
        return f"attention output dtype {old_val.dtype} differs from the query's {q_val.dtype}"
    return None


def _output_shape_differs(site: AttentionSite) -> Optional[str]:
    """A mask that broadcasts the scores past q's batch or heads makes the output larger than q."""
    q_val, old_val = _values(site)
    if old_val is not None and (old_val.dim() != q_val.dim() or not all(
            statically_known_true(a == b) for a, b in zip(old_val.shape, q_val.shape))):
        return f"attention output of shape {tuple(old_val.shape)} differs from the query's {tuple(q_val.shape)}"
    return None


def _float64(site: AttentionSite) -> Optional[str]:
    if site.query.meta["example_value"].dtype == torch.float64:
        return "float64 attention: the sparse op computes in fp32"
    return None


def _scale_not_constant(site: AttentionSite) -> Optional[str]:
    scale = _scale(site)
    if not isinstance(scale, (int, float)) and not is_lifted_scalar(scale):
        return f"scale is not a constant ({scale})"
    return None


def _scale_not_positive(site: AttentionSite) -> Optional[str]:
    scale = _scale(site)
    if isinstance(scale, (int, float)) and not (math.isfinite(scale) and scale > 0):
        return f"scale {scale} is not a finite number > 0, which the op's softmax needs"
    return None


CHECKS = (_output_dtype_differs, _output_shape_differs, _float64, _scale_not_constant, _scale_not_positive)
"""What the op needs of a site the earlier passes accepted, in order (the scale is read once it is known to be one)."""


def check(sites: list[AttentionSite]) -> list[AttentionSite]:
    """Each site, kept dense by the first of :data:`CHECKS` that fails on it."""
    return [site if site.blocker else site.blocked(first_reason(CHECKS, site)) for site in sites]


def run(gm: fx.GraphModule, sites: list[AttentionSite], plan_for: Callable[[AttentionSite], LayerPlan], min_sparse_len: int,
        observer: int | None = None, guard_threshold: float = 0.0, route_dense: bool = True,
        escalation: tuple = (), growth: tuple = ()) -> list[AttentionSite]:
    """Rewrite every site :func:`check` leaves unblocked; with ``observer`` (search mode) into the dense observed op
    instead. ``route_dense``: each op gets its own routing site id (``minference_fx.routing``). ``escalation``:
    the budgets a weak vertical-slash head tries before it runs dense (() for none). ``growth``: (keys, exponent)
    past which the budgets grow with the prompt (``plan.grown_plan``; () for none)."""
    graph = gm.graph
    out = []
    replaced: dict[fx.Node, fx.Node] = {}
    for site in check(sites):
        if site.blocker:
            out.append(site)
            continue
        plan = plan_for(site)
        patterns, budget_a, budget_b = plan.op_arguments()
        info = site.mask_info
        scale, old_val = _scale(site), site.node.meta.get("example_value")
        with graph.inserting_before(site.node):
            if site.scale_divides:
                scale = graph.call_function(operator.truediv, (1.0, scale))
            # an input may be an attention output rewritten above (attention fed straight into attention)
            q, k, v = (replaced.get(x, x) for x in (site.query, site.key, site.value))
            q_offset = _q_offset_arg(graph, info, k)
            key_mask = _from_key_start(graph, info.key_mask, info.key_mask_start, k)
            doc_ids = _from_key_start(graph, info.doc_ids, info.doc_ids_start, k)
            common = (q, k, v, key_mask, doc_ids, scale if isinstance(scale, fx.Node) else float(scale), q_offset,
                      int(info.window))
            if observer is None:
                route_site = routing.new_site() if route_dense else routing.NO_SITE
                # without an escalation, or a guard to fall back from, the call is as before escalation existed: the
                # op's defaults say none
                escalate = tuple(int(x) for x in escalation) if guard_threshold > 0 else ()
                # the growth's two arguments come after the escalation's, (0, 0) standing in for none
                trailing = ((*escalation_arguments(escalate), int(growth[0]), float(growth[1])) if growth
                            else escalate)
                new = graph.call_function(_OP, (*common, patterns, budget_a, budget_b, int(min_sparse_len), float(guard_threshold),
                                                route_site, *trailing))
            else:
                new = graph.call_function(_OBSERVE_OP, (*common, int(site.layer), int(observer)))
            # the traced value, though the op's output is contiguous: nothing reads new's strides but the copy
            # below, which only needs its shape
            new.meta.update({k: site.node.meta[k] for k in ("example_value", "stack_trace", "nn_module_stack")
                             if k in site.node.meta})
            order = memory_order(old_val) if old_val is not None else None
            # in the traced output's memory order, so that a later .view the traced strides allowed still works;
            # HF's transpose(1, 2).contiguous() after it then copies nothing, so the copy moves rather than adds one
            result = new if order is None else in_memory_order(graph, site.node, new, order)
        old_inputs = list(site.node.all_input_nodes)
        site.node.replace_all_uses_with(result)
        replaced[site.node] = result
        graph.erase_node(site.node)
        _remove_dead(graph, old_inputs + list(site.chain))
        out.append(dataclasses.replace(site, node=new))
    graph.lint()
    gm.recompile()
    return out
