"""Layer index of each site, for looking up its heads in the semantic config."""
from __future__ import annotations

import dataclasses
import re

from .site import AttentionSite

# nn_module_stack paths look like "L['self'].model.layers[3].self_attn" or "model.layers.3.self_attn"
_LAYER_INDEX = re.compile(r"(?:\[(\d+)\]|\.(\d+)(?=\.|$))")


AMBIGUOUS = "nn_module_stack, several list indices"
"""``layer_from`` of a site whose module path holds more than one list index (``stages[i].blocks[j]``, or two
attentions of one layer, ``layers[i].attns[k]``): which is the config's layer is not known, so a config is
refused for it (``backend.check_config_fits``) rather than applied by a guess."""


def module_path(stack) -> str:
    """The innermost module path of an ``nn_module_stack``, or "" without one."""
    return list(stack.values())[-1][0] if stack else ""


def _indices(stack) -> list[int]:
    return [int(bracket or dotted) for bracket, dotted in _LAYER_INDEX.findall(module_path(stack))]


def layer_from_module_stack(stack) -> int | None:
    """The last list index in the innermost module path, or None."""
    found = _indices(stack)
    return found[-1] if found else None


def run(sites: list[AttentionSite]) -> list[AttentionSite]:
    out = []
    for order, site in enumerate(sites):
        found = _indices(site.node.meta.get("nn_module_stack"))
        if not found:
            out.append(dataclasses.replace(site, layer=order, layer_from="call order"))
        else:
            out.append(dataclasses.replace(site, layer=found[-1],
                                           layer_from=AMBIGUOUS if len(found) > 1 else "nn_module_stack"))
    return out
