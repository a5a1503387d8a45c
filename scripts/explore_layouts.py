#!/usr/bin/env python3
"""Arithmetic, no kernel: the work key layouts would do for the same vertical-slash picks (issue 36, parts 2 and 3).

For each head the picks come from the project's own estimate (``kernels.density.selection_of``, the reference
path) on one of ``bench kernels``' input families, every head vertical-slash at the given budgets. Per 64-row query
tile it counts the 64 x 64 blocks of work of:

* **aligned tiles** (the walk today): a diagonal d = 64a + b crosses key tiles m - a and, when b > 0, m - a - 1;
  the tiles a query tile lists are the union over its diagonals;
* **unaligned ranges** (MInference's block offsets): diagonal d reads keys [64m - d, 64m + 63 - d]; diagonals
  closer than 64 merge into one run, and a run of L keys costs ceil(L / 64) blocks that may start anywhere;
* **diagonal blocks** (the walk since c533d13: ``reference.diagonal_blocks``), with 64-row query tiles, and the same
  rule for 128-row query tiles reading 128-key blocks (each four 64 x 64 blocks of work, each column group two).
  A 128-row program runs each 64 x 64 block faster (on the same near-dense heads the dense walk, 128-row programs
  reading no list, ran 1.24x the sparse walk's rate per tile: ``git show
  6fb579a:results/explore_dense_h200_2026-11-30_v4.txt``; an upper bound for rows alone), so ``--speedup`` turns the
  two counts into a predicted time ratio, per head taking the faster of the two;
* **one program a kv head** (64-row tiles): the query heads of a kv head walk the union of their diagonal blocks and
  columns together, each block once for all of them (K/V read once a group), so each head computes every block of
  the union. The count is the union's work over the heads' own.

Both add the same column groups: every picked column the query tile can read, 64 to a group (the walk reads
only the columns its tiles miss, so this overcounts both alike). Physical density is blocks over causal tiles;
logical is picked keys over causal keys (diagonal and column picks counted apart, so a key both picks hold counts
twice: an upper bound). The layout that gets physical nearest logical wastes least. CPU only, no timing.

    python scripts/explore_layouts.py --lengths 32k --families structured,scattered [--budgets 1000 6096] [--speedup 1.24]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from minference_fx.autotune.workload import scattered_qkv, structured_qkv
from minference_fx.kernels.density import selection_of
from minference_fx.kernels.reference import diagonal_blocks
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.cli import parse_lengths

BLOCK = 64
FAMILIES = {"structured": structured_qkv, "scattered": scattered_qkv}


def aligned_blocks(diagonals: torch.Tensor, m_tiles: int) -> torch.Tensor:
    """int64 [M]: key tiles each query tile lists for ``diagonals`` (ascending, >= 0): the tile offsets
    {a, a + 1 if b > 0} of d = 64a + b, those that do not reach before key 0."""
    a, b = diagonals // BLOCK, diagonals % BLOCK
    offsets = torch.unique(torch.cat([a, a[b > 0] + 1]))
    m = torch.arange(m_tiles)
    return torch.searchsorted(offsets, m, right=True)  # offsets t <= m: tile m - t exists


def unaligned_blocks(diagonals: torch.Tensor, m_tiles: int) -> torch.Tensor:
    """int64 [M]: 64-key blocks each query tile reads when ``diagonals`` merge into runs of keys that may start
    anywhere; a run is cut at key 0."""
    d = diagonals
    new_run = torch.ones_like(d, dtype=torch.bool)
    new_run[1:] = (d[1:] - d[:-1]) > BLOCK  # ranges [-d, 63 - d] touch when the diagonals are <= 64 apart
    run_id = torch.cumsum(new_run.long(), 0) - 1
    first = torch.full((int(run_id[-1]) + 1,), -1, dtype=torch.int64).scatter_reduce(0, run_id, d, "amin", include_self=False)
    last = torch.full_like(first, -1).scatter_reduce(0, run_id, d, "amax", include_self=False)
    # query tile m, relative to key 64m: the run covers keys [-last, 63 - first], cut below at -64m
    lo = torch.maximum(-last[None, :], -BLOCK * torch.arange(m_tiles)[:, None])
    keys = (BLOCK - first[None, :] - lo).clamp(min=0)  # (63 - first) - lo + 1
    return ((keys + BLOCK - 1) // BLOCK).sum(1)


def diagonal_block_offsets(diagonals: torch.Tensor, rows: int) -> torch.Tensor:
    """int64: the offsets of ``reference.diagonal_blocks`` for query tiles of ``rows`` rows reading ``rows``-key
    blocks (rows = 64 is the index's rule)."""
    return torch.tensor(diagonal_blocks(diagonals.tolist(), rows), dtype=torch.int64)


def walk_work(offsets: torch.Tensor, columns: torch.Tensor, length: int, rows: int = BLOCK) -> int:
    """64 x 64 blocks of work of a walk whose query tiles hold ``rows`` rows, over ``rows``-key block ``offsets`` and
    ``columns`` (both ascending): the blocks a tile reads (keys ``lo - x .. lo - x + rows - 1`` meet ``0 .. hi``:
    x <= lo + rows - 1), then its readable columns in groups of 64, each block or group ``rows / 64`` times as tall
    as a 64-row one."""
    lo = torch.arange(math.ceil(length / rows)) * rows
    hi = torch.clamp(lo + rows - 1, max=length - 1)
    blocks = torch.searchsorted(offsets, lo + rows - 1, right=True)
    groups = (torch.searchsorted(columns, hi, right=True) + BLOCK - 1) // BLOCK
    scale = rows // BLOCK
    return int((blocks * scale * scale + groups * scale).sum())


def measure(family: str, length: int, budgets: tuple[int, int], heads: int, kv_heads: int,
            speedup: float = 1.24) -> dict:
    q, k, _ = FAMILIES[family](length, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                               dtype=torch.float32, device="cpu")
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * heads)
    picks = selection_of(q, k, plan, scale=128 ** -0.5)
    m_tiles = math.ceil(length / BLOCK)
    rows = torch.arange(length)
    causal_tiles = m_tiles * (m_tiles + 1) // 2
    causal_keys = length * (length + 1) // 2
    totals = {"aligned": 0, "unaligned": 0, "columns": 0, "logical": 0, "rows64": 0, "rows128": 0, "best": 0.0, "group": 0}
    group = heads // kv_heads
    group_offsets: list[torch.Tensor] = []
    group_columns: list[torch.Tensor] = []
    for h in range(heads):
        diagonals = picks.diagonals[0, h][picks.diagonals[0, h] >= 0].sort().values
        columns = picks.columns[0, h][picks.columns[0, h] >= 0].sort().values
        last_row = torch.clamp(torch.arange(m_tiles) * BLOCK + BLOCK - 1, max=length - 1)
        column_groups = (torch.searchsorted(columns, last_row, right=True) + BLOCK - 1) // BLOCK
        totals["aligned"] += int(aligned_blocks(diagonals, m_tiles).sum())
        totals["unaligned"] += int(unaligned_blocks(diagonals, m_tiles).sum())
        totals["columns"] += int(column_groups.sum())
        work64, work128 = (walk_work(diagonal_block_offsets(diagonals, r), columns, length, r) for r in (BLOCK, 2 * BLOCK))
        totals["rows64"] += work64
        totals["rows128"] += work128
        totals["best"] += min(work64, work128 / speedup)  # in 64-row time units
        group_offsets.append(diagonal_block_offsets(diagonals, BLOCK))
        group_columns.append(columns)
        if len(group_offsets) == group:
            union = walk_work(torch.unique(torch.cat(group_offsets)), torch.unique(torch.cat(group_columns)), length)
            totals["group"] += group * union
            group_offsets, group_columns = [], []
        kept = torch.searchsorted(diagonals, rows, right=True) + torch.searchsorted(columns, rows, right=True)
        totals["logical"] += int(torch.minimum(kept, rows + 1).sum())
    logical = totals["logical"] / (heads * causal_keys)
    out = {"family": family, "length": length, "budgets": list(budgets), "heads": heads, "logical": logical}
    for layout in ("aligned", "unaligned"):
        physical = (totals[layout] + totals["columns"]) / (heads * causal_tiles)
        out[layout] = {"physical": physical, "physical_over_logical": physical / logical,
                       "diagonal_blocks_share": totals[layout] / (totals[layout] + totals["columns"])}
    out["diagonal_blocks"] = {f"rows_{r}": totals[f"rows{r}"] / (heads * causal_tiles) for r in (64, 128)}
    out["diagonal_blocks"]["time_128_over_64"] = totals["rows128"] / speedup / totals["rows64"]
    out["diagonal_blocks"]["time_best_per_head_over_64"] = totals["best"] / totals["rows64"]
    out["diagonal_blocks"]["kv_group_union_over_own"] = totals["group"] / totals["rows64"]
    out["speedup_assumed"] = speedup
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32k")
    ap.add_argument("--families", default="structured,scattered")
    ap.add_argument("--budgets", type=int, nargs=2, default=(1000, 6096), metavar=("VERTICAL", "SLASH"))
    ap.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=1.24,
                    help="a 128-row program's rate per 64 x 64 block over a 64-row one's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'family':<11}{'length':>8}{'logical':>9}{'aligned':>9}{'/logical':>9}{'unaligned':>11}{'/logical':>9}"
          f"{'blocks64':>10}{'blocks128':>11}{'t128/t64':>10}{'best/t64':>10}{'kv-union':>10}")
    for family in args.families.split(","):
        for length in parse_lengths(args.lengths):
            r = measure(family, length, tuple(args.budgets), args.heads, args.kv_heads, args.speedup)
            rows.append(r)
            print(f"{family:<11}{length:>8}{r['logical']:>9.3f}{r['aligned']['physical']:>9.3f}"
                  f"{r['aligned']['physical_over_logical']:>9.2f}{r['unaligned']['physical']:>11.3f}"
                  f"{r['unaligned']['physical_over_logical']:>9.2f}{r['diagonal_blocks']['rows_64']:>10.3f}"
                  f"{r['diagonal_blocks']['rows_128']:>11.3f}{r['diagonal_blocks']['time_128_over_64']:>10.3f}"
                  f"{r['diagonal_blocks']['time_best_per_head_over_64']:>10.3f}"
                  f"{r['diagonal_blocks']['kv_group_union_over_own']:>10.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python scripts/explore_layouts.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
                for k, v in vars(args).items() if k != "out" and v is not None), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
