"""What an attention mask means, by evaluating its construction symbolically.

HF transformers never passes ``is_causal=True`` under ``torch.compile``: it
builds a ``[B, 1, Q, KV]`` bool mask in the graph from index ranges::

    q_idx  = (arange(Q) + past)[None, None, :, None]
    kv_idx = arange(KV)[None, None, None, :]
    mask   = ones(()) & (kv_idx <= q_idx) [& (kv_idx > q_idx - window)]
                      [& padding[b, kv_idx]] [& packed[b, q_idx] == packed[b, kv_idx]]
    mask   = mask.expand(B, -1, Q, KV)          # eager: where(mask, 0, finfo.min)

Rather than match that text, each node is evaluated to a small abstract value
(an index along an axis, a gather from a tensor, a conjunction of predicates)
so reordered or re-spelled constructions still resolve, and anything outside
this vocabulary becomes ``_Unknown`` with the reason, which leaves the site
dense. The packed-sequence term built from ``position_ids = arange + c`` is
proved all-true here (its diff is 1 everywhere), so ordinary prompts keep the
plain causal fast path.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import mask_values
from .site import CASTS, AttentionSite, MaskInfo, MaskKind, call_arg, dtype_of, may_share_memory, shape_of, writers

# An offset is (fx node holding a SymInt or None, int constant)
_Off = tuple


@dataclasses.dataclass(frozen=True)
class _Const:
    value: Any


@dataclasses.dataclass(frozen=True)
class _Range:
    """index along the last dim + offset (an arange, possibly unsqueezed / expanded in front)"""

    offset: _Off


@dataclasses.dataclass(frozen=True)
class _Axis:
    """4-D index broadcast along dim (0 batch, 2 query, 3 key) + offset"""

    dim: int
    offset: _Off


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """a tensor the pass does not interpret (a model input, a cumsum of one, ...)"""

    node: fx.Node
    root: Optional[fx.Node] = None
    """the input or buffer it was computed from (for the report), when not ``node`` itself"""

    def derived(self, n: fx.Node) -> "_Tensor":
        """``n``, computed from this tensor: still not interpreted, and the op reads ``n``, not this."""
        return _Tensor(n, self.root or self.node)


@dataclasses.dataclass(frozen=True)
class _Gather:
    """source[b, index along dim + offset]"""

    source: fx.Node
    dim: int
    offset: _Off


class _Term:
    """One predicate over (b, q, kv) of a :class:`_Mask`, on positions: query row i at ``i + q_off``, key j at
    ``j + k_off`` (offsets as :data:`_Off`)."""

    axes: frozenset = frozenset()
    """the axes (counted from the right: -1 key, -2 query, -4 batch) its truth varies along"""

    def complement(self) -> Optional["_Term"]:
        """The predicate true where this one is false, when it is one predicate."""
        return None


@dataclasses.dataclass(frozen=True)
class Causal(_Term):
    """``kv_pos <= q_pos``: no key after the query"""

    q_off: _Off
    k_off: _Off
    axes = frozenset({-2, -1})

    def complement(self) -> "WindowStart":
        return WindowStart(self.q_off, self.k_off)


@dataclasses.dataclass(frozen=True)
class WindowStart(_Term):
    """``kv_pos > q_pos``: keys past a bound that moves with the query (a sliding window's first key lies past
    ``q_pos - window``)"""

    q_off: _Off
    k_off: _Off
    axes = frozenset({-2, -1})

    def complement(self) -> Causal:
        return Causal(self.q_off, self.k_off)


@dataclasses.dataclass(frozen=True)
class KeyValid(_Term):
    """``source[b, j + offset]``: a [B, S] padding table read at the key"""

    source: fx.Node
    offset: _Off
    axes = frozenset({-4, -1})


@dataclasses.dataclass(frozen=True)
class SameDocument(_Term):
    """``source[b, i + q_off] == source[b, j + k_off]``: a [B, S] packed-sequence id table, the same at both"""

    source: fx.Node
    q_off: _Off
    k_off: _Off
    axes = frozenset({-4, -2, -1})


@dataclasses.dataclass(frozen=True)
class PositionOrder(_Term):
    """``source[b, j + k_off] <= source[b, i + q_off]``: position ids gathered at the key and at the query, compared
    (transformers 5.24). Causal only where the ids step by one between the two, which a :class:`SameDocument`
    term over the runs of the same ids ensures (:func:`_positions_within_runs`); alone it is not read."""

    source: fx.Node
    q_off: _Off
    k_off: _Off
    axes = frozenset({-4, -2, -1})


_TERMS = {"le": Causal, "gt": WindowStart}
"""The comparison of a key position with a query position that each term reads."""


@dataclasses.dataclass(frozen=True)
class _Mask:
    """conjunction of predicates (:class:`_Term`) over (b, q, kv)"""

    preds: frozenset


@dataclasses.dataclass(frozen=True)
class _Additive:
    """a float mask: 0 where the bool mask holds, a huge negative elsewhere"""

    mask: Any


@dataclasses.dataclass(frozen=True)
class _Unknown:
    reason: str


_TRUE = _Const(True)
_ZERO = (None, 0)
_COMPARE = {
    operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt",
    operator.eq: "eq", operator.ne: "ne", torch.le: "le", torch.lt: "lt", torch.ge: "ge",
    torch.gt: "gt", torch.eq: "eq", torch.ne: "ne",
    "le": "le", "lt": "lt", "ge": "ge", "gt": "gt", "eq": "eq", "ne": "ne",
    "__le__": "le", "__lt__": "lt", "__ge__": "ge", "__gt__": "gt", "__eq__": "eq", "__ne__": "ne",
}
_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt", "eq": "eq", "ne": "ne"}
_AND = {operator.and_, torch.logical_and, torch.bitwise_and, "__and__", "logical_and", "bitwise_and", "__rand__"}
_ADD = {operator.add, torch.add, "add", "__add__", "__radd__"}
_SUB = {operator.sub, torch.sub, "sub", "__sub__"}
_IDENTITY_METHODS = {"contiguous", "clone"}
_CONVERSIONS = {*CASTS, "bool"}
_POSITION_DTYPES = (torch.int32, torch.int64)  # narrower integers wrap within a long prompt's positions
_AXIS_NAMES = {-1: "key", -2: "query", -3: "head", -4: "batch"}
_NOT = {torch.logical_not, torch.bitwise_not, operator.invert, "logical_not", "bitwise_not", "__invert__"}
_TRIANGLE = {torch.triu: "triu", torch.tril: "tril", "triu": "triu", "tril": "tril"}
_CONCAT = {torch.cat, torch.concat, torch.concatenate, torch.hstack}
_HUGE_NEGATIVE = -1e4


def _is_symbolic_scalar(x) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("example_value"), (int, torch.SymInt))


def _shift(off: _Off, delta) -> Optional[_Off]:
    base, const = off
    if isinstance(delta, int) and not isinstance(delta, bool):
        return (base, const + delta)
    if _is_symbolic_scalar(delta) and base is None:
        return (delta, const)
    return None


class _Evaluator:
    def __init__(self, writes: list):
        self.memo: dict[fx.Node, Any] = {}
        self.writes = writes
        """(node, what it may write into) for the graph's writing nodes (:func:`site.writers`)"""
        self.table_of: dict[fx.Node, fx.Node] = {}
        """a node holding the same rows as a [B, S] table (its expansion along the batch) -> that table"""
        self.steps_of: dict[fx.Node, tuple] = {}
        """``diff(table, dim=-1)`` -> ("diff", table); ``that != 1`` -> ("breaks", table); its cumsum along the
        positions -> ("runs", table): ids equal exactly within a run of positions that step by one"""

    def _mutated(self, n: fx.Node) -> bool:
        """Whether some node writes into ``n``'s memory: an in-place op (or an ``out=``) on it or on any view
        of it, or on what it is a view of, as torch's fake tensors share storage."""
        return any(writer is not n and may_share_memory(w, n) for writer, written in self.writes for w in written)

    def value(self, x):
        if isinstance(x, fx.Node):
            if x not in self.memo:
                v = self._eval(x)
                self.memo[x] = v if isinstance(v, _Unknown) else self._checked(x, v)
            return self.memo[x]
        if isinstance(x, (bool, int, float)):
            return _Const(x)
        return _Unknown(f"argument {x!r}")

    def _eval(self, n: fx.Node):
        target = n.target
        if n.op in ("placeholder", "get_attr"):
            return _Tensor(n)
        if n.op not in ("call_function", "call_method"):
            return _Unknown(f"{n.op} {n.name}")
        args = n.args
        if target is torch.arange:
            return self._arange(n)
        if target in ("new_ones", torch.ones) or target is torch.ones_like:
            return _TRUE if dtype_of(n) is torch.bool else _Const(1)
        if target in ("new_zeros", torch.zeros) or target is torch.zeros_like:
            return _Const(False) if dtype_of(n) is torch.bool else _Const(0)
        if target is torch.tensor and args and isinstance(args[0], (int, float)):
            return _Const(args[0])
        if target is torch.full and len(args) > 1 and isinstance(args[1], (bool, int, float)):
            return _Const(args[1])
        if target in _TRIANGLE:
            return self._triangle(n, _TRIANGLE[target])
        if target in _NOT:
            return _complement(self.value(args[0]), n)
        if target in _CONVERSIONS:
            return self._convert(n)
        if target in _IDENTITY_METHODS or target in ("expand", "expand_as", "unsqueeze", "view", "reshape"):
            return self._passthrough(n)
        if target in _ADD or target in _SUB:
            return self._add(n, negate=target in _SUB)
        if target in _COMPARE:
            return self._compare(_COMPARE[target], self.value(args[0]), self.value(args[1]), args, n)
        if target in _AND:
            return self._and(self.value(args[0]), self.value(args[1]))
        if target is operator.getitem:
            return self._getitem(n)
        if target is torch.diff:
            return self._diff(n)
        if target in ("cumsum", torch.cumsum):
            src = self.value(args[0])
            if isinstance(src, _Const) and not src.value:
                return _Const(0)
            kind, table = self.steps_of.get(args[0], (None, None))
            if kind == "breaks" and _last_axis(n.args[0], call_arg(n, 1, "dim")):
                self.steps_of[n] = ("runs", table)
            return _Tensor(n)
        if target is torch.where:
            return self._where(n)
        if target in (torch.masked_fill, "masked_fill"):
            return self._masked_fill(n)
        if target in _CONCAT:
            return self._key_prefix(n)
        return _Unknown(f"{getattr(target, '__name__', target)} at {n.name}")

    def _checked(self, n: fx.Node, v):
        """``v`` unless the tensor it describes is written in place later (the rewrite would miss the write), or
        ``n`` broadcasts an operand along an axis the operand's value varies on (``causal[..., :1, :] & m`` would
        repeat one query row's mask): the abstract values record what an entry depends on, not extents."""
        if self._mutated(n):
            return _Unknown(f"{n.name} is modified in place")
        if n.target == "unsqueeze" and isinstance(v, _Axis) and isinstance(self.memo.get(n.args[0]), _Range):
            return v  # a 1-D range stood up as [S, 1]: its axis moved, it was not broadcast (see _passthrough)
        if n.target is operator.getitem:
            operands = _index_nodes(n.args[1])  # a gather broadcasts its indices; a slice keeps positions
        elif _broadcasts(n.target):
            operands = _tensor_nodes((n.args, n.kwargs))
        else:
            operands = []
        for a in operands:
            for axis in _depends_on(self.memo.get(a)):
                if not _same_extent(shape_of(a), shape_of(n), axis):
                    return _Unknown(f"{a.name} varies along the {_AXIS_NAMES[axis]} axis, which {n.name} broadcasts")
        return v

    def _convert(self, n):
        """A dtype conversion keeps what a value means only where the new dtype holds its entries: bool masks
        and additive masks within their kind (a 0/1 mask as float is a bias to SDPA: the consumer checks), and
        positions as 32/64-bit integers."""
        src = self.value(n.args[0])
        before, after = dtype_of(n.args[0]), dtype_of(n)
        if isinstance(src, _Tensor):
            return src.derived(n)
        if isinstance(src, _Unknown) or (before is not None and before == after):
            return src
        if after is None:
            return _Unknown(f"conversion to an unknown dtype at {n.name}")
        if isinstance(src, _Const):
            if after is torch.bool:
                return _Const(bool(src.value))
            if not after.is_floating_point and isinstance(src.value, float) and not src.value.is_integer():
                return _Unknown(f"conversion of {src.value!r} to {after} at {n.name}")
            return _Const(float(src.value) if after.is_floating_point else int(src.value))
        if isinstance(src, _Mask):
            return src  # 0/1 in any dtype; where it meets SDPA or a fill its dtype is checked
        if isinstance(src, _Additive) and after.is_floating_point:
            return src
        if isinstance(src, (_Range, _Axis)) and after in _POSITION_DTYPES:
            return src
        return _Unknown(f"conversion of {type(src).__name__.strip('_')} from {before} to {after} at {n.name}")

    def _arange(self, n):
        dtype = dtype_of(n) or n.kwargs.get("dtype") or torch.int64  # a graph without meta: arange's default
        if dtype not in _POSITION_DTYPES:  # bf16 rounds past 256, uint8 wraps past 255: not exact positions
            return _Unknown(f"arange of dtype {dtype} at {n.name}, expected int32 or int64")
        args = [a for a in n.args]
        if len(args) == 1:
            return _Range((None, 0))
        if len(args) == 2:
            off = _shift((None, 0), args[0])
            return _Range(off) if off is not None else _Unknown(f"arange start at {n.name}")
        return _Unknown(f"arange with a step at {n.name}")

    def _triangle(self, n, kind):
        """``triu`` / ``tril`` of a constant [Q, KV] matrix: row i, column j kept where j >= i + d (triu) or
        j <= i + d (tril). Ones make a bool mask; a huge negative constant an additive one (its zeros are kept)."""
        src, d = self.value(n.args[0]), call_arg(n, 1, "diagonal", 0)
        if not isinstance(src, _Const) or not isinstance(d, int) or isinstance(d, bool):
            return _Unknown(f"{kind} of something other than a constant at {n.name}")
        # kept entries as one predicate: tril -> kv <= q + d; triu -> kv >= q + d, i.e. kv > q + d - 1
        kept = Causal((None, d), _ZERO) if kind == "tril" else WindowStart((None, d - 1), _ZERO)
        if src.value is True or src.value == 1:
            return _Mask(frozenset({kept}))
        if isinstance(src.value, (int, float)) and src.value <= _HUGE_NEGATIVE:
            return _Additive(_Mask(frozenset({kept.complement()})))
        return _Unknown(f"{kind} of {src.value!r} at {n.name}")

    def _passthrough(self, n):
        src = self.value(n.args[0])
        if n.target == "unsqueeze" and isinstance(src, (_Range, _Axis)):
            dim, ndim = call_arg(n, 1, "dim"), len(shape_of(n) or ())
            dim = dim + ndim if isinstance(dim, int) and dim < 0 else dim
            if dim == 0:  # a leading axis moves none of the others (they are counted from the right)
                return src
            if isinstance(src, _Range) and dim == 1 and len(shape_of(n.args[0]) or ()) == 1:
                return _axis(-2, src.offset, n)  # [S] -> [S, 1]: the query axis of a [Q, KV] mask
            return _Unknown(f"unsqueeze({dim}) of a position index at {n.name}: it moves the axis")
        if n.target in ("view", "reshape") and isinstance(src, _Tensor) and _same_shape(n, n.args[0]):
            return src.derived(n)  # GPT-2's attention_mask.view(batch, -1): the same [B, S] tensor
        if n.target in ("view", "reshape") and isinstance(src, _Additive) and _same_last_two(n, n.args[0]):
            return src  # [Q, KV] viewed as [1, 1, Q, KV] (nn.TransformerEncoderLayer)
        if n.target in ("view", "reshape") and not isinstance(src, (_Const, _Mask)):
            return _Unknown(f"{n.target} at {n.name}")
        if isinstance(src, _Tensor):
            if n.target == "expand" and _keeps_last_axis(n):
                self.table_of[n] = self.table_root(n.args[0])  # position_ids.expand(B, -1): the same rows
            return src.derived(n)  # same data, converted: pass the converted node on
        return src

    def _add(self, n, negate):
        a, b = n.args[0], n.args[1]
        va = self.value(a)
        if isinstance(va, (_Range, _Axis)):
            delta = b
            if negate:
                if isinstance(b, fx.Node):
                    return _Unknown(f"subtracting a symbolic value at {n.name}")
                delta = -b
            off = _shift(va.offset, delta)
            if off is None:
                return _Unknown(f"offset {b!r} at {n.name}")
            return dataclasses.replace(va, offset=off)
        vb = self.value(b)
        if isinstance(va, _Const) and isinstance(vb, _Const):
            return _Const(va.value - vb.value if negate else va.value + vb.value)
        if not negate and isinstance(va, _Additive) and isinstance(vb, _Additive):
            # 0 where both keep, a huge negative (or -inf) where either blocks: the keys both keep
            both = self._and(va.mask, vb.mask)
            return _Additive(both) if isinstance(both, _Mask) else both
        return _Unknown(f"arithmetic at {n.name}")

    def _getitem(self, n):
        src, index = self.value(n.args[0]), n.args[1]
        if not isinstance(index, tuple):
            index = (index,)
        if isinstance(src, _Unknown):
            return src
        if isinstance(src, _Const):
            return src
        if isinstance(src, _Range):
            if (2 <= len(index) <= 4 and all(i is None or i == slice(None) for i in index)
                    and index.count(slice(None)) == 1 and len(shape_of(n.args[0]) or ()) == 1):
                # one axis of the result, counted from the right as broadcasting aligns it: pos[:, None] is the
                # query axis of a [Q, KV] mask as pos[None, None, :, None] is of a [B, H, Q, KV] one
                return _axis(index.index(slice(None)) - len(index), src.offset, n)
            if all(isinstance(i, slice) for i in index):
                return self._range_slice(n, src, index)
            if len(index) == 2 and len(shape_of(n.args[0]) or ()) == 2:
                return self._range_gather(n, src, index)
            return _Unknown(f"index {index} of a range at {n.name}")
        if isinstance(src, _Tensor) and len(index) == 2 and len(shape_of(n.args[0]) or ()) == 2:  # a [B, S] table
            batch, pos = (self.value(i) for i in index)
            if isinstance(batch, _Axis) and batch.dim == 0 and batch.offset == (None, 0) and isinstance(pos, _Axis):
                return _Gather(src.node, pos.dim, pos.offset)
        if isinstance(src, _Tensor) and index == (slice(None), None, None, slice(None)) and (
                len(shape_of(n.args[0]) or ()) == 2):
            return _Gather(src.node, 3, _ZERO)  # padding[:, None, None, :]: the [B, S] table read at [b, kv]
        if isinstance(src, (_Mask, _Additive)) and _keeps_positions(index):
            return src
        if isinstance(src, _Tensor):
            return src.derived(n)  # another tensor the pass does not read (a slice, a row): the op gets this node
        return _Unknown(f"indexing at {n.name}")

    def _range_gather(self, n, src: _Range, index: tuple):
        """``positions[batch_idx, pos_idx]`` of a [B, S] table whose rows are all ``arange + offset`` (position
        ids built in the graph, then gathered at the query and key indices): row b holds the same value at column
        p, ``p + offset``, so the gather is the index ``pos_idx`` moved by the range's offset."""
        batch, pos = (self.value(i) for i in index)
        if not (isinstance(batch, _Axis) and batch.dim == 0) or not isinstance(pos, _Axis):
            return _Unknown(f"index ({', '.join(map(str, index))}) of a range at {n.name}")
        base, const = src.offset
        off = pos.offset if base is None else _shift(pos.offset, base)
        off = _shift(off, const) if off is not None else None
        return _Axis(pos.dim, off) if off is not None else _Unknown(f"two symbolic offsets at {n.name}")

    def _range_slice(self, n, src: _Range, index: tuple):
        """``positions[..., a:]``: still "arange + offset", from ``a`` on; other dims' slices keep the values
        (a range is the same along them), a step does not."""
        ndim = len(shape_of(n.args[0]) or ())
        last = index[-1] if len(index) == ndim else slice(None)
        if last.step not in (None, 1) or not (last.start is None or _is_symbolic_scalar(last.start) or (
                isinstance(last.start, int) and last.start >= 0)):
            return _Unknown(f"slice {last} of a range at {n.name}")
        if last.start is None:
            return src
        off = _shift(src.offset, last.start)
        return _Range(off) if off is not None else _Unknown(f"slice start {last.start} of a range at {n.name}")

    def _diff(self, n):
        src = self.value(n.args[0])
        prepend = n.kwargs.get("prepend")
        dim = n.kwargs.get("dim", -1)
        if isinstance(src, _Range) and dim == -1 and prepend is not None:
            pre = self.value(prepend)
            if isinstance(pre, _Range) and _shift(pre.offset, 1) == src.offset:
                return _Const(1)  # consecutive positions: one document
        if isinstance(src, _Tensor) and _one_step_per_position(n, dim, prepend):
            self.steps_of[n] = ("diff", self.table_root(src.node))
        return _Tensor(n)

    def table_root(self, node: fx.Node) -> fx.Node:
        """The [B, S] table whose rows ``node`` holds (itself unless it is an expansion of one)."""
        return self.table_of.get(node, node)

    def _where(self, n):
        cond, yes, no = (self.value(a) for a in n.args[:3])
        if (
            isinstance(yes, _Const) and yes.value == 0
            and isinstance(no, _Const) and isinstance(no.value, (int, float)) and no.value <= _HUGE_NEGATIVE
        ):
            return _Additive(cond)
        return _Unknown(f"where at {n.name}")

    def _masked_fill(self, n):
        """``zeros.masked_fill(blocked, -inf)``: an additive mask keeping what ``blocked`` does not."""
        src, blocked, fill = self.value(n.args[0]), self.value(call_arg(n, 1, "mask")), call_arg(n, 2, "value")
        if not (isinstance(src, _Const) and src.value == 0 and not isinstance(src.value, bool)):
            return _Unknown(f"masked_fill of something other than zeros at {n.name}")
        if not (isinstance(fill, (int, float)) and fill <= _HUGE_NEGATIVE):
            return _Unknown(f"masked_fill with {fill!r} at {n.name}")
        kept = _complement(self._as_mask(blocked) or blocked, n)
        if isinstance(kept, (_Mask, _Unknown)):
            return _Additive(kept) if isinstance(kept, _Mask) else kept
        return _Unknown(f"masked_fill by a {type(kept).__name__.strip('_')} at {n.name}")

    def _key_prefix(self, n):
        """``hstack([zeros(Q, P), mask])`` (Meta's reference Llama, P cached keys): P keys every query sees, in
        front of ``mask``; its terms then read key positions P further on. Only causal terms with constant
        offsets, whose first row already sees key P - 1, keep that meaning."""
        tensors = n.args[0] if n.args else None
        dim = 1 if n.target is torch.hstack else call_arg(n, 1, "dim", 0)  # hstack: dim 1, the keys of a 2-D mask
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not all(isinstance(t, fx.Node) for t in tensors):
            return _Unknown(f"concatenation at {n.name}")
        prefix, rest = tensors
        shape = shape_of(rest)
        if shape is None or len(shape) < 2 or dim not in (-1, len(shape) - 1):
            return _Unknown(f"concatenation along an axis other than the keys at {n.name}")
        width, head, main = shape_of(prefix)[-1], self.value(prefix), self.value(rest)
        if not isinstance(width, int):
            width = _size_node(prefix, width)  # a past length Dynamo made symbolic (start_pos under dynamic=True)
            if width is None:
                return _Unknown(f"a prefix of symbolic width not given as a size at {n.name}")
        elif width == 0:
            return main  # prefill from an empty cache: hstack([zeros(Q, 0), mask])
        additive = isinstance(main, _Additive)
        if not (isinstance(head, _Const) and head.value == (0 if additive else True)):
            return _Unknown(f"a key prefix that is not all kept at {n.name}")
        mask = main.mask if additive else main
        if not isinstance(mask, _Mask):
            return main if isinstance(main, _Unknown) else _Unknown(f"a key prefix before {type(mask).__name__.strip('_')} at {n.name}")
        preds = []
        for pred in mask.preds:
            if not isinstance(pred, Causal):
                return _Unknown(f"a key prefix before a padding, document or window term at {n.name}")
            (q_base, q_const), (k_base, k_const) = pred.q_off, pred.k_off
            # kv + k <= q + o holds for key P - 1 at query 0 when k - 1 <= o; keys P on then read kv + k <= q + o + P
            if q_base is not None or k_base is not None or k_const - 1 > q_const:
                return _Unknown(f"a key prefix before a mask that hides some of it at {n.name}")
            preds.append(Causal(_shift((None, q_const), width), (None, k_const)))
        shifted = _Mask(frozenset(preds))
        return _Additive(shifted) if additive else shifted

    def _compare(self, op, a, b, raw, n):
        for side in (a, b):
            if isinstance(side, _Unknown):
                return side
        if isinstance(b, _Mask) and isinstance(a, _Const):
            a, b = b, a
        if isinstance(a, _Mask) and isinstance(b, _Const) and op in ("eq", "ne") and b.value in (0, 1):
            # a 0/1 mask compared with 0 or 1: itself or its complement (tril == 0 marks what causal blocks)
            return a if (op == "eq") == bool(b.value) else _complement(a, raw[0])
        if op == "ne" and isinstance(a, _Tensor) and b == _Const(1) and raw[0] in self.steps_of:
            kind, table = self.steps_of[raw[0]]
            if kind == "diff":
                self.steps_of[n] = ("breaks", table)  # where a position does not follow the one before
        for side in (a, b):
            if isinstance(side, _Tensor):  # a comparison of a tensor the pass cannot read: itself one
                return side.derived(n)
        if isinstance(a, _Const) and isinstance(b, _Const):
            fn = {"le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt, "eq": operator.eq, "ne": operator.ne}[op]
            return _Const(fn(a.value, b.value))
        # a range is a key index (its last axis) where it meets a query index: pos[:, None] >= pos
        if isinstance(a, _Range) and isinstance(b, _Axis):
            a = _Axis(3, a.offset)
        elif isinstance(b, _Range) and isinstance(a, _Axis):
            b = _Axis(3, b.offset)
        if isinstance(a, _Axis) and isinstance(b, _Axis) and a.dim == 2 and b.dim == 3:
            a, b, op = b, a, _FLIP[op]
        if isinstance(a, _Axis) and isinstance(b, _Axis) and a.dim == 3 and b.dim == 2:
            # key j at position j + a.offset: a sliding cache's keys start at max(past - window + 1, 0)
            if op == "lt":
                op, b = "le", _Axis(2, _shift(b.offset, -1))
            if op == "ge":
                op, b = "gt", _Axis(2, _shift(b.offset, -1))
            if op in _TERMS:
                return _Mask(frozenset({_TERMS[op](b.offset, a.offset)}))
        if op == "eq" and isinstance(a, _Gather) and isinstance(b, _Gather) and a.source is b.source:
            if a.dim == 3 and b.dim == 2:
                a, b = b, a
            if a.dim == 2 and b.dim == 3:
                return _Mask(frozenset({SameDocument(a.source, a.offset, b.offset)}))
        if isinstance(a, _Gather) and isinstance(b, _Gather) and a.source is b.source and {a.dim, b.dim} == {2, 3}:
            if a.dim == 2:
                a, b, op = b, a, _FLIP[op]
            if op == "le":  # positions[b, kv] <= positions[b, q]
                return _Mask(frozenset({PositionOrder(a.source, b.offset, a.offset)}))
        return _Unknown(f"comparison {op} of {type(a).__name__.strip('_')} and {type(b).__name__.strip('_')}")

    def _as_mask(self, v):
        if isinstance(v, _Const) and v.value is True:
            return _Mask(frozenset())
        if isinstance(v, _Mask):
            return v
        if isinstance(v, _Gather) and v.dim == 3:
            return _Mask(frozenset({KeyValid(v.source, v.offset)}))
        return None

    def _and(self, a, b):
        ma, mb = self._as_mask(a), self._as_mask(b)
        if ma is None or mb is None:
            bad = a if ma is None else b
            return bad if isinstance(bad, _Unknown) else _Unknown(f"and with {type(bad).__name__.strip('_')}")
        return _Mask(ma.preds | mb.preds)


def _size_node(made: fx.Node, size) -> Optional[fx.Node]:
    """The graph value holding the symbolic ``size`` among the size arguments ``made`` was built from
    (``torch.zeros((Q, start_pos))``), or None."""
    found = []
    fx.node.map_arg((made.args, made.kwargs), lambda a: found.append(a) if _is_symbolic_scalar(a) else None)
    return next((a for a in found if statically_known_true(a.meta["example_value"] == size)), None)


def _broadcasts(target) -> bool:
    """Ops whose output may be larger than an operand along an axis: elementwise ones, expand, and views
    (which may also move an axis)."""
    return (target in _COMPARE or target in _AND or target in _ADD or target in _SUB or target is torch.where
            or target in ("expand", "expand_as", "view", "reshape", "unsqueeze", "masked_fill", torch.masked_fill))


def _tensor_nodes(args) -> list:
    """The tensor-valued nodes in (nested) arguments; scalars (SymInts) broadcast trivially."""
    found = []
    fx.node.map_arg(args, lambda a: found.append(a) if shape_of(a) is not None else None)
    return found


def _index_nodes(index) -> list:
    return _tensor_nodes(index if isinstance(index, tuple) else (index,))


def _axis(axis: int, offset: _Off, n):
    """A range laid along ``axis`` (counted from the right): batch, query or key; the op has no per-head term."""
    if axis == -3:
        return _Unknown(f"a range along the head axis at {n.name}")
    return _Axis(axis + 4, offset)


def _depends_on(v) -> set:
    """Axes (counted from the right: -1 key, -2 query, -4 batch) along which the entries of ``v`` vary."""
    if isinstance(v, _Range):
        return {-1}
    if isinstance(v, _Axis):
        return {v.dim - 4}
    if isinstance(v, _Gather):
        return {-4, v.dim - 4}
    if isinstance(v, _Additive):
        return _depends_on(v.mask)
    if isinstance(v, _Mask):
        axes = set()
        for pred in v.preds:
            axes |= pred.axes
        return axes
    return set()


def _same_extent(shape_a, shape_b, axis: int) -> bool:
    """Whether two shapes (right-aligned; a missing axis has size 1) have the same size along ``axis``, as
    far as the traced sizes prove it (symbolic sizes must be the same expression)."""
    if shape_a is None or shape_b is None:
        return False
    size_a = shape_a[axis] if len(shape_a) >= -axis else 1
    size_b = shape_b[axis] if len(shape_b) >= -axis else 1
    return statically_known_true(size_a == size_b)


def _same_shape(a: fx.Node, b) -> bool:
    shape_a, shape_b = shape_of(a), shape_of(b)
    return shape_a is not None and shape_a == shape_b


def _same_last_two(a: fx.Node, b) -> bool:
    """Whether a view keeps the (Q, KV) axes and only adds or drops leading ones of size 1."""
    shape_a, shape_b = shape_of(a), shape_of(b)
    if shape_a is None or shape_b is None or len(shape_a) < 2 or len(shape_b) < 2:
        return False
    return shape_a[-2:] == shape_b[-2:] and all(d == 1 for d in shape_a[:-2] + shape_b[:-2])


def _keeps_positions(index: tuple) -> bool:
    """Whether ``mask[index]`` reads the same (q, kv) entries: leading new axes, then slices from 0."""
    rest = list(index)
    while rest and rest[0] is None:
        rest.pop(0)
    return all(i is Ellipsis or (isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1)) for i in rest)


