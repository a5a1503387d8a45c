"""GPU exploration (not a test): the sparse and dense walks' speed by the order their programs launch in.

usage: git show fa62708:kernels/attend.py > minference_fx/kernels/attend.py && git apply scripts/explore_launch_order.patch &&
       python scripts/explore_launch_order.py --out DIR [--orders m,heads,rev,heads_rev] [--lengths 32k,128k]

The patch makes the launch order an environment switch of the kernel of fa62708 (and ``MFX_WS=1`` marks its key loops
``warp_specialize``, which Triton 3.6 ignores on sm_90a: the PTX is the same). The kernel now launches ``rev``'s
order. Each order runs in a process of its own (``MFX_ORDER`` is read when ``kernels.attend`` is imported):

* ``m``: query tiles fastest, then (batch, head): fa62708's order for the sparse walk;
* ``heads``: the query heads of one kv head side by side on one query tile, so their K/V reads meet in L2;
* ``rev`` / ``heads_rev``: the same, last query tile (the longest walk) first (the dense walk's order in every
  case).

Shapes: Llama-3-8B's heads (32 q / 8 kv, d128) on both input families, VS(1000, 6096) every head, with the
shipped H200 launch configs; Qwen2.5-Coder-1.5B's (12 / 2) on the structured family; and the dense walk (every
head forced dense) against cuDNN. Every order's outputs are compared with the first's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from variant_runs import print_variant_table, run_cases


def run_order(lengths: list[int], out_dir: Path, order: str) -> list[dict]:
    return run_cases(lengths, out_dir, order, "order", first=order == "m", reps=25, sparse_stages=lambda n: 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--orders", default="m,heads,rev,heads_rev")
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    from minference_fx.cli import parse_lengths

    lengths = parse_lengths(a.lengths)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        rows = run_order(lengths, a.out, a.child)
        (a.out / f"launch_order_{a.child}.json").write_text(json.dumps(rows, indent=1))
        return
    orders = a.orders.split(",")
    for order in orders:
        subprocess.run([sys.executable, __file__, "--out", str(a.out), "--lengths", a.lengths, "--child", order],
                       env={**os.environ, "MFX_ORDER": order}, check=False)
    print_variant_table(a.out, "launch_order", orders, "order")


if __name__ == "__main__":
    main()
