"""The op's dense policy: which (batch, head) pairs run dense attention, and by which path.

Which pairs run dense (each rule can only add keys to what a head reads):

=====================  ==================================================================================
rule                   pairs it sends dense
=====================  ==================================================================================
length                 every pair of a call shorter than ``min_sparse_len`` (the op's plan, ``op.plan_call``)
dense layer            every pair of a layer whose plan is dense on every head (likewise)
plan-dense heads       the plan's dense heads of a mixed layer (:class:`PlanSplit`)
near-dense index       a listed (vertical-slash or block-sparse) pair whose index keeps >= 90 % of the causal
                       key tiles (:func:`near_dense_heads`, :func:`forced_on_gpu`)
quality guard          a listed pair whose estimated captured mass is under the guard threshold
                       (:func:`weak_heads`, :func:`guard_mass`; on the GPU the index builds the estimate);
                       with an escalation (the op's ``escalate_a``/``escalate_b``), a vertical-slash pair
                       only if still under it at those larger budgets (:func:`plan.escalated_plan`,
                       :func:`take_index`); a block-sparse one has no larger index to try
routed heads           the heads a site ran dense in every batch row at its previous call, where
                       :func:`routable` (``minference_fx.routing``)
=====================  ==================================================================================

And the paths they take:

* the device's fused SDPA with no mask (:func:`fused_sdpa_applies`): a plain causal prefill or a decode step;
* SDPA given a materialised boolean mask (:func:`masked_sdpa`): masked calls, and on the GPU only up to
  :data:`MASKED_SDPA_MAX_PAIRS`;
* the sparse kernel's dense walk (:func:`dense_walk`): masked calls past that on the GPU, and on the GPU the
  pairs the index or the guard forced dense; it reads the masks tile by tile;
* fused SDPA without the padding mask, then the rows the mask hides keys of again in the dense walk: one prompt
  under ``generate``'s padding mask (:func:`routable`, :func:`every_head_routed`, :func:`dense_heads_by_sdpa`).

Every function here that launches the dense walk takes its launch config as an argument: the op looks it up
(``autotune.dispatch``), which sits above this module.
"""
from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .call_masks import CallMasks
from .kernels import attend, guard
from .kernels.reference import BLOCK, NO_BLOCK, SparseIndex
from .kernels.tables import int_table
from .plan import LISTED_PATTERNS, PATTERN_CODES, HeadPlan, LayerPlan, Pattern

MASKED_SDPA_MAX_PAIRS = 1 << 24
"""Above this many (query, key) pairs a masked dense call on the GPU runs the sparse kernel's dense walk instead
of SDPA. SDPA takes no padding mask beside ``is_causal``, so the mask would be materialised, a byte per pair
([1, 1, 128K, 128K] is 16 GiB), and read by a slower masked kernel; HF under torch.compile builds a padding
mask whenever it is given an ``attention_mask`` (``generate`` always gives one), so every long prefill through
``generate`` would pay it."""


# --------------------------------------------------------------------------- the dense paths


def fused_sdpa_applies(sq: int, skv: int, masks: CallMasks) -> bool:
    """Whether :func:`dense_attention` runs the device's fused SDPA with no mask: no padding, documents or
    window, and causal aligned top-left (a prefill) or every key visible (a decode step)."""
    return masks.plain and ((masks.q_offset == 0 and sq == skv) or masks.q_offset >= skv - 1)


def routable(batch: int, sq: int, skv: int, masks: CallMasks) -> bool:
    """Whether heads may go to the device's fused SDPA run without a mask: where :func:`fused_sdpa_applies`,
    and under a padding mask alone for one batch row, as ``generate`` runs a single prompt (its mask all
    ones; a padded row runs again with it: :func:`padded_rows_again`). In a padded batch most rows would
    run twice, SDPA's work on them wasted, so there the heads stay in the kernel's dense walk."""
    if masks.key_mask is not None and batch != 1:
        return False
    return fused_sdpa_applies(sq, skv, masks.without_key_mask())


def runs_dense_walk(q: torch.Tensor, k: torch.Tensor, masks: CallMasks) -> bool:
    """Whether :func:`dense_attention` of this call launches the kernel's dense walk (and so needs its launch
    config): a masked call on the GPU past :data:`MASKED_SDPA_MAX_PAIRS`."""
    sq, skv = q.shape[-2], k.shape[-2]
    return q.is_cuda and sq * skv > MASKED_SDPA_MAX_PAIRS and not fused_sdpa_applies(sq, skv, masks)


