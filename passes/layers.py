"""Layer index of each site, for looking up its heads in the semantic config.

A site's layer is the list index in the path of the module it runs in (``model.layers.3.self_attn``: 3). That
path is not guessed from how one Dynamo release spells sources (``L['self'].model.layers[3]`` on one,
``L['args'][0].model.layers.3`` on another). The graph's parameter and buffer inputs carry structured sources
(``AttrSource(UnspecializedNNModuleSource(DictGetItemSource(... '_modules' ..., '3')))``) that name, component
by component, every module owning one. Their root module's own rendering is cut off the front of the site's
``nn_module_stack`` path, and what remains must then be one of those modules, or lie inside one (a module with
no parameters of its own, inside a layer that has some). A path that does not check out gives no layer: the
site is numbered by call order, and a config is refused for such a graph (``backend.check_config_fits``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch.fx as fx

from .site import AttentionSite

AMBIGUOUS = "nn_module_stack, several list indices"
"""``layer_from`` of a site whose module path holds more than one list index (``stages[i].blocks[j]``, or two
attentions of one layer, ``layers[i].attns[k]``): which is the config's layer is not known, so a config is
refused for it (``backend.check_config_fits``) rather than applied by a guess."""

FROM_MODULE = "module path"
CALL_ORDER = "call order"

# one component of a module path after the root: .name, .3, [3] or ['name']
_COMPONENT = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']*)'\]")


@dataclasses.dataclass(frozen=True)
class ModuleTree:
    """The modules a graph's inputs come from: the root's rendering in source strings, and each module's path."""

    root: str
    paths: frozenset
    """tuples of path components, as ``named_modules`` names them (("model", "layers", "3", "self_attn"))"""

    def path_of(self, stack_path: str) -> Optional[tuple]:
        """The components of ``stack_path`` (an ``nn_module_stack`` entry) when they name a module of this tree
        or one inside such a module; else None."""
        if not stack_path.startswith(self.root):
            return None
        rest = stack_path[len(self.root):]
        parts = [m.group(1) or m.group(2) or m.group(3) for m in _COMPONENT.finditer(rest)]
        if "".join(m.group(0) for m in _COMPONENT.finditer(rest)) != rest:
            return None  # something in it that is not a module path component
        path = tuple(parts)
        if any(path[:i] in self.paths for i in range(len(path), 0, -1)):
            return path
        return None


def _source_of(node: fx.Node):
    source = getattr(node, "_dynamo_source", None)
    if source is None and "grapharg" in node.meta:
        source = getattr(node.meta["grapharg"], "source", None)
    return source


def _is_module_source(source) -> bool:
    return any(cls.__name__ == "NNModuleSource" for cls in type(source).__mro__)


def _name(source) -> str:
    name = source.name
    return name if isinstance(name, str) else name()


def _module_chain(source) -> list:
    """(module source, path) from the root module to the innermost module in ``source``'s chain."""
    links = []  # innermost first: every source down to the root
    while source is not None:
        links.append(source)
        source = getattr(source, "base", None)
    chain, path, pending = [], (), []
    for link in reversed(links):
        if _is_module_source(link):
            if chain:
                path = path + tuple(pending)
            chain.append((link, path))
            pending = []
        elif chain:
            key = getattr(link, "member", None)
            if key is None:
                key = getattr(link, "index", None)
            if key is not None and key != "_modules":
                pending.append(str(key))
    return chain


def module_tree(gm: fx.GraphModule) -> Optional[ModuleTree]:
    """The modules behind ``gm``'s inputs, or None when no input comes from a module (a compiled function)."""
    roots, paths = set(), set()
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = _source_of(node)
        chain = _module_chain(source) if source is not None else []
        if not chain:
            continue
        roots.add(_name(chain[0][0]))
        paths.update(path for _, path in chain)
    if len(roots) != 1:
        return None  # modules from two roots (two models as inputs): paths relative to which is not known
    return ModuleTree(roots.pop(), frozenset(paths))


def module_path(stack) -> str:
    """The innermost module path of an ``nn_module_stack``, or "" without one."""
    return list(stack.values())[-1][0] if stack else ""


def run(sites: list[AttentionSite], tree: Optional[ModuleTree]) -> list[AttentionSite]:
    out = []
    for order, site in enumerate(sites):
        stack = site.node.meta.get("nn_module_stack")
        path = tree.path_of(module_path(stack)) if tree is not None and stack else None
        indices = [int(part) for part in path if part.isdigit()] if path else []
        if not indices:
            out.append(dataclasses.replace(site, layer=order, layer_from=CALL_ORDER))
        else:
            out.append(dataclasses.replace(site, layer=indices[-1],
                                           layer_from=AMBIGUOUS if len(indices) > 1 else FROM_MODULE))
    return out


def parameter_path(node: fx.Node) -> Optional[tuple]:
    """The path of a parameter or buffer input as ``named_parameters`` spells it, split at the dots
    (("model", "layers", "0", "self_attn", "q_proj", "weight")), from its source; None for another input."""
    source = _source_of(node)
    chain = _module_chain(source) if source is not None else []
    key = getattr(source, "member", None) or getattr(source, "index", None)
    if not chain or key is None:
        return None
    return chain[-1][1] + (str(key),)
