"""Write attention on 3-D [B·H, S, D] operands (``torch.bmm`` / ``baddbmm``) as the 4-D chain ``find`` reads.

Older and hand-written models merge batch and heads before the products: ``q.reshape(B * H, S, D)``,
``bmm(q, k.transpose(1, 2))`` or ``baddbmm(empty, q, kᵀ, beta=0, alpha=scale)``, then either the whole chain in
3-D (mask, softmax, ``bmm(weights, v)``) or the scores viewed back as [B, H, Q, KV] (HF GPT-2's
``reorder_and_upcast_attn``, GPT-NeoX-Japanese). Which head a row of the merged axis belongs to is known only from
the reshape, so a chain is rewritten only where q and k (and v, in the 3-D form) are each a [B·H, S, D] view of a
4-D tensor, all with the same first two sizes, through casts at most. The products become 4-D matmuls on those
tensors, the ops between them run on the 4-D scores, and a 3-D output is flattened back to [B·H, S, D]. Every
other operand of those ops spans only the scores' last two dims (a [Q, KV] mask, a number), so each score meets
the same value it did; a [B·H, Q, KV] mask would need a head split of its own and is not read. Anything else
stays as written, and ``unread`` reports it with the reason :func:`why_not_rewritten` gives.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .einsum import reaches_softmax
from .find import DROPOUT_FUNCS, MAX_SCORE_STEPS, SOFTMAX_FUNCS, op_name, transposed_key
from .site import CASTS, add_call, add_call_like, call_arg, is_call, is_mT, is_lifted_scalar, shape_of

_BMM, _BADDBMM = (torch.bmm,), (torch.baddbmm,)
_MERGES, _MERGE_METHODS = (torch.reshape, torch.flatten), ("reshape", "view", "flatten")
_SPLITS, _SPLIT_METHODS = (torch.reshape,), ("reshape", "view")
_ZEROS, _ZEROS_METHODS = (torch.zeros, torch.zeros_like), ("new_zeros", "zero_")
# the ops a score chain may pass through on its way to the softmax; ``find`` decides what each means (a tanh
# soft-cap is carried over and then blocked there, so the report says so)
_SCORE_FUNCS = (operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div, torch.add,
                torch.sub, torch.masked_fill, torch.where, torch.tanh)
_SCORE_METHODS = ("mul", "div", "add", "sub", "masked_fill", "tanh", *CASTS)
_WEIGHT_FUNCS, _WEIGHT_METHODS = tuple(DROPOUT_FUNCS), ("dropout", *CASTS)
# what the rewrite may leave without users and erase: views, casts and baddbmm's discarded input
_PURE_FUNCS = (*_MERGES, torch.transpose, torch.permute, torch.empty, *_ZEROS)
_PURE_METHODS = (*_MERGE_METHODS, "transpose", "permute", "new_empty", "new_zeros", *CASTS)


@dataclasses.dataclass(frozen=True)
class _Operand:
    """A 3-D operand read as its 4-D tensor, and the casts applied to it after the merge."""

    whole: fx.Node
    """the [B, H, S, D] tensor (for the key, k itself, not kᵀ)"""
    casts: tuple = ()
    """cast nodes between the merge and the product, innermost first: replayed on ``whole``"""


@dataclasses.dataclass(frozen=True)
class _Chain:
    """A 3-D attention chain and the 4-D tensors its operands are views of."""

    scores: fx.Node
    """the score product: ``bmm(q3, k3ᵀ)`` or ``baddbmm(input, q3, k3ᵀ, ...)``"""
    between: tuple
    """the nodes after the score product up to ``end``, in order"""
    end: fx.Node
    """``bmm(weights, v3)``, or the view that splits the scores back into [B, H, Q, KV]"""
    query: _Operand
    key: _Operand
    value: Optional[_Operand]
    """None when the scores are split back to 4-D before the softmax"""


def _heads_merged(node) -> fx.Node | None:
    """``x`` from a [B·H, S, D] reshape, view or flatten of a 4-D [B, H, S, D] ``x``, else None."""
    if not is_call(node, _MERGES, _MERGE_METHODS) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    whole, merged = shape_of(node.args[0]), shape_of(node)
    if whole is None or merged is None or len(whole) != 4 or len(merged) != 3:
        return None
    expected = (whole[0] * whole[1], whole[2], whole[3])
    return node.args[0] if all(statically_known_true(a == b) for a, b in zip(merged, expected)) else None


def _key_of_transposed(node) -> fx.Node | None:
    """k (4-D) from a 3-D kᵀ: a merged k with its last two dims swapped, or a merge of a 4-D kᵀ."""
    if is_call(node, (torch.transpose,), ("transpose",)) and len(node.args) == 3 and not node.kwargs:
        swapped = {d % 3 if isinstance(d, int) else d for d in node.args[1:3]} == {1, 2}
        return _heads_merged(node.args[0]) if swapped else None
    if is_call(node, (torch.permute,), ("permute",)) and not node.kwargs:
        rest = node.args[1:]
        dims = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        swapped = tuple(d % 3 if isinstance(d, int) else d for d in dims) == (0, 2, 1)
        return _heads_merged(node.args[0]) if swapped else None
    if is_mT(node):
        return _heads_merged(node.args[0])
    merged = _heads_merged(node)
    return transposed_key(merged) if merged is not None else None


def _operand(node, read) -> _Operand | None:
    """``node`` as ``read`` (a merge reader) sees it below any casts (``q.float()`` after the reshape)."""
    casts = []
    while is_call(node, (), CASTS) and isinstance(node.args[0], fx.Node):
        casts.append(node)
        node = node.args[0]
    whole = read(node)
    return None if whole is None else _Operand(whole, tuple(reversed(casts)))


def _spans_scores_only(x) -> bool:
    """Whether ``x`` (an operand beside the scores) spans only their last two dims, so it pairs each score with
    the same value in 4-D as in 3-D."""
    if not isinstance(x, fx.Node) or is_lifted_scalar(x):
        return True
    shape = shape_of(x)
    if shape is None:
        return False
    return len(shape) <= 2 or (len(shape) == 3 and statically_known_true(shape[0] == 1))


def _number_or_lifted(x):
    return x if isinstance(x, (int, float)) or is_lifted_scalar(x) else None


def _baddbmm_terms(node: fx.Node) -> tuple:
    """(alpha, the input term to add or None, why not read or ""): ``beta * input + alpha * (q @ kᵀ)``."""
    alpha, beta, term = _number_or_lifted(node.kwargs.get("alpha", 1)), node.kwargs.get("beta", 1), node.args[0]
    if alpha is None:
        return None, None, "baddbmm's alpha is not a number"
    if isinstance(beta, (int, float)) and beta == 0:
        return alpha, None, ""
    if not (isinstance(beta, (int, float)) and beta == 1):
        return alpha, None, "baddbmm's beta is neither 0 nor 1"
    if is_call(term, _ZEROS, _ZEROS_METHODS):  # GPT-NeoX-Japanese adds a zeros tensor
        return alpha, None, ""
    if not _spans_scores_only(term):
        return alpha, None, "baddbmm adds an input over the merged [B·H] axis, which has no head split to read"
    return alpha, term, ""


def _heads_split(node, merged: fx.Node, query: fx.Node) -> bool:
    """Whether ``node`` views the 3-D ``merged`` scores as [B, H, Q, KV] with the query's B and H."""
    if not is_call(node, _SPLITS, _SPLIT_METHODS) or node.args[0] is not merged:
        return False
    split, scores, q = shape_of(node), shape_of(merged), shape_of(query)
    if split is None or scores is None or q is None or len(split) != 4:
        return False
    return all(statically_known_true(a == b) for a, b in zip(split, (q[0], q[1], scores[1], scores[2])))


