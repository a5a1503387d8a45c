"""Search space of each tunable kernel: a comprehension of launch configs plus a ``keep`` predicate.

Two kernels are tuned: ``sparse_attention`` (the sparse walk over the index's lists) and
``dense_walk`` (the same Triton kernel launched for the heads that run dense this call).
The sparse walk's space lists more than it accepts (BLOCK_M of two index query tiles, which
only the dense walk can use) so that widening a kernel means widening ``ACCEPTED_BLOCKS``,
not rewriting the space.
"""
from __future__ import annotations

from ..kernels.reference import BLOCK
from .cache import TuneEntry

# The index lists query tiles of BLOCK rows: a program owns one (BLOCK_M = BLOCK) or a part of one
# (BLOCK // 2 rows: more programs for short prompts). Key steps of BLOCK_N = BLOCK or 2 * BLOCK (two
# listed tiles gathered side by side) are tuned. The kernel also runs BLOCK // 4 rows and BLOCK // 2
# keys a step, left out of the search: they narrow the MMA for nothing the index could gain.
# The dense walk (the same kernel launched for forced-dense heads only) reads no list, so a program may
# own two query tiles.
ACCEPTED_BLOCKS = {"sparse_attention": {"BLOCK_M": frozenset({BLOCK // 2, BLOCK}),
                                        "BLOCK_N": frozenset({BLOCK, 2 * BLOCK})},
                   "dense_walk": {"BLOCK_M": frozenset({BLOCK, 2 * BLOCK}),
                                  "BLOCK_N": frozenset({BLOCK, 2 * BLOCK})}}

SPACE = {
    "sparse_attention": [
        TuneEntry(bm, bn, w, s)
        for bm in (32, 64, 128)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for s in (1, 2, 3, 4)
    ],
    # dense work is long and regular: shallow pipelines never won it (explore_dense), and each candidate
    # costs seconds to time at 128K
    "dense_walk": [TuneEntry(bm, bn, w, s) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for s in (2, 3)],
}

# Hopper (sm90) lets one block opt in to 227 KB of its 228 KB shared memory.
SM90_SMEM_BYTES = 228 * 1024
# tl.dot needs K >= 16; q and the accumulator live in registers, and past 256 the
# accumulator alone would not fit next to the score tile.
MIN_BLOCK_D, MAX_BLOCK_D = 16, 256
# fp32 accumulator registers per thread, of the 255 a thread may hold: the rest go
# to the score tile, pointers and masks. More than this spills.
MAX_ACC_REGS_PER_THREAD = 128


def block_d(head_dim: int) -> int:
    """The launcher pads the head dim to a power of two."""
    return 1 << max(head_dim - 1, 0).bit_length()


def smem_bytes(config: TuneEntry, head_dim: int, dtype_bytes: int) -> int:
    """Upper estimate of the shared memory of one program of the sparse attention kernel.

    The software pipeline keeps ``num_stages`` K and V tiles in flight (one when
    it does not pipeline); Q and the P tile of the second dot are staged once.
    """
    d = block_d(head_dim)
    kv_tiles = max(config.num_stages, 1) * 2 * config.BLOCK_N * d
    return dtype_bytes * (config.BLOCK_M * d + kv_tiles + config.BLOCK_M * config.BLOCK_N)


def keep(config: TuneEntry, head_dim: int, dtype_bytes: int, smem_limit: int = SM90_SMEM_BYTES,
         kernel: str = "sparse_attention") -> bool:
    """Whether ``config`` can run the kernel at this head dim and dtype within ``smem_limit`` bytes."""
    accepted = ACCEPTED_BLOCKS[kernel]
    if config.BLOCK_M not in accepted["BLOCK_M"] or config.BLOCK_N not in accepted["BLOCK_N"]:
        return False
    d = block_d(head_dim)
    if not MIN_BLOCK_D <= d <= MAX_BLOCK_D:
        return False
    if config.BLOCK_M * d // (config.num_warps * 32) > MAX_ACC_REGS_PER_THREAD:
        return False
    return smem_bytes(config, head_dim, dtype_bytes) <= smem_limit


def candidates(kernel: str, head_dim: int, dtype_bytes: int, smem_limit: int = SM90_SMEM_BYTES) -> list[TuneEntry]:
    """The configs of ``kernel`` worth timing for this shape; raises when none is left."""
    if kernel not in SPACE:
        raise KeyError(f"no search space for kernel {kernel!r} (known: {', '.join(SPACE)})")
    kept = [c for c in SPACE[kernel] if keep(c, head_dim, dtype_bytes, smem_limit, kernel)]
    if not kept:
        raise ValueError(
            f"{kernel}: no launch config fits head_dim={head_dim}, {dtype_bytes}-byte dtype, "
            f"{smem_limit} bytes of shared memory (head dims {MIN_BLOCK_D}..{MAX_BLOCK_D} are supported)"
        )
    return kept