def _complement(value, n):
    """not ``value`` for a one-term mask (a conjunction's complement is a disjunction: not in the vocabulary)."""
    if isinstance(value, _Mask) and len(value.preds) == 1:
        (pred,) = value.preds
        flipped = pred.complement()  # not (kv <= q + o)  is  kv > q + o
        if flipped is not None:
            return _Mask(frozenset({flipped}))
    if isinstance(value, _Unknown):
        return value
    if isinstance(value, _Tensor):
        return value.derived(n) if isinstance(n, fx.Node) and n is not value.node else value
    return _Unknown(f"negation of {type(value).__name__.strip('_')} at {getattr(n, 'name', n)}")


def _relative(q_off: _Off, k_off: _Off) -> tuple:
    """(query, key) offsets with one base folded into a number: both constant, or both from one past length."""
    if k_off[0] is q_off[0]:
        return (None, q_off[1] - k_off[1]), _ZERO
    return q_off, k_off


def _never_negative(base, const: int) -> bool:
    value = base.meta.get("example_value") if isinstance(base, fx.Node) else None
    return isinstance(value, (int, torch.SymInt)) and statically_known_true(value + const >= 0)


def _as_offset(off: _Off):
    base, const = off
    return const if base is None else (base, const)


def _positions_within_runs(preds: frozenset, evaluator: "_Evaluator"):
    """``preds`` with each :class:`PositionOrder` read as causal, or the reason it cannot be. Transformers 5.24
    compares gathered position ids, ``pos[kv] <= pos[q]``, and ands it with ``runs[q] == runs[kv]``, where ``runs``
    is the cumsum of ``diff(pos) != 1``: equal ids mean no step other than +1 between the two positions, so
    there ``pos[kv] - pos[q] == kv - q`` and the comparison is ``kv <= q``. Read so only when the runs come from
    the same table and are gathered at the same offsets."""
    out = set()
    for pred in preds:
        if not isinstance(pred, PositionOrder):
            out.add(pred)
            continue
        table = evaluator.table_root(pred.source)
        runs = [d for d in preds if isinstance(d, SameDocument) and evaluator.steps_of.get(d.source) == ("runs", table)
                and (d.q_off, d.k_off) == (pred.q_off, pred.k_off)]
        if not runs:
            return f"position ids compared (pos[kv] <= pos[q] from {pred.source.name}) without the packed-sequence " \
                   "ids of their runs: causal only where the positions step by one"
        out.add(Causal(pred.q_off, pred.k_off))
    return frozenset(out)


