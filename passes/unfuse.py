"""Open PyTorch's fused attention calls into projections + SDPA, so the ordinary passes can see them.

* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) holds the in- and out-projections. When
  it is self-attention with the ``is_causal`` hint, no key padding mask and no weights asked for,
  PyTorch itself drops the mask and runs ``scaled_dot_product_attention(is_causal=True)`` inside it;
  this pass writes exactly that into the graph (same projections, same head split).
* ``torch._transformer_encoder_layer_fwd`` (``nn.TransformerEncoderLayer``'s no-grad fast path) holds a
  whole layer. With an attention mask it is written out as the layer computes it (norms, attention with
  that mask through SDPA, feed-forward); the mask pass then decides whether the mask is causal.

Every other use stays fused, and :func:`why_not_opened` says why for the report.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .site import add_call as _add, shape_of

_MHA_PARAMS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
               "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
               "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
               "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
_DEFAULTS = dict(training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                 use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
                 static_k=None, static_v=None, average_attn_weights=True, is_causal=False)


def _bound(node: fx.Node, params: tuple, defaults: dict) -> dict:
    """The call's arguments by parameter name."""
    args = dict(defaults)
    args.update(zip(params, node.args))
    args.update(node.kwargs)
    return args


def _users_of_output(node: fx.Node):
    """(the getitem reading output 0 or None, whether anything else reads the call)."""
    out, other = None, False
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
            out = user
        elif user.users or not (user.op == "call_function" and user.target is operator.getitem):
            other = True
    return out, other


_LAYER_PARAMS = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "use_gelu",
                 "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2", "norm_bias_2", "ffn_weight_1",
                 "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask", "mask_type")


def _why_layer_not_opened(node: fx.Node) -> str:
    a = _bound(node, _LAYER_PARAMS, {})
    shape = shape_of(a.get("src"))
    checks = [
        (len(a) == len(_LAYER_PARAMS), "arguments not understood"),
        (a.get("mask") is not None, "no attention mask (bidirectional)"),
        (a.get("mask_type") in (0, 2), "a key padding mask"),
        (shape is not None and len(shape) == 3, "unbatched input"),
        (isinstance(a.get("num_heads"), int) and isinstance(a.get("embed_dim"), int)
         and a["embed_dim"] % a["num_heads"] == 0, "head count or width not constant"),
    ]
    return next((reason for ok, reason in checks if not ok), "")


def why_not_opened(node: fx.Node) -> str:
    """Why this fused call stays fused ("" when it can be opened)."""
    if node.target is torch._transformer_encoder_layer_fwd:
        return _why_layer_not_opened(node)
    if node.target is not F.multi_head_attention_forward:
        return f"{getattr(node.target, '__name__', node.target)} is not written out"
    a = _bound(node, _MHA_PARAMS, _DEFAULTS)
    shape = shape_of(a["query"])
    output, read_otherwise = _users_of_output(node)
    checks = [
        (a["query"] is a["key"] is a["value"], "not self-attention (query, key and value differ)"),
        (bool(a["is_causal"]), "no is_causal hint (a float or bool attn_mask alone is not read)"),
        (not a["need_weights"], "need_weights=True (the attention weights are returned)"),
        (a["key_padding_mask"] is None, "a key_padding_mask"),
        (a["bias_k"] is None and a["bias_v"] is None and not a["add_zero_attn"], "bias_k / bias_v / add_zero_attn"),
        (not a["use_separate_proj_weight"] and a["static_k"] is None and a["static_v"] is None,
         "separate projection weights or static keys"),
        (not a["training"] or a["dropout_p"] == 0.0, f"dropout p={a['dropout_p']} in training"),
        (shape is not None and len(shape) == 3, "unbatched input"),
        (isinstance(a["num_heads"], int) and isinstance(a["embed_dim_to_check"], int)
         and a["embed_dim_to_check"] % a["num_heads"] == 0, "head count or width not constant"),
        (output is not None and not read_otherwise, "its outputs are read other than as the attention output"),
        (a["in_proj_weight"] is not None, "no packed input projection"),
    ]
    failed = [reason for ok, reason in checks if not ok]
    return failed[0] if failed else ""


