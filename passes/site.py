"""What the passes learn about one attention call, one frozen record per site.

Each pass adds to a site with ``dataclasses.replace``; nothing is stashed in
``node.meta``.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from enum import Enum
from typing import Callable, Optional, Union

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.fx.experimental.symbolic_shapes import statically_known_true

# An offset into positions: an int, or an fx node holding a SymInt (past length)
Offset = Union[int, fx.Node]


def shape_of(node) -> Optional[tuple]:
    """The traced shape of ``node`` (from Dynamo's example value), or None when it is not a tensor node."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if value is not None and hasattr(value, "shape") else None


_META_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack")


def add_call(graph: fx.Graph, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """A call node with ``like``'s module path and source, and its fake value (the passes read shapes): for
    passes that write nodes into the graph before ``find`` reads it."""
    return _traced(graph.call_function(target, args, kwargs), like)


def add_call_like(graph: fx.Graph, like: fx.Node, args: tuple, kwargs: dict, target=None) -> fx.Node:
    """A call of ``like``'s function or tensor method (or ``target``, of the same kind) on other arguments, with
    its meta and fake value."""
    return _traced(graph.create_node(like.op, target or like.target, args, kwargs), like)


def _traced(node: fx.Node, like: fx.Node) -> fx.Node:
    for key in _META_KEYS:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    arg_values, kwarg_values = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
    modes = []
    fx.node.map_aggregate((arg_values, kwarg_values), lambda v: modes.append(v.fake_mode) if isinstance(v, FakeTensor) else v)
    # the graph's own fake mode (the one its example values live in), not whatever tracing context is active;
    # the Python dispatcher lets ops on symbolic sizes keep them symbolic (without it every size would be guarded
    # to its traced value, and each new prompt length would compile again)
    with modes[0], enable_python_dispatcher():
        if node.op == "call_method":
            node.meta["example_value"] = getattr(arg_values[0], node.target)(*arg_values[1:], **kwarg_values)
        else:
            node.meta["example_value"] = node.target(*arg_values, **kwarg_values)
    return node


def memory_order(value: torch.Tensor) -> Optional[tuple]:
    """The dims of ``value`` from outermost to innermost in memory when that is not the logical order (SDPA on
    transposed [B, S, H, D] inputs returns its output in that memory order), else None. Candidates are compared
    with ``statically_known_true`` so symbolic strides add no guard; a size-1 dim's stride is free. None too for
    strides no permutation of a dense tensor gives."""
    shape, strides = value.shape, value.stride()
    for order in itertools.permutations(range(value.dim())):
        if order == tuple(range(value.dim())):
            continue
        expected, step = [None] * value.dim(), 1
        for dim in reversed(order):
            expected[dim], step = step, step * shape[dim]
        if all(statically_known_true(shape[d] == 1) or statically_known_true(strides[d] == expected[d])
               for d in range(value.dim())):
            return order
    return None


def in_memory_order(graph: fx.Graph, like: fx.Node, x: fx.Node, order: Optional[tuple]) -> fx.Node:
    """A copy of ``x`` laid out in ``order`` (:func:`memory_order`; None: contiguous), of the same shape."""
    if order is None:
        return add_call(graph, like, torch.Tensor.contiguous, x)
    physical = add_call(graph, like, torch.Tensor.contiguous, add_call(graph, like, torch.permute, x, order))
    return add_call(graph, like, torch.permute, physical, tuple(sorted(range(len(order)), key=order.__getitem__)))


def dtype_of(node) -> Optional[torch.dtype]:
    """The traced dtype of ``node``, or None when it is not a tensor node."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return getattr(value, "dtype", None)


def is_lifted_scalar(x) -> bool:
    """A float Dynamo lifted to a graph input (``dynamic=True`` with a cache reads ``self.scaling`` through
    ``.item()``): a node holding a SymFloat, which the op takes as its scale, so one graph serves any value."""
    return isinstance(x, fx.Node) and isinstance(x.meta.get("example_value"), (float, torch.SymFloat))


_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
"""Python's statements that write into their first operand when it is a tensor (``x[i] = y``, ``x += y``)."""
CASTS = ("to", "type", "type_as", "float", "half", "bfloat16", "double")
"""Tensor methods that convert a dtype (``bool`` besides, for masks)."""
# Python builtins Dynamo puts in graphs that never write a tensor
_READ_ONLY_BUILTINS = {getattr, len, isinstance, operator.getitem, *(getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "and_", "or_", "xor", "invert",
    "lshift", "rshift", "eq", "ne", "lt", "le", "gt", "ge", "not_", "matmul"))}

UNKNOWN = None
"""What :func:`written_args` returns when torch cannot say what an op writes: every tensor argument may be."""


def _storages(node) -> Optional[set]:
    """The storages ``node``'s traced value lives in (a tuple of tensors: each one's); an empty set for a value
    that is no tensor (a size, a number); None when the node carries no traced value (unknown)."""
    if not isinstance(node, fx.Node):
        return set()
    if "example_value" not in node.meta:
        return None
    values, found = node.meta["example_value"], set()
    for value in (values if isinstance(values, (tuple, list)) else (values,)):
        if isinstance(value, torch.Tensor):
            found.add(StorageWeakRef(value.untyped_storage()))
    return found


def may_share_memory(a, b) -> bool:
    """Whether the tensors of ``a`` and ``b`` may share memory, as torch computed them while tracing: Dynamo runs
    every op on fake tensors, whose views share their base's (fake) storage, so ``x.mT``, ``x.view(...)`` or a
    cast to ``x``'s own dtype share ``x``'s. A node with no traced value may share anything."""
    storages_a, storages_b = _storages(a), _storages(b)
    if storages_a == set() or storages_b == set():
        return False
    if storages_a is None or storages_b is None:
        return True
    return bool(storages_a & storages_b)


def is_view_of_input(node: fx.Node) -> bool:
    """Whether ``node``'s value may share memory with one of its arguments (a view, a no-op cast)."""
    return any(may_share_memory(node, a) for a in node.all_input_nodes)


@functools.lru_cache(maxsize=None)
def _aten_schemas(name: str) -> list:
    packet = getattr(torch.ops.aten, name, None) if name else None
    if packet is None or not hasattr(packet, "overloads"):
        return []
    return [getattr(packet, overload)._schema for overload in packet.overloads()]


def _op_name(node: fx.Node) -> str:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", "")


def written_args(node: fx.Node):
    """The argument nodes ``node`` writes into, decided by torch: the aten schema of the op (an argument marked
    ``Tensor(a!)``), its ``out=``, an ``inplace=True`` of a functional, Python's in-place statements. A tensor
    method with no aten op of its name follows torch's naming rule (a trailing ``_`` writes ``self``). Returns
    :data:`UNKNOWN` for a function torch has no schema for."""
    if node.op not in ("call_function", "call_method"):
        return []
    written = [node.kwargs["out"]] if isinstance(node.kwargs.get("out"), fx.Node) else []
    if node.target in _IN_PLACE_OPERATORS:
        return written + list(node.args[:1])
    if node.op == "call_function" and node.target in _READ_ONLY_BUILTINS:
        return written
    if node.kwargs.get("inplace") is True:
        return written + list(node.args[:1])
    name = _op_name(node)
    if isinstance(node.target, torch._ops.OpOverload):
        schemas = [node.target._schema]
    elif isinstance(node.target, torch._ops.OpOverloadPacket):
        schemas = [getattr(node.target, overload)._schema for overload in node.target.overloads()]
    else:
        schemas = _aten_schemas(name)
    if not schemas:
        if node.op == "call_method":
            return written + (list(node.args[:1]) if name.endswith("_") and not name.endswith("__") else [])
        return written if written or not node.all_input_nodes else UNKNOWN
    for schema in schemas:
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            if argument.name in node.kwargs:
                written.append(node.kwargs[argument.name])
            elif not argument.kwarg_only and position < len(node.args):
                written.append(node.args[position])
    return [w for w in written if isinstance(w, fx.Node)]


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes into any of its arguments (or may: :data:`UNKNOWN` counts)."""
    written = written_args(node)
    return written is UNKNOWN or bool(written)


def writes_into(node: fx.Node, tensors) -> bool:
    """Whether ``node`` may write into the memory of any of ``tensors``."""
    written = written_args(node)
    if written is UNKNOWN:
        written = node.all_input_nodes
    return any(may_share_memory(w, t) for w in written for t in tensors)


def is_mT(node) -> bool:
    """Whether ``node`` is ``x.mT``: a ``getattr`` call on one torch release, ``torch.ops.aten.mT`` on another."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
        return False
    if node.target is getattr:
        return tuple(node.args[1:]) == ("mT",)
    return node.target in (torch.ops.aten.mT, torch.ops.aten.mT.default)


def is_call(node, funcs=(), methods=()) -> bool:
    """Whether ``node`` calls one of the torch functions ``funcs`` or the tensor methods ``methods``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target in funcs:
        return True
    return node.op == "call_method" and node.target in methods


def written_between(tensors, start: fx.Node, end: fx.Node) -> bool:
    """Whether a node after ``start`` and before ``end`` may write into the memory of any of ``tensors``."""
    node = start.next
    while node is not end and node.op != "root":
        if writes_into(node, tensors):
            return True
        node = node.next
    return False


def writers(graph: fx.Graph) -> list:
    """(node, the argument nodes it may write into) for every node of ``graph`` that may write into one."""
    found = []
    for node in graph.nodes:
        written = written_args(node)
        if written is UNKNOWN:
            found.append((node, node.all_input_nodes))
        elif written:
            found.append((node, written))
    return found


def call_arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``name`` of a call node, given by keyword or at position ``index``."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


class MaskKind(str, Enum):
    CAUSAL = "causal"
    CAUSAL_PADDING = "causal+padding"
    SLIDING_WINDOW = "sliding_window"
    PACKED = "packed_documents"
    NONE = "none"  # no mask and not causal: bidirectional attention
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class MaskInfo:
    """The meaning of an attention site's mask, if the pass understood it."""

    kind: MaskKind
    q_offset: Offset = 0
    """position of query row 0 (key 0 at ``k_offset``); the op's query offset is ``q_offset - k_offset``"""
    k_offset: Offset = 0
    """position of key 0: a sliding cache holds keys from ``max(past - window + 1, 0)`` on"""
    window: int = 0
    """sliding-window size (0: none)"""
    key_mask: Optional[fx.Node] = None
    """bool [B, L] node: which keys are real (padding); key j's entry is at ``key_mask_start + j``"""
    key_mask_start: Offset = 0
    doc_ids: Optional[fx.Node] = None
    """int [B, L] node: packed-sequence id per position; key j's at ``doc_ids_start + j``"""
    doc_ids_start: Offset = 0
    q_at_last_key: bool = False
    """one query row that reads every key, as a decode step without a mask does: it sits at the last key, so the
    op's query offset is ``Skv - 1`` whatever the cache holds (``q_offset`` and ``k_offset`` are unused)"""
    reason: str = ""
    """why the mask is unknown"""

    def describe(self) -> str:
        parts = [f"{self.kind.value}({self.window})" if self.window else self.kind.value]
        if self.key_mask is not None and self.kind != MaskKind.CAUSAL_PADDING:
            parts.append("padding")
        if self.doc_ids is not None and self.kind != MaskKind.PACKED:
            parts.append("packed")
        if self.q_at_last_key:
            parts.append("q_offset=last key")
        for name in ("q_offset", "k_offset"):
            offset = getattr(self, name)
            if not (isinstance(offset, int) and offset == 0):
                parts.append(f"{name}={offset}")
        return "+".join(parts)


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    """One attention call found in a Dynamo graph."""

    node: fx.Node
    """the node whose output is the attention output (SDPA, or the final matmul of a manual chain)"""
    form: str
    """"sdpa", "manual" (matmul → softmax → matmul as HF eager emits it); never rewritten: "fused" (a torch
    module's fused attention call) or "flex" (FlexAttention)"""
    query: fx.Node
    key: fx.Node
    value: fx.Node
    mask: Optional[fx.Node]
    """the attn_mask argument as written (bool or additive float), or None"""
    is_causal: bool
    dropout_p: float
    scale: Optional[float]
    """a number, or a node holding a SymFloat (:func:`is_lifted_scalar`); None: SDPA's default"""
    enable_gqa: bool = False
    source: str = ""
    """where in the user's source the call is (file:line)"""
    chain: tuple = ()
    """nodes of a manual chain that die with the rewrite"""
    mask_info: Optional[MaskInfo] = None
    gqa_from: Optional[str] = None
    """"repeat_kv" or "enable_gqa" when K/V were looked through to fewer heads"""
    layer: Optional[int] = None
    layer_from: str = ""
    shapes: str = ""
    blocker: str = ""
    """non-empty: why the site must stay dense (first reason found)"""
    scale_divides: bool = False
    """the lifted ``scale`` divides the scores (``/ math.sqrt(q.shape[-1])`` under ``dynamic=True``): the op's
    scale is its reciprocal"""
    mask_fills: bool = False
    """the mask marks the scores filled with -inf (``masked_fill``): True where a key may NOT be read"""
    mask_selects: bool = False
    """the mask marks the scores kept (``torch.where(mask, scores, -inf)``): True where a key may be read"""

    def blocked(self, reason: Optional[str]) -> "AttentionSite":
        """This site, kept dense for ``reason`` unless an earlier reason holds it already (None: unchanged)."""
        return self if self.blocker or not reason else dataclasses.replace(self, blocker=reason)


Check = Callable[..., Optional[str]]
"""A check: why its arguments (a site, a matched chain) rule a rewrite out, or None when they do not."""


def first_reason(checks: "tuple[Check, ...]", *args) -> Optional[str]:
    """The reason of the first of ``checks`` that fails on ``args``, or None when all pass; the later ones are not
    run (one may read what an earlier one checked)."""
    return next((reason for check in checks if (reason := check(*args))), None)
