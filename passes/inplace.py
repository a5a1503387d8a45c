"""Read attention scores written in place (``scores.masked_fill_(mask, -inf)``, ``scores.mul_(scale)``) as the
out-of-place chain ``find`` reads.

Dynamo records ``x.masked_fill_(m, v)`` as a node nobody uses, and the softmax after it reads ``x`` itself, so the
scores seem to have two users and the chain is not read. Where nothing else can see the write, the write is the
same as ``y = x.masked_fill(m, v)`` with every later reader of ``x`` reading ``y``: ``x`` is computed in the graph
(not an input, a parameter or a view of one; through ``*=`` and ``/=`` of a tensor nobody else reads), and no view
of it is taken. Readers before the write keep ``x``. Only score tensors (a q·kᵀ product within the walk's reach)
are rewritten; anything else is left as it was.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .find import MATMUL_FUNCS, MAX_SCORE_STEPS
from .site import add_call_like, is_call, is_view_of_input, may_share_memory, written_args, writes_in_place

_OUT_OF_PLACE = {"masked_fill_": "masked_fill", "mul_": "mul", "div_": "div", "add_": "add"}
_IN_PLACE_OPERATORS = (operator.imul, operator.itruediv, operator.iadd)
_PRODUCTS, _PRODUCT_METHODS = (*MATMUL_FUNCS, torch.bmm, torch.baddbmm), ("matmul", "bmm", "baddbmm")


def _scores(x) -> bool:
    """Whether ``x`` is a matrix product, or follows one through a few first-argument steps (scale, mask)."""
    for _ in range(MAX_SCORE_STEPS + 1):
        if not isinstance(x, fx.Node) or x.op not in ("call_function", "call_method") or not x.args:
            return False
        if is_call(x, _PRODUCTS, _PRODUCT_METHODS):
            return True
        x = x.args[0]
    return False


def _only_name(x: fx.Node, later: set) -> bool:
    """Whether a write into ``x`` changes nothing the graph reads under another name: ``x`` is no view of an
    input, and no view of ``x`` is taken before the write (one taken after reads the written value, and is moved
    to the out-of-place result). Views are what torch's fake tensors say shares ``x``'s memory."""
    if x.op not in ("call_function", "call_method") or is_view_of_input(x) and x.target not in _IN_PLACE_OPERATORS:
        return False
    if any(user not in later and x not in (written_args(user) or ()) and may_share_memory(user, x) for user in x.users):
        return False
    if x.op == "call_function" and x.target in _IN_PLACE_OPERATORS:  # x is its first argument, written
        source = x.args[0]
        return isinstance(source, fx.Node) and len(source.users) == 1 and _only_name(source, later)
    return not writes_in_place(x)


def _after(node: fx.Node) -> set:
    later, cursor = set(), node.next
    while cursor.op != "root":
        later.add(cursor)
        cursor = cursor.next
    return later


def run(gm: fx.GraphModule) -> int:
    """Write each in-place op on attention scores out of place; returns how many."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in _OUT_OF_PLACE or not node.args:
            continue
        x, later = node.args[0], _after(node)
        if not isinstance(x, fx.Node) or not _only_name(x, later) or not _scores(x):
            continue
        with graph.inserting_before(node):
            y = add_call_like(graph, node, node.args, node.kwargs, target=_OUT_OF_PLACE[node.target])
        for user in list(x.users):
            if user in later:
                user.replace_input_with(x, y)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
