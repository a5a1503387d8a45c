"""Lagged routing of the heads that run dense to the device's fused SDPA.

Which heads run dense at a call (a near-dense index, or the quality guard) is decided on the device,
after the index is built; the host cannot know it without a sync, so on the GPU those heads go
through the kernel's dense walk, which is slower than cuDNN on the same work (0.93x of it inside a
Llama-shaped model at 128K on an H200, ``git show 6fb579a:results/explore_prefill_profile_h200_2026-12-01.txt``).
Each rewritten site therefore remembers the heads that ran dense at its previous call, and those the cost
model (:mod:`minference_fx.cost`) found cheaper dense than walked, read back by an asynchronous copy into
pinned memory, and its next call sends them to SDPA instead. A head routed this way runs dense whatever its
index says, so routing can only add keys: it changes speed, never costs accuracy. The index is still built
for routed heads, so a head that stops being near-dense (or costly) is routed back at the call after. Measured on random weights (every head near-dense), 8
layers of the Llama-3-8B shape: 0.98x -> 1.04x HF eager at 128K; at 256K the dense walk keeps up with
cuDNN and routing changes nothing (``results/bench_prefill_h200_2026-12-01_v15*``, ``_v16_256k*`` in git history at 6fb579a).
Under a padding mask (``generate`` always passes one) a call of one batch row routes too: routed heads
run SDPA without the mask, and the row again masked if the mask hides keys (``dense.routable``); with
generate's all-ones mask, 0.98x -> 1.04x at 128K (``results/bench_prefill_h200_2026-12-01_v19*``, BENCHMARKS.md). A padded batch does not route.

A site whose every head is routed runs the whole layer through SDPA, and its index then only serves to see
whether a head has stopped being near-dense or costly. It builds the index at one call in ``RECHECK_EVERY`` at first
(and at once when the prompt has grown ``RECHECK_GROWTH``-fold since the call it last checked), and skips it in
between. On random weights (every head routed) a checking call costs ~1 % of the model's prefill at 64K-128K
(+9 / +24 ms of 865 / 2799 ms, ``results/bench_prefill_h200_2026-12-02_v27*`` at 6fb579a), which the other seven calls
now save. Each check that finds every head routed again doubles the calls until the next, up to ``RECHECK_MAX``: a
layer whose heads all stay dense (the scattered inputs at 32K on an H200) then pays the index at one call in 64, not one
in 8: 0.1 % of cuDNN's time there, where the op measured 1.01x cuDNN once settled (BENCHMARKS.md section 1). A check
that routes fewer heads starts over at ``RECHECK_EVERY``; the checks a probe forces (:meth:`Router.index_at_every_call`)
do not lengthen the interval. A skipped check can only keep a head dense some calls
longer (up to ``RECHECK_MAX`` prompts of under twice the length): slower at worst, never less exact.

No host sync: the host reads a decision only once the copy's event has completed
(``Event.query``); until then it keeps the one before. During a CUDA graph capture nothing is read
or copied, so a captured graph replays the decision of the warm-up calls before it. A capture must not
read a newer one even where it could without a CUDA call: it would take a path its warm-up never ran,
and cuDNN's first call at a shape inside a capture invalidates it
(``git show 6fb579a:results/bench_prefill_h200_2026-12-02_v29_capture_reads_routing_failed.txt``).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import itertools
import threading
from typing import Optional

import torch

NO_SITE = -1
"""the op's ``route_site`` when routing is off"""

RECHECK_EVERY = 8
"""an all-routed site builds its index at one call in this many at first (the others skip it)"""
RECHECK_MAX = 64
"""... doubling from ``RECHECK_EVERY`` up to this many while each check routes every head again"""
RECHECK_GROWTH = 2
"""... and at once at a prompt this many times the last checked one: a head near-dense at a short prompt is
often sparse at a long one (the budgets stay fixed while the causal rows grow)"""

MAX_SITES = 1 << 16
"""Sites whose decisions are kept, most recently observed first. Every compile creates new sites and
nothing says when a compiled model is gone, so the oldest are forgotten past this many: a forgotten
site that is still called only starts over (nothing routed until its next call), never runs wrong."""


@dataclasses.dataclass
class SiteState:
    """What a router remembers of one site."""

    heads: int
    routed: tuple = ()
    host: Optional[torch.Tensor] = None
    """pinned [heads] uint8: whether each head ran dense at the last observed call (GPU only)"""
    ready: Optional[torch.cuda.Event] = None
    """recorded after the copy into ``host``; None once read (or on CPU)"""
    checked_len: int = 0
    """the query length of the last observed call"""
    skipped: int = 0
    """calls since then that skipped the index (every head routed)"""
    all_routed_streak: int = 0
    """decisions in a row, as the host read them, that routed every head (a decision the host never read because
    the next call's overwrote it does not count)"""
    probed: bool = False
    """whether the latest observed call was inside :meth:`Router.index_at_every_call`"""
    plan_dense: tuple = ()
    """the heads the site's plan runs dense at every call: never routed, yet with the routed ones they make a call
    that skips its index (``dense.all_routed``), so the back-off counts them as routed"""


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _heads(dense: torch.Tensor) -> tuple:
    """The indices of a host [heads] tensor's nonzero entries."""
    return tuple(dense.nonzero().flatten().tolist())


