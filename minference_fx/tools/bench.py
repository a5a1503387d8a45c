"""``minference-fx bench kernels``: index + sparse kernel vs dense and FlexAttention, same run, same inputs.

Inputs are *structured* so the online index sees what it sees in a long-context LLM, in two
families (``--families``, see :data:`~minference_fx.autotune.workload.FAMILIES`):

* ``structured`` (:func:`structured_qkv`): a recency window of a few thousand tokens over a slowly
  decaying far field, attention sinks, vertical lines, a strong far diagonal, and noise. Its slashes
  cluster near the diagonal and pack into few key tiles.
* ``scattered`` (:func:`scattered_qkv`): a narrow band, sinks, hot columns, slashes at scattered
  offsets and a noisy far field. Most of its slashes are isolated far diagonals, each crossing two
  key tiles per query tile for one key per row.

Random Q/K make every diagonal look alike and would flatter nobody in particular. Each row reports
the index's physical density (key tiles walked / causal key tiles) and logical density (keys kept /
causal keys), from :mod:`minference_fx.kernels.density`.

"index + kernel" is the sparse path with nothing sent dense. The "op" column is the op as a compiled
model calls it, once per forward at the same site: the quality guard on, the near-dense rule, and the
routing that sends the heads the previous call ran dense, or found slower walked than dense (the cost
model, :mod:`minference_fx.cost`), to the fused SDPA; its time is the mean over calls once the routing has
settled, index rebuilds included: up to 128K, once an all-routed site's back-off has reached its longest interval
(:func:`settle_calls`), over that interval (64 calls, one rebuild: the steady state of a long run); past 128K, where a
call takes seconds, over 8 calls after three. It gets Q/K/V token-major (memory ``[B, S, H, D]``), as an HF model's
attention hands them over; fused SDPA gives its output q's layout, so head-major inputs would cost the op's routed
calls a copy into its token-major output that no model call pays.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .. import routing
from ..autotune.dispatch import launch_config
from ..autotune.identity import kernel_source_hash
from ..autotune.workload import FAMILIES, family_qkv
from ..defaults import DEFAULTS
from ..kernels.attend import as_output, sparse_attention_triton
from ..kernels.density import Density, index_density, selection_of
from ..kernels.index import build_index_gpu
from ..kernels.reference import BLOCK, SparseIndex, covering_tiles
from ..plan import HeadPlan, LayerPlan, Pattern, escalation_arguments

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
KERNEL_FAMILIES = tuple(FAMILIES)
"""The input families ``bench kernels`` runs by default: all of them."""


def event_ms(fn, reps: int = 2) -> float:
    """Median milliseconds of ``reps`` calls of ``fn``, timed by CUDA events after one warm-up call: for calls long
    enough (tens of ms and more) that one timing each is precise."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def _ms(fn, reps_hint: float) -> float:
    """Median milliseconds of ``fn``. ``reps_hint`` <= 1 means a long call (seconds at 512K+): do_bench
    would still run it ~8 times to estimate its runtime, so time one warm-up and two calls instead."""
    if reps_hint <= 1:
        return event_ms(fn, 2)
    return float(triton.testing.do_bench(fn, warmup=max(1, int(reps_hint)), rep=max(1, int(4 * reps_hint)), return_mode="median"))


def settle_calls(router: routing.Router) -> int:
    """Calls until an all-routed site's index checks are :attr:`~routing.Router.longest_interval` apart: checks at
    calls 0, 8, 24 and 56 by default, so 57 (the check at call 0 starts the streak at one)."""
    calls, streak = 1, 1
    while router.interval_after(streak) < router.longest_interval:
        calls += router.interval_after(streak)
        streak += 1
    return calls


def op_window(router: routing.Router, seq: int) -> tuple[int, int]:
    """(calls to settle, calls timed) of the op column at ``seq`` keys: up to 128K, :func:`settle_calls` and then the
    longest interval between an all-routed site's checks (one check in the window); past 128K, where a call takes
    seconds, three and ``recheck_every``."""
    if seq > 131072:
        return 3, router.recheck_every
    return settle_calls(router), router.longest_interval


