"""Time launch configs and the dense/sparse crossover; write what wins to the cache.

Only ``warm_up`` (the ``minference-fx autotune`` command) times anything, and
never inside a forward pass. The timer and the workload are parameters, so the
logic runs on CPU with fake timings and on the GPU with ``do_bench`` and
:class:`~.workload.CudaWorkload`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol, Sequence, Union

import torch
import triton.testing

from ..cost import WalkCost
from . import cache, space
from .cache import CrossoverKey, TuneEntry, TuneKey
from .identity import DeviceIdentity, dtype_name, kernel_source_hash, triton_version
from .progress import ProgressBar
from .workload import MIN_HEAD_DIM, CudaWorkload

Timer = Callable[[Callable[[], object]], float]
"""Milliseconds one call of the thunk takes."""

# Dense is exact, and the tuner's win overstates the model's: its structured inputs leave no head
# near-dense (real weights leave some, and those run SDPA on top), and in a model the op's host work
# queues behind the rest of the layer's. SmolLM2's shape at 32K won by 1.06x here and ran 0.67x of HF
# eager in the model (git show 6fb579a:results/bench_prefill_smollm2_h200_2026-12-01_v15_table_v14.txt), so sparse must
# be this much faster (a fraction of its own time) before the crossover leaves dense.
CROSSOVER_MARGIN = 0.5
# The input families (``workload.FAMILIES``) the sparse walk's launch configs are chosen against: the structured
# one, whose slashes cluster, and the scattered one, whose lone far diagonals each cost a block. The crossover and
# the cost model's rates come from the first alone: the crossover's margin already stands for what real heads add
# (above), and a head the scattered family would make slower than dense is the cost model's to route at run time.
TUNE_FAMILIES = ("structured", "scattered")
# Lengths the crossover is measured at. Dense SDPA past 64K costs seconds per call and is
# never the faster one there, so longer prompts are tuned for launch configs only.
CROSSOVER_LENGTHS = tuple(1 << p for p in range(10, 17))  # 1K .. 64K

# The sparse kernel launched for the forced-dense (batch, head) pairs only (see ``sparse_path.sparse_on_gpu``).
DENSE_WALK = "dense_walk"

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def do_bench(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, return_mode="median"))


@dataclasses.dataclass(frozen=True)
class TuneResult:
    kernel: str
    best: TuneEntry
    timings_by_way: dict[TuneEntry, tuple[float, ...]]
    """every way's time of each candidate, in ``tune``'s order of ways"""
    failures: dict[TuneEntry, str]
    """candidates that raised (out of resources, compile errors), with the message"""

    @property
    def timings(self) -> dict[TuneEntry, float]:
        """each candidate's time on the first way"""
        return {config: times[0] for config, times in self.timings_by_way.items()}

    @property
    def best_ms(self) -> float:
        return self.timings_by_way[self.best][0]


def tune(kernel: str, candidates: Iterable[TuneEntry], run_candidate: Callable[[TuneEntry], object],
         timer: Optional[Timer] = None, *, on_timed: Optional[Callable[[TuneEntry], None]] = None,
         also: Sequence[Callable[[TuneEntry], object]] = ()) -> TuneResult:
    """Time ``run_candidate(config)`` for every candidate and keep the fastest (the first among equals).

    ``also``: more ways to run a candidate (the same kernel on other input families). Then the winner is the
    candidate whose times, each over its way's fastest, sum lowest: a config fast on one family and slow on another
    loses to one near the best on every family. ``timings`` and ``best_ms`` stay the first way's."""
    timer = timer or do_bench
    runs = (run_candidate, *also)
    per_way, failures = {}, {}
    for config in candidates:
        try:
            per_way[config] = [float(timer(lambda config=config, run=run: run(config))) for run in runs]
        except Exception as e:  # a config the compiler or the GPU refuses is just not a winner
            failures[config] = f"{type(e).__name__}: {e}"
        if on_timed is not None:
            on_timed(config)
    if not per_way:
        raise RuntimeError(f"{kernel}: every candidate failed: " + "; ".join(f"{c}: {m}" for c, m in failures.items()))
    # a zero time (a fake timer's) must not divide: the floor keeps the ordering of the others
    fastest = [max(min(times[way] for times in per_way.values()), 1e-9) for way in range(len(runs))]
    slowdown = lambda config: sum(t / f for t, f in zip(per_way[config], fastest))  # noqa: E731
    return TuneResult(kernel, min(per_way, key=slowdown), {c: tuple(t) for c, t in per_way.items()}, failures)


