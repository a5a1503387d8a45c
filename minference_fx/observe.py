"""Search mode: an op that runs dense attention and shows each call's Q/K/V to a Python observer.

The offline pattern search compiles the model with ``options={"observer": token}``;
the rewrite then emits ``minference::observed_attention`` instead of the sparse
op, so the search sees every layer's real Q/K/V through the same passes (mask
recognition, repeat_kv look-through, layer numbering) as a normal compile, for
any model the passes understand.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional

import torch

from .call_masks import CallMasks
from .dense import dense_attention
from .op import dense_walk_launch


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call as the search sees it (tensors are the live ones: copy what you keep)."""

    layer: int
    q: torch.Tensor
    """[B, Hq, Sq, D]"""
    k: torch.Tensor
    """[B, Hkv, Skv, D]"""
    v: torch.Tensor
    key_mask: Optional[torch.Tensor]
    doc_ids: Optional[torch.Tensor]
    scale: float
    q_offset: int
    window: int
    out: torch.Tensor
    """the dense output [B, Hq, Sq, D]"""


_OBSERVERS: dict[int, Callable[[AttentionCall], None]] = {}
_TOKENS = itertools.count(1)


def register(fn: Callable[[AttentionCall], None]) -> int:
    """Register an observer; returns the token to pass as ``options["observer"]``."""
    token = next(_TOKENS)
    _OBSERVERS[token] = fn
    return token


def unregister(token: int) -> None:
    _OBSERVERS.pop(token, None)


@torch.library.custom_op("minference::observed_attention", mutates_args=())
def observed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor], doc_ids: Optional[torch.Tensor],
    scale: float, q_offset: int, window: int, layer: int, observer: int,
) -> torch.Tensor:
    masks = CallMasks(key_mask, doc_ids, q_offset, window)
    out = dense_attention(q, k, v, masks, scale, walk=dense_walk_launch(q, k, masks))
    fn = _OBSERVERS.get(observer)
    if fn is None:
        raise RuntimeError(f"minference::observed_attention: observer {observer} is not registered (was it unregistered?)")
    fn(AttentionCall(layer, q, k, v, key_mask, doc_ids, scale, q_offset, window, out))
    return out


@observed_attention.register_fake
def _observed_attention_fake(q, k, v, key_mask, doc_ids, scale, q_offset, window, layer, observer):
    return q.new_empty(q.shape)


def run_observed(model, ids: torch.Tensor, fn: Callable[[AttentionCall], None]) -> None:
    """One forward of ``model(ids)`` in search mode, ``fn`` seeing every attention call (Dynamo reset around it)."""
    token = register(fn)
    try:
        torch._dynamo.reset()
        observed = torch.compile(model, backend="minference", options={"observer": token, "inner": "eager", "min_sparse_len": 0})
        with torch.no_grad():
            observed(ids, use_cache=False)
    finally:
        unregister(token)
        torch._dynamo.reset()