class Router:
    """The routing state of a set of sites: each site's last decision, the ids handed out, the recheck policy.

    The op reads and writes :data:`ROUTER`, the process's; a test or a benchmark can build its own."""

    def __init__(self, *, recheck_every: int = RECHECK_EVERY, recheck_max: int = RECHECK_MAX,
                 recheck_growth: int = RECHECK_GROWTH, max_sites: int = MAX_SITES):
        self.recheck_every = recheck_every
        self.recheck_max = recheck_max
        self.recheck_growth = recheck_growth
        self.max_sites = max_sites
        self.states: collections.OrderedDict[int, SiteState] = collections.OrderedDict()
        """per site id, most recently observed last"""
        self._lock = threading.Lock()
        self._site_ids = itertools.count()
        # set by index_at_every_call for its own thread (a context variable, not recheck_every: another thread's
        # model keeps skipping while a probe runs)
        self._every_call = contextvars.ContextVar(f"minference_fx_index_at_every_call_{id(self)}", default=False)

    def new_site(self) -> int:
        """A unique id (for this router) for one rewritten attention site (the op's ``route_site``)."""
        with self._lock:
            return next(self._site_ids)

    def routed_heads(self, site: int, heads: int, device: torch.device) -> tuple:
        """The query heads ``site`` sends to SDPA at this call: those its latest observed call with the same head
        count marked in every batch row (ran dense, or cheaper dense: :meth:`observe`); () for a new site or
        ``NO_SITE``."""
        state = self.states.get(site)
        if site == NO_SITE or state is None or state.heads != heads:
            return ()
        if state.ready is not None and not _capturing(device) and state.ready.query():
            self._adopt_decision(state, _heads(state.host))
        return state.routed

    @staticmethod
    def _adopt_decision(state: SiteState, routed: tuple) -> None:
        """Make ``routed`` the site's decision (once per observed call that the host reads) and count the streak
        of all-routed decisions; a probe's check may end the streak, never lengthen it."""
        state.routed, state.ready = routed, None
        if len(set(routed).union(state.plan_dense)) < state.heads:
            state.all_routed_streak = 0
        elif not state.probed:
            state.all_routed_streak += 1

    def recheck_interval(self, site: int) -> int:
        """Calls from one index build of an all-routed ``site`` to the next (:meth:`interval_after` its streak)."""
        state = self.states.get(site)
        return self.interval_after(state.all_routed_streak if state is not None else 0)

    def interval_after(self, streak: int) -> int:
        """Calls to the next index build after ``streak`` read decisions in a row that routed every head:
        ``recheck_every``, doubled for each after the first, at most :attr:`longest_interval`."""
        return min(self.recheck_every << max(streak - 1, 0), self.longest_interval)

    @property
    def longest_interval(self) -> int:
        """The calls between an all-routed site's index builds once its back-off is done."""
        return max(self.recheck_max, self.recheck_every)

    def index_due(self, site: int, length: int, device: torch.device) -> bool:
        """Whether this call of ``site``, whose every head is routed, builds its index (:meth:`recheck_interval`,
        ``recheck_growth``) at query ``length``; when not, it counts as skipped. A CUDA graph capture counts
        nothing: the graph replays whichever it took."""
        state = self.states.get(site)
        if (state is None or self._every_call.get() or length >= self.recheck_growth * state.checked_len
                or state.skipped >= self.recheck_interval(site) - 1):
            return True
        if not _capturing(device):
            state.skipped += 1
        return False

    @contextlib.contextmanager
    def index_at_every_call(self):
        """Inside, every call builds its index (``index_due`` always True): for a probe that counts what the
        index decides, such as the prefill benchmark's guard counters. Only this thread's calls: others keep
        skipping. Its checks do not lengthen the back-off (:meth:`recheck_interval`)."""
        token = self._every_call.set(True)
        try:
            yield
        finally:
            self._every_call.reset(token)

    def observe(self, site: int, ran_dense: torch.Tensor, length: int, plan_dense: tuple = ()) -> None:
        """Record ``ran_dense`` ([B, H] bool: the (batch, head) pairs this call's index or guard ran dense, and
        those the cost model marked, ``SparseResult.route_next``, at query ``length``) for the next call of
        ``site``, whose plan runs heads ``plan_dense`` dense. On the GPU: an asynchronous copy, read when it has
        landed."""
        if site == NO_SITE or _capturing(ran_dense.device):
            return
        heads = ran_dense.shape[1]
        every_row = ran_dense.all(0)
        state = self.states.get(site)
        if state is None or state.heads != heads:
            state = self.states[site] = SiteState(heads)
            while len(self.states) > self.max_sites:
                self.states.popitem(last=False)
        self.states.move_to_end(site)
        state.checked_len, state.skipped, state.probed = length, 0, self._every_call.get()
        state.plan_dense = plan_dense
        if not ran_dense.is_cuda:
            self._adopt_decision(state, _heads(every_row))
            return
        if state.host is None:
            state.host = torch.empty(heads, dtype=torch.uint8, pin_memory=True)
        state.host.copy_(every_row.to(torch.uint8), non_blocking=True)
        if state.ready is None:
            state.ready = torch.cuda.Event()
        state.ready.record(torch.cuda.current_stream(ran_dense.device))

    def routed_count(self) -> int:
        """Heads routed to SDPA at the latest call of every site (what the host knows now, no sync)."""
        return sum(len(state.routed) for state in self.states.values())

    def reset(self) -> None:
        """Forget every site's decisions (tests; a benchmark between variants)."""
        self.states.clear()


ROUTER = Router()
"""The process's router: every compiled site's ids and decisions, what the op reads and writes."""

new_site = ROUTER.new_site  # the rewrite pass numbers its sites with it
