"""Find attention calls in a Dynamo (torch IR) graph.

Forms recognised:

* ``F.scaled_dot_product_attention`` (the Dynamo target is
  ``torch._C._nn.scaled_dot_product_attention``), as HF ``sdpa`` emits it (and ``unfuse`` writes for
  ``nn.MultiheadAttention``);
* a manual chain ``matmul(q, kᵀ) → ×scale (or ÷, any number of constants) → (+ mask, or
  masked_fill(blocked, -inf)) → softmax(-1) (→ cast) (→ dropout) → matmul(·, v)``, as HF ``eager``
  emits it (kᵀ as ``transpose``, ``permute(0, 1, 3, 2)`` or ``mT``; ``einsum`` writes einsum attention in
  this form); with other ops among the scores (Gemma 2's tanh soft-cap) or weights that escape, the site
  is found but blocked, so the report says why it stays dense;
* PyTorch's fused attention calls that ``unfuse`` did not open and FlexAttention calls (HF
  ``flex_attention``): found and always blocked, for the report.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .site import (CASTS, AttentionSite, call_arg, dtype_of, first_reason, is_call, is_mT, is_lifted_scalar,
                   written_between)
from .unfuse import why_not_opened

_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
SOFTMAX_FUNCS = {F.softmax, torch.softmax, torch.nn.functional.softmax}
MATMUL_FUNCS = {torch.matmul, operator.matmul}
DROPOUT_FUNCS = {F.dropout, torch.dropout}


def source_of(node: fx.Node) -> str:
    """file:line of the innermost user frame that made this node, from Dynamo's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return ""
    path, line = frames[-1]
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{line}"


def _dropout_p(p) -> float:
    """The probability as a number (1.0 for one :func:`_lifted_dropout` keeps dense)."""
    return float(p) if isinstance(p, (int, float)) else 1.0


def _lifted_dropout(p) -> Optional[str]:
    """A probability Dynamo lifted to a graph input (``dynamic=True``, or a changed ``self.p``) is not known
    here, so the site stays dense."""
    return None if isinstance(p, (int, float)) else "the dropout probability is a graph value, not a constant"


def _sdpa_site(node: fx.Node) -> AttentionSite:
    p = call_arg(node, 4, "dropout_p", 0.0)
    return AttentionSite(
        node=node,
        form="sdpa",
        query=call_arg(node, 0, "query"),
        key=call_arg(node, 1, "key"),
        value=call_arg(node, 2, "value"),
        mask=call_arg(node, 3, "attn_mask"),
        dropout_p=_dropout_p(p),
        is_causal=bool(call_arg(node, 5, "is_causal", False)),
        scale=call_arg(node, 6, "scale", None),
        enable_gqa=bool(node.kwargs.get("enable_gqa", False)),
        source=source_of(node),
        blocker=_lifted_dropout(p) or "",
    )


def _single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def permutation_of(node) -> tuple | None:
    """The dims of a ``permute`` call, negative ones read as a 4-D tensor's, or None for any other node."""
    if not is_call(node, (torch.permute,), ("permute",)) or node.kwargs:
        return None
    rest = node.args[1:]
    perm = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    return tuple(d % 4 if isinstance(d, int) else d for d in perm)


def transposed_key(node) -> fx.Node | None:
    """k from ``k.transpose(-2, -1)`` (any spelling of the last two dims), ``k.permute(0, 1, 3, 2)`` or ``k.mT``."""
    if is_call(node, (torch.transpose,), ("transpose",)):
        dims = {d % 4 if isinstance(d, int) else d for d in node.args[1:3]}
        return node.args[0] if dims == {2, 3} else None
    if permutation_of(node) == (0, 1, 3, 2):
        return node.args[0]
    if is_mT(node):
        return node.args[0]
    return None


