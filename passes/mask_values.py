"""What a mask computes, read off its values: the mask-building subgraph run on small concrete sizes.

The symbolic reader (``masks.py``) reads a construction it knows term by term. This module checks it by what the
construction computes: where the mask depends on sizes alone (no tensor's data: no padding mask, no position
ids passed in), its subgraph is run with every size symbol set to small values, and the mask it yields is
compared entry by entry with the causal / sliding-window rule the reading gave. A reading the values
contradict is refused. In a static-shape graph, whose one size is checked where the mask is small enough, a
construction the reader does not know is accepted where its values are exactly the causal rule, or a window of one
fixed width, with queries and keys aligned (query i at key i): what ``is_causal`` and the op's plain causal path
compute. Where the length varies it is not: a window wider than every size tried, or bounded by a number the
sizes do not name (a float, an argument, a constant the graph computes), looks causal at small sizes. Anything
else stays as the reader left it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from .site import AttentionSite, MaskInfo, MaskKind, may_share_memory

# sizes are set past every integer the construction names (a window of W keys shows only in rows past W), in
# two settings; a construction naming a larger number than this is not run
_MAX_TRIAL_SIZE = 8192
_MAX_STATIC_ENTRIES = 1 << 24
# float32 holds every integer up to 2**24 tokens; narrower types wrap or round within a long prompt
_EXACT_DTYPES = (torch.bool, torch.int32, torch.int64, torch.float32, torch.float64)
_SIZE_READS = {"size", "dim"}
_SIZE_FUNCS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_size} if hasattr(torch.ops.aten, "sym_size") else set()


class _TooLarge(Exception):
    """An input to stand in for would be too large to make."""


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """The kept entries of a mask at one size setting: bool [B or 1, 1 or H, Q, KV]."""

    kept: torch.Tensor
    q_len: int
    kv_len: int
    offsets: dict
    """the concrete value of each size node the mask's reading may name (offset nodes)"""


def _slice(mask: fx.Node) -> Optional[list]:
    """The nodes ``mask`` is computed from, in graph order; None when it reads some tensor's data (a tensor
    input or buffer read other than for its size), which small sizes cannot stand for."""
    seen, work = set(), [mask]
    while work:
        node = work.pop()
        if node in seen:
            continue
        seen.add(node)
        work.extend(node.all_input_nodes)
    for node in seen:
        if node.op == "get_attr":
            return None
        if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor):
            if not all(_reads_size_only(user, node) for user in node.users if user in seen):
                return None
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _reads_size_only(user: fx.Node, tensor: fx.Node) -> bool:
    if user.op == "call_method" and user.target in _SIZE_READS:
        return True
    if user.op == "call_function" and user.target in _SIZE_FUNCS:
        return True
    return user.op == "call_function" and user.target is getattr and user.args[1:] == ("shape",)


def _literals(nodes: list) -> list:
    found = []
    fx.node.map_aggregate([(n.args, n.kwargs) for n in nodes],
                          lambda a: found.append(a) if isinstance(a, int) and not isinstance(a, bool) else a)
    return found


def _symbols(nodes: list) -> set:
    found = set()
    for node in nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            found |= value.node.expr.free_symbols
        elif isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    found |= size.node.expr.free_symbols
    return found


def _concrete(size, assignment: dict) -> int:
    return int(size.node.expr.xreplace(assignment)) if isinstance(size, torch.SymInt) else int(size)


def _run(nodes: list, assignment: dict, wanted: list) -> list:
    """The values of ``wanted`` nodes with every size symbol set by ``assignment``."""
    env = {}
    for node in nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder":
            if isinstance(value, torch.Tensor):  # read for its size alone (``_slice``): any values do
                shape = [_concrete(s, assignment) for s in value.shape]
                if torch.Size(shape).numel() > _MAX_STATIC_ENTRIES:
                    raise _TooLarge(node.name)
                env[node] = torch.zeros(shape, dtype=value.dtype, device=value.device)
            else:
                env[node] = _concrete(value, assignment)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        if node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return [env[w] if isinstance(w, fx.Node) else w for w in wanted]


def _kept(mask_value: torch.Tensor, site: AttentionSite) -> Optional[torch.Tensor]:
    """Which entries the attention may read, from the mask's values as the site uses them; None for values
    the op cannot reproduce (a float mask other than 0 / a huge negative)."""
    if site.mask_fills:
        return ~mask_value.bool()
    if site.mask_selects or mask_value.dtype is torch.bool:
        return mask_value.bool()
    blocked = mask_value <= -1e4
    if not torch.all(blocked | (mask_value == 0)):
        return None
    return ~blocked


def _offset(value, offsets: dict) -> int:
    if isinstance(value, tuple):
        base, const = value
        return offsets[base] + const
    return offsets[value] if isinstance(value, fx.Node) else int(value)


def rule(q_len: int, kv_len: int, relative: int, window: int, device=None) -> torch.Tensor:
    """[Q, KV] bool: query i reads key j when j <= i + relative (and j > i + relative - window)."""
    i = torch.arange(q_len, device=device)[:, None] + relative
    j = torch.arange(kv_len, device=device)[None, :]
    kept = j <= i
    return kept & (j > i - window) if window else kept


