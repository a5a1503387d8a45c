"""``minference-fx bench breakdown``: where a real model's prefill time goes at one length, and what bounds it.

One model, one prompt length, the same process and inputs for every number:

1. **Eager and compiled wall time.** HF eager (SDPA, cuDNN first) and ``torch.compile(model, backend="minference")``
   with the given semantic config, each the median of ``reps`` forwards after warm-ups (the compiled one warms up
   twice, so routing has seen a call).
2. **Each attention call, taken apart.** One more compiled forward runs with the op's ``run_call`` wrapped: at a
   call whose every head is routed to fused SDPA it times the layer through SDPA; at one that runs the GPU path
   (``sparse_path.sparse_on_gpu``) it times, on that call's own inputs, the whole path, the online index as the path
   builds it (with the guard's estimate and the escalation's index), the plan's dense heads through fused SDPA
   alone, and the whole layer dense through fused SDPA (what eager's attention costs there). The sparse walk is
   what is left of the path. It also counts what the index keeps and walks (:mod:`minference_fx.kernels.density`,
   with the pairs that call ran dense counted whole, and the escalated picks of those that took them) and what
   the config asks (:func:`asked_density`).
3. **The rest.** Non-attention work is the compiled forward's wall time less its attention paths; eager's is its
   wall time less the layers' dense attention.
4. **One forward on the device's clock** (:class:`Timeline`). Steps 2 and 3 re-time each call alone, and their sum
   has disagreed with the forward bench prefill times (BENCHMARKS.md, section 2b). So one more compiled forward, and
   one eager one, run with CUDA events recorded on the stream at the entry and exit of the op's stages (the index, the
   Triton walk, fused SDPA, the copies around the SDPA heads, the op's own glue; eager: fused SDPA). Nested stages
   count their own time only, so the parts and the non-attention rest add up to that forward's wall time on the
   device, whatever the host did. The events sync nothing until the forward ends. The table's times and the
   bounds come from these two forwards; step 2's re-timings stay in the JSON, call by call, and its densities
   weight the bounds.

The arithmetic bounds put the compiled model's non-attention time beside dense attention scaled by a density:
the physical one (what the walk computes, at cuDNN's rate per tile) and the one the config asks. A measurement
tool: the wrapper syncs the device, which the op itself never does.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import statistics
from typing import Callable, Optional
from unittest import mock

import torch

from .. import dense, op, precompile, sparse_path
from ..kernels import attend
from ..kernels.density import Density, index_density, selection_of
from ..plan import LayerPlan, Pattern
from . import assets
from .bench import event_ms
from .bench_prefill import _sdpa_context, build_real, environment, text_prompt_ids

BLOCK_ROWS = 64
"""rows of a block-sparse head's key block (``kernels.reference.BLOCK``)"""


def asked_density(plan: LayerPlan, length: int) -> float:
    """The share of causal (query, key) pairs the plan's budgets ask for at ``length``, every head pooled: a row
    ``r`` of a head keeps ``min(r + 1, keys)`` with ``keys`` the budgets' sum (vertical-slash: columns +
    diagonals; A-shape: sink + window; block-sparse: blocks x 64), a dense head all ``r + 1``."""
    rows = torch.arange(1, length + 1, dtype=torch.float64)
    causal = float(rows.sum())
    kept = 0.0
    for head in plan.heads:
        if head.pattern is Pattern.DENSE:
            kept += causal
            continue
        keys = head.budget_a * BLOCK_ROWS if head.pattern is Pattern.BLOCK_SPARSE else head.budget_a + head.budget_b
        kept += float(rows.clamp(max=max(keys, 1)).sum())
    return kept / (causal * len(plan.heads))


@dataclasses.dataclass
class LayerRow:
    """One attention call of the prompt's length, taken apart (milliseconds, densities as shares)."""

    call: int
    path_ms: float
    """the op's GPU path: index, sparse walk, dense heads"""
    index_ms: float
    dense_heads_ms: float
    """the plan's dense heads and the routed ones through fused SDPA (0 without any)"""
    dense_layer_ms: float
    """every head dense through fused SDPA: the layer's attention in eager"""
    physical: float
    logical: float
    asked: float
    plan_dense_heads: int
    ran_dense_pairs: int
    """(batch, head) pairs this call's index or guard ran dense"""
    routed_heads: int

    @property
    def walk_ms(self) -> float:
        return max(self.path_ms - self.index_ms - self.dense_heads_ms, 0.0)


