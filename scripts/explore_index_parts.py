"""GPU exploration (not a test): what the op's index costs, part by part, on a shipped config's layer plans.

usage: python scripts/explore_index_parts.py [--config configs/qwen2.5_coder_1.5b_instruct_32k_yarn.json]
                                             [--lengths 32k,128k] [--families structured] [--old-index PATH]
                                             [--old-escalation pair|own] [--reps N] [--out PATH]

``bench breakdown`` on Qwen2.5-Coder-1.5B (H100, 2026-12-06) found the index at 19 % of the compiled forward at 32K
(2.1 ms a layer on average against 5.1 ms for the layer's dense attention) and 10 % at 128K. This takes it apart on synthetic
inputs of the model's attention shape (12 query / 2 KV heads, d128), every layer's plan as the op runs it at that
length (budget growth included), in one run:

* the index alone (``build_index_gpu``), with the guard's mass, and with the guard's escalation (two indexes and
  the merge), the sum over the config's layers by CUDA events;
* one pass of the escalated path under ``torch.profiler``: CUDA time by kernel, so the parts (estimate, ranking,
  top-k, sort, tiles, merge) can be named;
* with ``--old-index`` (an ``index.py``: an older one, e.g. ``git show REV:minference_fx/kernels/index.py``, or this
  tree's ``minference_fx/kernels/index.py``), the same sums through it with the escalation as the op ran it before
  2026-12-06 (two indexes, then ``dense.take_index``), on the same inputs in the same run, and whether both list the
  same keys and give the same verdicts;
* with ``--walk-parts``, the sparse walk of every layer's index (the plan's dense heads skipped, as the op sends them to
  SDPA; tuned launch config) whole, with its leftover columns dropped, and with its blocks dropped, summed over the
  layers, and the units of work each part lists (a block, or a gather of up to 64 columns): what the columns cost on
  this config's budgets, whose vertical-slash heads keep thousands of columns a head past 32K.
"""
from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from minference_fx import dense, sparse_path
from minference_fx.autotune.dispatch import launch_config
from minference_fx.autotune.workload import family_qkv
from minference_fx.call_masks import CallMasks
from minference_fx.cli import parse_lengths
from minference_fx.config import load_config
from minference_fx.kernels.attend import sparse_attention_triton
from minference_fx.kernels.reference import SparseIndex
from minference_fx.plan import escalated_plan
from minference_fx.sparse_path import guarded_index_on_gpu
from minference_fx.tools.bench import event_ms

QWEN_SHAPE = dict(num_q_heads=12, num_kv_heads=2, head_dim=128)


def layer_plans(config, length: int) -> list:
    heads = QWEN_SHAPE["num_q_heads"]
    plans = [config.plan_at(layer, 0, heads, length) for layer in range(len(config.layers))]
    return [(plan, escalated_plan(plan, config.guard_escalation) if config.guard_escalation else None)
            for plan in plans]


def parts(q, k, plans, threshold: float, reps: int = 3) -> tuple:
    """({variant: ms over every layer's plan}, a run of the escalated variant over them for the profiler)."""
    scale = q.shape[-1] ** -0.5
    masks = CallMasks(None, None, 0, 0)

    def every_layer(one):
        def run():
            for plan, up in plans:
                one(plan, up)
        return run

    variants = {
        "index alone": lambda plan, up: sparse_path.build_index_gpu(q, k, plan, scale=scale),
        "index + guard mass": lambda plan, up: guarded_index_on_gpu(q, k, plan, scale, masks, threshold, None),
        "index + guard + escalation": lambda plan, up: guarded_index_on_gpu(q, k, plan, scale, masks, threshold, up),
    }
    return {name: event_ms(every_layer(fn), reps=reps) for name, fn in variants.items()}, every_layer(
        variants["index + guard + escalation"])