def dense_attention(q, k, v, masks: CallMasks, scale: float, walk=None) -> torch.Tensor:
    """Dense attention with the op's mask semantics, through the device's fused SDPA.

    The plain causal cases use ``is_causal`` / no mask so the fast fused kernels
    run; padding, packed documents, windows or an unaligned offset build a
    boolean mask of shape [B, 1, Sq, Skv], or on the GPU past
    :data:`MASKED_SDPA_MAX_PAIRS` run :func:`dense_walk` with launch config ``walk`` (needed only then:
    :func:`runs_dense_walk`), which builds none.
    There a prefill of one prompt under a padding mask alone (``generate``'s) runs the fused SDPA without the
    mask, then the row again in the masked dense walk if the mask hides a key of it.
    """
    sq, skv = q.shape[-2], k.shape[-2]
    if fused_sdpa_applies(sq, skv, masks):
        # a prefill aligned at 0 is causal; otherwise (a decode step) every cached key is visible
        return fused_sdpa(q, k, v, causal=masks.q_offset == 0 and sq == skv, scale=scale)
    if q.is_cuda and sq * skv > MASKED_SDPA_MAX_PAIRS:
        if walk is None:
            raise ValueError(f"dense_attention: a masked call of {sq} x {skv} pairs on the GPU runs the kernel's dense "
                             "walk, and no launch config was given for it (walk=...; the op passes "
                             "autotune.dispatch.launch_config(q, k, 'dense_walk'))")
        if routable(q.shape[0], sq, skv, masks):
            # One prompt under generate's all-ones mask: this path at 0.79-1.00x maskless cuDNN, the walk at
            # 0.66-0.97x (16K-64K, explore_padding_mask_h200_2026-12-01_v2); a padded prompt pays both (1.6-1.7x
            # the walk). Below the limit the re-run's host cost (0.5-0.9 ms a call) outweighs what cuDNN saves.
            # the walk writes into SDPA's output in whatever layout SDPA gave it (q's), no copy
            out = dense_attention(q, k, v, masks.without_key_mask(), scale)
            return dense_walk(q, k, v, masks, scale, walk, out=out)
        return dense_walk(q, k, v, masks, scale, walk)
    return masked_sdpa(q, k, v, masks, scale)


def repeats_kv_heads(q, group: int) -> bool:
    """Whether :func:`fused_sdpa` repeats grouped KV heads for SDPA instead of passing ``enable_gqa``.

    On CUDA only the flash and cuDNN kernels take grouped KV heads, and neither takes float32: SDPA would fall back
    to its math path, which builds every score ([B, Hq, Sq, Skv] in float32: 48 GiB for Qwen2.5-Coder's 12 heads
    at 32K, where the float32 search ran out of an H100's memory). Repeated KV heads cost Hq / Hkv copies of K and
    V instead, and the memory-efficient kernel takes them.
    """
    return group > 1 and q.is_cuda and q.dtype == torch.float32


@functools.lru_cache(maxsize=16)
def _cudnn_first_device(device: torch.device) -> bool:
    # Hopper: where cuDNN's kernel was measured against flash (H100, 2026-12-06: 5.1 against 10.0 ms at 32K on
    # Qwen2.5-Coder's shape, 90 against 163 ms at 128K; results/explore_dense_path_h100_2026-12-06.json)
    return torch.cuda.get_device_capability(device)[0] == 9


def runs_cudnn(q, k, v, *, causal: bool, gqa: bool) -> bool:
    """Whether :func:`fused_sdpa` asks for cuDNN's kernel alone: on Hopper, where torch says cuDNN takes the call.

    SDPA otherwise picks its backend by a process-wide order that torch sets lazily at the first SDPA call; a
    ``sdpa_kernel(..., set_priority=True)`` block entered before that call restores the unset order, flash first, on
    exit, for the rest of the process. The compiled model then ran the op's dense SDPA through flash at twice
    cuDNN's time (results/explore_op_host_h100_2026-12-06_32k_block.json; ``bench breakdown`` times eager in such
    a block). Only the enabled flags are switched here, and restored as they were; a backend the user disabled
    stays so (torch's check then says no)."""
    if not q.is_cuda or not _cudnn_first_device(q.device):
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, gqa)
    return torch.backends.cuda.can_use_cudnn_attention(params, False)


