"""Softmax calls that look like attention but that no site holds, and why the pass did not read them.

A hand-written attention in a form ``find`` does not read runs as written, dense and correct; without a
word in the report its author sees only "0/0 attention sites rewritten" and cannot tell a form the pass
missed from a model with no attention. Attention-like here means a matrix product within a few steps above
the softmax and one taking its weights below it, so a router's softmax (fed by a linear layer, read by
``topk``) is not named.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import bmm
from .find import DROPOUT_FUNCS, MATMUL_FUNCS, MAX_SCORE_STEPS, SOFTMAX_FUNCS, op_name, source_of, transposed_key
from .site import CASTS, AttentionSite, call_arg, is_call

_THREE_D, _THREE_D_METHODS = (torch.bmm, torch.baddbmm), ("bmm", "baddbmm")
_PRODUCTS = (*MATMUL_FUNCS, *_THREE_D, torch.einsum)
_PRODUCT_METHODS = ("matmul", "__matmul__", *_THREE_D_METHODS)
# scores are made by products and elementwise ops; a walk that meets a layer has left them (a classifier's
# softmax over linear logits is no attention, whatever product lies further up)
_LAYERS = (torch._C._nn.linear, F.linear, F.layer_norm, F.group_norm, F.embedding, torch.conv1d, torch.conv2d)


def _tensor_operand(node: fx.Node):
    """The operand a score chain continues through: the first graph node among the first two arguments."""
    return next((a for a in node.args[:2] if isinstance(a, fx.Node)), None)


def _path_up(softmax: fx.Node) -> list:
    """The nodes from the softmax's input up to the first matrix product (that product last), or [] when none
    is met within the bound the finder's own walk has (with room for casts)."""
    path, node = [], softmax.args[0] if softmax.args else None
    for _ in range(MAX_SCORE_STEPS + 3):
        if (not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or not node.args
                or is_call(node, _LAYERS)):
            return []
        path.append(node)
        if is_call(node, _PRODUCTS, _PRODUCT_METHODS):
            return path
        node = _tensor_operand(node)
    return []


def _weights_meet_a_product(softmax: fx.Node) -> bool:
    """Whether the softmax's weights reach a matrix product, through casts and dropout."""
    frontier = [softmax]
    for _ in range(4):
        users = [u for n in frontier for u in n.users]
        if any(is_call(u, _PRODUCTS, _PRODUCT_METHODS) for u in users):
            return True
        frontier = [u for u in users if is_call(u, DROPOUT_FUNCS, ("dropout",) + CASTS)]
    return False


def _reason(softmax: fx.Node, path: list) -> str:
    product = path[-1]
    name = op_name(product)
    if is_call(product, _THREE_D, _THREE_D_METHODS):
        return bmm.why_not_rewritten(product) or (
            f"attention written with {name} on 3-D [B·H, S, D] operands, its scores reaching the softmax through "
            "ops the pass does not carry to 4-D (it reads bmm(q, kᵀ) ... softmax ... bmm(·, v), or the scores "
            "viewed back to [B, H, Q, KV], with a scale, a mask, casts and dropout between)")
    if is_call(product, (torch.einsum,)):
        return "an einsum the pass does not read as a per-head q·kᵀ (its subscripts are not 'bhqd,bhkd->bhqk' or a spelling of it)"
    dim = call_arg(softmax, 1, "dim", None)
    if dim not in (-1, 3):
        return f"the softmax runs over dim {dim}, not the key dim (-1)"
    shared = next((n for n in path if len(n.users) > 1), None)
    if shared is not None:
        return (f"the scores after {op_name(shared)} have other users too ({', '.join(u.name for u in shared.users)}): "
                "the pass reads a chain whose scores nothing else reads (an in-place op on them is read only where "
                "no view of them is taken before it)")
    key_t = product.args[1] if len(product.args) > 1 else None
    if isinstance(key_t, fx.Node) and transposed_key(key_t) is None:
        return (f"the key side of the score product is {op_name(key_t)}(...), not k.transpose(-2, -1), "
                "k.permute(0, 1, 3, 2) or k.mT of a [B, H, S, D] key")
    ops = ", ".join(op_name(n) for n in path[:-1]) or "nothing"
    return (f"the scores reach the softmax through {ops}: not the scale (x or / by a number), mask (+ or "
            "masked_fill with -inf) and casts the pass reads, or not in that order")


def run(gm: fx.GraphModule, sites: list[AttentionSite]) -> list[str]:
    """One line per softmax no site holds whose input comes from a matrix product and whose weights meet
    another: where it is and why it stays as written."""
    held = {n for site in sites for n in site.chain}
    notes = []
    for node in gm.graph.nodes:
        if node in held or not is_call(node, SOFTMAX_FUNCS, ("softmax",)):
            continue
        path = _path_up(node)
        if path and _weights_meet_a_product(node):
            notes.append(f"{source_of(node) or node.name}: {_reason(node, path)}")
    return notes