_SCALE_FUNCS = (operator.mul, torch.mul, operator.imul, operator.truediv, torch.div, operator.itruediv)
_DIVIDE = {operator.truediv, torch.div, operator.itruediv, "div", "div_"}
_COMMUTING_SCALE = (operator.mul, torch.mul)  # a factor on the left is read too (not for ÷: c / x is not x / c)
# q·kᵀ → softmax seldom takes more steps than scale, soft-cap (÷, tanh, ×) and mask; a bound keeps the
# walk from wandering up a long chain of single-user nodes
MAX_SCORE_STEPS = 6


def _is_minus_inf(value) -> bool:
    """A fill value that removes a score from the softmax: -inf or a huge negative number."""
    return isinstance(value, (int, float)) and value <= -1e4


def op_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _plain_binary(node: fx.Node) -> bool:
    """``a op b`` and nothing else: no ``alpha``, ``rounding_mode`` or ``out``, which change what the op computes."""
    return len(node.args) == 2 and not node.kwargs


def _narrowing_cast(cast: fx.Node, query: fx.Node):
    """Why a cast of the attention weights changes what the op would compute (None when it does not): the op
    keeps them in fp32 and reads v in its own dtype, which matches a cast to the query's dtype or to a wider float."""
    after = dtype_of(cast)
    if (after is not None and after == dtype_of(query)) or _loses_nothing(dtype_of(cast.args[0]), after):
        return None
    return f"the attention weights are cast to {after} before the value product"


def _loses_nothing(before, after) -> bool:
    """Whether a cast from ``before`` to ``after`` keeps what the op's fp32 arithmetic would: the same dtype, or
    a float of 32 bits or more."""
    return after is not None and after.is_floating_point and (after == before or torch.finfo(after).bits >= 32)


