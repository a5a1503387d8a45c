"""GPU exploration (not a test): the sparse walk reading its next block start one step ahead, against the shipped walk.

usage: python scripts/explore_list_prefetch.py --out DIR [--variants base3,prefetch3,base2,prefetch2] [--lengths 32k,128k]

Full causal attention listed for the sparse walk ran 1.14x slower than the dense walk's 64-row programs on the same
launch config, while enumerating the tiles instead of listing them saved 1 % (``explore_list_cost.py``, H100,
2026-12-07). What Triton 3.6 compiles for sm_90a says why: the listed block start is a load the pipeliner gives a stage
of its own, so with 3 stages the walk copies K/V one step ahead into two buffers, where the dense walk, whose start
is the loop counter, copies two steps ahead into three. ``scripts/explore_list_prefetch.patch`` adds
``MFX_PREFETCH=1``: the walk reads slot i + 1's start while it walks slot i, so the TMA coordinate is a value the step
before made, and the same 3 stages copy two steps ahead into three buffers (115.7 KB of shared memory, as the dense
walk's). The variants' digit is the sparse walk's stages. Cases: ``variant_runs.run_cases`` (Llama-3-8B's heads on
both input families, Qwen2.5-Coder-1.5B's on the structured one, VS(1000, 6096), 64 x 64 blocks, 4 warps; the dense
walk on the structured family). Outputs are compared with the first variant's; cuDNN runs in its process.

The read-ahead shipped in 6cb727e, so the patch applies to the tree before it (``git worktree add DIR 43568f3``, then run
this script from DIR); BENCHMARKS.md section 1 has the run.
"""
from __future__ import annotations

from pathlib import Path

from variant_runs import run_cases, run_patched_variants, variant_arguments

PATCH = Path(__file__).resolve().parent / "explore_list_prefetch.patch"
VARIANTS = {"base3": ({}, 3), "prefetch3": ({"MFX_PREFETCH": "1"}, 3), "base2": ({}, 2),
            "prefetch2": ({"MFX_PREFETCH": "1"}, 2), "prefetch4": ({"MFX_PREFETCH": "1"}, 4)}


def run_variant(lengths: list[int], out_dir: Path, variant: str, first: bool, reps: int) -> list[dict]:
    from minference_fx.kernels import attend

    print(f"variant {variant}: {attend.__file__} PREFETCH={attend.PREFETCH}", flush=True)
    stages = VARIANTS[variant][1]
    return run_cases(lengths, out_dir, variant, "variant", first=first, reps=reps, sparse_stages=lambda n: stages)


def main() -> None:
    a = variant_arguments("base3,prefetch3,base2,prefetch2", "/tmp/mfx-list-prefetch").parse_args()
    run_patched_variants(a, Path(__file__), PATCH, {name: env for name, (env, _) in VARIANTS.items()}, "list_prefetch",
                         run_variant)


if __name__ == "__main__":
    main()