def _last_axis(node, dim) -> bool:
    """Whether ``dim`` is the last axis of ``node``'s value (a [B, S] table's positions)."""
    shape = shape_of(node)
    return shape is not None and dim in (-1, len(shape) - 1)


def _one_step_per_position(n: fx.Node, dim, prepend) -> bool:
    """``diff(table, prepend=<one column>, dim=-1)``: entry p is ``table[p] - table[p - 1]``, aligned with the
    table's positions (without the prepend, or with an append, entry p would describe the step after p)."""
    table, out = shape_of(n.args[0]), shape_of(n)
    first = shape_of(prepend) if isinstance(prepend, fx.Node) else None
    return (len(n.args) == 1 and n.kwargs.get("n", 1) == 1 and n.kwargs.get("append") is None and _last_axis(n.args[0], dim)
            and first is not None and len(first) == len(table) and first[-1] == 1 and out is not None
            and statically_known_true(out[-1] == table[-1]))


def _keeps_last_axis(n: fx.Node) -> bool:
    """``table.expand(...)`` that keeps the positions axis as it is (only a batch of one is broadcast)."""
    sizes = n.args[1:] if len(n.args) > 2 or not isinstance(n.args[1] if len(n.args) > 1 else None, (tuple, list)) \
        else n.args[1]
    before, after = shape_of(n.args[0]), shape_of(n)
    return (before is not None and after is not None and len(before) == len(after) == 2 and len(sizes) == 2
            and (sizes[-1] == -1 or statically_known_true(after[-1] == before[-1])))


