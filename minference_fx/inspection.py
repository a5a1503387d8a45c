"""``inspect(model, *args)``: what the backend would do to a model, without running it sparse."""
from __future__ import annotations

import dataclasses

import torch

from .backend import rewrite_graph
from .options import BackendOptions
from .report import Report, summarize


@dataclasses.dataclass
class Inspection:
    """Reports of every graph Dynamo produced for one call (one per graph break)."""

    reports: list[Report]
    traced_with_grad_off_only: bool = False
    """the caller had autograd on: the trace ran under no_grad (what a prefill runs), and a model called as the
    caller was would keep its attention dense (the op is inference-only)"""

    @property
    def rows(self):
        return [row for report in self.reports for row in report.rows]

    @property
    def unread(self) -> tuple:
        """Every graph's notes on softmax calls that look like attention but were not read (``Report.unread``)."""
        return tuple(note for report in self.reports for note in report.unread)

    @property
    def tensor_parallel(self):
        """This rank's share of the query heads (``parallel.HeadShare``) under tensor parallelism, else None."""
        return next((r.tensor_parallel for r in self.reports if r.tensor_parallel is not None), None)

    @property
    def rewritten(self) -> int:
        """Sites rewritten to the sparse op, over every graph; 0: the model runs dense."""
        return sum(r.rewritten for r in self.reports)

    def summary(self, *, one_line: bool = False) -> str:
        """First line: "minference: 30 of 30 attention sites rewritten", "... only 28 of 30 ...", or "... 0 of 30
        attention sites rewritten: the model runs dense"; then the most common reasons why sites stayed dense,
        with counts (``one_line``: all on one line)."""
        text = summarize(self.rows, self.unread, one_line=one_line)
        if self.tensor_parallel is not None:  # each rank inspects its own slice of the heads: say which
            text += f"; {self.tensor_parallel.describe()}" if one_line else f"\n  {self.tensor_parallel.describe()}"
        if self.traced_with_grad_off_only and self.rewritten:
            note = ("traced under no_grad; called with autograd on, as inspect() was, these sites stay dense: run the "
                    "prefill under torch.inference_mode() or torch.no_grad()")
            text += f"; {note}" if one_line else f"\n  {note}"
        return text

    def diff(self) -> str:
        return "\n".join(r.diff() for r in self.reports)

    def __str__(self) -> str:
        graphs = f"{len(self.reports)} graph(s)"
        return self.summary() + "\n\n" + graphs + "\n" + "\n\n".join(r.table() for r in self.reports)


def inspect(model, *args, options=None, **kwargs) -> Inspection:
    """Trace ``model(*args, **kwargs)`` with Dynamo and report each attention site.

    The call runs once with the rewritten graph executed eagerly (no Inductor),
    so it is cheap; the model itself is not modified. Dynamo's caches are reset
    first so the trace is fresh.
    """
    if not callable(model):
        raise TypeError(f"minference_fx.inspect needs a callable model (an nn.Module or a function), got "
                        f"{type(model).__name__}")
    opts = dataclasses.replace(BackendOptions.from_user(options))
    reports: list[Report] = []

    def capture(gm, example_inputs):
        reports.append(rewrite_graph(gm, opts))
        return gm.forward

    grad_on = torch.is_grad_enabled()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(*args, **kwargs)
    torch._dynamo.reset()
    return Inspection(reports, traced_with_grad_off_only=grad_on)