def find_crossover(lengths: Iterable[int], time_dense, time_sparse, *, margin: float = 0.0) -> Optional[int]:
    """The smallest measured length from which sparse beats dense there and at every longer measured length.

    ``time_dense`` and ``time_sparse`` map a length to milliseconds (callables or
    mappings). Sparse wins where ``(1 + margin)`` times its time is under dense's.
    Returns None when sparse does not win at the longest length.
    """
    dense, sparse = _as_fn(time_dense), _as_fn(time_sparse)
    crossover = None
    # a win below a loss is noise or a bump, not a crossover: walk down from the longest
    for length in sorted(set(lengths), reverse=True):
        if not sparse(length) * (1.0 + margin) < dense(length):
            break
        crossover = length
    return crossover


def _as_fn(times) -> Callable[[int], float]:
    return times.__getitem__ if isinstance(times, Mapping) else times


class Workload(Protocol):
    """What the tuner times at one shape (see :class:`~.workload.CudaWorkload`)."""

    identity: DeviceIdentity
    smem_limit: int

    def kernel(self, length: int, config: TuneEntry) -> Callable[[], object]: ...
    def dense_walk(self, length: int, config: TuneEntry) -> Callable[[], object]: ...
    def sparse(self, length: int, config: TuneEntry, dense_walk: TuneEntry) -> Callable[[], object]: ...
    def dense(self, length: int) -> Callable[[], object]: ...
    def index(self, length: int) -> Callable[[], object]: ...
    def kept_share(self, length: int) -> float: ...


@dataclasses.dataclass
class WarmUpReport:
    path: Path
    results: dict[int, TuneResult]
    dense_ms: dict[int, float]
    sparse_ms: dict[int, float]
    crossover: Optional[int]
    dense_walk: dict[int, TuneResult] = dataclasses.field(default_factory=dict)
    """the dense walk's tuning, at the lengths asked for"""
    cost: Optional[WalkCost] = None
    """the cost model's rates, at the longest crossover length"""
    families: tuple = ("structured",)
    """the input families the sparse walk's launch configs were chosen against (its times are the first's)"""

    def __str__(self) -> str:
        lines = [f"launch configs chosen against the input families {', '.join(self.families)}; times on "
                 f"{self.families[0]}",
                 f"{'length':>8} {'config (M, N, warps, stages)':>29} {'kernel ms':>10} {'default ms':>10} {'tuned gain':>10} "
                 f"{'sparse ms':>10} {'dense ms':>10}"]
        for length, r in sorted(self.results.items()):
            sp, de = self.sparse_ms.get(length), self.dense_ms.get(length)
            default_ms = r.timings.get(cache.DEFAULT_ENTRY)  # what an untuned lookup would launch
            gain = "-" if default_ms is None else f"{default_ms / r.best_ms:.2f}x"
            best = f"{r.best.BLOCK_M}, {r.best.BLOCK_N}, {r.best.num_warps}, {r.best.num_stages}"
            lines.append(f"{length:>8} {best:>29} {r.best_ms:>10.3f} "
                         f"{'-' if default_ms is None else f'{default_ms:.3f}':>10} {gain:>10} "
                         f"{'-' if sp is None else f'{sp:.3f}':>10} {'-' if de is None else f'{de:.3f}':>10}")
        for length, r in sorted(self.dense_walk.items()):
            default_ms = r.timings.get(cache.DEFAULT_ENTRIES["dense_walk"])
            best = f"{r.best.BLOCK_M}, {r.best.BLOCK_N}, {r.best.num_warps}, {r.best.num_stages}"
            gain = "-" if default_ms is None else f"{default_ms / r.best_ms:.2f}x"
            lines.append(f"dense walk @ {length}: {best}, {r.best_ms:.3f} ms (default "
                         f"{'-' if default_ms is None else f'{default_ms:.3f}'} ms, tuned gain {gain})")
        if self.dense_ms:
            shown = "never (dense at every measured length)" if self.crossover is None else f"sparse from {self.crossover}"
            lines.append(f"crossover: {shown}")
        failed = {(r.kernel, config): message for r in (*self.results.values(), *self.dense_walk.values())
                  for config, message in r.failures.items()}
        if failed:  # on any family: a config that fails on one is no winner
            (kernel, config), message = next(iter(failed.items()))
            lines.append(f"{len(failed)} candidate launch(es) failed and were left out, e.g. {kernel} {config}: {message}")
        if self.cost is not None:
            lines.append(describe_cost(self.cost))
        lines.append(f"written to {self.path}")
        return "\n".join(lines)