@dataclasses.dataclass
class Span:
    """One stage's call, between two events recorded on the stream, with the stages it called inside it."""

    part: str
    start: object
    end: object
    inner: list["Span"] = dataclasses.field(default_factory=list)

    def ms(self) -> float:
        return self.start.elapsed_time(self.end)


class SpanRecorder:
    """Wraps stage functions so that each call records an event pair on the current stream, nested as the calls
    nest. ``new_event`` makes an event with ``record()`` and ``elapsed_time(other)`` (``torch.cuda.Event`` with
    timing on the GPU)."""

    def __init__(self, new_event: Callable[[], object]):
        self.new_event = new_event
        self.spans: list[Span] = []
        self._open: list[Span] = []

    def wrap(self, part: str, fn: Callable) -> Callable:
        def stage(*args, **kwargs):
            span = Span(part, self.new_event(), self.new_event())
            (self._open[-1].inner if self._open else self.spans).append(span)
            self._open.append(span)
            span.start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                span.end.record()
                self._open.pop()
        return stage

    def own_ms(self) -> dict[str, float]:
        """Each part's time less the time of the stages it called: the parts add up to the outer spans' time."""
        totals: collections.Counter = collections.Counter()
        pending = list(self.spans)
        while pending:
            span = pending.pop()
            totals[span.part] += span.ms() - sum(inner.ms() for inner in span.inner)
            pending.extend(span.inner)
        return dict(totals)


# The op's stages as its modules call them (each by module attribute, so a wrapper set on the module is the one
# called). The order is the table's.
INDEX = "index (estimate, picks, guard mass)"
WALK = "Triton walk (sparse tiles, pairs forced dense)"
SDPA = "fused SDPA (plan-dense, routed, dense-path heads)"
COPIES = "copies around the SDPA heads"
GLUE = "op glue (shares, routing, guard counters)"
COMPILED_STAGES = (
    (INDEX, sparse_path, "guarded_index_on_gpu"),
    (WALK, attend, "sparse_attention_triton"),
    (SDPA, dense, "dense_attention"),
    (COPIES, dense, "dense_heads_by_sdpa"),
    (COPIES, dense, "every_head_routed"),
    (GLUE, op, "run_call"),
)
EAGER_STAGES = (("fused SDPA", torch.nn.functional, "scaled_dot_product_attention"),)
REST = "non-attention (the rest of the forward)"


@dataclasses.dataclass
class Timeline:
    """One forward on the device's clock: its wall time and each stage's own time (ms); the rest is
    :meth:`rest_ms`."""

    wall_ms: float
    parts_ms: dict[str, float]
    calls_ms: list[float] = dataclasses.field(default_factory=list)
    """each outermost stage call's time, in order: the compiled forward's op calls (a layer's attention each), or
    eager's SDPA calls"""

    @property
    def op_calls(self) -> int:
        return len(self.calls_ms)

    def rest_ms(self) -> float:
        return self.wall_ms - sum(self.parts_ms.values())

    def attention_ms(self) -> float:
        return sum(self.parts_ms.values())


@contextlib.contextmanager
def recording(stages, recorder: SpanRecorder):
    """``stages`` (part, module, function name) wrapped by ``recorder`` while the block runs."""
    with contextlib.ExitStack() as patches:
        for part, module, name in stages:
            patches.enter_context(mock.patch.object(module, name, recorder.wrap(part, getattr(module, name))))
        yield recorder


def timeline(forward: Callable[[], object], stages, new_event: Callable[[], object], sync: Callable[[], None]) -> Timeline:
    """Run ``forward`` once with ``stages`` recorded; its wall time is between two events around it."""
    recorder = SpanRecorder(new_event)
    begin, end = new_event(), new_event()
    sync()
    with recording(stages, recorder):
        begin.record()
        forward()
        end.record()
    sync()
    parts = recorder.own_ms()
    return Timeline(begin.elapsed_time(end), {part: parts.get(part, 0.0) for part, _, _ in stages},
                    [span.ms() for span in recorder.spans])


