"""GPU exploration (not a test): the sparse walk with two query heads a program, on picks the two heads share.

usage: python scripts/explore_pair_heads.py --out FILE.json [--lengths 32k,128k] [--reps 10]

Today's walk runs 64-row programs, one query tile of one head each, because the index lists keys per head and per
64-row tile (BENCHMARKS section 1). If two query heads of one kv head kept the same picks, one 128-row program could
hold the same tile of both heads (rows 0..63 of head h, 64..127 of head h + 1, at the same positions), walk one block
list and read each K/V block once for both. ``scripts/explore_pair_heads.patch`` adds that launch to a copy of
``kernels/attend.py`` (``pair_heads=True``, ``block_m=128``; the shipped launches compile as before), and this script
times, on an index whose odd heads list what the even ones do (the shared picks, emulated: each pair takes its
first head's lists):

* ``own``: the shipped walk on the index as built (each head its own picks);
* ``shared``: the shipped walk on the shared index (the same work as the pair launch, 64-row programs);
* ``pair wW sS``: the pair launch on the shared index, W warps, S stages (8 warps: 4 spill on sm_90a).

The pair launch's output is compared with ``shared``'s (they compute the same thing). cuDNN runs beside them.
Which error shared picks cost is ``scripts/explore_band_picks.py``'s rules ``pair`` and ``group`` (CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from variant_runs import cases, cudnn_causal_ms, patched_tree

PATCH = Path(__file__).resolve().parent / "explore_pair_heads.patch"
PAIR_LAUNCHES = [(8, 2), (8, 3)]


def measure(lengths: list[int], reps: int) -> list[dict]:
    import torch

    from minference_fx.kernels.attend import sparse_attention_triton
    from minference_fx.kernels.index import build_index_gpu
    from minference_fx.kernels.reference import SparseIndex
    from minference_fx.tools.bench import _ms

    rows = []
    for shape_name, family, n, q, k, v, scale, plan, group in cases(lengths):
        args = plan.op_arguments()
        own = build_index_gpu(q, k, plan, scale=scale)
        even = lambda t: t[:, 0::2].repeat_interleave(2, 1).contiguous()  # noqa: E731
        shared = SparseIndex(*(even(t) for t in (own.block_count, own.block_start, own.col_count, own.col_index)))
        stages = 3 if n <= 32768 else 2  # the H200's tuned sparse walk of these shapes

        def walk(index, **launch):
            config = dict(num_warps=4, num_stages=stages, block_m=64, block_n=64) | launch
            return lambda: sparse_attention_triton(q, k, v, index, *args, scale=scale, **config)

        runs = {"own": walk(own), "shared": walk(shared)}
        for warps, st in PAIR_LAUNCHES:
            runs[f"pair w{warps} s{st}"] = walk(shared, block_m=128, num_warps=warps, num_stages=st, pair_heads=True)
        row = dict(shape=shape_name, family=family, length=n, cudnn_ms=cudnn_causal_ms(q, k, v, group, reps), ms={},
                   max_diff={})
        want = runs["shared"]()
        for name, fn in runs.items():
            out = fn()
            row["ms"][name] = _ms(fn, reps)
            if name.startswith("pair"):
                row["max_diff"][name] = float((out.float() - want.float()).abs().max())
            del out
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, own, shared, want
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tree", type=Path, default=Path("/tmp/mfx-pair-heads"))
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    from minference_fx.cli import parse_lengths

    if a.child:
        a.out.write_text(json.dumps(measure(parse_lengths(a.lengths), a.reps), indent=1))
        return
    tree = patched_tree(a.tree, PATCH)
    subprocess.run([sys.executable, str(tree / "scripts" / Path(__file__).name), "--out", str(a.out.resolve()),
                    "--lengths", a.lengths, "--reps", str(a.reps), "--child"],
                   env={**os.environ, "PYTHONPATH": str(tree)}, cwd="/", check=True)
    rows = json.loads(a.out.read_text())
    names = list(rows[0]["ms"])
    print("| shape | family | length | cuDNN | " + " | ".join(names) + " | shared / best pair | max diff |")
    print("| --- " * (5 + len(names)) + "| --- |")
    for r in rows:
        best = min(v for k, v in r["ms"].items() if k.startswith("pair"))
        print(f"| {r['shape']} | {r['family']} | {r['length'] // 1024}K | {r['cudnn_ms']:.2f} | "
              + " | ".join(f"{r['ms'][k]:.2f}" for k in names)
              + f" | {r['ms']['shared'] / best:.3f} | {max(r['max_diff'].values()):.2e} |")


if __name__ == "__main__":
    main()
