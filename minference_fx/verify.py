"""Self-check: ``options={"verify": True}``.

The first call of each compiled graph also runs two eager copies of it: the graph as Dynamo traced it, before
any pass touched it, and the graph as rewritten, with every sparse op on its exact dense path (the same mask,
offsets, GQA and layout the passes derived, without the sparse approximation). Each rewritten site's output is
compared with the traced attention's output on the same call, and the graph's outputs with the traced graph's;
the first that differs beyond a dtype-aware tolerance raises :class:`VerifyError` naming the site. So a pass
that misreads a mask or a layout on a new model or release fails loudly on the first call instead of running
wrong. Cost: the first call of each graph runs the model about twice more, eagerly, and holds every site's
output of the traced run until the comparison (one attention output per layer).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Callable, Optional

import torch
import torch.fx as fx

from . import op  # noqa: F401  (registers the op this module recognises)

log = logging.getLogger("minference_fx")
SPARSE_OP = torch.ops.minference.sparse_attention.default
_MIN_SPARSE_LEN_ARG = 11  # position of min_sparse_len in the op's arguments
# (absolute, relative to the largest reference entry) per dtype: the dense path and the traced attention add in
# different orders, and a wrong mask or layout moves outputs by far more than this
_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 3e-2)}


class VerifyError(RuntimeError):
    """The rewritten graph computes something other than the traced one."""


@dataclasses.dataclass(frozen=True)
class SiteCheck:
    label: str
    """how the report names the site ("layer 3 (modeling_llama.py:412)")"""
    traced: str
    """the attention output's node name in the traced copy"""
    rewritten: str
    """the sparse op's node name in the rewritten copy"""


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph (node names kept), to run after the passes or Inductor edit ``gm``."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def tolerance(dtype: torch.dtype) -> tuple:
    return _TOLERANCE.get(dtype, _TOLERANCE[torch.float32])


def mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """Why ``got`` is not ``want`` within the dtype's tolerance, or ""."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} where the traced graph has {tuple(want.shape)}"
    if not want.is_floating_point():
        return "" if torch.equal(got, want) else "different values"
    absolute, relative = tolerance(want.dtype)
    got, want = got.float(), want.float()
    if not torch.equal(got.isnan(), want.isnan()):
        return "NaN where the traced graph has none" if got.isnan().any() else "no NaN where the traced graph has one"
    finite = want.isfinite() & got.isfinite()
    if not torch.equal(got[~finite], want[~finite]):
        return "different infinities"
    if not finite.any():
        return ""
    error = (got[finite] - want[finite]).abs().max().item()
    bound = absolute + relative * want[finite].abs().max().item()
    return f"max abs error {error:.3g} > tolerance {bound:.3g}" if error > bound else ""


class _Recorder(fx.Interpreter):
    """Runs a graph eagerly, keeping the values of the named nodes; the sparse op runs its exact dense path."""

    def __init__(self, gm: fx.GraphModule, keep: set):
        super().__init__(gm)
        self.keep, self.kept = keep, {}
        self.op_args: dict = {}
        """the sparse op's arguments, by node name"""
        self.current = ""

    def call_function(self, target, args, kwargs):
        if target is SPARSE_OP:
            args = tuple(sys.maxsize if i == _MIN_SPARSE_LEN_ARG else a for i, a in enumerate(args))
            self.op_args[self.current] = args
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        self.current = n.name
        value = super().run_node(n)
        if n.name in self.keep:
            self.kept[n.name] = value
        return value


def rows_with_keys(op_args: tuple) -> Optional[torch.Tensor]:
    """bool [B, 1, Sq, 1]: the query rows that may read at least one key under the op's mask (a left-padded row
    reads none, and what attention returns there is the model's own convention, which nothing downstream reads);
    None when every row may."""
    q, k, key_mask, q_offset, window = op_args[0], op_args[1], op_args[3], op_args[6], op_args[7]
    if key_mask is None:
        return None
    sq, skv = q.shape[-2], k.shape[-2]
    last = (torch.arange(sq, device=q.device) + int(q_offset)).clamp(max=skv - 1)  # the last key row i may read
    seen = torch.cumsum(key_mask[:, :skv].to(torch.int32), dim=1)  # valid keys among 0..j
    count = seen[:, last]
    if window:
        first = last - int(window)  # keys after this one are in the window
        count = count - torch.where(first >= 0, seen[:, first.clamp(min=0)], torch.zeros_like(count))
    return (count > 0)[:, None, :, None]


def _tensors(value) -> list:
    return [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _own_copies(inputs: list) -> list:
    """``inputs`` with every tensor but the parameters cloned: a graph that writes an input (a cache's length, a
    step counter) must find it, at the compiled run after both checks, as the caller left it."""
    return [x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) else x for x in inputs]


def check(traced: fx.GraphModule, rewritten: fx.GraphModule, sites: list, inputs: list) -> None:
    """Run both copies on ``inputs``; raise :class:`VerifyError` at the first site (or output) that differs."""
    with torch.no_grad():
        want = _Recorder(traced, {s.traced for s in sites})
        want_out = want.run(*_own_copies(inputs))
        got = _Recorder(rewritten, {s.rewritten for s in sites})
        got_out = got.run(*_own_copies(inputs))
    every_row_read = True
    for site in sites:
        rows = rows_with_keys(got.op_args[site.rewritten]) if site.rewritten in got.op_args else None
        every_row_read = every_row_read and (rows is None or bool(rows.all()))
        if site.traced not in want.kept:
            continue  # a site a pass wrote before the rewrite (unfuse, einsum, bmm): checked at the outputs
        got_site, want_site = got.kept[site.rewritten], want.kept[site.traced]
        if rows is not None and got_site.shape == want_site.shape:
            got_site, want_site = got_site.masked_fill(~rows, 0), want_site.masked_fill(~rows, 0)
        why = mismatch(got_site, want_site)
        if why:
            raise VerifyError(f"minference verify: attention site {site.label} differs from the traced model: {why}. "
                              "The pass misread this site; compile without backend='minference' for this model "
                              "and report it (the inspection report says what was read)")
    if not every_row_read:
        return  # rows that read no key (padding) end in outputs the model does not use: each site was checked
    got_tensors, want_tensors = _tensors(got_out), _tensors(want_out)
    if [t.shape for t in got_tensors] != [t.shape for t in want_tensors]:
        log.warning("minference verify: the graphs' outputs do not pair up (%s against %s); checked site by site only",
                    [tuple(t.shape) for t in got_tensors], [tuple(t.shape) for t in want_tensors])
        return
    for i, (g, w) in enumerate(zip(got_tensors, want_tensors)):
        why = mismatch(g, w)
        if why:
            labels = ", ".join(s.label for s in sites) or "none"
            raise VerifyError(f"minference verify: graph output {i} differs from the traced model: {why} "
                              f"(rewritten sites: {labels})")


def checked(compiled: Callable, traced: fx.GraphModule, rewritten: fx.GraphModule, sites: list) -> Callable:
    """``compiled``, whose first call is checked first (:func:`check`)."""
    boxed = getattr(compiled, "_boxed_call", False)  # the inputs may then come as one list, which the call clears
    pending = [True]

    def run(*args):
        if pending:
            pending.clear()
            as_list = boxed and len(args) == 1 and isinstance(args[0], list)
            check(traced, rewritten, sites, list(args[0]) if as_list else list(args))
        return compiled(*args)

    if boxed:
        run._boxed_call = True
    return run