def _plan(scores: fx.Node) -> _Chain | str | None:
    """The chain from a 3-D score product, a reason it cannot be rewritten, or None when it is no attention."""
    is_bmm = is_call(scores, _BMM, ("bmm",))
    if not is_bmm and not is_call(scores, _BADDBMM, ("baddbmm",)):
        return None
    operands = scores.args[:2] if is_bmm else scores.args[1:3]
    if len(operands) != 2 or not all(isinstance(x, fx.Node) for x in operands) or scores.kwargs.keys() - {"alpha", "beta"}:
        return None
    name = op_name(scores)
    not_views = (f"attention written with {name} on 3-D [B·H, S, D] operands that are not each a reshape of a 4-D "
                 "[B, H, S, D] tensor (q.reshape(B * H, S, D); k's transposed after or before the reshape)")
    query, key = _operand(operands[0], _heads_merged), _operand(operands[1], _key_of_transposed)
    between, previous, value = [], scores, None
    for _ in range(MAX_SCORE_STEPS + 3):
        if len(previous.users) != 1:
            return None
        (user,) = previous.users
        if query is not None and _heads_split(user, previous, query.whole):
            if not reaches_softmax(user):
                return None
            break
        between.append(user)
        previous = user
        if is_call(user, SOFTMAX_FUNCS, ("softmax",)):
            if call_arg(user, 1, "dim", None) not in (-1, 2):
                return None
            while True:  # casts and dropout of the weights, up to the value product
                if len(previous.users) != 1:
                    return f"attention written with {name}: its weights have other users besides the value product"
                (user,) = previous.users
                if is_call(user, _BMM, ("bmm",)) and user.args[0] is previous:
                    break
                if not is_call(user, _WEIGHT_FUNCS, _WEIGHT_METHODS):
                    return None
                between.append(user)
                previous = user
            value = _operand(user.args[1], _heads_merged)
            if value is None:
                return not_views
            break
        if not is_call(user, _SCORE_FUNCS, _SCORE_METHODS):
            return None
    else:
        return None
    if query is None or key is None:
        return not_views
    splits = [shape_of(x.whole) for x in (query, key, value) if x is not None]
    if not all(statically_known_true(s[0] == splits[0][0]) and statically_known_true(s[1] == splits[0][1]) for s in splits):
        return f"attention written with {name}: q, k and v merge batch and heads from different [B, H] splits"
    before = scores
    for node in between:
        others = [a for a in (*node.args, *node.kwargs.values()) if a is not before]
        if not is_call(node, (), CASTS) and not all(_spans_scores_only(a) for a in others):
            return (f"attention written with {name}: {op_name(node)} takes an operand over the merged [B·H] axis, "
                    "which has no head split to read")
        before = node
    if not is_bmm and _baddbmm_terms(scores)[2]:
        return f"attention written with {name}: {_baddbmm_terms(scores)[2]}"
    return _Chain(scores, tuple(between), user, query, key, value)