def op_arguments(q, k, v, scale: float, plan: LayerPlan, site: int, escalation: tuple = ()) -> tuple:
    """The op's arguments for a call at ``site`` with the default guard and no crossover, on ``q``, ``k``, ``v``
    ``[B, H, S, D]`` laid out token-major (:func:`~minference_fx.kernels.attend.as_output`), as an HF model's
    attention hands them over: a call routed whole to fused SDPA then needs no copy into the op's output.
    ``escalation``: (columns, diagonals) a head the guard finds weak tries before it runs dense; () none."""
    q, k, v = (as_output(t) for t in (q, k, v))
    return (q, k, v, None, None, scale, 0, 0, *plan.op_arguments(), 0, DEFAULTS.guard_threshold, site,
            *escalation_arguments(escalation))


def _op_ms(q, k, v, scale: float, plan: LayerPlan, settle: int, calls: int, escalation: tuple = ()) -> tuple[float, int]:
    """(mean milliseconds, heads routed) of the op at one new site (:func:`op_arguments`): the mean of ``calls``
    calls after ``settle`` that let the routing settle (its decisions land a call late)."""
    site = routing.new_site()
    args = op_arguments(q, k, v, scale, plan, site, escalation)
    op = torch.ops.minference.sparse_attention.default
    for _ in range(settle):  # each decision lands before the next call, as between a model's forwards
        op(*args)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        op(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls, len(routing.ROUTER.routed_heads(site, q.shape[1], q.device))


def _index_work(index, patterns, budgets_a, budgets_b, sq, skv):
    """(computed (i, j) pairs, logical pairs) over all (b, h) — tiles at 64×64, columns at 64 rows each."""
    tiles = index.block_count.sum().item()
    cols = index.col_count.sum().item()
    m_tiles = math.ceil(sq / BLOCK)
    diag_tiles = index.block_count.shape[0] * index.block_count.shape[1] * m_tiles  # every VS head lists its diagonal
    physical = tiles * BLOCK * BLOCK + cols * BLOCK
    logical = physical - diag_tiles * BLOCK * (BLOCK - 1) // 2
    return physical, logical


def _flex_from_index(index, sq, skv, block):
    """A BlockMask of the aligned key tiles that hold our blocks' keys (``reference.covering_tiles``: the diagonal
    tile partial, the rest full). Flex's layout has no unaligned block, so where a diagonal block spans two tiles
    Flex walks both; leftover columns are not given to it."""
    tiles = covering_tiles(index, skv)  # [B, H, M, N]
    m = torch.arange(tiles.shape[2], device=tiles.device)[None, None, :, None]
    n = torch.arange(tiles.shape[3], device=tiles.device)
    is_diag = tiles & (n == m)
    full = tiles & ~is_diag
    full_idx = torch.where(full, n, torch.iinfo(torch.int32).max).sort(-1).values
    full_num = full.sum(-1).to(torch.int32)
    full_idx = torch.where(full_idx == torch.iinfo(torch.int32).max, 0, full_idx).to(torch.int32)
    part_num = is_diag.any(-1).to(torch.int32)
    part_idx = m[..., 0:1].expand(*index.block_count.shape, 1).to(torch.int32).contiguous()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=causal,
                                    seq_lengths=(sq, skv), compute_q_blocks=False)