def as_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from None


def warm_up(lengths: Sequence[int], head_dim: int, gqa: int, dtype: Union[str, torch.dtype] = torch.bfloat16,
            progress: bool = True, *, num_kv_heads: int = 8, crossover_lengths: Sequence[int] = CROSSOVER_LENGTHS,
            workload: Optional[Workload] = None, timer: Optional[Timer] = None, path=None,
            families: Sequence[str] = TUNE_FAMILIES, also: Optional[Sequence[Workload]] = None) -> WarmUpReport:
    """Tune the sparse attention kernel at ``lengths``, its dense walk there, and the crossover; write them to the cache.

    Every length of ``crossover_lengths`` up to the longest of ``lengths`` is tuned too,
    since the crossover times the sparse path with its tuned config. Entries are
    written after each length, so an interrupted run keeps what it measured.
    From the shortest length asked for up, the sparse walk's launch config is chosen against every input family
    of ``families`` that can build ``head_dim`` (:func:`tune`'s ``also``); the crossover grid's shorter lengths,
    the crossover and the cost are the first family's (:data:`TUNE_FAMILIES` says why).
    Needs CUDA unless a ``workload`` (the first family's) and ``also`` (the others') are given.
    """
    dtype = as_dtype(dtype)
    timer = timer or do_bench
    if workload is None:
        workload = CudaWorkload(head_dim, gqa, dtype, num_kv_heads=num_kv_heads, family=families[0])
        if also is None:  # a family that cannot build this head dim is left out; the report lists those timed
            also = [CudaWorkload(head_dim, gqa, dtype, num_kv_heads=num_kv_heads, family=f) for f in families[1:]
                    if head_dim >= MIN_HEAD_DIM.get(f, 0)]
    also = list(also or ())
    path = Path(path) if path is not None else cache.cache_path()
    kernel = "sparse_attention"
    candidates = {kernel: space.candidates(kernel, head_dim, dtype.itemsize, workload.smem_limit),
                  DENSE_WALK: space.candidates(DENSE_WALK, head_dim, dtype.itemsize, workload.smem_limit)}
    thunks = {kernel: workload.kernel, DENSE_WALK: workload.dense_walk}
    top = max(lengths)
    grid = sorted(length for length in set(crossover_lengths) if length <= top)
    todo = sorted(set(lengths) | set(grid))
    # the dense walk runs only what the index leaves near-dense: tuned at the lengths asked for, the
    # crossover grid times it with the default (on the tuner's structured inputs it has nothing to run)
    walk_todo = set(lengths)
    bar = ProgressBar(len(todo) * len(candidates[kernel]) + len(walk_todo) * len(candidates[DENSE_WALK]) + 2 * len(grid),
                      enabled=progress)
    measured_on = _measured_on(workload, dtype, head_dim, gqa)

    results, walks, dense_ms, sparse_ms = {}, {}, {}, {}
    try:
        for length in todo:
            for name in (DENSE_WALK, kernel) if length in walk_todo else (kernel,):
                # the other families from the shortest length asked for up (the grid's lengths between the asked
                # ones run sparse too, 64K among them); the grid's shorter ones, mostly under the crossover, would
                # double the tune's time for configs that run dense; and the dense walk computes every tile of the
                # heads it runs, whatever the inputs, so one family times it
                others = ([lambda c, n=length, w=w: w.kernel(n, c)() for w in also]
                          if name == kernel and length >= min(lengths) else [])
                result = tune(name, candidates[name], lambda c, n=length, run=thunks[name]: run(n, c)(), timer,
                              on_timed=lambda c, n=length, name=name: bar.step(
                                  f"{name} @ {n}: BLOCK_M {c.BLOCK_M} BLOCK_N {c.BLOCK_N} warps {c.num_warps} "
                                  f"stages {c.num_stages}"), also=others)
                (results if name == kernel else walks)[length] = result
                cache.write(configs={TuneKey.of(name, measured_on, length): result.best}, path=path)
            if length in grid:
                dense_ms[length] = float(timer(workload.dense(length)))
                bar.step(f"dense @ {length}")
                walk = walks[length].best if length in walks else cache.DEFAULT_ENTRIES[DENSE_WALK]
                sparse_ms[length] = float(timer(workload.sparse(length, results[length].best, walk)))
                bar.step(f"index + sparse @ {length}")
    finally:
        bar.close()
    crossover = cost = None
    if grid:
        crossover = find_crossover(grid, dense_ms, sparse_ms, margin=CROSSOVER_MARGIN)
        top = grid[-1]
        whole = top == max(crossover_lengths)
        if whole:
            # a cost from a shorter grid would replace the full one's with launch overhead (a user cache wins over
            # the shipped table): only the whole grid measures it. The walk is timed again beside the dense time
            # rather than taken from the sweep: on an H100 (2026-12-07) the sweep timed Qwen's 64K walk 11 % slower
            # than a stand-alone run of the same config did, and its rate came out 11 % under the costs step's
            cost = measure_cost(workload, top, results[top].best, timer, dense_ms=dense_ms[top])
        # a shorter grid that never saw sparse win says nothing past its end: its "never sparse" would replace
        # the shipped crossover, and the op ran dense at 128K after a tune that stopped at 16K
        crossovers = {measured_on: crossover} if whole or crossover is not None else {}
        cache.write(crossovers=crossovers, costs={measured_on: cost} if cost else {}, path=path)
    return WarmUpReport(path, results, dense_ms, sparse_ms, crossover, walks, cost,
                        tuple(getattr(w, "family", "given") for w in (workload, *also)))


