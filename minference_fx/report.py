"""What the backend found and did: one row per attention site, plus a graph diff."""
from __future__ import annotations

import dataclasses
import difflib
from collections import Counter

from .passes.site import AttentionSite


@dataclasses.dataclass(frozen=True)
class SiteRow:
    index: int
    layer: int | None
    source: str
    form: str
    shapes: str
    mask: str
    gqa: str
    decision: str
    """"sparse" (rewritten to minference::sparse_attention) or "dense" (left as it was)"""
    reason: str
    plan: str


def _plan_summary(plan) -> str:
    counts = Counter((h.pattern.value, h.budget_a, h.budget_b) for h in plan.heads)
    return ", ".join(f"{n}x{p}({a},{b})" if p != "dense" else f"{n}xdense" for (p, a, b), n in counts.items())


def _rewritten_reason(min_sparse_len: int) -> str:
    if min_sparse_len < 0:
        return "rewritten; dense below the tuned crossover length"
    if min_sparse_len <= 1:  # a prompt of one token is dense either way: nothing to skip
        return "rewritten; sparse at every length"
    return f"rewritten; dense below {min_sparse_len} query tokens"


@dataclasses.dataclass
class Report:
    rows: list[SiteRow]
    code_before: str
    code_after: str
    min_sparse_len: int
    guard_threshold: float = 0.0
    route_dense: bool = True
    unread: tuple = ()
    """one line per softmax that looks like attention but no site holds (``passes.unread``): where, and why"""

    @staticmethod
    def build(sites: list[AttentionSite], plans: dict, code_before: str, code_after: str, min_sparse_len: int,
              guard_threshold: float = 0.0, route_dense: bool = True, unread: tuple = ()) -> "Report":
        rows = []
        for i, site in enumerate(sites):
            mask = site.mask_info.describe() if site.mask_info else "?"
            plan = plans.get(i)
            rows.append(SiteRow(
                index=i, layer=site.layer, source=site.source, form=site.form, shapes=site.shapes, mask=mask,
                gqa=site.gqa_from or "-", decision="dense" if site.blocker else "sparse",
                reason=site.blocker or _rewritten_reason(min_sparse_len),
                plan=_plan_summary(plan) if plan is not None else "-",
            ))
        return Report(rows, code_before, code_after, min_sparse_len, guard_threshold, route_dense, unread)

    @property
    def rewritten(self) -> int:
        return sum(r.decision == "sparse" for r in self.rows)

    def diff(self) -> str:
        return "".join(difflib.unified_diff(
            self.code_before.splitlines(keepends=True), self.code_after.splitlines(keepends=True),
            fromfile="graph before", tofile="graph after",
        ))

    def table(self) -> str:
        header = ("#", "layer", "form", "mask", "gqa", "decision", "plan", "shapes", "source", "reason")
        lines = [header] + [
            (str(r.index), str(r.layer), r.form, r.mask, r.gqa, r.decision, r.plan, r.shapes, r.source, r.reason)
            for r in self.rows
        ]
        widths = [max(len(line[c]) for line in lines) for c in range(len(header) - 1)]
        out = ["  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1] for line in lines]
        out.append(f"{self.rewritten}/{len(self.rows)} attention sites rewritten")
        out += [f"not read as attention, runs as written: {note}" for note in self.unread]
        if self.rewritten and self.guard_threshold > 0:
            from .kernels.guard import STATS

            out.append(f"quality guard: vertical-slash heads under {self.guard_threshold:.2f} captured mass run dense; "
                       f"so far {STATS.heads_forced_dense}/{STATS.heads_checked} head-calls fired in {STATS.calls} calls")
        if self.rewritten:
            out.append("routing: heads that ran dense at a site's last call run through SDPA at its next" if self.route_dense
                       else "routing off: heads that run dense take the kernel's dense walk")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()
