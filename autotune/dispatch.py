"""Run-time lookups of the op: shapes, dtype and device in, crossover or launch config out.

Only metadata is read (no host sync, nothing sized by data), and each answer is
remembered per process, so a forward pass pays a few dict lookups per call.
The environment variables are part of the memo key so that pointing
``MINFERENCE_FX_CACHE_DIR`` elsewhere takes effect at once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading

import torch

from ..cost import UNTUNED_COST, WalkCost
from ..defaults import DEFAULTS
from ..kernels.reference import BLOCK
from ..plan import LayerPlan, Pattern
from . import cache, tuner
from .identity import device_identity, dtype_name, kernel_source_hash, triton_version


log = logging.getLogger("minference_fx.autotune")

# Opt-in (``options={"autotune": "on-miss"}``): a lookup that misses tunes that shape
# here and now, once per process. Process-wide because the cache it fills is.
_on_miss = False
_tuned_here: set = set()
_tuning = threading.Lock()


def set_on_miss(enabled: bool) -> None:
    """Let run-time lookups that miss benchmark and store the shape (off by default: a forward never times)."""
    global _on_miss
    _on_miss = bool(enabled)


def _can_tune(q: torch.Tensor) -> bool:
    return q.is_cuda


def _tune_now(q: torch.Tensor, k: torch.Tensor, length: int) -> None:
    """Warm up this shape at ``length`` (and the crossover grid below it), then drop the memo so lookups see it."""
    shape = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], length)
    with _tuning:
        if shape in _tuned_here:
            return
        _tuned_here.add(shape)
        log.warning("autotune on-miss: tuning head_dim=%d group=%d %s at %d tokens on %s (once per process)",
                    shape[2], shape[3], q.dtype, length, q.device)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            # inside a forward: the first family alone, half the stall and one set of inputs in memory
            tuner.warm_up([length], shape[2], shape[3], q.dtype, progress=False, num_kv_heads=k.shape[1],
                          families=tuner.TUNE_FAMILIES[:1])
        cache.forget()


def _where() -> tuple:
    return os.environ.get(cache.ENV_DIR), os.environ.get("XDG_CACHE_HOME")


def crossover_key(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> cache.CrossoverKey:
    ident = device_identity(device)
    return cache.CrossoverKey(kernel_source_hash(), ident.gpu, ident.capability, triton_version(), dtype_name(dtype),
                              head_dim, group)


def tune_key(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int, group: int, length: int) -> cache.TuneKey:
    return cache.TuneKey.of(kernel, crossover_key(device, dtype, head_dim, group), length)


# A device with no measured crossover still knows the plan's budgets, and they bound what sparse attention
# can save on any GPU: a head reading more than an eighth of the prompt's keys per row (a quarter of a causal
# row's mean) saves too little to pay for its index and the heads real weights leave near-dense. On the H200
# the default budgets (7,096 keys a row) lost to dense SDPA at 16K alone (87 % of the mean causal row,
# results/autotune_warmup_h200_2026-12-01_v14.txt), and at 32K (43 %) in SmolLM2 end to end, 0.67x of HF
# eager (git show 6fb579a:results/bench_prefill_smollm2_h200_2026-12-01_v15_table_v14.txt); they won at 64K (22 %), 1.56x.
UNTUNED_LENGTH_PER_KEY = 8


def plan_keys_per_row(plan) -> int:
    """The most keys a query row of ``plan``'s sparse heads can read, from the budgets alone (0: every head dense)."""
    per_head = {Pattern.VERTICAL_SLASH: lambda hp: hp.budget_a + hp.budget_b,  # columns + diagonals
                Pattern.A_SHAPE: lambda hp: hp.budget_a + hp.budget_b,  # sink + window
                Pattern.BLOCK_SPARSE: lambda hp: hp.budget_a * BLOCK}  # key tiles
    return max((per_head[hp.pattern](hp) for hp in plan.heads if hp.pattern in per_head), default=0)


@functools.lru_cache(maxsize=4096)
def untuned_crossover(plan=None) -> int:
    """The crossover used where none was measured: the first power of two at least
    :data:`UNTUNED_LENGTH_PER_KEY` times ``plan``'s keys per row (MInference's default head when None), and never
    below the semantic default :data:`cache.DEFAULT_MIN_SPARSE_LEN`."""
    if plan is None:
        plan = LayerPlan((DEFAULTS.head,))
    bound = UNTUNED_LENGTH_PER_KEY * plan_keys_per_row(plan)
    return max(cache.DEFAULT_MIN_SPARSE_LEN, 1 << max(bound - 1, 0).bit_length())


def tuned_min_sparse_len(q: torch.Tensor, k: torch.Tensor, plan=None) -> int:
    """Prompt length from which the sparse path beats dense SDPA for q ``[B, Hq, Sq, D]``, k ``[B, Hkv, Skv, D]``
    (on a device with no measured crossover: :func:`untuned_crossover` of ``plan``)."""
    shape = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1])
    if _on_miss and _can_tune(q) and not cache.has_crossover(crossover_key(*shape)):
        _tune_now(q, k, max(tuner.CROSSOVER_LENGTHS))  # the whole grid: a crossover from short prompts alone would mislead
    untuned = untuned_crossover(plan)
    return cache.remembered(("crossover", _where(), *shape, untuned),
                            lambda: cache.lookup_crossover(crossover_key(*shape), untuned=untuned))


def launch_config(q: torch.Tensor, k: torch.Tensor, kernel: str = "sparse_attention") -> cache.TuneEntry:
    """Tuned launch config of ``kernel`` for the bucket of this query length (the default when untuned)."""
    shape = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], q.shape[-2])
    if _on_miss and _can_tune(q) and cache.find(tune_key(kernel, *shape)) is None:
        _tune_now(q, k, cache.seq_bucket(shape[4]))
    return cache.remembered(("config", _where(), kernel, *shape[:4], cache.seq_bucket(shape[4])),
                            lambda: cache.lookup(tune_key(kernel, *shape)))


def walk_cost(q: torch.Tensor, k: torch.Tensor) -> WalkCost:
    """The measured :class:`~minference_fx.cost.WalkCost` of this shape on this device; where none was, the most
    cautious one measured for the shape on other GPUs (:func:`cache.cautious_cost`), else ``cost.UNTUNED_COST``."""
    shape = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1])
    return cache.remembered(("cost", _where(), *shape), lambda: _measured_or_cautious(crossover_key(*shape)))


def _measured_or_cautious(key: cache.CrossoverKey) -> WalkCost:
    measured = cache.lookup_cost(key)
    if measured is not None:
        return measured
    cautious = cache.cautious_cost(key)
    if cautious is None:
        return UNTUNED_COST
    log.warning("no measured sparse-walk cost for %s; weighing heads by the slowest measured for this shape on any GPU "
                "or kernel version in the tables (walk rate %.3f, index %.4f of a dense layer at %d keys; run "
                "`minference-fx autotune` on this GPU)", key, cautious.walk_rate, cautious.index_share,
                cautious.measured_at)
    return cautious