def _cuda_event():
    return torch.cuda.Event(enable_timing=True)


@dataclasses.dataclass
class Breakdown:
    meta: dict
    eager_ms: float
    compiled_ms: float
    layers: list[LayerRow]
    compiled_timeline: Optional[Timeline] = None
    eager_timeline: Optional[Timeline] = None

    def totals(self) -> dict:
        """One accounting: with the timelines, every time is theirs (their parts add up to their walls: the module
        docstring, step 4); without them, the calls re-timed alone. Densities are the calls' own either way, weighted
        by each call's dense attention time."""
        rows = self.layers
        weight = sum(r.dense_layer_ms for r in rows) or 1.0
        physical = sum(r.physical * r.dense_layer_ms for r in rows) / weight
        asked = sum(r.asked * r.dense_layer_ms for r in rows) / weight
        compiled, eager = self.compiled_timeline, self.eager_timeline
        if compiled is not None and eager is not None:
            parts = compiled.parts_ms
            times = dict(index_ms=parts[INDEX], walk_ms=parts[WALK], dense_heads_ms=parts[SDPA] + parts[COPIES],
                         glue_ms=parts[GLUE], attention_ms=compiled.attention_ms(), non_attention_ms=compiled.rest_ms(),
                         compiled_wall_ms=compiled.wall_ms, eager_attention_ms=eager.attention_ms(),
                         eager_non_attention_ms=eager.rest_ms(), eager_wall_ms=eager.wall_ms)
        else:
            attention = sum(r.path_ms for r in rows)
            dense_attention = sum(r.dense_layer_ms for r in rows)
            times = dict(index_ms=sum(r.index_ms for r in rows), walk_ms=sum(r.walk_ms for r in rows),
                         dense_heads_ms=sum(r.dense_heads_ms for r in rows), glue_ms=0.0, attention_ms=attention,
                         non_attention_ms=self.compiled_ms - attention, compiled_wall_ms=self.compiled_ms,
                         eager_attention_ms=dense_attention, eager_non_attention_ms=self.eager_ms - dense_attention,
                         eager_wall_ms=self.eager_ms)
        return dict(
            **times,
            physical_density=statistics.fmean(r.physical for r in rows) if rows else None,
            logical_density=statistics.fmean(r.logical for r in rows) if rows else None,
            asked_density=statistics.fmean(r.asked for r in rows) if rows else None,
            bound_physical_ms=times["non_attention_ms"] + physical * times["eager_attention_ms"],
            bound_asked_ms=times["non_attention_ms"] + asked * times["eager_attention_ms"],
        )

    def table(self) -> str:
        t = self.totals()
        n = len(self.layers)
        if not n:  # below the crossover every call runs dense SDPA: nothing to take apart
            return (f"{self.meta['model']} at {self.meta['length']} tokens, {self.meta['config']}\n"
                    f"no call took the sparse path (this length runs dense); compiled {self.compiled_ms:.1f} ms, "
                    f"eager {self.eager_ms:.1f} ms, {self.eager_ms / self.compiled_ms:.2f}x eager")
        lines = [f"{self.meta['model']} at {self.meta['length']} tokens, {self.meta['config']}"]
        lines += self._timeline_lines() or self._retimed_lines(t)
        eager_wall = t["eager_wall_ms"]
        lines += [
            f"median of {self.meta.get('reps', '?')} timed forwards: compiled {self.compiled_ms:.1f} ms, eager "
            f"{self.eager_ms:.1f} ms, {self.eager_ms / self.compiled_ms:.2f}x eager",
            f"density, mean over calls: asked by the config {t['asked_density']:.4f}, index logical "
            f"{t['logical_density']:.4f}, physical {t['physical_density']:.4f}",
            f"plan-dense heads {sum(r.plan_dense_heads for r in self.layers)}, pairs run dense by index or guard "
            f"{sum(r.ran_dense_pairs for r in self.layers)}, routed heads {sum(r.routed_heads for r in self.layers)}",
            f"bound (compiled non-attention + dense attention x density): physical {t['bound_physical_ms']:.1f} ms "
            f"({eager_wall / t['bound_physical_ms']:.2f}x eager), asked {t['bound_asked_ms']:.1f} ms "
            f"({eager_wall / t['bound_asked_ms']:.2f}x eager)",
        ]
        if self.compiled_timeline is not None and not self.compiled_timeline.op_calls:
            lines.append("warning: the compiled forward ran none of the op's stages in Python (a CUDA graph replay?); "
                         "its parts read 0 and the rest holds its attention")
        for what, retries in (("compiled forward was timed", self.meta.get("compiled_alloc_retries")),
                              ("timelines ran", self.meta.get("timeline_alloc_retries"))):
            if retries:
                lines.append(f"warning: the allocator freed its cache {retries} time(s) while the {what}; those times "
                             "are not the steady state")
        return "\n".join(lines)

    def _retimed_lines(self, t: dict) -> list[str]:
        share = lambda ms: f"{100 * ms / self.compiled_ms:5.1f} %"  # noqa: E731
        return [
            "each call re-timed alone (the parts need not add up to the forward):",
            f"{'part':<44}{'ms':>10}  share of compiled",
            f"{'index (' + str(len(self.layers)) + ' calls)':<44}{t['index_ms']:>10.1f}  {share(t['index_ms'])}",
            f"{'sparse walk (and pairs forced dense)':<44}{t['walk_ms']:>10.1f}  {share(t['walk_ms'])}",
            f"{'plan-dense and routed heads (fused SDPA)':<44}{t['dense_heads_ms']:>10.1f}  {share(t['dense_heads_ms'])}",
            f"{'non-attention (compiled)':<44}{t['non_attention_ms']:>10.1f}  {share(t['non_attention_ms'])}",
            f"{'compiled total (wall)':<44}{self.compiled_ms:>10.1f}  {self.eager_ms / self.compiled_ms:.2f}x eager",
            f"{'eager total (wall)':<44}{self.eager_ms:>10.1f}",
            f"{'  of which dense attention (fused SDPA)':<44}{t['eager_attention_ms']:>10.1f}",
            f"{'  non-attention (eager)':<44}{t['eager_non_attention_ms']:>10.1f}",
        ]

    def _timeline_lines(self) -> list[str]:
        compiled, eager = self.compiled_timeline, self.eager_timeline
        if compiled is None or eager is None:
            return []
        share = lambda ms: f"{100 * ms / compiled.wall_ms:6.1f} %"  # noqa: E731
        lines = [f"one forward each on the device's clock, {compiled.op_calls} op calls (each part its own time; they "
                 "add up to the wall):",
                 f"{'part':<52}{'compiled ms':>12}{'share':>9}{'eager ms':>10}"]
        for part, ms in compiled.parts_ms.items():
            lines.append(f"{part:<52}{ms:>12.1f}{share(ms)}")
        for part, ms in eager.parts_ms.items():
            lines.append(f"{'eager: ' + part:<52}{'':>21}{ms:>10.1f}")
        lines.append(f"{REST:<52}{compiled.rest_ms():>12.1f}{share(compiled.rest_ms())}{eager.rest_ms():>10.1f}")
        if compiled.op_calls == eager.op_calls > 0:  # one op call and one SDPA call a layer: compare them
            ratios = sorted(((c / e if e > 0 else float("inf"), layer, c, e) for layer, (c, e)
                             in enumerate(zip(compiled.calls_ms, eager.calls_ms))), reverse=True)
            lines.append("layers whose attention kept most of eager's time (compiled / eager ms): " + ", ".join(
                f"{layer}: {c:.1f} / {e:.1f}" for _, layer, c, e in ratios[:3]))
        lines.append(f"{'wall (this forward)':<52}{compiled.wall_ms:>12.1f}{'':>9}{eager.wall_ms:>10.1f}  "
                     f"{eager.wall_ms / compiled.wall_ms:.2f}x eager")
        return lines

    def save(self, path: str) -> None:
        timelines = {name: None if t is None else {**dataclasses.asdict(t), "rest_ms": t.rest_ms()}
                     for name, t in (("compiled_timeline", self.compiled_timeline),
                                     ("eager_timeline", self.eager_timeline))}
        with open(path, "w") as f:
            json.dump({"meta": self.meta, "eager_ms": self.eager_ms, "compiled_ms": self.compiled_ms,
                       "totals": self.totals(), "layers": [dataclasses.asdict(r) for r in self.layers], **timelines},
                      f, indent=1)