def _mask_info(preds: frozenset) -> MaskInfo:
    """Predicates read in key indices: a term ``kv_pos <= q_pos + o`` with keys at ``j + k`` is ``j <= i + (o - k)``."""
    causal = [p for p in preds if isinstance(p, Causal)]
    if len(causal) != 1:
        return MaskInfo(MaskKind.UNKNOWN, reason="mask has no single causal (kv <= q) term")
    q_off, k_off = _relative(causal[0].q_off, causal[0].k_off)
    if q_off[0] is None and k_off[0] is None and q_off[1] - k_off[1] < 0:
        # strict causal and the like: eager attention gives such rows the mean of V (a finite fill) or NaN
        # (-inf), the op zeros; only dense attention reproduces what the model computes
        return MaskInfo(MaskKind.UNKNOWN, reason=f"causal term kv <= q{q_off[1] - k_off[1]} leaves the first "
                                                 f"{k_off[1] - q_off[1]} query row(s) without a key")
    if q_off[0] is not None and k_off[0] is None and not _never_negative(q_off[0], q_off[1] - k_off[1]):
        # a cache length is a size and never negative; KV - Q is, for more queries than keys
        return MaskInfo(MaskKind.UNKNOWN, reason=f"causal term's query offset {q_off[0].name} + {q_off[1] - k_off[1]} "
                                                 "may be negative (query rows without a key)")
    window = 0
    key_mask = doc = None
    key_start = doc_start = _ZERO
    for pred in preds:
        if isinstance(pred, WindowStart):
            (wq_base, wq), (wk_base, wk) = _relative(pred.q_off, pred.k_off)
            if wq_base is not q_off[0] or wk_base is not k_off[0]:
                return MaskInfo(MaskKind.UNKNOWN, reason="window offset differs from the causal offset")
            term = (q_off[1] - k_off[1]) - (wq - wk)
            if term <= 0:
                return MaskInfo(MaskKind.UNKNOWN, reason="empty sliding window")
            window = min(window, term) if window else term  # two window terms keep the narrower
        elif isinstance(pred, KeyValid):
            if key_mask is not None:
                return MaskInfo(MaskKind.UNKNOWN, reason="two padding masks")
            key_mask, key_start = pred.source, pred.offset
        elif isinstance(pred, SameDocument):
            # ids read at [q_pos] and [kv_pos]; sliced from where key 0 reads them, the query side must then
            # land at the op's query offset: the same gap as the causal term's
            (cq_base, cq), (ck_base, ck) = causal[0].q_off, causal[0].k_off
            (dq_base, dq), (dk_base, dk) = pred.q_off, pred.k_off
            same_gap = dq_base is cq_base and dk_base is ck_base and dq - dk == cq - ck
            if doc is not None or not same_gap:
                return MaskInfo(MaskKind.UNKNOWN, reason="packed-sequence ids at other positions than the queries")
            doc, doc_start = pred.source, pred.k_off
    if key_mask is not None:
        dtype = dtype_of(key_mask)
        if dtype is not torch.bool:
            return MaskInfo(MaskKind.UNKNOWN, reason=f"padding mask of dtype {dtype}, expected bool")
    if doc is not None:
        dtype = dtype_of(doc)
        if dtype is None or dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
            return MaskInfo(MaskKind.UNKNOWN, reason=f"packed-sequence ids of dtype {dtype}, expected an integer dtype")
    kind = MaskKind.PACKED if doc is not None else MaskKind.SLIDING_WINDOW if window else (
        MaskKind.CAUSAL_PADDING if key_mask is not None else MaskKind.CAUSAL
    )
    return MaskInfo(kind, q_offset=_as_offset(q_off), k_offset=_as_offset(k_off), window=window, key_mask=key_mask,
                    key_mask_start=_as_offset(key_start), doc_ids=doc, doc_ids_start=_as_offset(doc_start))


