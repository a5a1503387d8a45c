"""Look through ``repeat_kv`` to the original K/V, so the op reads Hkv heads.

HF under compile always repeats K/V (its SDPA GQA flag needs ``attn_mask is
None``, and the mask is always materialised)::

    k[:, :, None, :, :].expand(B, Hkv, n_rep, S, D).reshape(B, Hkv * n_rep, S, D)
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from .site import AttentionSite, call_arg, shape_of, written_between


def unrepeat(node: fx.Node) -> fx.Node | None:
    """The [B, Hkv, S, D] tensor that ``node`` repeats, or None if it is not repeat_kv."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    unsqueezed = expand.args[0]
    source = None
    if isinstance(unsqueezed, fx.Node) and unsqueezed.op == "call_function" and unsqueezed.target is operator.getitem:
        index = unsqueezed.args[1]
        if isinstance(index, tuple) and len(index) == 5 and index[2] is None and all(
            i == slice(None) for j, i in enumerate(index) if j != 2
        ):
            source = unsqueezed.args[0]
    elif isinstance(unsqueezed, fx.Node) and unsqueezed.op == "call_method" and unsqueezed.target == "unsqueeze":
        if call_arg(unsqueezed, 1, "dim") == 2:
            source = unsqueezed.args[0]
    src_shape, out_shape, exp_shape = shape_of(source), shape_of(node), shape_of(expand)
    if source is None or src_shape is None or out_shape is None or exp_shape is None or len(src_shape) != 4:
        return None
    b, hkv, s, d = src_shape
    if len(exp_shape) != 5 or exp_shape[:2] != (b, hkv) or exp_shape[3:] != (s, d):
        return None
    if out_shape != (b, hkv * exp_shape[2], s, d):
        return None
    return source


def run(sites: list[AttentionSite]) -> list[AttentionSite]:
    out = []
    for site in sites:
        if site.blocker:
            out.append(site)
            continue
        k_src, v_src = unrepeat(site.key), unrepeat(site.value)
        # the op reads the sources where the attention was: a write into a source or a repeated copy after the
        # copy was made would reach one side only (eager reads the copies as they were made)
        if (k_src is not None and v_src is not None and shape_of(k_src)[:3] == shape_of(v_src)[:3]
                and not any(written_between((src, copy), copy, site.node)
                            for src, copy in ((k_src, site.key), (v_src, site.value)))):
            site = dataclasses.replace(site, key=k_src, value=v_src, gqa_from="repeat_kv")
        elif site.enable_gqa:
            site = dataclasses.replace(site, gqa_from="enable_gqa")
        out.append(site)
    return out
