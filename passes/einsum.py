"""Write attention spelled with ``torch.einsum`` in the matmul spelling that ``find`` reads.

Research code often writes the scores as ``einsum("b h i d, b h j d -> b h i j", q, k)`` and the value
product as ``einsum("b h i j, b h j d -> b h i d", attn, v)``: any letters, ``...`` for the leading dims,
operands in either order, [B, S, H, D] operands too. Only attention's einsums are rewritten: a product
over one shared letter whose result reaches a softmax over its last dim (the scores), or the product of
softmax weights with values over the weights' last dim. Each becomes permutes and a ``matmul``, the batched
matmul einsum runs itself, so a site left dense computes what it did.

Reference code that keeps its projections sequence-major turns the key straight from [B, S, H, D] to
[B, H, D, S] for the scores (``q.transpose(1, 2) @ k.permute(0, 2, 3, 1)``); where those scores reach a
softmax, that key is written as ``k.transpose(1, 2).transpose(-2, -1)``, the same values in the spelling
``find`` reads.
"""
from __future__ import annotations

import dataclasses
import string

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .find import DROPOUT_FUNCS, MATMUL_FUNCS, MAX_SCORE_STEPS, SOFTMAX_FUNCS, permutation_of
from .site import CASTS, add_call, call_arg, in_memory_order, is_call, memory_order

_EINSUM = {torch.einsum, torch.functional.einsum}


@dataclasses.dataclass(frozen=True)
class _Product:
    """A two-operand einsum of 4-D tensors as one letter per dim (``...`` spelled out)."""

    left: str
    right: str
    out: str

    @property
    def left_only(self) -> set:
        return set(self.left) - set(self.right)

    @property
    def right_only(self) -> set:
        return set(self.right) - set(self.left)

    @property
    def contracted(self) -> set:
        return (set(self.left) & set(self.right)) - set(self.out)

    @property
    def batch(self) -> list:
        return [x for x in self.out if x in self.left and x in self.right]

    def well_formed(self) -> bool:
        """One letter summed, two kept from both operands, one kept from each alone: a batched matmul."""
        return (len(self.contracted) == 1 and len(self.batch) == 2 and len(self.left_only) == 1
                and len(self.right_only) == 1 and set(self.out) == set(self.left) ^ set(self.right) | set(self.batch))


def _product(equation: str, left: torch.Tensor, right: torch.Tensor) -> _Product | None:
    """The letters of ``equation`` for 4-D operands, or None for any other einsum (implicit output, repeated
    letters, more dims, an ellipsis the output drops)."""
    eq = equation.replace(" ", "")
    if "->" not in eq or left.dim() != 4 or right.dim() != 4:
        return None
    inputs, out = eq.split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return None
    free = iter(c for c in string.ascii_letters if c not in eq)
    spelled = []
    for part in (*parts, out):
        if "..." in part:
            width = 4 - len(part.replace("...", ""))
            if width < 0 or part.count("...") != 1:
                return None
            part = part.replace("...", "\0" * width)
        spelled.append(part)
    ellipsis = [s.count("\0") for s in spelled]
    if len(set(ellipsis)) != 1:
        return None
    fresh = "".join(next(free) for _ in range(ellipsis[0]))
    spelled = [s.replace("\0" * len(fresh), fresh) if fresh else s for s in spelled]
    if any(len(s) != 4 or len(set(s)) != 4 for s in spelled):
        return None
    return _Product(*spelled)


def _operands(node: fx.Node):
    """(equation, left, right) of a two-operand ``torch.einsum`` call, or None."""
    if node.op != "call_function" or node.target not in _EINSUM or node.kwargs or not node.args:
        return None
    equation, rest = node.args[0], node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = tuple(rest[0])
    if not isinstance(equation, str) or len(rest) != 2 or not all(isinstance(x, fx.Node) for x in rest):
        return None
    return equation, *rest


def _softmax_over_last(node) -> bool:
    return is_call(node, SOFTMAX_FUNCS, ("softmax",)) and call_arg(node, 1, "dim", None) in (-1, 3)


def reaches_softmax(node: fx.Node) -> bool:
    """Whether ``node`` flows through single users (scale, mask) into a softmax over its last dim."""
    for _ in range(MAX_SCORE_STEPS + 1):
        if len(node.users) != 1:
            return False
        (node,) = node.users
        if is_call(node, SOFTMAX_FUNCS, ("softmax",)):
            return _softmax_over_last(node)
    return False


def _from_softmax(node) -> bool:
    """Whether ``node`` is weights from a softmax over the last dim (through casts and dropout)."""
    while is_call(node, DROPOUT_FUNCS, CASTS + ("dropout",)):
        node = node.args[0]
    return _softmax_over_last(node)


