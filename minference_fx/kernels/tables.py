"""Small per-head int tables on the device, written without a host sync.

A pageable host→device copy synchronises in eager mode and is illegal while a
CUDA graph captures. So each distinct table is kept once in pinned host memory
and every call copies it to a fresh device tensor asynchronously: one copy a
table, which a capture records as a memcpy node. A plan whose budgets differ
head by head once cost up to two launches a run of equal steps; the copies cut
the op's time on a mixed Qwen2.5-Coder config by 4-5 % at 16K-32K (BENCHMARKS.md
section 2b). The device tensor is never cached: a cached one would
be allocated inside Inductor's cudagraph pool during warm-up and then be an
untracked live allocation ("tensors in the cudagraph pool not tracked as
outputs"), which cudagraph trees refuse. A table first asked for while a
capture runs (no pinned allocation is allowed then) is written by
``fill_``/``arange`` kernels whose arguments are python ints, one per run.
"""
from __future__ import annotations

import torch


_PINNED: dict[tuple, torch.Tensor] = {}
"""Each distinct table's values in pinned host memory, kept for the process: the copies read them at any later
time (a graph replays its memcpy from the same host buffer)."""


def int_table(values, device) -> torch.Tensor:
    """int32 ``[len(values)]`` tensor on ``device`` holding ``values``."""
    values = tuple(int(v) for v in values)
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int32, device=device)
    host = _PINNED.get(values)
    if host is None and not torch.cuda.is_current_stream_capturing():
        host = _PINNED[values] = torch.tensor(values, dtype=torch.int32).pin_memory()
    out = torch.empty(len(values), dtype=torch.int32, device=device)
    if host is not None:
        return out.copy_(host, non_blocking=True)
    return _write_runs(out, values)


def _write_runs(out: torch.Tensor, values: tuple) -> torch.Tensor:
    """``values`` into ``out`` by one ``fill_`` or ``arange`` kernel per arithmetic run (a uniform table is one)."""
    i = 0
    while i < len(values):
        step = values[i + 1] - values[i] if i + 1 < len(values) else 0
        end = i + 1
        while end < len(values) and values[end] - values[end - 1] == step:
            end += 1
        if step == 0:
            out[i:end].fill_(values[i])
        else:
            out[i:end].copy_(torch.arange(values[i], values[i] + step * (end - i), step, dtype=torch.int32,
                                          device=out.device))
        i = end
    return out


def rows_per_batch(t, batch: int):
    """A [1 or B, S] mask or document table (or None) as the kernels read it: row b at ``b * stride(0)``, its
    entries adjacent. A one-row table is broadcast (stride 0, no copy); a strided one is copied (only odd
    layouts). Read as given, a one-row table's row 1 lay past its end."""
    if t is None:
        return None
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.expand(batch, -1) if t.shape[0] == 1 and batch > 1 else t