def analyse(site: AttentionSite, writes: Optional[list] = None) -> MaskInfo:
    if site.mask is None:
        if site.is_causal:
            return MaskInfo(MaskKind.CAUSAL)  # SDPA's is_causal is aligned top-left
        if _one_query_row(site):
            # a decode step (transformers 5.24 passes no mask there): every key is at or before the one query,
            # which is causal attention's last row
            return MaskInfo(MaskKind.CAUSAL, q_at_last_key=True)
        return MaskInfo(MaskKind.NONE, reason="no mask and is_causal=False: bidirectional attention")
    if site.is_causal:
        return MaskInfo(MaskKind.UNKNOWN, reason="both attn_mask and is_causal given")
    shape = shape_of(site.mask)
    # a head axis is allowed: the vocabulary below has no per-head term, so a mask it understands is the
    # same for every head (nn.TransformerEncoderLayer expands its [Q, KV] mask to [B, H, Q, KV])
    if shape is None or len(shape) not in (2, 4):
        return MaskInfo(MaskKind.UNKNOWN, reason=f"mask of shape {tuple(shape) if shape is not None else '?'}; expected [B, 1 or H, Q, KV] or [Q, KV]")
    evaluator = _Evaluator(writers(site.node.graph) if writes is None else writes)
    value = evaluator.value(site.mask)
    if isinstance(value, _Unknown):
        return MaskInfo(MaskKind.UNKNOWN, reason=f"mask construction not understood ({value.reason})")
    additive = isinstance(value, _Additive)
    wrong_dtype = _dtype_mismatch(site, value)
    if wrong_dtype:
        return MaskInfo(MaskKind.UNKNOWN, reason=wrong_dtype)
    if additive:
        value = value.mask
    if site.mask_fills:
        if additive or isinstance(value, _Const):
            return MaskInfo(MaskKind.UNKNOWN, reason="masked_fill with a condition that is not a bool mask")
        value = _complement(value, site.mask)  # masked_fill marks what is blocked; the op takes what is kept
    elif site.mask_selects:
        if additive or isinstance(value, _Const):
            return MaskInfo(MaskKind.UNKNOWN, reason="where with a condition that is not a bool mask")
    elif site.form == "manual" and not additive:
        return MaskInfo(MaskKind.UNKNOWN, reason="manual attention adds a mask that is not 0/-inf")
    if isinstance(value, _Unknown):
        return MaskInfo(MaskKind.UNKNOWN, reason=f"mask construction not understood ({value.reason})")
    if isinstance(value, _Tensor):
        return MaskInfo(MaskKind.UNKNOWN, reason=f"mask read from a tensor the graph does not compute ({(value.root or value.node).name}: an input "
                                                 "or a buffer); build it in forward from shapes (triu/tril, arange) or use is_causal")
    if not isinstance(value, _Mask):
        return MaskInfo(MaskKind.UNKNOWN, reason=f"mask evaluates to {type(value).__name__.strip('_')}")
    attention = (shape_of(site.query)[0], 1, shape_of(site.query)[-2], shape_of(site.key)[-2])  # [B, ., Q, KV]
    for axis in sorted(_depends_on(value)):
        if not _same_extent(shape_of(site.mask), attention, axis):
            return MaskInfo(MaskKind.UNKNOWN, reason=f"mask of shape {shape_of(site.mask)} varies along the "
                                                     f"{_AXIS_NAMES[axis]} axis but does not span the attention's")
    preds = _positions_within_runs(value.preds, evaluator)
    if isinstance(preds, str):
        return MaskInfo(MaskKind.UNKNOWN, reason=preds)
    return _mask_info(preds)


