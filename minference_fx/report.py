"""What the backend found and did: one row per attention site, plus a graph diff."""
from __future__ import annotations

import dataclasses
import difflib
from collections import Counter
from typing import TYPE_CHECKING, Optional

from .kernels.guard import STATS
from .passes.site import AttentionSite

if TYPE_CHECKING:  # the report only holds and prints a share; parallel sits beside the backend, above the report
    from .parallel import HeadShare


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


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def summarize(rows, unread=(), *, reasons: int = 3, one_line: bool = False) -> str:
    """What ``rows`` (of one graph or of all a call's graphs) come to, first line first:
    "minference: 30 of 30 attention sites rewritten", "... only 28 of 30 ...", "... 0 of 30 attention sites
    rewritten: the model runs dense", "... no attention site found: the model runs dense"; then the most
    common reasons the dense sites stayed dense, with counts, and the softmax calls not read as attention.
    ``one_line`` joins it all into one line (for an error message)."""
    total = len(rows)
    done = sum(r.decision == "sparse" for r in rows)
    if not total:
        head = "minference: no attention site found: the model runs dense"
    elif done == total:
        head = f"minference: {done} of {total} attention sites rewritten"
    elif done:
        head = f"minference: only {done} of {total} attention sites rewritten; the other {total - done} run dense"
    else:
        head = f"minference: 0 of {total} attention sites rewritten: the model runs dense"
    why = Counter(r.reason for r in rows if r.decision != "sparse").most_common()
    lines = [f"{n} of {total}: {_clip(reason)}" for reason, n in why[:reasons]]
    if len(why) > reasons:
        lines.append(f"{sum(n for _, n in why[reasons:])} more for {len(why) - reasons} other reason(s): see the table")
    if unread:
        lines.append(f"{len(unread)} softmax call(s) look like attention but were not read: {_clip(unread[0])}"
                     + (" (more in the table)" if len(unread) > 1 else ""))
    if one_line:
        return head + "".join(f"; {line}" for line in lines)
    return "\n".join([head] + ["  " + line for line in lines])


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
    tensor_parallel: Optional["HeadShare"] = None
    """this rank's share of the query heads as the sharded weights say (``parallel.read``); None: not sharded"""
    head_offset: int = 0
    """the global query head the sites' head 0 read in the config: the share's first head, or the option's"""
    guard_escalation: tuple = ()
    """(columns, diagonals) a weak head tries before it runs dense; (): none"""
    budget_growth: tuple = ()
    """(keys, exponent) past which the listed budgets grow with the prompt; (): none"""

    @staticmethod
    def build(sites: list[AttentionSite], plans: dict, code_before: str, code_after: str, min_sparse_len: int,
              guard_threshold: float = 0.0, route_dense: bool = True, unread: tuple = (),
              tensor_parallel: Optional["HeadShare"] = None, head_offset: int = 0,
              guard_escalation: tuple = (), budget_growth: tuple = ()) -> "Report":
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
        return Report(rows, code_before, code_after, min_sparse_len, guard_threshold, route_dense, unread,
                      tensor_parallel, head_offset, tuple(guard_escalation), tuple(budget_growth))

    @property
    def rewritten(self) -> int:
        return sum(r.decision == "sparse" for r in self.rows)

    def summary(self, *, one_line: bool = False) -> str:
        """What :meth:`table` comes to, in a few lines: how many sites were rewritten and, for those that were
        not, the most common reasons (see :func:`summarize`)."""
        return summarize(self.rows, self.unread, one_line=one_line)

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
        if self.tensor_parallel is not None:
            out.append(self.tensor_parallel.describe())
        if self.head_offset != (self.tensor_parallel.first_head if self.tensor_parallel else 0):
            out.append(f"config heads read from global query head {self.head_offset} (options['head_offset'])")
        if self.rewritten and self.guard_threshold > 0:
            fallback = (f"first try {self.guard_escalation} (columns, diagonals), then run dense" if self.guard_escalation
                        else "run dense")
            out.append(f"quality guard: vertical-slash and block-sparse heads under {self.guard_threshold:.2f} captured "
                       f"mass {fallback}; so far {STATS.heads_forced_dense}/{STATS.heads_checked} head-calls fired in "
                       f"{STATS.calls} calls")
        if self.rewritten and self.budget_growth:
            keys, exponent = self.budget_growth
            out.append(f"budget growth: past {keys} keys, vertical-slash and block-sparse budgets times "
                       f"(keys / {keys}) ** {exponent:g}")
        if self.rewritten:
            out.append("routing: heads that ran dense at a site's last call, or cost more walked than dense, run through "
                       "SDPA at its next" if self.route_dense else "routing off: heads that run dense take the kernel's dense walk")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()
