"""Layer index of each site, for looking up its heads in the semantic config."""
from __future__ import annotations

import dataclasses
import re

from .site import AttentionSite

# nn_module_stack paths look like "L['self'].model.layers[3].self_attn" or "model.layers.3.self_attn"
_LAYER_INDEX = re.compile(r"(?:\[(\d+)\]|\.(\d+)(?=\.|$))")


def layer_from_module_stack(stack) -> int | None:
    """The last list index in the innermost module path, or None."""
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    found = _LAYER_INDEX.findall(path)
    if not found:
        return None
    bracket, dotted = found[-1]
    return int(bracket or dotted)


def run(sites: list[AttentionSite]) -> list[AttentionSite]:
    out = []
    for order, site in enumerate(sites):
        layer = layer_from_module_stack(site.node.meta.get("nn_module_stack"))
        if layer is None:
            out.append(dataclasses.replace(site, layer=order, layer_from="call order"))
        else:
            out.append(dataclasses.replace(site, layer=layer, layer_from="nn_module_stack"))
    return out
