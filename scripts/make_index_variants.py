"""Write launch variants of ``minference_fx/kernels/index.py`` as ``out/idx_NAME.py``, for ``gpu_qwen.sh start
index_variants`` to time each against the index as it is (``explore_index_long.py --old-index``, one run).

Each variant is the current file with one launch change made by text substitution, so it follows the file as it
evolves; a substitution that no longer matches fails loudly instead of writing an unchanged copy.

    python scripts/make_index_variants.py            # every variant
    python scripts/make_index_variants.py rs64 cs2   # these alone

Variants: ``rs64`` the row-statistics pass in 64-key steps (as before 2026-12-07); ``rs128w8`` its 128-key steps with 8
warps; ``cs2`` the column sums two key blocks a program. Measured against the index of their day (H100, 2026-12-07,
BENCHMARKS.md section 1): 128-key steps won and were kept; 8 warps and two blocks a program lost.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "minference_fx/kernels/index.py"
OUT = REPO / "out"


def replacing(old: str, new: str):
    return lambda src: substitute(src, old, new)


def substitute(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise SystemExit(f"index.py changed: {old[:60]!r} is not found exactly once")
    return src.replace(old, new)


def colsum_two_blocks(src: str) -> str:
    """The column-sum kernel loops over two key blocks a program (its q rows and row statistics loaded once)."""
    start = src.index("def _vs_colsum_kernel(")
    end = src.index("@triton.jit", start)
    kernel = src[start:end]
    kernel = substitute(kernel, "BLOCK_D: tl.constexpr,\n):", "BLOCK_D: tl.constexpr, PER_PROG: tl.constexpr = 2,\n):")
    kernel = substitute(kernel, "    kblk = tl.program_id(0)\n", "")
    body_at = kernel.index("    j = kblk * BLOCK_N")
    body = "\n".join("        " + line if line.strip() else line for line in kernel[body_at:].rstrip("\n").split("\n"))
    kernel = (kernel[:body_at] + "    for i in tl.static_range(PER_PROG):\n"
              "        kblk = tl.program_id(0) * PER_PROG + i\n"
              "        if kblk * BLOCK_N < skv:\n" + body + "\n\n\n")
    src = src[:start] + kernel + src[end:]
    return substitute(src, "_vs_colsum_kernel[(_cdiv(skv, _KEY_BLOCK), rows)]",
                      "_vs_colsum_kernel[(_cdiv(skv, 2 * _KEY_BLOCK), rows)]")


VARIANTS = {
    "rs64": replacing("_STATS_STEPS = (128, 64)", "_STATS_STEPS = (64,)"),
    "rs128w8": replacing('"BLOCK_N": config[0]}', '"BLOCK_N": config[0], "num_warps": 8}'),
    "cs2": colsum_two_blocks,
}


def write_variants(names: list[str], out: Path = OUT) -> list[Path]:
    """``out/idx_NAME.py`` for each of ``names`` (every variant if none)."""
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    out.mkdir(exist_ok=True)
    src = SOURCE.read_text()
    paths = []
    for name in names or VARIANTS:
        paths.append(out / f"idx_{name}.py")
        paths[-1].write_text(VARIANTS[name](src))
    return paths


def main(names: list[str]) -> None:
    for path in write_variants(names):
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