def _one_query_row(site: AttentionSite) -> bool:
    """Whether the traced query length is 1 in every graph this one stands for (a static 1, not a SymInt)."""
    shape = shape_of(site.query)
    return shape is not None and len(shape) == 4 and isinstance(shape[-2], int) and shape[-2] == 1


def _dtype_mismatch(site: AttentionSite, value) -> Optional[str]:
    """Why the mask's dtype contradicts how it was read (SDPA adds a float mask and selects by a bool one):
    a 0/1 mask of floats masks nothing, a 0/-inf mask turned bool keeps the blocked keys."""
    dtype = dtype_of(site.mask)
    if dtype is None or site.mask_fills or site.mask_selects:  # masked_fill and where insist on a bool condition
        return None
    if isinstance(value, _Additive) and not dtype.is_floating_point:
        return f"a 0/-inf mask converted to {dtype}"
    if isinstance(value, (_Mask, _Const)) and dtype is not torch.bool and site.form != "manual":
        return f"a 0/1 mask of dtype {dtype}: SDPA adds a non-bool mask to the scores, so it masks nothing"
    return None


def _not_causal(info: MaskInfo) -> Optional[str]:
    """Why a site whose mask means ``info`` stays dense: a mask not understood, or none (bidirectional)."""
    if info.kind == MaskKind.UNKNOWN:
        return f"unknown mask: {info.reason}"
    if info.kind == MaskKind.NONE:
        return info.reason
    return None


def run(sites: list[AttentionSite]) -> list[AttentionSite]:
    out = []
    writes = writers(sites[0].node.graph) if sites else []
    checked: dict = {}  # layers share one mask: run its subgraph once
    for site in sites:
        info = analyse(site, writes)
        key = (site.mask, info, site.mask_fills, site.mask_selects, site.query, site.key)
        if key not in checked:
            checked[key] = mask_values.check(site, info, writes)
        info = checked[key]
        out.append(dataclasses.replace(site, mask_info=info).blocked(_not_causal(info)))
    return out
