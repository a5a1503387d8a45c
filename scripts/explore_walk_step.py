"""GPU exploration (not a test): two changes to the walk's step, measured against the shipped kernel in one run.

usage: python scripts/explore_walk_step.py --out DIR [--variants base,lazy8,pair,lazy8_pair] [--lengths 32k,128k]

``scripts/explore_walk_step.patch`` makes two environment switches of ``kernels/attend.py`` (read at import; both
off take the shipped kernel's code path, its registers on sm_90a too, the PTX not compared):

* ``MFX_LAZY=T`` (``lazyT``): on unmasked full blocks, the accumulator and the row sums are rescaled only when some
  row's max grew by more than T (log2 units) in the block; otherwise the old max stays the reference, so the
  probabilities reach at most 2**T. Mathematically the same softmax; it saves the rescale's multiplies and the
  exponent of the correction on most steps, for a reduction across the tile's warps a step.
* ``MFX_PAIR=1`` (``pair``): unmasked listed blocks two a step (two TMA copies, two score tiles), one online-softmax
  update for both: half the max/sum bookkeeping and rescales per key.

The patch is applied to a copy of this tree (``--tree``, made here) and every variant runs in a process of its
own from that copy. Shapes: Llama-3-8B's heads (32 q / 8 kv, d128) on both input families and Qwen2.5-Coder-1.5B's
(12 / 2) on the structured one, VS(1000, 6096) every head, the H200's tuned launch configs of those shapes
(sparse walk 64 x 64, 4 warps, 3 stages at 32K and 2 at 128K; dense walk 128 x 64, 4 warps, 2 stages); the dense
walk (every head forced dense) on the structured family. Outputs are compared with the base variant's; cuDNN
runs in the base variant's process.

The patch applies to the kernel before the walk read its block starts ahead (6cb727e): run this script from a worktree
of 43568f3 (``git worktree add DIR 43568f3``). BENCHMARKS.md section 1 has the run (1634bd0).
"""
from __future__ import annotations

from pathlib import Path

from variant_runs import run_cases, run_patched_variants, variant_arguments

PATCH = Path(__file__).resolve().parent / "explore_walk_step.patch"
VARIANTS = {"base": {}, "lazy8": {"MFX_LAZY": "8"}, "lazy0": {"MFX_LAZY": "1e-6"}, "pair": {"MFX_PAIR": "1"},
            "lazy8_pair": {"MFX_LAZY": "8", "MFX_PAIR": "1"}}


def run_variant(lengths: list[int], out_dir: Path, variant: str, first: bool, reps: int) -> list[dict]:
    from minference_fx.kernels import attend

    print(f"variant {variant}: {attend.__file__} LAZY={attend.LAZY} PAIR={attend.PAIR}", flush=True)
    # the H200's tuned sparse-walk stages of these shapes: 3 at 32K, 2 at 128K
    return run_cases(lengths, out_dir, variant, "variant", first=first, reps=reps,
                     sparse_stages=lambda n: 3 if n <= 32768 else 2)


def main() -> None:
    a = variant_arguments("base,lazy8,lazy0,pair,lazy8_pair", "/tmp/mfx-walk-step").parse_args()
    run_patched_variants(a, Path(__file__), PATCH, VARIANTS, "walk_step", run_variant)


if __name__ == "__main__":
    main()