def _measured_on(workload: Workload, dtype: torch.dtype, head_dim: int, gqa: int) -> CrossoverKey:
    """The key of what this process times on ``workload``'s device, with these kernels and this Triton."""
    ident = workload.identity
    return CrossoverKey(kernel_source_hash(), ident.gpu, ident.capability, triton_version(), dtype_name(dtype),
                        head_dim, gqa)


def measure_cost(workload: Workload, length: int, config: TuneEntry, timer: Timer, *,
                 dense_ms: Optional[float] = None, kernel_ms: Optional[float] = None) -> WalkCost:
    """The cost model's :class:`~minference_fx.cost.WalkCost` of ``workload``'s shape at ``length``: the sparse
    walk (launch ``config``) over the share of causal key tiles its index keeps, against the fused SDPA over all of them; and
    the index against the fused SDPA. Times what is not given. ValueError when the timings make no cost (a zero
    time, a NaN): nothing is written then, since a table holding it would be read as foreign as a whole."""
    dense_ms = float(timer(workload.dense(length))) if dense_ms is None else dense_ms
    kernel_ms = float(timer(workload.kernel(length, config))) if kernel_ms is None else kernel_ms
    index_ms = float(timer(workload.index(length)))
    if not (dense_ms > 0 and kernel_ms > 0):
        raise ValueError(f"cannot weigh the walk at {length}: dense {dense_ms} ms, kernel {kernel_ms} ms")
    return cache.checked_cost(WalkCost(walk_rate=workload.kept_share(length) * dense_ms / kernel_ms,
                                       index_share=index_ms / dense_ms, measured_at=length))


def describe_cost(cost: WalkCost) -> str:
    return (f"cost at {cost.measured_at}: the sparse walk runs {cost.walk_rate:.3f}x the fused SDPA's rate per key "
            f"tile (heads keeping at least that share route to SDPA); the index costs {cost.index_share:.4f} of "
            f"the dense layer")


def measure_costs(head_dim: int, gqa: int, dtype: Union[str, torch.dtype] = torch.bfloat16, *, num_kv_heads: int = 8,
                  family: str = TUNE_FAMILIES[0],
                  length: int = max(CROSSOVER_LENGTHS), workload: Optional[Workload] = None,
                  timer: Optional[Timer] = None, path=None) -> WalkCost:
    """Measure the cost model's rates alone (:func:`measure_cost`), with the launch config the cache holds for
    ``length``, and write them to the cache: for a table tuned before the rates existed."""
    dtype = as_dtype(dtype)
    timer = timer or do_bench
    if workload is None:
        workload = CudaWorkload(head_dim, gqa, dtype, num_kv_heads=num_kv_heads, family=family)
    measured_on = _measured_on(workload, dtype, head_dim, gqa)
    config = cache.lookup(TuneKey.of("sparse_attention", measured_on, length), path=path)
    cost = measure_cost(workload, length, config, timer)
    cache.write(costs={measured_on: cost}, path=path)
    return cost
