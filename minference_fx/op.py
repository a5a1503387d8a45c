"""``minference::sparse_attention``: the one op the rewrite pass inserts.

It is a functional ``torch.library.custom_op``: opaque to Inductor, a new output
tensor, no host sync and no data-sized allocation, so a CUDA graph can capture it
and a change of prompt length never recompiles (every size is a SymInt).

Semantics, for query row ``i`` at absolute position ``p_i = q_offset + i`` of
batch ``b`` and query head ``h`` (kv head ``h // (Hq // Hkv)``), key ``j`` is
read when all of these hold:

* ``j <= p_i`` (causal, aligned bottom-right when ``q_offset = Skv - Sq``);
* ``key_mask[b, j]`` when a key mask (padding) is given;
* ``doc_ids[b, p_i] == doc_ids[b, j]`` when packed-sequence ids are given;
* ``p_i - j < window`` when ``window > 0`` (sliding-window models);
* ``j`` is in the head's sparse key set (its plan entry), unless that set holds at
  least 90 % of the causal key tiles (``kernels.guard.near_dense``: then the head runs
  dense, which is cheaper and exact) or the quality guard finds it captures too little
  attention mass, or unless the prompt is
  shorter than ``min_sparse_len``, in which case every head is dense and the
  call goes to the device's dense SDPA (cuDNN / flash on GPU). So do a layer
  whose plan is dense on every head and, on GPU, the dense heads of a mixed
  plan (cuDNN is faster than the sparse kernel's tile walk on dense work). A negative
  ``min_sparse_len`` means the tuned crossover of this device and shape
  (``minference-fx autotune``; untuned: from the plan's budgets, ``autotune.dispatch.untuned_crossover``,
  32768 for MInference's default head);
* or unless ``route_site`` names a rewritten site (``routing.new_site``) whose previous call ran the
  head dense in every batch row (near-dense index or guard), and this call needs no mask that SDPA would
  have to read (:func:`routable`: no documents or window, a prefill aligned at 0 or a decode step; a
  padding mask only with one batch row): then the head runs dense through the device's SDPA this call,
  without the mask, and a row the padding mask hides keys of runs it again with the mask in the kernel's
  dense walk (``minference_fx.routing``: lagged, read without a host sync). A head only ever gains keys
  by it. A site whose every head is routed builds its index only at one call in eight, or when the prompt
  has doubled (``routing.index_due``), to see a head stop being near-dense.

A row with no readable key yields zeros, never NaN.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .kernels.guard import GuardStats
from .kernels.tables import rows_per_batch
from .plan import LISTED_PATTERNS, HeadPlan, LayerPlan, Pattern


def _check_inputs(q, k, v, key_mask, doc_ids, scale, q_offset, window, patterns, budget_a, budget_b):
    problems = []
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        problems.append(f"q, k, v must be 4-D [B, H, S, D]; got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    else:
        if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
            problems.append(f"batch/heads/length disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if q.shape[-1] != k.shape[-1] or v.shape[-1] != q.shape[-1]:
            # the output is q's shape (the fake says so), so a value head dim of its own has no place in it
            problems.append(f"q, k, v head dims must agree, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
            problems.append(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
        if len(patterns) != q.shape[1]:
            problems.append(f"head plan has {len(patterns)} entries, q has {q.shape[1]} heads")
        batches = (1, q.shape[0])
        if key_mask is not None and (key_mask.dim() != 2 or key_mask.dtype != torch.bool
                                     or key_mask.shape[0] not in batches or key_mask.shape[1] != k.shape[2]):
            problems.append(f"key_mask must be a bool [B or 1, Skv={k.shape[2]}] tensor (B={q.shape[0]}), got "
                            f"{key_mask.dtype} of shape {tuple(key_mask.shape)}")
        if doc_ids is not None and (doc_ids.dim() != 2 or doc_ids.shape[0] not in batches
                                    or doc_ids.shape[1] < k.shape[2]
                                    or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool):
            problems.append(f"doc_ids must be an integer [B or 1, S >= Skv={k.shape[2]}] tensor (B={q.shape[0]}), "
                            f"got {doc_ids.dtype} of shape {tuple(doc_ids.shape)}")
        elif doc_ids is not None and q.shape[2] and (q_offset < 0 or q_offset + q.shape[2] > k.shape[2]):
            # a query's document is the id at its own position, which must be one of the keys' (the index
            # and the kernels read the ids of keys only)
            problems.append(f"with doc_ids every query must sit at a key position 0..{k.shape[2] - 1}, the queries "
                            f"sit at {q_offset}..{q_offset + q.shape[2] - 1}")
    if not (q.dtype == k.dtype == v.dtype):
        problems.append(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    elif q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        problems.append(f"q, k, v must be float16, bfloat16 or float32 (what the kernels compute in), got {q.dtype}")
    if window < 0:
        problems.append(f"window must be >= 0 (0: none), got {window}")
    if not (math.isfinite(scale) and scale > 0):
        problems.append(f"scale must be a finite number > 0, got {scale!r}")
    if not (len(patterns) == len(budget_a) == len(budget_b)):
        problems.append(f"plan lists differ in length: {len(patterns)}, {len(budget_a)}, {len(budget_b)}")
    if problems:
        raise ValueError("minference::sparse_attention: " + "; ".join(problems))


MASKED_SDPA_MAX_PAIRS = 1 << 24
"""Above this many (query, key) pairs a masked dense call on the GPU runs the sparse kernel's dense walk instead
of SDPA. SDPA takes no padding mask beside ``is_causal``, so the mask would be materialised, a byte per pair
([1, 1, 128K, 128K] is 16 GiB), and read by a slower masked kernel; HF under torch.compile builds a padding
mask whenever it is given an ``attention_mask`` (``generate`` always gives one), so every long prefill through
``generate`` would pay it."""


def dense_attention(q, k, v, key_mask, doc_ids, scale, q_offset, window):
    """Dense attention with the op's mask semantics, through the device's fused SDPA.

    The plain causal cases use ``is_causal`` / no mask so the fast fused kernels
    run; padding, packed documents, windows or an unaligned offset build a
    boolean mask of shape [B, 1, Sq, Skv], or on the GPU past
    :data:`MASKED_SDPA_MAX_PAIRS` run :func:`dense_walk`, which builds none.
    There a prefill of one prompt under a padding mask alone (``generate``'s) runs the fused SDPA without the
    mask, then the row again in the masked dense walk if the mask hides a key of it.
    """
    sq, skv = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if fused_sdpa_applies(sq, skv, key_mask, doc_ids, q_offset, window):
        # a prefill aligned at 0 is causal; otherwise (a decode step) every cached key is visible
        causal = q_offset == 0 and sq == skv
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa).contiguous()
    if q.is_cuda and sq * skv > MASKED_SDPA_MAX_PAIRS:
        masks = dict(key_mask=key_mask, doc_ids=doc_ids, q_offset=q_offset, window=window)
        if routable(q.shape[0], sq, skv, masks):
            # One prompt under generate's all-ones mask: this path at 0.79-1.00x maskless cuDNN, the walk at
            # 0.66-0.97x (16K-64K, explore_padding_mask_h200_2026-12-01_v2); a padded prompt pays both (1.6-1.7x
            # the walk). Below the limit the re-run's host cost (0.5-0.9 ms a call) outweighs what cuDNN saves.
            out = dense_attention(q, k, v, None, None, scale, q_offset, window)
            return dense_walk(q, k, v, key_mask, None, scale, q_offset, window, out=out)
        return dense_walk(q, k, v, key_mask, doc_ids, scale, q_offset, window)
    return masked_sdpa(q, k, v, key_mask, doc_ids, scale, q_offset, window)


def masked_sdpa(q, k, v, key_mask, doc_ids, scale, q_offset, window):
    """Dense attention with the op's mask semantics through SDPA given a boolean [B, 1, Sq, Skv] mask."""
    sq, skv = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    pos = torch.arange(sq, device=q.device) + q_offset
    keys = torch.arange(skv, device=q.device)
    allowed = (keys[None, :] <= pos[:, None])[None, None]
    if window > 0:
        allowed = allowed & (pos[:, None] - keys[None, :] < window)[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    if doc_ids is not None:
        q_doc = doc_ids[:, pos.clamp(max=doc_ids.shape[-1] - 1)]
        allowed = allowed & (q_doc[:, None, :, None] == doc_ids[:, None, None, :skv])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    # fully masked rows (left padding) must be 0, whatever the backend does with them
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0).to(q.dtype).contiguous()


def fused_sdpa_applies(sq: int, skv: int, key_mask, doc_ids, q_offset, window) -> bool:
    """Whether :func:`dense_attention` runs the device's fused SDPA with no mask: no padding, documents or
    window, and causal aligned top-left (a prefill) or every key visible (a decode step)."""
    plain = key_mask is None and doc_ids is None and window <= 0
    return plain and ((q_offset == 0 and sq == skv) or q_offset >= skv - 1)


def routable(batch: int, sq: int, skv: int, masks: dict) -> bool:
    """Whether heads may go to the device's fused SDPA run without a mask: where :func:`fused_sdpa_applies`,
    and under a padding mask alone for one batch row, as ``generate`` runs a single prompt (its mask all
    ones; a padded row runs again with it: :func:`_padded_rows_again`). In a padded batch most rows would
    run twice, SDPA's work on them wasted, so there the heads stay in the kernel's dense walk."""
    if masks["key_mask"] is not None and batch != 1:
        return False
    return fused_sdpa_applies(sq, skv, **{**masks, "key_mask": None})


def dense_walk(q, k, v, key_mask, doc_ids, scale, q_offset, window, launch=None, out=None):
    """Dense attention with the op's mask semantics through the sparse kernel's dense walk (every (batch, head)
    forced dense, nothing listed): it reads the key mask, document ids and window tile by tile, so nothing of
    size Sq x Skv is built. ``launch``: a launch config (default: this device's tuned dense walk). ``out``:
    SDPA wrote every row of it without ``key_mask`` (the only mask); only the rows the mask hides keys of run,
    into it."""
    from .kernels.attend import empty_index
    from .kernels.reference import BLOCK
    from .plan import PATTERN_CODES

    B, hq, sq, _ = q.shape
    if out is not None and (doc_ids is not None or window > 0):
        raise ValueError("dense_walk(out=...) runs again only the rows a padding mask hides keys of: with documents "
                         "or a window SDPA's unmasked rows would stand")
    key_mask, doc_ids = rows_per_batch(key_mask, B), rows_per_batch(doc_ids, B)  # as the kernel reads them
    if launch is None:
        from .autotune.dispatch import launch_config

        launch = launch_config(q, k, "dense_walk")
    zeros = (0,) * hq
    args = (q, k, v, empty_index(B, hq, -(-sq // BLOCK), q.device), (PATTERN_CODES[Pattern.DENSE],) * hq, zeros, zeros)
    masks = dict(key_mask=key_mask, doc_ids=doc_ids, q_offset=q_offset, window=window)
    if out is not None:
        _padded_rows_again(args, out, tuple(range(hq)), _padded_rows(masks), masks, scale=scale, **launch.launch())
        return out
    every_pair = torch.ones(B, hq, dtype=torch.bool, device=q.device)
    return _launch_by_rows(args, masks, _padded_rows(masks), every_pair, "only", scale=scale, **launch.launch())


def _padded_rows(masks: dict):
    """[B, 1] bool: the batch rows whose padding mask hides a key, when a padding mask is the only mask (with
    documents or a window the walk checks every tile anyway); else None."""
    if masks["key_mask"] is None or masks["doc_ids"] is not None or masks["window"] > 0:
        return None
    return ~masks["key_mask"].all(1, keepdim=True)


def _launch_by_rows(args: tuple, masks: dict, padded, force: torch.Tensor, forced: str, **launch) -> torch.Tensor:
    """One kernel launch of ``forced`` mode over the [B, Hq] table ``force`` ("skip" runs the other pairs, "only"
    these); with ``padded`` rows (:func:`_padded_rows`), two: the rows whose keys are all valid without the
    mask, which would cost the walk its unmasked fast path on every tile (SmolLM2 at 128K: 1.81x HF eager with
    generate's all-ones mask before this split, 2.26x without a mask:
    ``results/bench_prefill_smollm2_h200_2026-12-01_v12*``, ``_v10*`` at 6fb579a), then the padded rows with it. Each leaves the other's rows
    alone, so every pair runs once, as the mask says. Returns the output."""
    from .kernels.attend import sparse_attention_triton

    if padded is None:
        return sparse_attention_triton(*args, force_dense=force, forced=forced, **launch, **masks)
    valid_rows, padded_rows = (force | padded, force | ~padded) if forced == "skip" else (force & ~padded, force & padded)
    out = sparse_attention_triton(*args, force_dense=valid_rows, forced=forced, **launch, **{**masks, "key_mask": None})
    return sparse_attention_triton(*args, force_dense=padded_rows, forced=forced, **{**launch, "out": out}, **masks)


@torch.library.custom_op("minference::sparse_attention", mutates_args=())
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    doc_ids: Optional[torch.Tensor],
    scale: float,
    q_offset: int,
    window: int,
    patterns: list[int],
    budget_a: list[int],
    budget_b: list[int],
    min_sparse_len: int,
    guard_threshold: float = 0.0,
    route_site: int = -1,
) -> torch.Tensor:
    _check_inputs(q, k, v, key_mask, doc_ids, scale, q_offset, window, patterns, budget_a, budget_b)
    if doc_ids is not None:
        doc_ids = doc_ids[:, :k.shape[2]]  # ids past the keys belong to no key and no query (checked above)
    key_mask, doc_ids = rows_per_batch(key_mask, q.shape[0]), rows_per_batch(doc_ids, q.shape[0])
    if q.is_cuda:
        from . import precompile

        # the first call, dense or sparse, waits for the kernels compiling in the background (at once when
        # none is): no CUDA work of that thread can then overlap a graph capture that follows this call
        precompile.wait()
    plan = _layer_plan(tuple(patterns), tuple(budget_a), tuple(budget_b))
    if q.numel() == 0:
        # nothing to attend for: an empty batch or no query rows. The output is as empty as q; the index, the
        # guard and the kernels are never asked about a call with no rows (the reference's index and the guard
        # failed on them)
        return q.new_empty(q.shape)
    if min_sparse_len < 0:
        from .autotune.dispatch import tuned_min_sparse_len

        min_sparse_len = tuned_min_sparse_len(q, k, plan)
    if q.shape[-2] < min_sparse_len or _split(plan).all_dense or k.shape[-2] == 0:
        # a layer the plan keeps wholly dense runs the device's fused SDPA, faster than any tile walk (and with
        # no keys there is no tile to walk: every row is zeros)
        return dense_attention(q, k, v, key_mask, doc_ids, scale, q_offset, window)
    return _sparse_impl(q, k, v, key_mask, doc_ids, scale, q_offset, window, plan, guard_threshold, route_site)


def _sparse_impl(q, k, v, key_mask, doc_ids, scale, q_offset, window, plan: LayerPlan, guard_threshold, route_site):
    from . import routing
    from .kernels import guard

    masks = dict(key_mask=key_mask, doc_ids=doc_ids, q_offset=q_offset, window=window)
    split = _split(plan)
    n_vs = split.n_vs
    guarded = guard_threshold > 0 and n_vs > 0
    # routing sends heads to the fused SDPA; with documents or a window to read it has none to send them to
    can_route = routable(q.shape[0], q.shape[-2], k.shape[-2], masks)
    routed = routing.routed_heads(route_site, q.shape[1], q.device) if can_route else ()
    if routed and _split(_layer_plan_with_dense(plan, routed)).all_dense and \
            not routing.index_due(route_site, q.shape[-2], q.device):
        if not q.is_cuda:  # the CPU's SDPA reads the mask itself
            return dense_attention(q, k, v, key_mask, None, scale, q_offset, 0)
        return _every_head_routed(q, k, v, key_mask, scale, q_offset)
    if q.is_cuda:
        from .autotune.dispatch import launch_config

        out, weak, ran_dense = sparse_on_gpu(q, k, v, plan, scale, masks, guard_threshold if guarded else 0.0,
                                             launch_config(q, k), launch_config(q, k, "dense_walk"), routed)
        if weak is not None:
            guard.record(weak, q.shape[0] * n_vs)
        if ran_dense is not None and can_route:
            routing.observe(route_site, ran_dense, q.shape[-2])
        return out
    # CPU: the reference is the implementation (the Triton interpreter is for tests, not speed)
    from .kernels import reference

    index = reference.build_index(q, k, plan, scale=scale, **masks)
    force, weak = dense_rules(q, k, plan, index, scale, masks, guard_threshold if guarded else 0.0)
    guard.record(force, q.shape[0] * split.n_listed, NEAR_DENSE_STATS)
    if weak is not None:
        guard.record(weak, q.shape[0] * n_vs)
        force = force | weak
    if can_route:
        routing.observe(route_site, force, q.shape[-2])
    force = force | _head_mask(routed, q.shape[1])[None, :]
    if bool(force.any()):  # CPU: a host check is free, and densify copies the index
        index = guard.densify(index, force, q.shape[-2], k.shape[-2], q_offset)
    out = reference.sparse_attention_reference(q, k, v, plan, scale=scale, index=index, **masks)
    return out.to(q.dtype).contiguous()


def _every_head_routed(q, k, v, key_mask, scale: float, q_offset: int, walk=None) -> torch.Tensor:
    """A layer whose every head is routed: the device's fused SDPA without the mask (``routable`` allows no
    other), then the rows a padding mask hides keys of again, masked, in the kernel's dense walk (launch config
    ``walk``, default this device's). The same launches whether the call built its index or skipped it
    (``routing.index_due``), so a CUDA graph captured at a skipping call runs only what its warm-up ran."""
    out = dense_attention(q, k, v, None, None, scale, q_offset, 0)
    if key_mask is None:
        return out
    return dense_walk(q, k, v, key_mask, None, scale, q_offset, 0, launch=walk, out=out)


def dense_rules(q, k, plan: LayerPlan, index, scale: float, masks: dict, guard_threshold: float):
    """The run-time rules that send a (batch, head) pair dense, on an index that lists every head (the
    reference's): ([B, Hq] near-dense listed heads, [B, Hq] vertical-slash heads whose estimated captured
    mass is under ``guard_threshold``, or None when that is 0)."""
    near = near_dense_heads(index, plan, q.shape[-2], k.shape[-2], masks["q_offset"], masks["key_mask"])
    if guard_threshold <= 0 or not _split(plan).n_vs:
        return near, None
    return near, weak_heads(guard_mass(q, k, index, scale, masks), plan, guard_threshold)


def guarded_heads(plan: LayerPlan) -> tuple:
    """Per head, whether the quality guard checks it (vertical-slash heads)."""
    return _split(plan).vs_mask


def weak_heads(mass: torch.Tensor, plan: LayerPlan, guard_threshold: float) -> torch.Tensor:
    """[B, Hq] bool: the vertical-slash heads (the only ones the quality guard checks) whose estimated
    captured ``mass`` ([B, Hq]) is under ``guard_threshold``."""
    return (mass < guard_threshold) & torch.tensor(guarded_heads(plan), device=mass.device)[None, :]


def guard_mass(q, k, index, scale: float, masks: dict) -> torch.Tensor:
    """[B, Hq] fp32: the quality guard's estimate of each head's captured mass (the last query rows' softmax
    mass inside the last query tile's keys of ``index``), which it compares with the threshold."""
    from .kernels import guard

    return guard.captured_mass(guard.vertical_scores(q, k, scale=scale, **masks), index, min(guard.VS_LAST_Q, q.shape[-2]))


class GpuResult(NamedTuple):
    out: torch.Tensor
    weak: Optional[torch.Tensor]
    """[B, Hq] bool: the pairs the quality guard forced dense; None without a guard"""
    ran_dense: Optional[torch.Tensor]
    """[B, Hq] bool: the pairs this call's index or guard ran dense (routed heads by their own index, not by
    the routing); None when the plan lists no head and there is no guard"""


def sparse_on_gpu(q, k, v, plan: LayerPlan, scale: float, masks: dict, guard_threshold: float, tuned,
                  dense_walk=None, routed: tuple = ()) -> GpuResult:
    """The op's GPU path with launch configs ``tuned`` (the sparse walk) and ``dense_walk``: index, the
    heads to run dense this call (quality guard, near-dense index), kernel; the plan's dense heads and the
    ``routed`` ones through the device's fused SDPA without a mask (the whole layer in one call when that is
    every head) where :func:`routable` (under a padding mask, one batch row: run again in the masked dense walk
    when padded), else in the kernel's dense walk (routing then changes nothing). The index still
    covers routed heads, so ``ran_dense`` says whether they would have run dense."""
    from .autotune.cache import DEFAULT_ENTRIES
    from .kernels import guard
    from .kernels.attend import sparse_attention_triton
    from .kernels.index import build_index_gpu

    split = _split(plan)
    guarded = guard_threshold > 0
    mass = torch.ones(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device) if guarded else None
    index = build_index_gpu(q, k, plan, scale=scale, mass_out=mass, **masks)  # dense heads list nothing
    weak = mass < guard_threshold if guarded else None
    force = weak
    if split.n_listed:  # only listed heads can be near-dense: a plan without any needs no check
        # the GPU index lists nothing for other heads, so near_dense alone never picks them
        near = guard.near_dense(index, q.shape[-2], k.shape[-2], masks["q_offset"], masks["key_mask"])
        guard.record(near, q.shape[0] * split.n_listed, NEAR_DENSE_STATS)
        force = near if force is None else force | near
    ran_dense = force
    walk = dense_walk or DEFAULT_ENTRIES["dense_walk"]
    by_sdpa = routable(q.shape[0], q.shape[-2], k.shape[-2], masks)
    if routed and by_sdpa:
        split = _split(_layer_plan_with_dense(plan, routed))
        if split.all_dense:
            out = _every_head_routed(q, k, v, masks["key_mask"], scale, masks["q_offset"], walk)
            return GpuResult(out, weak, ran_dense)
    padded, walk_launch = _padded_rows(masks), walk.launch()
    kernel_args, sdpa_heads = split.kernel_args, split.dense_heads
    if sdpa_heads and not by_sdpa:
        # With documents, a window or a padded batch SDPA would read a materialised mask (or run padded rows
        # twice), or the dense walk would run on copies of these heads (a kernel variant of its own, compiled
        # at the first such call): the plan's dense heads join this call's dense walk.
        kernel_args, sdpa_heads = split.op_args, ()
        pairs = _dense_pairs(split.dense_heads, q)
        force = pairs if force is None else force | pairs
    args = (q, k, v, index, *kernel_args)
    if force is None and padded is None:
        out = sparse_attention_triton(*args, scale=scale, **tuned.launch(), **masks)
    else:
        # Launches into one output, whatever the device decided: the sparse walk skips the forced pairs, the
        # dense walk (programs of up to two query tiles, no list reads) runs only them.
        skip = force if force is not None else torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
        out = _launch_by_rows(args, masks, padded, skip, "skip", scale=scale, **tuned.launch())
        if force is not None:
            _launch_by_rows(args, masks, padded, force, "only", scale=scale, out=out, **walk_launch)
    if sdpa_heads:
        _dense_heads_by_sdpa(q, k, v, out, sdpa_heads, _kv_heads(sdpa_heads, q.shape[1] // k.shape[1]), scale,
                             {**masks, "key_mask": None})
        _padded_rows_again((q, k, v, index, *split.op_args), out, sdpa_heads, padded, masks, scale=scale,
                           **walk_launch)
    return GpuResult(out, weak, ran_dense)


def _padded_rows_again(args: tuple, out, heads: tuple, padded, masks: dict, **launch) -> None:
    """SDPA wrote query ``heads`` of every batch row without the padding mask: the rows it hides keys of
    (``padded``, :func:`_padded_rows`; None: no mask) run those heads again, with it, in the kernel's dense
    walk over ``args`` (q, k, v, index and op arguments that code those heads dense). Without padding every
    program of that launch returns at once (no host check decides it)."""
    if padded is None:
        return
    from .kernels.attend import sparse_attention_triton

    sparse_attention_triton(*args, force_dense=_dense_pairs(heads, args[0]) & padded, forced="only", out=out,
                            **launch, **masks)


def _dense_pairs(heads: tuple, q: torch.Tensor) -> torch.Tensor:
    """[B, Hq] bool on q's device: True for query heads ``heads`` (built on the device: no host copy)."""
    from .kernels.tables import int_table

    pairs = torch.zeros(q.shape[1], dtype=torch.bool, device=q.device)
    pairs.index_fill_(0, int_table(heads, q.device).long(), True)
    return pairs[None, :].expand(q.shape[0], -1)


def near_dense_heads(index, plan: LayerPlan, sq: int, skv: int, q_offset: int, key_mask=None) -> torch.Tensor:
    """[B, Hq] bool: the (batch, head) pairs the op runs dense by the near-dense rule, for an index that lists
    every head (the reference's; it enumerates dense and A-shape heads' tiles too, which the rule skips)."""
    from .kernels import guard

    listed = torch.tensor(_split(plan).listed_mask, device=index.tile_count.device)
    return guard.near_dense(index, sq, skv, q_offset, key_mask) & listed[None, :]


NEAR_DENSE_STATS = GuardStats()
"""Counters of the near-dense rule, in the guard's type: ``heads_checked`` counts the listed (vertical-slash or
block-sparse) (batch, head) pairs, ``heads_forced_dense`` those whose index was near-dense, so they ran dense."""


@dataclasses.dataclass(frozen=True)
class _PlanSplit:
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
def _layer_plan(patterns: tuple, budget_a: tuple, budget_b: tuple) -> LayerPlan:
    return LayerPlan.from_op_arguments(patterns, budget_a, budget_b)


@functools.lru_cache(maxsize=4096)
def _split(plan: LayerPlan) -> _PlanSplit:
    from .kernels.attend import SKIP_CODE

    patterns, budget_a, budget_b = plan.op_arguments()
    dense = tuple(h for h, hp in enumerate(plan.heads) if hp.pattern is Pattern.DENSE)
    vs_mask = tuple(hp.pattern is Pattern.VERTICAL_SLASH for hp in plan.heads)
    listed_mask = tuple(hp.pattern in LISTED_PATTERNS for hp in plan.heads)
    return _PlanSplit((tuple(patterns), tuple(budget_a), tuple(budget_b)),
                      (tuple(SKIP_CODE if h in dense else code for h, code in enumerate(patterns)), tuple(budget_a),
                       tuple(budget_b)), dense, vs_mask, listed_mask, sum(vs_mask), sum(listed_mask))


@functools.lru_cache(maxsize=4096)
def _layer_plan_with_dense(plan: LayerPlan, heads: tuple) -> LayerPlan:
    """``plan`` with ``heads`` dense (the routed ones)."""
    dense = HeadPlan(Pattern.DENSE)
    return LayerPlan(tuple(dense if h in heads else hp for h, hp in enumerate(plan.heads)))


@functools.lru_cache(maxsize=4096)
def _head_mask(heads: tuple, count: int) -> torch.Tensor:
    return torch.tensor([h in heads for h in range(count)], dtype=torch.bool)


@functools.lru_cache(maxsize=4096)
def _kv_heads(heads: tuple, group: int) -> tuple:
    return tuple(h // group for h in heads)


def _dense_heads_by_sdpa(q, k, v, out, dense_heads: tuple, kv_heads: tuple, scale: float, masks: dict) -> None:
    """Write dense attention of query heads ``dense_heads`` into ``out``, each reading its kv head in
    ``kv_heads`` (no repeat of the others). The head lists become device tables written without a host
    copy, so a CUDA graph can capture this."""
    from .kernels.tables import int_table

    heads = int_table(dense_heads, q.device)
    kv_heads = int_table(kv_heads, q.device)
    dense = dense_attention(q.index_select(1, heads), k.index_select(1, kv_heads), v.index_select(1, kv_heads),
                            masks["key_mask"], masks["doc_ids"], scale, masks["q_offset"], masks["window"])
    out.index_copy_(1, heads.long(), dense)


_TENSOR_ARGS = ("q", "k", "v", "key_mask", "doc_ids")


def _inference_only_message(needs_grad) -> str:
    return (f"minference::sparse_attention is inference-only (it has no backward), but {', '.join(needs_grad)} "
            "require grad with grad mode on; call it under torch.inference_mode() or torch.no_grad(), or pass "
            "detached tensors (torch.compile with the minference backend leaves such sites dense by itself)")


def _refuse_autograd(ctx, inputs, output):
    # runs at the call (autograd only calls it when grad mode is on and an input requires grad), so the error
    # comes where the op is used, not at a later .backward()
    needs_grad = [name for name, x in zip(_TENSOR_ARGS, inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    raise RuntimeError(_inference_only_message(needs_grad or ["inputs"]))


def _no_backward(ctx, grad):  # unreachable: _refuse_autograd raised at the call
    raise RuntimeError(_inference_only_message(["inputs"]))


sparse_attention.register_autograd(_no_backward, setup_context=_refuse_autograd)


@sparse_attention.register_fake
def _sparse_attention_fake(q, k, v, key_mask, doc_ids, scale, q_offset, window, patterns, budget_a, budget_b, min_sparse_len,
                           guard_threshold=0.0, route_site=-1):
    # new_empty, not empty_like: q is often a transposed view and the real op returns contiguous
    return q.new_empty(q.shape)
