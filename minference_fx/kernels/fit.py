"""How the op's kernels launch: the compiler options every launch pins, and launch configs that fit the GPU's
shared memory.

The tuned tables come from Hopper, which gives one block up to 227 KB of shared memory; an A100 gives 163 KB,
and the sm_86 / sm_89 / sm_120 cards (A10, L4, L40S, RTX 3090 to 5090) 99 KB. What a compiled kernel needs grows
with the head dim, the dtype, the tile and the pipeline depth, and only Triton knows it exactly: it checks the
compiled kernel against the device at its first launch and raises ``OutOfResources`` before any work is queued.
So a launch here tries the requested config, then smaller ones in a fixed order, and remembers per process which
one fit. Where none does, :class:`DoesNotFit` names the kernel and the numbers; the op then runs the call dense
(``op.CallPath.DENSE_BY_DEVICE``) instead of failing.

Measured under a stand-in driver on the CPU (``kernels.codegen``, ``scripts/explore_gpu_targets.py``): in bf16
the index's estimate kernels need at most 97 KB (d256, 3 stages) and fit every target; the attention kernel's
configs at d256 pass the 99 KB cards' limit and fit once their stages or rows are cut. In fp32 the estimate needs
twice as much (128 KB at d256 with one stage), so fp32 d256 does not fit the 99 KB cards.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, Hashable, Sequence, TypeVar

from triton.runtime.errors import OutOfResources

Config = TypeVar("Config")

COMPILE_OPTIONS = {"enable_fp_fusion": True}
"""Passed by every launch of the op's kernels. Triton fused multiply-adds by default through 3.9, which warns at
each compile that 3.10 stops doing so: pinned, the kernels compile on every release as they were tuned and tested
(the same PTX as the default on 3.6 and 3.9), and no warning reaches the user."""

_fitted: dict = {}
"""(kernel name, specialisation key, requested config) -> the config that fit"""
_lock = threading.Lock()


class DoesNotFit(RuntimeError):
    """No launch config of a kernel fits this device (shared memory): the call must take another path."""

    def __init__(self, kernel: str, tried: int, error: OutOfResources):
        self.kernel, self.required, self.limit = kernel, error.required, error.limit
        super().__init__(f"{kernel}: none of {tried} launch configs fits this GPU's {error.name}; the smallest needs "
                         f"{error.required} bytes, the device allows {error.limit} a block")


def launch(kernel: str, key: Hashable, configs: Sequence[Config], run: Callable[[Config], object]):
    """``run(config)`` with the first of ``configs`` (requested first, then smaller) whose compiled kernel fits
    the device; remembered per (``kernel``, ``key``, requested config), so a config that failed is tried once a
    process. ``key`` holds what the kernel is specialised on besides the config (dtype, head dim, flags)."""
    memo = (kernel, key, configs[0])
    start = _fitted.get(memo, 0)
    error = None
    for i in range(start, len(configs)):
        try:
            result = run(configs[i])
        except OutOfResources as exc:  # raised at the first launch, before anything is queued
            error = exc
            continue
        if i != start:
            with _lock:
                _fitted[memo] = i
        return result
    raise DoesNotFit(kernel, len(configs) - start, error)


def stage_ladder(num_stages: int) -> tuple:
    """``num_stages`` then each shallower pipeline down to 1."""
    return tuple(range(max(num_stages, 1), 0, -1))


@functools.lru_cache(maxsize=256)
def attention_ladder(block_m: int, block_n: int, num_warps: int, num_stages: int,
                     rows: tuple, keys: tuple) -> tuple:
    """(block_m, block_n, num_warps, num_stages) from the requested one down: fewer stages first, then fewer
    rows a program (``rows``: what the launch accepts), then fewer keys a step (``keys``); the warps stay."""
    return tuple((bm, bn, num_warps, s)
                 for bn in sorted((n for n in keys if n <= block_n), reverse=True)
                 for bm in sorted((m for m in rows if m <= block_m), reverse=True)
                 for s in stage_ladder(num_stages))


def forget() -> None:
    """Drop what was learned (tests)."""
    with _lock:
        _fitted.clear()
