"""The GPU workload the tuner times: realistic sparse indices, not dense fake masks.

Inputs come from ``bench.structured_qkv`` (a local band, sinks and hot columns,
like real Q/K after RoPE) and the index from ``build_index_gpu`` with the default
vertical-slash plan on every head, so the kernel walks the tile and column lists
it walks in a real prefill.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..plan import HeadPlan, LayerPlan, Pattern
from .cache import TuneEntry
from .identity import DeviceIdentity, device_identity

NEEDS_GPU = ("autotuning times the Triton kernels on a CUDA GPU, and torch sees none here; "
             "run `minference-fx autotune` on the machine whose GPU will run the model "
             "(`minference-fx autotune --show` prints the cache anywhere)")

# MInference's default head (the backend's default plan): the index the kernel meets most.
DEFAULT_BUDGETS = (1000, 6096)


class CudaWorkload:
    """Index + sparse attention and dense SDPA at one shape, on the current CUDA device."""

    def __init__(self, head_dim: int, group: int, dtype: torch.dtype, *, num_kv_heads: int = 8,
                 budgets: tuple[int, int] = DEFAULT_BUDGETS, guard_threshold: float | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError(NEEDS_GPU)
        device = torch.device("cuda", torch.cuda.current_device())
        self.identity: DeviceIdentity = device_identity(device)
        self.smem_limit: int = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        self.head_dim, self.group, self.dtype, self.num_kv_heads = head_dim, group, dtype, num_kv_heads
        self.plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * (num_kv_heads * group))
        if guard_threshold is None:
            from ..config import DEFAULT_DEFAULTS

            guard_threshold = DEFAULT_DEFAULTS["guard_threshold"]
        self.guard_threshold = guard_threshold
        self._length = None
        self._inputs = None

    def _at(self, length: int):
        if self._length != length:
            from ..bench import structured_qkv
            from ..kernels.index import build_index_gpu

            # one length at a time: at 1M tokens the inputs alone take gigabytes
            self._inputs = None
            torch.cuda.empty_cache()
            q, k, v = structured_qkv(length, num_q_heads=self.num_kv_heads * self.group, num_kv_heads=self.num_kv_heads,
                                     head_dim=self.head_dim, dtype=self.dtype)
            scale = self.head_dim ** -0.5
            self._inputs = (q, k, v, scale, build_index_gpu(q, k, self.plan, scale=scale))
            self._length = length
        return self._inputs

    def kernel(self, length: int, config: TuneEntry) -> Callable[[], object]:
        """The attention kernel alone on a prebuilt index: what the launch config changes."""
        from ..kernels.attend import sparse_attention_triton

        q, k, v, scale, index = self._at(length)
        return lambda: sparse_attention_triton(q, k, v, index, *self.plan.op_arguments(), scale=scale, **config.launch())

    def dense_walk(self, length: int, config: TuneEntry) -> Callable[[], object]:
        """The kernel's launch for forced-dense heads, every head forced: dense work, no list read."""
        from ..kernels.attend import sparse_attention_triton

        q, k, v, scale, index = self._at(length)
        every_head = torch.ones(q.shape[0], q.shape[1], dtype=torch.bool, device=q.device)
        return lambda: sparse_attention_triton(q, k, v, index, *self.plan.op_arguments(), scale=scale,
                                               force_dense=every_head, forced="only", **config.launch())

    def sparse(self, length: int, config: TuneEntry, dense_walk: TuneEntry) -> Callable[[], object]:
        """The op's sparse path: index (with the quality guard's mass estimate when it is on), then the kernel."""
        from ..op import sparse_on_gpu

        q, k, v, scale, _ = self._at(length)
        masks = dict(key_mask=None, doc_ids=None, q_offset=0, window=0)
        return lambda: sparse_on_gpu(q, k, v, self.plan, scale, masks, self.guard_threshold, config, dense_walk)

    def dense(self, length: int) -> Callable[[], object]:
        """The op's dense path (fused SDPA, causal, GQA without repeat_kv)."""
        from ..op import dense_attention

        q, k, v, scale, _ = self._at(length)
        return lambda: dense_attention(q, k, v, None, None, scale, 0, 0)