def fused_sdpa(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    """SDPA with no mask, grouped KV heads included, on a kernel that builds no score matrix (cuDNN's on Hopper:
    :func:`runs_cudnn`)."""
    group = q.shape[1] // k.shape[1]
    if repeats_kv_heads(q, group):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        group = 1
    gqa = group > 1
    backend = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if runs_cudnn(q, k, v, causal=causal, gqa=gqa) else nullcontext()
    with backend:
        # no .contiguous(): the op returns SDPA's token-major layout as it comes (attend.as_output)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)


def masked_sdpa(q, k, v, masks: CallMasks, scale: float) -> torch.Tensor:
    """Dense attention with the op's mask semantics through SDPA given a boolean [B, 1, Sq, Skv] mask."""
    sq, skv = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    pos = torch.arange(sq, device=q.device) + masks.q_offset
    keys = torch.arange(skv, device=q.device)
    allowed = (keys[None, :] <= pos[:, None])[None, None]
    if masks.window > 0:
        allowed = allowed & (pos[:, None] - keys[None, :] < masks.window)[None, None]
    if masks.key_mask is not None:
        allowed = allowed & masks.key_mask[:, None, None, :]
    if masks.doc_ids is not None:
        doc_ids = masks.doc_ids
        q_doc = doc_ids[:, pos.clamp(max=doc_ids.shape[-1] - 1)]
        allowed = allowed & (q_doc[:, None, :, None] == doc_ids[:, None, None, :skv])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    # fully masked rows (left padding) must be 0, whatever the backend does with them
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0).to(q.dtype).contiguous()