def _permuted(graph: fx.Graph, like: fx.Node, x: fx.Node, letters: str, order: str) -> fx.Node:
    perm = tuple(letters.index(c) for c in order)
    return x if perm == (0, 1, 2, 3) else add_call(graph, like, torch.permute, x, perm)


def _scores(graph: fx.Graph, node: fx.Node, p: _Product, left: fx.Node, right: fx.Node) -> fx.Node | None:
    """``q @ kᵀ`` for a scores einsum whose output ends (query letter, key letter), else None."""
    (d,) = p.contracted
    if p.out[:2] != "".join(p.batch) or {p.out[2], p.out[3]} != p.left_only | p.right_only:
        return None
    (q, q_letters), (k, k_letters) = sorted(((left, p.left), (right, p.right)), key=lambda x: p.out[3] in x[1])
    q = _permuted(graph, node, q, q_letters, p.out[:3] + d)
    k = _permuted(graph, node, k, k_letters, p.out[:2] + p.out[3] + d)
    return add_call(graph, node, torch.matmul, q, add_call(graph, node, torch.transpose, k, 2, 3))


def _value_product(graph: fx.Graph, node: fx.Node, p: _Product, left: fx.Node, right: fx.Node) -> fx.Node | None:
    """``weights @ v`` (then the output's order) for an einsum of softmax weights over their last letter."""
    weights_left = _from_softmax(left)
    if not weights_left and not _from_softmax(right):
        return None
    (w, w_letters), (v, v_letters) = ((left, p.left), (right, p.right)) if weights_left else ((right, p.right), (left, p.left))
    (j,) = p.contracted
    if w_letters[3] != j:  # the softmax ran over another dim: not attention's product
        return None
    batch = "".join(p.batch)
    (i,), (d,) = set(w_letters) - set(v_letters), set(v_letters) - set(w_letters)
    out = add_call(graph, node, torch.matmul, _permuted(graph, node, w, w_letters, batch + i + j),
                   _permuted(graph, node, v, v_letters, batch + j + d))
    return _permuted(graph, node, out, batch + i + d, p.out)


def _same_contracted_size(p: _Product, left: torch.Tensor, right: torch.Tensor) -> bool:
    """einsum broadcasts a size-1 summed dim against the other operand's; matmul does not."""
    (c,) = p.contracted
    return statically_known_true(left.shape[p.left.index(c)] == right.shape[p.right.index(c)])


def _in_traced_strides(graph: fx.Graph, node: fx.Node, new: fx.Node) -> fx.Node:
    """``new`` laid out in memory as einsum laid out its result (a later ``.view`` may rely on it): a copy only
    where the permuted matmul differs (a value product whose output puts d before i)."""
    want = memory_order(node.meta["example_value"])
    return new if memory_order(new.meta["example_value"]) == want else in_memory_order(graph, node, new, want)


def _key_straight_from_sequence_major(node) -> bool:
    """``x.permute(0, 2, 3, 1)`` of a 4-D ``x``."""
    if permutation_of(node) != (0, 2, 3, 1) or not isinstance(node.args[0], fx.Node):
        return False
    value = node.args[0].meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() == 4


def _respell_sequence_major_keys(graph: fx.Graph) -> int:
    """Write each attention score product's ``k.permute(0, 2, 3, 1)`` as ``k.transpose(1, 2).transpose(-2, -1)``."""
    respelled = 0
    for node in list(graph.nodes):
        if not is_call(node, MATMUL_FUNCS, ("matmul",)) or len(node.args) != 2 or node.kwargs:
            continue
        key_t = node.args[1]
        if not _key_straight_from_sequence_major(key_t) or not reaches_softmax(node):
            continue
        with graph.inserting_before(node):
            by_head = add_call(graph, node, torch.transpose, key_t.args[0], 1, 2)
            node.replace_input_with(key_t, add_call(graph, node, torch.transpose, by_head, -2, -1))
        if not key_t.users:
            graph.erase_node(key_t)
        respelled += 1
    return respelled


def run(gm: fx.GraphModule) -> int:
    """Rewrite every attention einsum, and respell every sequence-major key of attention scores; returns how
    many were rewritten."""
    graph = gm.graph
    rewritten = _respell_sequence_major_keys(graph)
    for node in list(graph.nodes):
        operands = _operands(node)
        if operands is None:
            continue
        equation, left, right = operands
        values = [x.meta.get("example_value") for x in (left, right)]
        if not all(isinstance(x, torch.Tensor) for x in values):
            continue
        p = _product(equation, *values)
        if p is None or not p.well_formed() or not _same_contracted_size(p, *values):
            continue
        with graph.inserting_before(node):
            new = _scores(graph, node, p, left, right) if reaches_softmax(node) else None
            if new is None:
                new = _value_product(graph, node, p, left, right)
            if new is not None:
                new = _in_traced_strides(graph, node, new)
        if new is None:
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
