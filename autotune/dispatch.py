"""Run-time lookups of the op: shapes, dtype and device in, crossover or launch config out.

Only metadata is read (no host sync, nothing sized by data), and each answer is
remembered per process, so a forward pass pays a few dict lookups per call.
The environment variables are part of the memo key so that pointing
``MINFERENCE_FX_CACHE_DIR`` elsewhere takes effect at once.
"""
from __future__ import annotations

import os

import torch

from . import cache
from .identity import device_identity, dtype_name, kernel_source_hash, triton_version


def _where() -> tuple:
    return os.environ.get(cache.ENV_DIR), os.environ.get("XDG_CACHE_HOME")


def crossover_key(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> cache.CrossoverKey:
    ident = device_identity(device)
    return cache.CrossoverKey(kernel_source_hash(), ident.gpu, ident.capability, triton_version(), dtype_name(dtype),
                              head_dim, group)


def tune_key(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int, group: int, length: int) -> cache.TuneKey:
    ident = device_identity(device)
    return cache.TuneKey(kernel, kernel_source_hash(), ident.gpu, ident.capability, triton_version(), dtype_name(dtype),
                         head_dim, group, cache.seq_bucket(length))


def tuned_min_sparse_len(q: torch.Tensor, k: torch.Tensor) -> int:
    """Prompt length from which the sparse path beats dense SDPA for q ``[B, Hq, Sq, D]``, k ``[B, Hkv, Skv, D]``."""
    shape = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1])
    return cache.remembered(("crossover", _where(), *shape), lambda: cache.lookup_crossover(crossover_key(*shape)))


def launch_config(q: torch.Tensor, k: torch.Tensor, kernel: str = "sparse_attention") -> cache.TuneEntry:
    """Tuned launch config of ``kernel`` for the bucket of this query length (the default when untuned)."""
    shape = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], q.shape[-2])
    return cache.remembered(("config", _where(), kernel, *shape[:4], cache.seq_bucket(shape[4])),
                            lambda: cache.lookup(tune_key(kernel, *shape)))
