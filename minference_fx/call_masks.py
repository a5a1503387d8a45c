"""The run-time masks of one call of the op, as one frozen record.

The rewrite pass reads a site's mask at compile time and passes what it found as four op arguments (a padding
mask, packed-sequence ids, the query offset and a sliding window). At run time they travel together through
the index, the guard, the kernels and the dense paths; :class:`CallMasks` is that bundle, with the few
questions the op asks of it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .kernels.tables import rows_per_batch


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: fields are tensors, which do not compare to a bool
class CallMasks:
    """What keys a call's query rows may read, beside causality and the head plan (``minference_fx.op``)."""

    key_mask: Optional[torch.Tensor] = None
    """[B or 1, Skv] bool: False hides a key (padding); None: every key is valid"""
    doc_ids: Optional[torch.Tensor] = None
    """[B or 1, >= Skv] integer: a query reads only the keys of its own document; None: one document"""
    q_offset: int = 0
    """absolute position of query row 0 (Skv - Sq for a prefill aligned bottom-right, 0 for one at the start)"""
    window: int = 0
    """a query reads only keys closer than this (sliding-window models); 0: no window"""

    @property
    def plain(self) -> bool:
        """No padding mask, no documents, no window: causality alone says what a row reads."""
        return self.key_mask is None and self.doc_ids is None and self.window <= 0

    def without_key_mask(self) -> CallMasks:
        return dataclasses.replace(self, key_mask=None)

    def kwargs(self) -> dict:
        """The masks as the keyword arguments the kernels, the index, the guard and the reference take."""
        return dict(key_mask=self.key_mask, doc_ids=self.doc_ids, q_offset=self.q_offset, window=self.window)

    def rows_per_batch(self, batch: int) -> CallMasks:
        """One mask and document row per batch row, entries adjacent: how the kernels read them (a [1, S] table
        broadcast over the batch, a strided one copied)."""
        return dataclasses.replace(self, key_mask=rows_per_batch(self.key_mask, batch),
                                   doc_ids=rows_per_batch(self.doc_ids, batch))

    def padded_rows(self) -> Optional[torch.Tensor]:
        """[B, 1] bool: the batch rows whose padding mask hides a key, when a padding mask is the only mask (with
        documents or a window the dense walk checks every tile anyway); else None."""
        if self.key_mask is None or self.doc_ids is not None or self.window > 0:
            return None
        return ~self.key_mask.all(1, keepdim=True)