def _widening_cast(node) -> bool:
    """A cast of the scores that the op's fp32 softmax makes anyway: to fp32 or wider, or to their own dtype
    (Meta's reference Llama: ``F.softmax(scores.float(), dim=-1)``)."""
    if not is_call(node, (), CASTS) or not _single_user(node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    return _loses_nothing(dtype_of(node.args[0]), dtype_of(node))


def _reaches_matmul(node) -> bool:
    """Whether following first arguments from ``node`` meets a matmul within the walk's bound."""
    for _ in range(MAX_SCORE_STEPS + 1):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or not node.args:
            return False
        if is_call(node, MATMUL_FUNCS, ("matmul",)):
            return True
        node = _score_operand(node)
    return False


def _score_operand(node: fx.Node):
    """The operand the walk follows up from ``node``: the first, or the second of ``c * x`` (a factor on the left)."""
    if is_call(node, _COMMUTING_SCALE, ()) and _plain_binary(node) and isinstance(node.args[0], (int, float)):
        return node.args[1]
    return node.args[0]


@dataclasses.dataclass(frozen=True)
class _Scores:
    """What lies between ``matmul(q, kᵀ)`` and the softmax (:func:`_walk_scores`)."""

    product: fx.Node
    """the ``matmul(q, kᵀ)``"""
    mask: object
    """the mask operand (added, a ``masked_fill`` condition or a ``where`` condition), or None"""
    fills: bool
    """the mask is a ``masked_fill`` condition (True where a key may NOT be read)"""
    selects: bool
    """the mask is a ``where`` condition (True where a key may be read)"""
    scale: object
    """the product of the constant factors, or a lifted scale node"""
    divides: bool
    """the lifted scale divides the scores"""
    chain: tuple
    """the nodes passed, from the softmax's input up (the product not among them)"""
    unknown: tuple
    """the ops not understood, from the softmax up"""


def _walk_scores(softmax: fx.Node) -> Optional[_Scores]:
    """From the softmax's input up to ``matmul(q, kᵀ)``, or None when the softmax is not fed by a q·kᵀ product."""
    scores = softmax.args[0]
    chain, mask, fills, selects, scale, unknown = [], None, False, False, 1.0, []
    while _widening_cast(scores):
        chain.append(scores)
        scores = scores.args[0]
    # a scale Dynamo lifted to a graph input (dynamic=True reads self.scaling through .item(), and makes
    # math.sqrt(q.shape[-1]) symbolic), and whether it divides the scores
    lifted, divides = None, False
    # an add with alpha (or a div with a rounding mode, below) is not the plain op read here: left for the walk
    # to report
    if is_call(scores, (operator.add, torch.add, operator.iadd), ("add", "__add__")) and _single_user(scores) and (
            _plain_binary(scores)):
        chain.append(scores)
        scores, mask = scores.args
        if _reaches_matmul(mask) and not _reaches_matmul(scores):  # mask + scores
            scores, mask = mask, scores
    elif is_call(scores, (torch.masked_fill,), ("masked_fill",)) and _single_user(scores) and _is_minus_inf(call_arg(scores, 2, "value")):
        chain.append(scores)
        scores, mask, fills = scores.args[0], call_arg(scores, 1, "mask"), True
    elif is_call(scores, (torch.where,), ()) and _single_user(scores) and len(scores.args) == 3 and not scores.kwargs and (
            _is_minus_inf(scores.args[2])):
        chain.append(scores)  # where(keep, scores, -inf): the condition marks the keys read
        scores, mask, selects = scores.args[1], scores.args[0], True
    for _ in range(MAX_SCORE_STEPS):
        if not isinstance(scores, fx.Node) or not _single_user(scores):
            return None
        if is_call(scores, MATMUL_FUNCS, ("matmul",)):
            if lifted is not None:
                if scale != 1.0:  # the op takes one scale value; a product with constants would need new nodes
                    unknown.append("a lifted scale beside constant factors")
                    divides = False
                else:
                    scale = lifted
            return _Scores(scores, mask, fills, selects, scale, divides, tuple(chain), tuple(unknown))
        if scores.op not in ("call_function", "call_method") or not scores.args:
            return None
        operand = _score_operand(scores)
        factor = scores.args[1] if len(scores.args) > 1 and _plain_binary(scores) else None
        if operand is not scores.args[0]:
            factor = scores.args[0]  # scale * (q @ kᵀ): the factor on the left
        if not isinstance(operand, fx.Node):
            return None
        if _widening_cast(scores):
            chain.append(scores)
            scores = operand
            continue
        if is_call(scores, _SCALE_FUNCS, ("mul", "div")) and isinstance(factor, (int, float)) and factor != 0:
            scale *= 1.0 / factor if scores.target in _DIVIDE else float(factor)
        elif is_call(scores, _SCALE_FUNCS, ("mul", "div")) and is_lifted_scalar(factor):
            if lifted is None:
                lifted, divides = factor, scores.target in _DIVIDE
            else:  # the op takes one scale value; a product of two would need new nodes
                unknown.append("a second lifted scale")
        else:
            unknown.append(op_name(scores))
        chain.append(scores)
        scores = operand
    return None


def _exact_upcast_of(x) -> fx.Node | None:
    """y from ``y.float()`` (any cast to fp32) of a 16-bit float ``y``, else None."""
    if not is_call(x, (), CASTS) or not isinstance(x.args[0], fx.Node):
        return None
    return x.args[0] if dtype_of(x.args[0]) in (torch.float16, torch.bfloat16) and dtype_of(x) == torch.float32 else None


def _below_exact_upcasts(query: fx.Node, key: fx.Node) -> tuple:
    """q and k from below their casts to fp32 when both are 16-bit floats of one dtype (GPT-2's
    ``reorder_and_upcast_attn``): a product of two such numbers is exact in fp32, which the op accumulates q·kᵀ
    in, so it computes the same scores from q and k in their own dtype, and v's dtype is theirs again. A site
    left dense keeps the casts: the graph is not changed here."""
    q, k = _exact_upcast_of(query), _exact_upcast_of(key)
    return (q, k) if q is not None and k is not None and dtype_of(q) == dtype_of(k) else (query, key)


@dataclasses.dataclass(frozen=True)
class _Weights:
    """From the softmax down to ``matmul(weights, v)`` (:func:`_walk_weights`)."""

    steps: tuple
    """the casts and dropouts the weights pass through, in order"""
    product: fx.Node
    """the value product"""
    escape: bool
    """the weights the product reads are read besides (``output_attentions``)"""


def _walk_weights(softmax: fx.Node) -> Optional[_Weights]:
    """Down from the softmax through casts and dropout to the value product; None when the weights go elsewhere."""
    steps, probs = [], softmax
    while True:
        escape = len(probs.users) != 1
        if escape:
            # the weights escape too (output_attentions): attention still, but the op makes no weights
            user = next((u for u in probs.users if is_call(u, MATMUL_FUNCS, ("matmul",)) and u.args[0] is probs), None)
            if user is None:
                return None
        else:
            (user,) = probs.users
        if is_call(user, (), CASTS) or is_call(user, DROPOUT_FUNCS, ("dropout",)):
            steps.append(user)
            probs = user
        elif is_call(user, MATMUL_FUNCS, ("matmul",)) and user.args[0] is probs:
            return _Weights(tuple(steps), user, escape)
        else:
            return None


@dataclasses.dataclass(frozen=True)
class _ManualChain:
    """A matched manual chain: ``matmul(q, kᵀ)`` → :class:`_Scores` → softmax → :class:`_Weights`."""

    softmax: fx.Node
    scores: _Scores
    query: fx.Node
    key: fx.Node
    key_t: fx.Node
    weights: _Weights


def _match_manual(softmax: fx.Node) -> Optional[_ManualChain]:
    """The chain through a softmax over the last dim, or None when it is not attention."""
    if call_arg(softmax, 1, "dim", None) not in (-1, 3):
        return None
    scores = _walk_scores(softmax)
    if scores is None:
        return None
    query, key_t = scores.product.args[0], scores.product.args[1]
    key = transposed_key(key_t)
    if key is None or not _single_user(key_t):
        return None
    query, key = _below_exact_upcasts(query, key)
    weights = _walk_weights(softmax)
    return None if weights is None else _ManualChain(softmax, scores, query, key, key_t, weights)


def _is_dropout(node: fx.Node) -> bool:
    return is_call(node, DROPOUT_FUNCS, ("dropout",))


def _training(dropout: fx.Node):
    """The dropout's training flag, as written (truthy: it drops)."""
    return dropout.kwargs.get("train", call_arg(dropout, 2, "training", True))  # torch.dropout says train


def _unread_score_ops(m: _ManualChain) -> Optional[str]:
    if not m.scores.unknown:
        return None
    what = " (logit soft-capping)" if "tanh" in m.scores.unknown else ""
    return (f"attention scores pass through {', '.join(reversed(m.scores.unknown))}{what} between q·kᵀ and the softmax: "
            "the sparse kernel computes only scaled scores plus an additive mask")


def _narrow_softmax(m: _ManualChain) -> Optional[str]:
    # dtype by keyword or at its place: F.softmax(input, dim, _stacklevel, dtype), torch.softmax(input, dim, dtype),
    # Tensor.softmax(dim, dtype) (self is the method node's first argument)
    functional = m.softmax.op == "call_function" and m.softmax.target is F.softmax
    dtype = call_arg(m.softmax, 3 if functional else 2, "dtype")
    if isinstance(dtype, torch.dtype) and torch.finfo(dtype).bits < 32:
        return f"the softmax is computed in {dtype} (the op computes it in fp32)"
    return None


def _weights_changed(m: _ManualChain) -> Optional[str]:
    """A cast or a dropout on the way to the value product that the op would not compute the same."""
    for step in m.weights.steps:
        if _is_dropout(step):
            reason = _lifted_dropout(call_arg(step, 1, "p", 0.5)) if _training(step) else None
        else:
            reason = _narrowing_cast(step, m.query)
        if reason:
            return reason
    return None


def _weights_escape(m: _ManualChain) -> Optional[str]:
    return "the attention weights are used besides the output (output_attentions=True?)" if m.weights.escape else None


def _qk_written(m: _ManualChain) -> Optional[str]:
    if written_between((m.query, m.key), m.scores.product, m.weights.product):
        return "q or k is written in place between q·kᵀ and the value product (the op reads both there)"
    return None


MANUAL_CHECKS = (_unread_score_ops, _narrow_softmax, _weights_changed, _weights_escape, _qk_written)
"""Why a matched manual chain stays dense, in the order its reasons are given."""


def _manual_site(softmax: fx.Node) -> AttentionSite | None:
    """Walk up and down from a softmax over the last dim; None when it is not attention.

    A chain that is attention but computes its scores with something the kernel does not (logit
    soft-capping's tanh, a tensor scale), or whose weights are also returned (``output_attentions``),
    comes back blocked, so the report names it and it stays dense."""
    m = _match_manual(softmax)
    if m is None:
        return None
    # every training dropout on the way drops: the chain keeps a weight only where each of them does
    kept = math.prod(1.0 - _dropout_p(call_arg(step, 1, "p", 0.5))
                     for step in m.weights.steps if _is_dropout(step) and _training(step))
    dropout_p = 1.0 - kept
    product = m.weights.product
    return AttentionSite(
        node=product,
        form="manual",
        query=m.query,
        key=m.key,
        value=product.args[1],
        mask=m.scores.mask,
        dropout_p=dropout_p,
        is_causal=False,
        scale=m.scores.scale,
        source=source_of(product),
        chain=(softmax, *m.scores.chain, m.scores.product, m.key_t, *m.weights.steps),
        blocker=first_reason(MANUAL_CHECKS, m) or "",
        mask_fills=m.scores.fills,
        mask_selects=m.scores.selects,
        scale_divides=m.scores.divides,
    )


# PyTorch's own attention modules reach Dynamo as single calls that hold the projections too (and, for the
# encoder layer's inference fast path, the whole layer). Those ``unfuse`` could not write out are still
# found, so the report shows them and why; never rewritten.
_FUSED_MHA = {
    F.multi_head_attention_forward: "torch.nn.MultiheadAttention",
    torch._native_multi_head_attention: "torch.nn.MultiheadAttention (inference fast path)",
    torch._transformer_encoder_layer_fwd: "torch.nn.TransformerEncoderLayer (inference fast path)",
}


_FLEX = torch.ops.higher_order.flex_attention


def _opaque_site(node: fx.Node) -> AttentionSite:
    """Attention the pass recognises but never rewrites: a fused torch module call, or FlexAttention (its
    score_mod / block mask are arbitrary code)."""
    x = node.args[0]
    name = getattr(node.target, "__name__", str(node.target))
    whole_layer = node.target is torch._transformer_encoder_layer_fwd
    if node.target is _FLEX:
        blocker = ("FlexAttention call (its score_mod and block mask are code the pass does not read); load HF "
                   "models with attn_implementation='sdpa' or 'eager' to make them sparse")
    else:
        why = why_not_opened(node)
        blocker = f"{_FUSED_MHA[node.target]} runs as one fused call ({name}) that stays fused: {why}"
    return AttentionSite(
        node=node,
        form="flex" if node.target is _FLEX else "fused",
        query=x,
        key=x if whole_layer else node.args[1],
        value=x if whole_layer else node.args[2],
        mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        source=source_of(node),
        blocker=blocker,
    )


def run(gm: fx.GraphModule) -> list[AttentionSite]:
    """Every attention site of the graph, in graph order."""
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            sites.append(_sdpa_site(node))
        elif node.op == "call_function" and (node.target in _FUSED_MHA or node.target is _FLEX):
            sites.append(_opaque_site(node))
        elif is_call(node, SOFTMAX_FUNCS, ("softmax",)):
            site = _manual_site(node)
            if site is not None:
                sites.append(site)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites.sort(key=lambda s: order[s.node])
    return sites