def _exact_at_every_size(nodes: list) -> bool:
    """Whether every tensor the mask is built from has a dtype that holds positions exactly at any prompt length
    (bf16 rounds past 256, uint8 wraps past 255: small sizes would not show it)."""
    return all(getattr(n.meta.get("example_value"), "dtype", torch.bool) in _EXACT_DTYPES for n in nodes)


def evaluations(site: AttentionSite, info: MaskInfo, writes: list) -> Optional[list]:
    """The mask at each size setting tried, or None when it cannot be run on small sizes, when what small sizes
    show may not hold at large ones (narrow dtypes), or when some node writes into the memory of a node it is
    computed from (the subgraph alone would miss that write)."""
    nodes = _slice(site.mask)
    if nodes is None or not _exact_at_every_size(nodes):
        return None
    if any(may_share_memory(w, n) for _, written in writes for w in written for n in nodes):
        return None
    offset_nodes = [x for v in (info.q_offset, info.k_offset) for x in ((v[0],) if isinstance(v, tuple) else (v,))
                    if isinstance(x, fx.Node)]
    q_value, k_value = site.query.meta["example_value"], site.key.meta["example_value"]
    symbols = sorted(_symbols(nodes + [site.query, site.key] + offset_nodes), key=str)
    if any(n not in nodes for n in offset_nodes):
        return None
    if not symbols:
        shape = site.mask.meta["example_value"].shape
        if shape.numel() > _MAX_STATIC_ENTRIES:
            return None
        trials = [{}]
    else:
        first = max([abs(c) for c in _literals(nodes)] + [4]) + 3
        if first > _MAX_TRIAL_SIZE:
            return None
        trials = [{s: base + 3 * i for i, s in enumerate(symbols)} for base in (first, first + 5)]
    found = []
    for assignment in trials:
        try:
            mask_value, *offsets = _run(nodes, assignment, [site.mask, *offset_nodes])
            q_len, kv_len = _concrete(q_value.shape[-2], assignment), _concrete(k_value.shape[-2], assignment)
        except Exception:  # a size the traced program's guards would not allow, an input too large to stand in
            return None   # for: no evidence either way
        if not isinstance(mask_value, torch.Tensor) or mask_value.device.type == "meta":
            return None
        kept = _kept(mask_value, site)
        if kept is None:
            return []
        found.append(Evaluated(kept, q_len, kv_len, dict(zip(offset_nodes, offsets))))
    return found


def _varies_in_size(site: AttentionSite) -> bool:
    """Whether the site's graph has a size symbol in its mask or its query and key lengths (a dynamic-shape graph)."""
    nodes = _slice(site.mask) or [site.mask]
    return bool(_symbols(nodes + [site.query, site.key]))


def agrees(info: MaskInfo, runs: list) -> bool:
    for run in runs:
        relative = _offset(info.q_offset, run.offsets) - _offset(info.k_offset, run.offsets)
        want = rule(run.q_len, run.kv_len, relative, info.window, run.kept.device)
        if run.kept.shape[-2:] != want.shape or not torch.equal(run.kept, want.expand_as(run.kept)):
            return False
    return True


def aligned_rule(runs: list) -> Optional[MaskInfo]:
    """A causal or fixed-window mask with query i at key i that every run computes, or None."""
    windows = set()
    for run in runs:
        if run.q_len != run.kv_len or run.kept.shape[-2:] != (run.q_len, run.kv_len) or not run.kept.any():
            return None
        row = run.kept.reshape(-1, run.q_len, run.kv_len)[0, -1]
        window = int(row.sum())
        window = 0 if window == run.kv_len else window
        if not torch.equal(run.kept, rule(run.q_len, run.kv_len, 0, window, run.kept.device).expand_as(run.kept)):
            return None
        windows.add(window)
    if len(windows) != 1:
        return None
    (window,) = windows
    return MaskInfo(MaskKind.SLIDING_WINDOW if window else MaskKind.CAUSAL, window=window)


def check(site: AttentionSite, info: MaskInfo, writes: list) -> MaskInfo:
    """``info`` (the symbolic reading) checked against the mask's values, or a reading from the values alone.
    ``writes``: the graph's writing nodes (``site.writers``)."""
    if site.mask is None or info.kind not in (MaskKind.CAUSAL, MaskKind.SLIDING_WINDOW, MaskKind.UNKNOWN):
        return info
    if info.kind == MaskKind.UNKNOWN and _varies_in_size(site):
        # values at a few sizes cannot show a window wider than the sizes tried, nor one the sizes do not name
        # (a float bound, an int argument, a constant computed in the graph): a varying size keeps it unread
        return dataclasses.replace(info, reason=f"{info.reason}; not read from its values either, since the graph "
                                                "serves every prompt length and its values at a few cannot prove a "
                                                "rule at all of them")
    runs = evaluations(site, info if info.kind != MaskKind.UNKNOWN else MaskInfo(MaskKind.CAUSAL), writes)
    if not runs:
        return info
    if info.kind == MaskKind.UNKNOWN:
        found = aligned_rule(runs)
        return found if found is not None else info
    if agrees(info, runs):
        return info
    sizes = ", ".join(f"Q={r.q_len} KV={r.kv_len}" for r in runs)
    return MaskInfo(MaskKind.UNKNOWN, reason=f"the mask's values at {sizes} are not the {info.describe()} rule it "
                                             "was read as")