def walk_parts(q, k, v, plans, reps: int = 3) -> dict:
    """{part: ms over every layer's walk} and the units each part lists, for the index whole, its blocks alone and its
    leftover columns alone."""
    scale = q.shape[-1] ** -0.5
    launch = launch_config(q, k).launch()
    layers = []
    for plan, _ in plans:
        index = sparse_path.build_index_gpu(q, k, plan, scale=scale)
        no_cols = torch.zeros_like(index.col_count)
        no_blocks = torch.zeros_like(index.block_count)
        layers.append((dense.split_plan(plan).kernel_args, {
            "whole": index,
            "blocks only": SparseIndex(index.block_count, index.block_start, no_cols, index.col_index),
            "columns only": SparseIndex(no_blocks, index.block_start, index.col_count, index.col_index)}))
    found = {}
    for part in ("whole", "blocks only", "columns only"):
        def run(part=part):
            for kernel_args, indexes in layers:
                sparse_attention_triton(q, k, v, indexes[part], *kernel_args, scale=scale, **launch)
        found[f"{part} ms"] = event_ms(run, reps=reps)
    found["blocks"] = sum(int(ix["whole"].block_count.sum()) for _, ix in layers)
    found["column gathers"] = sum(int(((ix["whole"].col_count + 63) // 64).sum()) for _, ix in layers)
    found["columns"] = sum(int(ix["whole"].col_count.sum()) for _, ix in layers)
    return found


def load_index_module(path: str):
    spec = importlib.util.spec_from_file_location("old_index", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pair_then_take(module):
    """The guard's escalation as the op ran it before 2026-12-06: ``module``'s two indexes (``build_index_pair_gpu``),
    then the weak rows taken from the second by ``dense.take_index`` (pads and copies of both tables)."""
    def build(q, k, plan, escalated, *, scale, take_below, mass_out, escalated_mass_out, **kw):
        index, index_up = module.build_index_pair_gpu(q, k, plan, escalated, scale=scale, mass_out=mass_out,
                                                      escalated_mass_out=escalated_mass_out, **kw)
        took = mass_out < take_below
        return dense.take_index(index, index_up, took), took
    return build


def through(module, run, escalation: str = "pair"):
    """``run`` with the op's path building its index through ``module`` (another index.py, or this one), its
    escalation by :func:`pair_then_take` (``escalation`` "pair") or by the module's own one-index escalation ("own")."""
    saved = sparse_path.build_index_gpu, sparse_path.build_index_escalated_gpu
    escalated = module.build_index_escalated_gpu if escalation == "own" else pair_then_take(module)
    sparse_path.build_index_gpu, sparse_path.build_index_escalated_gpu = module.build_index_gpu, escalated
    try:
        return run()
    finally:
        sparse_path.build_index_gpu, sparse_path.build_index_escalated_gpu = saved


def listed(index) -> list[torch.Tensor]:
    """The index's counts, and its slots up to them (past the counts a slot may hold anything), as comparable tensors."""
    padded = index.padded()
    return [padded.block_count, padded.col_count, padded.block_start.int(), padded.col_index]


def same_index(q, k, plans, threshold: float, module, escalation: str = "pair") -> bool:
    """Whether the escalated path lists the same keys and gives the same verdicts through ``module`` as through this
    tree's."""
    scale = q.shape[-1] ** -0.5
    masks = CallMasks(None, None, 0, 0)
    for plan, up in plans:
        new = guarded_index_on_gpu(q, k, plan, scale, masks, threshold, up)
        old = through(module, lambda: guarded_index_on_gpu(q, k, plan, scale, masks, threshold, up), escalation)
        if not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(listed(new.index), listed(old.index))):
            return False
        if not torch.equal(new.weak, old.weak):
            return False
    return True


def kernel_table(run, top: int = 25) -> tuple[list[dict], int]:
    """The ``top`` kernels of one ``run`` by CUDA time, and the count of every device activity it launched (kernels,
    memsets, copies): what bounds the index by the host where its kernels are short."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        ms = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)) / 1000
        if ms > 0:
            rows.append(dict(kernel=event.key[:90], calls=event.count, ms=round(ms, 3)))
    return sorted(rows, key=lambda r: -r["ms"])[:top], sum(r["calls"] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen2.5_coder_1.5b_instruct_32k_yarn.json")
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--families", default="structured")
    ap.add_argument("--old-index")
    ap.add_argument("--old-escalation", choices=["pair", "own"], default="pair",
                    help="the old index's escalation: two indexes then take_index (as before 2026-12-06), or its own")
    ap.add_argument("--reps", type=int, default=3, help="timed passes over the layers, their median reported")
    ap.add_argument("--walk-parts", action="store_true", help="also time the sparse walk whole, blocks only, columns only")
    ap.add_argument("--out")
    args = ap.parse_args()
    config = load_config(args.config)
    threshold = config.guard_threshold
    old = load_index_module(args.old_index) if args.old_index else None
    found = []
    for family in args.families.split(","):
        for length in parse_lengths(args.lengths):
            q, k, v = family_qkv(family, length, **QWEN_SHAPE)
            plans = layer_plans(config, length)
            if args.walk_parts:
                found.append(dict(family=family, length=length, walk_parts=walk_parts(q, k, v, plans, args.reps)))
                print(f"\n{family} {length}: walk parts over {len(plans)} layers: {found[-1]['walk_parts']}", flush=True)
            times, escalated_run = parts(q, k, plans, threshold, args.reps)
            table, launches = kernel_table(escalated_run)
            print(f"\n{family} {length}: {len(plans)} layers, guard {threshold}, escalation {config.guard_escalation}")
            for name, ms in times.items():
                print(f"  {name:<30} {ms:8.2f} ms  ({ms / len(plans):.3f} a layer)")
            print(f"  device activities launched by the escalated pass: {launches}")
            print(f"  {'kernel':<90} {'calls':>6} {'ms':>9}")
            for row in table:
                print(f"  {row['kernel']:<90} {row['calls']:>6} {row['ms']:>9.3f}")
            run = dict(family=family, length=length, layers=len(plans), times_ms=times, kernels=table, launches=launches)
            if old is not None:
                old_times, old_run = through(old, lambda: parts(q, k, plans, threshold, args.reps), args.old_escalation)
                _, old_launches = through(old, lambda: kernel_table(old_run), args.old_escalation)
                run.update(old_times_ms=old_times, old_launches=old_launches,
                           same_index=same_index(q, k, plans, threshold, old, args.old_escalation))
                for name, ms in old_times.items():
                    print(f"  old index: {name:<30} {ms:8.2f} ms")
                print(f"  old index: device activities launched by the escalated pass: {old_launches}")
                print(f"  same index and verdicts as the old: {run['same_index']}")
            found.append(run)
            del q, k, v
            torch.cuda.empty_cache()
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, config=args.config)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, runs=found), f, indent=1)


if __name__ == "__main__":
    main()