def parse_families(text: str) -> tuple[str, ...]:
    """``"structured,scattered"`` -> the family names, checked (a misspelt one would just be missing)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in FAMILIES]
    if unknown or not names:
        raise ValueError(f"unknown input family(ies) {unknown or [text]}; known: {', '.join(FAMILIES)}")
    return names


@dataclasses.dataclass
class KernelCase:
    """One (family, length) of the benchmark: its inputs, the index and what the index keeps and walks."""

    family: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    index: SparseIndex
    density: Density


def prepare_case(family: str, seq: int, plan: LayerPlan, *, shape=LLAMA3_8B, device="cuda", dtype=torch.bfloat16,
                 build_index=build_index_gpu) -> KernelCase:
    """Inputs of ``family`` at ``seq``, their index (``build_index``: the GPU builder, or the reference's on CPU)
    and its densities; ``shape`` holds ``num_q_heads``, ``num_kv_heads`` and ``head_dim``."""
    q, k, v = family_qkv(family, seq, **shape, dtype=dtype, device=device)
    scale = shape["head_dim"] ** -0.5
    index = build_index(q, k, plan, scale=scale)
    density = index_density(index, plan, selection_of(q, k, plan, scale=scale), sq=seq)
    return KernelCase(family, q, k, v, scale, index, density)


def density_fields(density: Density) -> dict:
    """A row's density fields: the call's (every head pooled) and each head's (batch row 0), as floats."""
    physical, logical = density.overall()
    return dict(physical_density=physical, logical_density=logical,
                physical_by_head=[round(x, 5) for x in density.physical[0].tolist()],
                logical_by_head=[round(x, 5) for x in density.logical[0].tolist()])


@dataclasses.dataclass
class KernelRow:
    family: str
    seq: int
    index_ms: float
    kernel_ms: float
    total_ms: float
    physical_density: float
    logical_density: float
    tflops_computed: float
    cudnn_ms: float | None
    op_ms: float | None
    """the op with the guard and routing (see the module's docstring)"""
    op_routed_heads: int | None
    """query heads its routing sent to the fused SDPA at the timed calls"""
    flash_ms: float | None
    flex_ms: float | None
    flex_mask_ms: float | None
    launch_config: dict = dataclasses.field(default_factory=dict)
    """the sparse walk's BLOCK_M, BLOCK_N, num_warps and num_stages at this length (the tuned table's, else the default)"""
    physical_by_head: list[float] = dataclasses.field(default_factory=list)
    """walked / causal key tiles of each query head (batch row 0)"""
    logical_by_head: list[float] = dataclasses.field(default_factory=list)
    """kept / causal keys of each query head (batch row 0)"""

    def speedup(self, baseline):
        return None if baseline is None else baseline / self.total_ms

    @property
    def waste(self) -> float | None:
        """Physical over logical density: the tile walk's work per kept key, 1 when the kept keys fill whole tiles."""
        return None if not self.logical_density else self.physical_density / self.logical_density


KERNEL_BASELINES = ("cudnn", "flash", "flex")


def bench_kernels(lengths, *, families=KERNEL_FAMILIES, budgets=DEFAULTS.budgets, baselines=KERNEL_BASELINES,
                  num_warps=None, num_stages=None, escalation: tuple = ()):
    """Rows of index + kernel against the baselines, and of the op (guard on, routing; weak heads first try the
    ``escalation`` budgets when given), per family and length."""
    unknown = [name for name in baselines if name not in KERNEL_BASELINES]
    if unknown:  # a misspelt baseline would just be missing from the table
        raise ValueError(f"unknown baseline(s) {unknown}; known: {', '.join(KERNEL_BASELINES)}")
    families = parse_families(",".join(families))

    rows = []
    shape = LLAMA3_8B
    group = shape["num_q_heads"] // shape["num_kv_heads"]
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * shape["num_q_heads"])
    patterns, budget_a, budget_b = plan.op_arguments()
    for family, seq in ((family, seq) for family in families for seq in lengths):
        case = prepare_case(family, seq, plan, shape=shape)
        q, k, v, scale = case.q, case.k, case.v, case.scale
        reps = 5 if seq <= 131072 else 1
        tuned = launch_config(q, k)  # what the op launches at this length: the tuned config, else the default
        config = dataclasses.replace(tuned, num_warps=num_warps or tuned.num_warps, num_stages=num_stages or tuned.num_stages)
        print(f"{family} seq {seq}: kernel launch config BLOCK_M={config.BLOCK_M} BLOCK_N={config.BLOCK_N} "
              f"num_warps={config.num_warps} num_stages={config.num_stages}", flush=True)
        index_fn = lambda: build_index_gpu(q, k, plan, scale=scale)  # noqa: E731
        index = case.index
        kernel_fn = lambda: sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale,  # noqa: E731
                                                    **config.launch())
        total_fn = lambda: sparse_attention_triton(q, k, v, index_fn(), patterns, budget_a, budget_b, scale=scale,  # noqa: E731
                                                   **config.launch())
        index_ms, kernel_ms, total_ms = _ms(index_fn, reps), _ms(kernel_fn, reps), _ms(total_fn, reps)
        computed_pairs, _ = _index_work(index, patterns, budget_a, budget_b, seq, seq)
        row = dict(family=family, seq=seq, index_ms=index_ms, kernel_ms=kernel_ms, total_ms=total_ms,
                   **density_fields(case.density),
                   tflops_computed=4 * shape["head_dim"] * computed_pairs / (kernel_ms * 1e-3) / 1e12,
                   cudnn_ms=None, flash_ms=None, flex_ms=None, flex_mask_ms=None, launch_config=dataclasses.asdict(config))
        row["op_ms"], row["op_routed_heads"] = _op_ms(q, k, v, scale, plan, *op_window(routing.ROUTER, seq),
                                                       escalation=escalation)
        dense_reps = 3 if seq <= 131072 else 1
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            if name == "flash" and seq > 131072:
                print(f"flash at {seq}: skipped (minutes of device time; cuDNN is the faster dense baseline)")
                continue
            if name in baselines:
                try:
                    with sdpa_kernel(backend):
                        row[f"{name}_ms"] = _ms(lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True), dense_reps)
                except RuntimeError as exc:
                    print(f"{name} at {seq}: {exc}")
        del k_rep, v_rep
        print(f"{family} seq {seq}: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)), flush=True)
        if "flex" in baselines:
            try:
                flex = torch.compile(flex_attention, dynamic=False)
                opts = {"BLOCK_M": 64, "BLOCK_N": 64}
                block_mask = _flex_from_index(index, seq, seq, 64)
                flex(q, k, v, block_mask=block_mask, enable_gqa=True, scale=scale, kernel_options=opts)
                row["flex_mask_ms"] = _ms(lambda: _flex_from_index(index, seq, seq, 64), reps)
                row["flex_ms"] = _ms(lambda: flex(q, k, v, block_mask=_flex_from_index(index, seq, seq, 64), enable_gqa=True,
                                                  scale=scale, kernel_options=opts), reps)
            except Exception as exc:  # a baseline that cannot run is reported, not fatal
                print(f"flex at {seq}: {type(exc).__name__}: {exc}"[:400])
        rows.append(KernelRow(**row))
        del q, k, v, index, case
        torch.cuda.empty_cache()
    return rows


def format_kernel_rows(rows) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = f"{'family':>10} {'seq':>8} {'index':>8} {'kernel':>8} {'total':>8} {'idx%':>5} {'phys%':>6} {'log%':>6} " \
           f"{'ph/lo':>5} {'TF/s':>6} {'cuDNN':>9} {'x':>6} {'op':>9} {'x':>6} {'routed':>6} {'flash':>9} {'x':>6} " \
           f"{'flex':>8} {'x':>6}"
    lines = [head]
    for r in rows:
        flex_x = None if r.flex_ms is None else r.flex_ms / r.kernel_ms
        op_x = None if r.op_ms is None or r.cudnn_ms is None else r.cudnn_ms / r.op_ms
        lines.append(
            f"{r.family:>10} {r.seq:>8} {r.index_ms:>8.2f} {r.kernel_ms:>8.2f} {r.total_ms:>8.2f} "
            f"{100 * r.index_ms / r.total_ms:>5.1f} {100 * r.physical_density:>6.2f} {100 * r.logical_density:>6.2f} "
            f"{f(r.waste, '5.2f')} {r.tflops_computed:>6.0f} "
            f"{f(r.cudnn_ms, '9.2f')} {f(r.speedup(r.cudnn_ms), '6.2f')} {f(r.op_ms, '9.2f')} {f(op_x, '6.2f')} "
            f"{f(r.op_routed_heads, '6d')} {f(r.flash_ms, '9.2f')} {f(r.speedup(r.flash_ms), '6.2f')} "
            f"{f(r.flex_ms, '8.2f')} {f(flex_x, '6.2f')}"
        )
    lines.append("times in ms; x = baseline / ours (index + kernel; flex: its kernel+mask vs our kernel on the same tiles); "
                 "op = the op with guard and routing, its x = cuDNN / op, routed = heads it sent to SDPA; "
                 "phys% = key tiles walked / causal key tiles, log% = keys kept / causal keys, ph/lo = their ratio")
    return "\n".join(lines)


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        # the hash that keys the tuned tables: which kernel sources these numbers ran (the device copy has no git)
        "kernel_source_hash": kernel_source_hash(),
    }


def write_json(path, rows, command):
    with open(path, "w") as fh:
        json.dump({"command": command, **environment(), "rows": [dataclasses.asdict(r) for r in rows]}, fh, indent=2)