def _take_apart(length: int, rows: list[LayerRow]):
    """A stand-in for ``op.run_call`` that takes apart into ``rows`` every call of ``length`` rows that runs the
    sparse path or, every head routed to fused SDPA, skips it (the background precompile's short calls and the
    dense paths are left alone)."""
    real = op.run_call

    def wrapper(call, q, k, v):
        out = real(call, q, k, v)
        if q.shape[-2] == length and call.path in (op.CallPath.SPARSE_GPU, op.CallPath.ALL_ROUTED):
            rows.append(_layer_row(call, q, k, v, length, len(rows)))
        return out

    return wrapper


def _layer_row(call, q, k, v, length: int, number: int) -> LayerRow:
    """One call taken apart, timed on its own inputs."""
    plan, masks, scale = call.plan, call.masks, call.scale
    plan_dense = dense.split_plan(plan).dense_heads
    with _sdpa_context("eager", q.device):  # cuDNN first, as eager runs it
        dense_layer_ms = event_ms(lambda: dense.dense_attention(q, k, v, masks, scale))
    common = dict(call=number, dense_layer_ms=dense_layer_ms, asked=asked_density(plan, length),
                  plan_dense_heads=len(plan_dense), routed_heads=len(call.routed))
    if call.path is op.CallPath.ALL_ROUTED:  # no index, no walk: the whole layer through fused SDPA
        path_ms = event_ms(lambda: dense.every_head_routed(q, k, v, masks, scale, call.walk_launch))
        return LayerRow(path_ms=path_ms, index_ms=0.0, dense_heads_ms=path_ms, physical=1.0, logical=1.0,
                        ran_dense_pairs=0, **common)  # routed, counted in routed_heads: no index or guard ran

    def path():
        return sparse_path.sparse_on_gpu(q, k, v, plan, scale, masks, call.guard_threshold, call.sparse_launch,
                                         call.walk_launch, call.routed, call.escalated)

    def index():  # as the path builds it: with the guard's estimate and, where the call has one, the escalation's
        return sparse_path.guarded_index_on_gpu(q, k, plan, scale, masks, call.guard_threshold, call.escalated)

    result = path()
    path_ms = event_ms(path)
    index_ms = event_ms(index)
    # the heads the path hands to fused SDPA: the plan's dense ones and the routed ones
    heads = tuple(sorted(set(plan_dense) | set(call.routed)))
    out = torch.empty_like(q)
    with _sdpa_context("eager", q.device):
        dense_heads_ms = event_ms(lambda: dense.dense_heads_by_sdpa(
            q, k, v, out, heads, dense.kv_heads_of(heads, q.shape[1] // k.shape[1]), scale, masks)) if heads else 0.0
    guarded = index()
    # every pair the call ran dense counts whole: those its index or guard sent dense, and the routed heads,
    # which fused SDPA ran (``ran_dense`` leaves them out: routing reads each head's own index)
    dense_pairs = result.ran_dense
    if call.routed:
        routed = dense.dense_pairs(call.routed, q)
        dense_pairs = routed if dense_pairs is None else dense_pairs | routed
    density = _density(q, k, plan, guarded.index, masks.q_offset, scale, dense_pairs)
    if guarded.escalated_pairs is not None:  # the pairs that took the escalated index keep its picks
        up = _density(q, k, call.escalated, guarded.index, masks.q_offset, scale, dense_pairs)
        took = guarded.escalated_pairs
        density = Density(torch.where(took, up.logical_keys, density.logical_keys), density.causal_keys,
                          torch.where(took, up.physical_tiles, density.physical_tiles), density.causal_tiles)
    physical, logical = density.overall()
    return LayerRow(path_ms=path_ms, index_ms=index_ms, dense_heads_ms=dense_heads_ms, physical=physical,
                    logical=logical, ran_dense_pairs=int(result.ran_dense.sum()) if result.ran_dense is not None else 0,
                    **common)


def _density(q, k, plan: LayerPlan, index, q_offset: int, scale: float, ran_dense) -> Density:
    selection = selection_of(q, k, plan, scale=scale, q_offset=q_offset)
    return index_density(index, plan, selection, sq=q.shape[-2], skv=k.shape[-2], q_offset=q_offset,
                         force_dense=ran_dense)


def breakdown(model_name: str, length: int, *, config_path: Optional[str] = None, reps: int = 3,
              minference_options: Optional[dict] = None, command: Optional[str] = None) -> Breakdown:
    """Time ``model_name`` (:data:`assets.REAL_MODELS`) at ``length`` tokens of Austen's prose, eager against the
    backend with ``config_path`` (default: the backend's default semantic config) and ``minference_options``,
    and take the compiled forward's attention apart call by call."""
    if model_name not in assets.REAL_MODELS:
        raise ValueError(f"unknown model {model_name!r}; known: {', '.join(assets.REAL_MODELS)}")
    if not torch.cuda.is_available():
        raise RuntimeError("bench breakdown needs a CUDA GPU")
    device = torch.device("cuda")
    model, tokenizer = build_real(model_name, length, device, torch.bfloat16)
    ids = text_prompt_ids(tokenizer, length, 0, device)

    def forward(fn, variant: str):
        def run():
            with torch.inference_mode(), _sdpa_context(variant, device):
                fn(input_ids=ids, logits_to_keep=1)
        return run

    def wall_ms(fn, variant: str) -> float:
        return event_ms(forward(fn, variant), reps)

    eager_ms = wall_ms(model, "eager")
    # eager's cached blocks would be carved up for the compiled graph's other sizes: bench prefill times each
    # variant in a process of its own, so this one starts from an empty cache too
    torch.cuda.empty_cache()
    options = {**(minference_options or {}), **({"config": config_path} if config_path else {})}
    compiled = torch.compile(model, backend="minference", options=options)
    # the graph bench prefill times and a server runs, one for every length: compiled static, this tool's forward
    # disagreed with bench prefill's (BENCHMARKS.md, section 2b)
    torch._dynamo.mark_dynamic(ids, 1)
    with torch.inference_mode():
        compiled(input_ids=ids, logits_to_keep=1)  # compiles; routing sees its first call
    precompile.wait()  # the background compile of other lengths' kernels would share the device with the timing
    def alloc_retries() -> int:
        return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)

    retries = alloc_retries()
    compiled_ms = wall_ms(compiled, "minference")
    # each retry frees the allocator's cache and syncs: a timing with any is not the steady state bench prefill sees
    retries = alloc_retries() - retries
    timeline_retries = alloc_retries()
    compiled_timeline = timeline(forward(compiled, "minference"), COMPILED_STAGES, _cuda_event, torch.cuda.synchronize)
    torch.cuda.empty_cache()  # as between eager's timing and the compile: neither carves up the other's blocks
    eager_timeline = timeline(forward(model, "eager"), EAGER_STAGES, _cuda_event, torch.cuda.synchronize)
    timeline_retries = alloc_retries() - timeline_retries
    torch.cuda.empty_cache()
    rows: list[LayerRow] = []
    # the op calls run_call through its module, so the stand-in set there is the one called
    with mock.patch.object(op, "run_call", _take_apart(length, rows)), torch.inference_mode():
        compiled(input_ids=ids, logits_to_keep=1)
    real = assets.REAL_MODELS[model_name]
    meta = {**environment(device), "command": command or "breakdown(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": real.title, "model_name": model_name, "length": length, "yarn_factor": real.yarn_factor(length),
            "config": config_path or "the backend's default semantic config", "options": options, "reps": reps,
            "attention_calls": len(rows), "layers": real.layers,
            "compiled_alloc_retries": retries, "timeline_alloc_retries": timeline_retries}
    return Breakdown(meta, eager_ms, compiled_ms, rows, compiled_timeline, eager_timeline)