def why_not_rewritten(scores: fx.Node) -> str | None:
    """Why the 3-D attention chain from the score product ``scores`` stays as written, for the report."""
    plan = _plan(scores)
    return plan if isinstance(plan, str) else None


def _replayed(graph: fx.Graph, operand: _Operand) -> fx.Node:
    x = operand.whole
    for cast in operand.casts:
        x = add_call_like(graph, cast, (x, *cast.args[1:]), cast.kwargs)
    return x


def _scores_4d(graph: fx.Graph, chain: _Chain) -> fx.Node:
    node = chain.scores
    key_t = add_call(graph, node, torch.transpose, _replayed(graph, chain.key), 2, 3)
    scores = add_call(graph, node, torch.matmul, _replayed(graph, chain.query), key_t)
    if is_call(node, _BMM, ("bmm",)):
        return scores
    alpha, term, _ = _baddbmm_terms(node)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        scores = add_call(graph, node, operator.mul, scores, alpha)
    return scores if term is None else add_call(graph, node, operator.add, scores, term)


def _rewrite(graph: fx.Graph, chain: _Chain) -> None:
    with graph.inserting_before(chain.scores):
        previous, previous_4d = chain.scores, _scores_4d(graph, chain)
    for node in chain.between:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda x: previous_4d if x is previous else x)
        if is_call(node, SOFTMAX_FUNCS, ("softmax",)):
            # dim 2 of the 3-D scores is dim 3 of the 4-D ones: -1 names both
            if "dim" in kwargs:
                kwargs = {**kwargs, "dim": -1}
            else:
                args = (args[0], -1, *args[2:])
        with graph.inserting_before(node):
            previous, previous_4d = node, add_call_like(graph, node, args, kwargs)
    if chain.value is None:
        result = previous_4d  # already the [B, H, Q, KV] scores the split gave
    else:
        with graph.inserting_before(chain.end):
            out = add_call(graph, chain.end, torch.matmul, previous_4d, _replayed(graph, chain.value))
            result = add_call(graph, chain.end, torch.flatten, out, 0, 1)
    chain.end.replace_all_uses_with(result)
    dead = [chain.end, *reversed(chain.between), chain.scores]
    inputs = [x for node in dead for x in node.all_input_nodes if x not in dead]
    for node in dead:
        graph.erase_node(node)
    _erase_unused(graph, inputs, set())


def _erase_unused(graph: fx.Graph, nodes, erased: set) -> None:
    """Erase the views, casts and baddbmm inputs the rewrite left without users, and theirs in turn."""
    for node in nodes:
        if node in erased or node.users or not (is_call(node, _PURE_FUNCS, _PURE_METHODS) or node.target is getattr):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        _erase_unused(graph, inputs, erased)


def run(gm: fx.GraphModule) -> int:
    """Rewrite every 3-D attention chain whose operands have a head split; returns how many."""
    graph = gm.graph
    chains = [plan for node in list(graph.nodes) if isinstance(plan := _plan(node), _Chain)]
    for chain in chains:
        _rewrite(graph, chain)
    if chains:
        gm.recompile()
    return len(chains)
