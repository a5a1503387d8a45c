"""Open ``nn.MultiheadAttention``'s fused call into projections + SDPA, where it is causal self-attention.

Dynamo keeps ``F.multi_head_attention_forward`` as one call that holds the in- and out-projections, so
no attention is visible in the graph. When the call is self-attention with the ``is_causal`` hint, no
key padding mask and no weights asked for, PyTorch itself drops the mask and runs
``scaled_dot_product_attention(is_causal=True)`` inside it; this pass writes exactly that into the
graph (same projections, same head split), so the ordinary passes find and rewrite it. Every other
use stays fused, and :func:`why_not_opened` says why for the report.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

_MHA_PARAMS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
               "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
               "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
               "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
_DEFAULTS = dict(training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                 use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
                 static_k=None, static_v=None, average_attn_weights=True, is_causal=False)
_META_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack")


def _bound(node: fx.Node) -> dict:
    args = dict(_DEFAULTS)
    args.update(zip(_MHA_PARAMS, node.args))
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


def why_not_opened(node: fx.Node) -> str:
    """Why this ``F.multi_head_attention_forward`` call stays fused ("" when it can be opened)."""
    a = _bound(node)
    shape = getattr(getattr(a["query"], "meta", {}).get("example_value"), "shape", None)
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


def _add(graph: fx.Graph, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """A call node with ``like``'s module path and source, and its fake value (the passes read shapes)."""
    node = graph.call_function(target, args, kwargs)
    for key in _META_KEYS:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    arg_values, kwarg_values = fx.node.map_arg((args, kwargs), lambda n: n.meta["example_value"])
    modes = []
    fx.node.map_aggregate((arg_values, kwarg_values), lambda v: modes.append(v.fake_mode) if isinstance(v, FakeTensor) else v)
    # the graph's own fake mode (the one its example values live in), not whatever tracing context is active
    with modes[0]:
        node.meta["example_value"] = target(*arg_values, **kwarg_values)
    return node


def _open(graph: fx.Graph, node: fx.Node) -> None:
    a = _bound(node)
    heads, width = a["num_heads"], a["embed_dim_to_check"]
    head_dim = width // heads
    out_item, _ = _users_of_output(node)
    with graph.inserting_before(node):
        # [T, B, E] (nn.MultiheadAttention transposes batch-first input before the call)
        qkv = _add(graph, node, F.linear, a["query"], a["in_proj_weight"], a["in_proj_bias"])
        parts = []
        for i in range(3):
            part = _add(graph, node, torch.narrow, qkv, -1, i * width, width)
            part = _add(graph, node, torch.unflatten, part, -1, (heads, head_dim))  # [T, B, H, D]
            parts.append(_add(graph, node, torch.permute, part, (1, 2, 0, 3)))  # [B, H, T, D]
        attn = _add(graph, node, F.scaled_dot_product_attention, *parts, is_causal=True)
        attn = _add(graph, node, torch.permute, attn, (2, 0, 1, 3))  # [T, B, H, D]
        attn = _add(graph, node, torch.flatten, attn, 2)
        out = _add(graph, node, F.linear, attn, a["out_proj_weight"], a["out_proj_bias"])
    out_item.replace_all_uses_with(out)
    for user in list(node.users):
        graph.erase_node(user)
    graph.erase_node(node)


def run(gm: fx.GraphModule) -> int:
    """Open every fused MHA call that is causal self-attention; returns how many were opened."""
    opened = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.multi_head_attention_forward and not why_not_opened(node):
            _open(gm.graph, node)
            opened += 1
    if opened:
        gm.recompile()
    return opened