def _attention(graph, like, x, heads, width, qkv_weight, qkv_bias, out_weight, out_bias, seq_major, **sdpa_kwargs):
    """Packed projection → heads → SDPA → out projection, on ``x`` [T, B, E] (``seq_major``) or [B, T, E]."""
    to_heads, from_heads = ((1, 2, 0, 3), (2, 0, 1, 3)) if seq_major else ((0, 2, 1, 3), (0, 2, 1, 3))
    qkv = _add(graph, like, F.linear, x, qkv_weight, qkv_bias)
    parts = []
    for i in range(3):
        part = _add(graph, like, torch.narrow, qkv, -1, i * width, width)
        part = _add(graph, like, torch.unflatten, part, -1, (heads, width // heads))
        parts.append(_add(graph, like, torch.permute, part, to_heads))  # [B, H, T, D]
    attn = _add(graph, like, F.scaled_dot_product_attention, *parts, **sdpa_kwargs)
    attn = _add(graph, like, torch.permute, attn, from_heads)
    attn = _add(graph, like, torch.flatten, attn, 2)
    return _add(graph, like, F.linear, attn, out_weight, out_bias)


def _open_mha(graph: fx.Graph, node: fx.Node) -> None:
    a = _bound(node, _MHA_PARAMS, _DEFAULTS)
    out_item, _ = _users_of_output(node)
    with graph.inserting_before(node):
        # [T, B, E]: nn.MultiheadAttention transposes batch-first input before the call
        out = _attention(graph, node, a["query"], a["num_heads"], a["embed_dim_to_check"], a["in_proj_weight"],
                         a["in_proj_bias"], a["out_proj_weight"], a["out_proj_bias"], seq_major=True, is_causal=True)
    out_item.replace_all_uses_with(out)
    for user in list(node.users):
        graph.erase_node(user)
    graph.erase_node(node)


def _open_layer(graph: fx.Graph, node: fx.Node) -> None:
    """The encoder layer as its fused kernel computes it (batch-first, dropout off: it only runs in eval)."""
    a = _bound(node, _LAYER_PARAMS, {})
    width = a["embed_dim"]

    def norm(x, i):
        return _add(graph, node, F.layer_norm, x, (width,), a[f"norm_weight_{i}"], a[f"norm_bias_{i}"], a["eps"])

    with graph.inserting_before(node):
        src = a["src"]
        h = norm(src, 1) if a["norm_first"] else src
        x = _add(graph, node, torch.add, src, _attention(graph, node, h, a["num_heads"], width, a["qkv_weight"],
                                                          a["qkv_bias"], a["proj_weight"], a["proj_bias"],
                                                          seq_major=False, attn_mask=a["mask"]))
        if not a["norm_first"]:
            x = norm(x, 1)
        h = norm(x, 2) if a["norm_first"] else x
        h = _add(graph, node, F.linear, h, a["ffn_weight_1"], a["ffn_bias_1"])
        h = _add(graph, node, F.gelu if a["use_gelu"] else F.relu, h)
        x = _add(graph, node, torch.add, x, _add(graph, node, F.linear, h, a["ffn_weight_2"], a["ffn_bias_2"]))
        if not a["norm_first"]:
            x = norm(x, 2)
    node.replace_all_uses_with(x)
    graph.erase_node(node)


_OPENERS = {F.multi_head_attention_forward: _open_mha, torch._transformer_encoder_layer_fwd: _open_layer}


def run(gm: fx.GraphModule) -> int:
    """Open every fused call this pass can write out; returns how many were opened."""
    opened = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _OPENERS and not why_not_opened(node):
            _OPENERS[node.target](gm.graph, node)
            opened += 1
    if opened:
        gm.recompile()
    return opened
