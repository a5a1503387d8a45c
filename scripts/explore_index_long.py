"""GPU exploration (not a test): where the index's time goes at long prompts on issue 36's layer.

usage: python scripts/explore_index_long.py [--lengths 128k,1m] [--families structured] [--reps 5] [--old-index PATH]
                                           [--out PATH]

This times ``build_index_gpu`` as `bench kernels` calls it (Llama-3-8B's 32 query / 8 KV heads, d128, every head
VS(1000, 6096), no guard) and lists its CUDA time by kernel, memsets and fills included. At 1M on the H100
(2026-12-07) the index took 19.4 ms, 4.2 % of index + walk: 4.5 ms of it filling the worst-case block-start table
(11.7 GB, ``index.index_bytes``) with padding no reader looks at (since left unwritten: 15.6 ms), and 10 ms the
estimate's two passes over the keys (6.3 ms the column sums, 3.6 ms the row statistics; launching a GQA group's
heads side by side on each key block changed neither). One gather for the diagonal sums and 128-key steps for the
row statistics then made them 5.6 and 3.2 ms, the index 13.7 ms (BENCHMARKS.md section 1).

``--old-index PATH`` also builds the same inputs through an older ``kernels/index.py`` (loaded from PATH), in the
same process: its time and kernels, whether both list the same blocks and columns (up to their counts), and
whether the sparse walk's output over both is bit-identical.
"""
from __future__ import annotations

import argparse
import json

import torch

from explore_index_parts import kernel_table, listed, load_index_module
from minference_fx.autotune.dispatch import launch_config
from minference_fx.autotune.workload import family_qkv
from minference_fx.cli import parse_lengths
from minference_fx.kernels.attend import sparse_attention_triton
from minference_fx.kernels.index import build_index_gpu, index_bytes
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools.bench import event_ms

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def old_index_ab(q, k, v, plan, scale, reps: int, path: str) -> dict:
    """The older index's time, kernels and agreement with this one on the same inputs."""
    old = load_index_module(path)
    patterns, budget_a, budget_b = plan.op_arguments()
    launch = launch_config(q, k).launch()
    build_old = lambda: old.build_index_gpu(q, k, plan, scale=scale)  # noqa: E731
    ms = event_ms(build_old, reps)
    table, launches = kernel_table(build_old)
    new, older = build_index_gpu(q, k, plan, scale=scale), build_old()
    same = all(torch.equal(a, b) for a, b in zip(listed(new), listed(older)))
    outputs = [sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale, **launch)
               for index in (new, older)]
    return dict(old_index_ms=ms, old_kernels=table, old_launches=launches, same_listing=same,
                same_output=torch.equal(*outputs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="128k,1m")
    ap.add_argument("--families", default="structured")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--old-index", help="an older kernels/index.py to time and compare on the same inputs")
    ap.add_argument("--out")
    args = ap.parse_args()
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * LLAMA3_8B["num_q_heads"])
    runs = []
    for family in args.families.split(","):
        for length in parse_lengths(args.lengths):
            q, k, v = family_qkv(family, length, **LLAMA3_8B)
            scale = LLAMA3_8B["head_dim"] ** -0.5
            build = lambda: build_index_gpu(q, k, plan, scale=scale)  # noqa: E731
            ms = event_ms(build, args.reps)
            table, launches = kernel_table(build)
            sizes = {name: round(n / 2**30, 3) for name, n in index_bytes(plan, 1, length).items()}
            print(f"\n{family} {length}: index {ms:.2f} ms (median of {args.reps}), {launches} device activities, "
                  f"GiB {sizes}")
            for row in table:
                print(f"  {row['kernel']:<90} {row['calls']:>6} {row['ms']:>9.3f}")
            run = dict(family=family, length=length, index_ms=ms, kernels=table, launches=launches, gib=sizes)
            if args.old_index:
                run.update(old_index_ab(q, k, v, plan, scale, args.reps, args.old_index))
                print(f"  old index: {run['old_index_ms']:.2f} ms, {run['old_launches']} device activities, same "
                      f"listing {run['same_listing']}, walk output bit-identical {run['same_output']}")
                for row in run["old_kernels"]:
                    print(f"    {row['kernel']:<88} {row['calls']:>6} {row['ms']:>9.3f}")
            runs.append(run)
            del q, k, v
            torch.cuda.empty_cache()
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, plan="VS(1000, 6096) x 32 heads")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
