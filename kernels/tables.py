"""Small per-head int tables on the device, written without a host copy.

A host→device copy synchronises in eager mode and is illegal while a CUDA graph
captures, so each table is written with ``fill_`` / ``arange`` kernels whose
arguments are python ints, one per arithmetic run (a uniform plan is one
launch). Tables are rebuilt on every call on purpose: a cached tensor would be
allocated inside Inductor's cudagraph pool during warm-up and then be an
untracked live allocation ("tensors in the cudagraph pool not tracked as
outputs"), which cudagraph trees refuse.
"""
from __future__ import annotations

import torch


def int_table(values, device) -> torch.Tensor:
    """int32 ``[len(values)]`` tensor on ``device`` holding ``values``."""
    values = tuple(int(v) for v in values)
    out = torch.empty(len(values), dtype=torch.int32, device=device)
    i = 0
    while i < len(values):
        step = values[i + 1] - values[i] if i + 1 < len(values) else 0
        end = i + 1
        while end < len(values) and values[end] - values[end - 1] == step:
            end += 1
        if step == 0:
            out[i:end].fill_(values[i])
        else:
            out[i:end].copy_(torch.arange(values[i], values[i] + step * (end - i), step, dtype=torch.int32, device=device))
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