def dense_walk(q, k, v, masks: CallMasks, scale: float, launch, out=None) -> torch.Tensor:
    """Dense attention with the op's mask semantics through the sparse kernel's dense walk (every (batch, head)
    forced dense, nothing listed): it reads the key mask, document ids and window tile by tile, so nothing of
    size Sq x Skv is built. ``launch``: its launch config (``autotune.cache.TuneEntry``). ``out``: SDPA wrote
    every row of it without ``key_mask`` (the only mask); only the rows the mask hides keys of run, into it."""
    B, hq, sq, _ = q.shape
    if out is not None and (masks.doc_ids is not None or masks.window > 0):
        raise ValueError("dense_walk(out=...) runs again only the rows a padding mask hides keys of: with documents "
                         "or a window SDPA's unmasked rows would stand")
    masks = masks.rows_per_batch(B)  # as the kernel reads them
    zeros = (0,) * hq
    args = (q, k, v, attend.empty_index(B, hq, -(-sq // BLOCK), q.device), (PATTERN_CODES[Pattern.DENSE],) * hq,
            zeros, zeros)
    if out is not None:
        padded_rows_again(args, out, tuple(range(hq)), masks.padded_rows(), masks, scale=scale, **launch.launch())
        return out
    every_pair = torch.ones(B, hq, dtype=torch.bool, device=q.device)
    return launch_by_rows(args, masks, masks.padded_rows(), every_pair, "only", scale=scale, **launch.launch())


def every_head_routed(q, k, v, masks: CallMasks, scale: float, walk=None) -> torch.Tensor:
    """A layer whose every head is routed: the device's fused SDPA without the mask (:func:`routable` allows no
    other), then the rows a padding mask hides keys of again, masked, in the kernel's dense walk (launch config
    ``walk``, needed only with a padding mask). The same launches whether the call built its index or skipped it
    (``routing.Router.index_due``), so a CUDA graph captured at a skipping call runs only what its warm-up ran."""
    out = dense_attention(q, k, v, masks.without_key_mask(), scale)
    if masks.key_mask is None:
        return out
    return dense_walk(q, k, v, masks, scale, walk, out=out)


def dense_heads_by_sdpa(q, k, v, out, dense_heads: tuple, kv_heads: tuple, scale: float, masks: CallMasks) -> None:
    """Write dense attention of query heads ``dense_heads`` into ``out``, each reading its kv head in
    ``kv_heads`` (no repeat of the others). The head lists become device tables written without a host
    copy, so a CUDA graph can capture this."""
    heads = int_table(dense_heads, q.device)
    kv_heads = int_table(kv_heads, q.device)
    dense = dense_attention(q.index_select(1, heads), k.index_select(1, kv_heads), v.index_select(1, kv_heads),
                            masks, scale)
    out.index_copy_(1, heads.long(), dense)


# --------------------------------------------------------------------------- kernel launches by padded rows


def launch_by_rows(args: tuple, masks: CallMasks, padded, force: torch.Tensor, forced: str, **launch) -> torch.Tensor:
    """One kernel launch of ``forced`` mode over the [B, Hq] table ``force`` ("skip" runs the other pairs, "only"
    these); with ``padded`` rows (:meth:`CallMasks.padded_rows`), two: the rows whose keys are all valid without
    the mask, which would cost the walk its unmasked fast path on every tile (SmolLM2 at 128K: 1.81x HF eager with
    generate's all-ones mask before this split, 2.26x without a mask:
    ``results/bench_prefill_smollm2_h200_2026-12-01_v12*``, ``_v10*`` at 6fb579a), then the padded rows with it.
    Each leaves the other's rows alone, so every pair runs once, as the mask says. Returns the output."""
    if padded is None:
        return attend.sparse_attention_triton(*args, force_dense=force, forced=forced, **launch, **masks.kwargs())
    valid_rows, padded_rows = (force | padded, force | ~padded) if forced == "skip" else (force & ~padded, force & padded)
    out = attend.sparse_attention_triton(*args, force_dense=valid_rows, forced=forced, **launch,
                                         **masks.without_key_mask().kwargs())
    return attend.sparse_attention_triton(*args, force_dense=padded_rows, forced=forced, **{**launch, "out": out},
                                          **masks.kwargs())


def padded_rows_again(args: tuple, out, heads: tuple, padded, masks: CallMasks, **launch) -> None:
    """SDPA wrote query ``heads`` of every batch row without the padding mask: the rows it hides keys of
    (``padded``, :meth:`CallMasks.padded_rows`; None: no mask) run those heads again, with it, in the kernel's
    dense walk over ``args`` (q, k, v, index and op arguments that code those heads dense). Without padding every
    program of that launch returns at once (no host check decides it)."""
    if padded is None:
        return
    attend.sparse_attention_triton(*args, force_dense=dense_pairs(heads, args[0]) & padded, forced="only", out=out,
                                   **launch, **masks.kwargs())


def dense_pairs(heads: tuple, q: torch.Tensor) -> torch.Tensor:
    """[B, Hq] bool on q's device: True for query heads ``heads`` (built on the device: no host copy)."""
    pairs = torch.zeros(q.shape[1], dtype=torch.bool, device=q.device)
    pairs.index_fill_(0, int_table(heads, q.device).long(), True)
    return pairs[None, :].expand(q.shape[0], -1)


# --------------------------------------------------------------------------- the rules


@dataclasses.dataclass(frozen=True)
class PlanSplit:
    """What the op derives from a layer's plan, once per distinct plan (not per call, not per head)."""

    op_args: tuple
    """the plan's op arguments as they are (dense heads run by the kernel when SDPA cannot take them)"""
    kernel_args: tuple
    """the plan's op arguments with its dense heads skipped (``SKIP_CODE``): cuDNN runs dense causal
    attention faster than the kernel's tile walk (0.76-0.80x of it on an H200), so those heads go to SDPA"""
    dense_heads: tuple
    vs_mask: tuple
    """per head, whether it is vertical-slash (what the quality guard checks)"""
    listed_mask: tuple
    """per head, whether it is vertical-slash or block-sparse: the heads the GPU index lists, so the only
    ones that can be near-dense (the reference index enumerates dense and A-shape heads' tiles too)"""
    n_vs: int
    n_listed: int

    @property
    def all_dense(self) -> bool:
        return len(self.dense_heads) == len(self.vs_mask)


@functools.lru_cache(maxsize=4096)
def split_plan(plan: LayerPlan) -> PlanSplit:
    patterns, budget_a, budget_b = plan.op_arguments()
    dense = tuple(h for h, hp in enumerate(plan.heads) if hp.pattern is Pattern.DENSE)
    vs_mask = tuple(hp.pattern is Pattern.VERTICAL_SLASH for hp in plan.heads)
    listed_mask = tuple(hp.pattern in LISTED_PATTERNS for hp in plan.heads)
    return PlanSplit((tuple(patterns), tuple(budget_a), tuple(budget_b)),
                     (tuple(attend.SKIP_CODE if h in dense else code for h, code in enumerate(patterns)),
                      tuple(budget_a), tuple(budget_b)), dense, vs_mask, listed_mask, sum(vs_mask), sum(listed_mask))


@functools.lru_cache(maxsize=4096)
def with_dense_heads(plan: LayerPlan, heads: tuple) -> LayerPlan:
    """``plan`` with ``heads`` dense (the routed ones)."""
    dense = HeadPlan(Pattern.DENSE)
    return LayerPlan(tuple(dense if h in heads else hp for h, hp in enumerate(plan.heads)))


def all_routed(plan: LayerPlan, routed: tuple) -> bool:
    """Whether the plan's dense heads and the ``routed`` ones are every head of the layer."""
    return bool(routed) and split_plan(with_dense_heads(plan, routed)).all_dense


@functools.lru_cache(maxsize=4096)
def head_mask(heads: tuple, count: int) -> torch.Tensor:
    """[count] bool on the host: True for ``heads``."""
    return torch.tensor([h in heads for h in range(count)], dtype=torch.bool)


@functools.lru_cache(maxsize=4096)
def kv_heads_of(heads: tuple, group: int) -> tuple:
    """The kv head each query head of ``heads`` reads, ``group`` query heads to a kv head."""
    return tuple(h // group for h in heads)


NEAR_DENSE_STATS = guard.GuardStats()
"""Counters of the near-dense rule, in the guard's type: ``heads_checked`` counts the listed (vertical-slash or
block-sparse) (batch, head) pairs, ``heads_forced_dense`` those whose index was near-dense, so they ran dense."""


def near_dense_heads(index, plan: LayerPlan, sq: int, skv: int, q_offset: int, key_mask=None) -> torch.Tensor:
    """[B, Hq] bool: the (batch, head) pairs the op runs dense by the near-dense rule, for an index that lists
    every head (the reference's; it enumerates dense and A-shape heads' tiles too, which the rule skips)."""
    listed = torch.tensor(split_plan(plan).listed_mask, device=index.block_count.device)
    return guard.near_dense(index, sq, skv, q_offset, key_mask) & listed[None, :]


def guarded_heads(plan: LayerPlan) -> tuple:
    """Per head, whether the quality guard checks it: the listed heads (vertical-slash and block-sparse), whose
    keys an estimate picks. A-shape heads read fixed keys, and dense heads all of them."""
    return split_plan(plan).listed_mask


def weak_heads(mass: torch.Tensor, plan: LayerPlan, guard_threshold: float) -> torch.Tensor:
    """[B, Hq] bool: the heads the quality guard checks (:func:`guarded_heads`) whose estimated captured
    ``mass`` ([B, Hq]) is under ``guard_threshold``."""
    return (mass < guard_threshold) & torch.tensor(guarded_heads(plan), device=mass.device)[None, :]


def guard_mass(q, k, index, scale: float, masks: CallMasks) -> torch.Tensor:
    """[B, Hq] fp32: the quality guard's estimate of each head's captured mass (the last query rows' softmax
    mass inside the last query tile's keys of ``index``), which it compares with the threshold."""
    vertical = guard.vertical_scores(q, k, scale=scale, **masks.kwargs())
    return guard.captured_mass(vertical, index, min(guard.VS_LAST_Q, q.shape[-2]))


def dense_rules(q, k, plan: LayerPlan, index, scale: float, masks: CallMasks, guard_threshold: float):
    """The run-time rules that send a (batch, head) pair dense, on an index that lists every head (the
    reference's): ([B, Hq] near-dense listed heads, [B, Hq] listed heads whose estimated captured mass is
    under ``guard_threshold``, or None when that is 0)."""
    near = near_dense_heads(index, plan, q.shape[-2], k.shape[-2], masks.q_offset, masks.key_mask)
    if guard_threshold <= 0 or not split_plan(plan).n_listed:
        return near, None
    return near, weak_heads(guard_mass(q, k, index, scale, masks), plan, guard_threshold)


def forced_on_gpu(share: Optional[torch.Tensor], plan: LayerPlan,
                  weak: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[B, Hq] bool on the device: the pairs the quality guard found ``weak`` or whose index is near-dense by
    ``share`` (``guard.kept_share`` of the GPU's index, which lists only the listed heads, so the others keep
    nothing there and are never near-dense), decided without a host sync; None when neither rule can fire (no
    guard, and no listed head: ``share`` is then None)."""
    split = split_plan(plan)
    if not split.n_listed:
        return weak
    near = share >= guard.NEAR_DENSE_SHARE
    guard.record(near, share.shape[0] * split.n_listed, NEAR_DENSE_STATS)
    return near if weak is None else weak | near


# --------------------------------------------------------------------------- the guard's escalation


def take_index(base: SparseIndex, other: SparseIndex, take: torch.Tensor) -> SparseIndex:
    """``base`` with the (batch, head) rows of ``other`` where ``take`` ([B, Hq] bool); the slot dims padded to the
    wider of the two (sizes from the shapes: no host sync, nothing sized by the data)."""
    def pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[-1]), value=value)

    rows = take[:, :, None]
    blocks = max(base.block_start.shape[-1], other.block_start.shape[-1])
    cols = max(base.col_index.shape[-1], other.col_index.shape[-1])
    return SparseIndex(
        block_count=torch.where(rows, other.block_count, base.block_count),
        block_start=torch.where(rows[..., None], pad(other.block_start, blocks, NO_BLOCK),
                                pad(base.block_start, blocks, NO_BLOCK)),
        col_count=torch.where(rows, other.col_count, base.col_count),
        col_index=torch.where(rows[..., None], pad(other.col_index, cols, -1), pad(base.col_index, cols, -1)),
    )

