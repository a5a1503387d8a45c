"""The sm_90a PTX of every launch the shipped tables (``autotune/*.json``) make of the attention kernel, as sha256 fingerprints of
its instructions (debug information left out): the variants a Hopper GPU compiles (TMA copies of K/V where the launch takes
them; before 2026-12-06 the CPU compiled pointer loads for those, and fp32 dots in the index's estimate).

An edit of ``kernels/attend.py`` that leaves every launch's PTX byte-identical leaves the tuned launch configs valid:
the tables can then be re-keyed to the new source hash instead of tuned again (BENCHMARKS.md section 6). Run it
before and after the edit, on each Triton version the project claims, and compare (CPU only, no GPU):

    TRITON_INTERPRET=0 python scripts/explore_ptx_identity.py > before.json   # ... edit ...
    TRITON_INTERPRET=0 python scripts/explore_ptx_identity.py > after.json && diff before.json after.json

``--index`` adds the index and guard kernels (``_vs_row_stats_kernel`` and the rest) as the op's index build compiles
them. ``--ptxas`` adds ptxas's account of each launch (registers, spill bytes, and whether the wgmma pipeline is
serialised: advisory C7515), to compare what two Triton releases make of the same launches.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import torch
import triton

from minference_fx.call_masks import CallMasks
from minference_fx.kernels.codegen import ptx_instructions, ptxas_report, simulated_gpu, sparse_walk_ptx
from minference_fx.plan import HeadPlan, LayerPlan, Pattern, escalated_plan
from minference_fx.sparse_path import guarded_index_on_gpu

TABLES = sorted((Path(__file__).resolve().parent.parent / "autotune").glob("*.json"))


def shipped_launches(tables: list[Path] = TABLES) -> list[tuple]:
    """(head_dim, BLOCK_M, BLOCK_N, num_warps, num_stages, dense_walk) of every entry of ``tables``, once each."""
    rows = [row for table in tables for row in json.loads(table.read_text())["configs"]]
    return sorted({(r["key"]["head_dim"], r["entry"]["BLOCK_M"], r["entry"]["BLOCK_N"], r["entry"]["num_warps"],
                    r["entry"]["num_stages"], r["key"]["kernel"] == "dense_walk") for r in rows})


def index_fingerprints(head_dims: list[int]) -> dict:
    """{"index d<D>[ key_mask] <kernel>": fingerprint of the PTX of every variant of that kernel} as the op's
    guarded, escalated index build of a vertical-slash and a block-sparse head compiles them for sm_90a in bf16."""
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096), HeadPlan(Pattern.BLOCK_SPARSE, 8, 0)) * 2)
    prints = {}
    for head_dim in head_dims:
        q = torch.zeros(1, 4, 1024, head_dim, dtype=torch.bfloat16)
        k = torch.zeros(1, 2, 1024, head_dim, dtype=torch.bfloat16)
        for key_mask in (False, True):
            masks = CallMasks(key_mask=torch.ones(1, 1024, dtype=torch.bool) if key_mask else None)
            with simulated_gpu(90) as gpu:
                guarded_index_on_gpu(q, k, plan, head_dim ** -0.5, masks, 0.8, escalated_plan(plan, (2000, 8000)))
                for name, variants in gpu.ptx().items():
                    if variants:
                        digest = hashlib.sha256()
                        for ptx in sorted(ptx_instructions(p) for p in variants):
                            digest.update(ptx.encode())
                        prints[f"index d{head_dim}{' key_mask' if key_mask else ''} {name}"] = digest.hexdigest()[:16]
    return prints


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptxas", action="store_true", help="also ptxas's registers, spills and C7515 per launch")
    parser.add_argument("--index", action="store_true", help="also the index and guard kernels of the op's index "
                        "build at the shipped head dims")
    args = parser.parse_args()
    prints, reports = {}, {}
    if args.index:
        prints.update(index_fingerprints(sorted({launch[0] for launch in shipped_launches()})))
    for head_dim, block_m, block_n, warps, stages, dense_walk in shipped_launches():
        for key_mask in (False, True):
            ptx = sparse_walk_ptx(head_dim, block_m, block_n, warps, stages, key_mask=key_mask, dense_walk=dense_walk)
            name = (f"d{head_dim} m{block_m} n{block_n} w{warps} s{stages}{' dense_walk' if dense_walk else ''}"
                    f"{' key_mask' if key_mask else ''}")
            prints[name] = hashlib.sha256(ptx_instructions(ptx).encode()).hexdigest()[:16]
            line = prints[name]
            if args.ptxas:
                reports[name] = dataclasses.asdict(ptxas_report(ptx))
                line += f" {reports[name]}"
            print(name, line, file=sys.stderr, flush=True)
    out = {"triton": triton.__version__, "ptx_sha256": prints}
    if args.ptxas:
        out["ptxas"] = reports
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
