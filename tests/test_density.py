"""Physical (tiles walked) against logical (keys kept) density of an index (minference_fx/kernels/density.py).

Hand-built indexes with answers worked out by hand, then brute force on both builders' indexes: the
reference's, and the GPU builder's under the interpreter. CPU, small shapes, fp32/fp16.
"""
from __future__ import annotations

import pytest
import torch

from minference_fx.autotune import workload
from minference_fx.kernels import density as den
from minference_fx.kernels import reference as ref
from minference_fx.kernels.index import build_index_gpu, vs_estimate
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

BLOCK = ref.BLOCK
VS, BS, DENSE, ASHAPE = Pattern.VERTICAL_SLASH, Pattern.BLOCK_SPARSE, Pattern.DENSE, Pattern.A_SHAPE


def plan_of(*heads) -> LayerPlan:
    return LayerPlan(tuple(HeadPlan(*h) for h in heads))


def index_from_masks(tiles: torch.Tensor, cols: torch.Tensor) -> ref.SparseIndex:
    """A SparseIndex listing the aligned tiles ``[B, H, M, N]`` and columns ``[B, H, M, Skv]`` marked True."""
    block_count, tile = ref._pack(tiles, 1)
    col_count, col_index = ref._pack(cols, 1)
    return ref.SparseIndex(block_count, torch.where(tile >= 0, tile * BLOCK, ref.NO_BLOCK), col_count, col_index)


def selection(columns, diagonals) -> den.KeySelection:
    """One (batch, head)'s picks as a KeySelection."""
    as_t = lambda xs: torch.tensor(sorted(xs), dtype=torch.int64).view(1, 1, -1)  # noqa: E731
    return den.KeySelection(as_t(columns), as_t(diagonals))


def brute_keys(columns, diagonals, sq):
    """bool ``[Sq, Sq]``: causal pairs on the columns or the diagonals."""
    i, j = torch.arange(sq)[:, None], torch.arange(sq)[None]
    on = torch.isin(j, torch.tensor(list(columns), dtype=torch.long)) | torch.isin(i - j, torch.tensor(list(diagonals), dtype=torch.long))
    return on & (j <= i)


def tiles_of(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[M, N]``: the 64 x 64 tiles a ``[Sq, Skv]`` mask touches."""
    sq, skv = mask.shape
    m, n = -(-sq // BLOCK), -(-skv // BLOCK)
    padded = torch.nn.functional.pad(mask, (0, n * BLOCK - skv, 0, m * BLOCK - sq))
    return padded.view(m, BLOCK, n, BLOCK).any(3).any(1)


def causal_tile_count(sq):
    m = -(-sq // BLOCK)
    return m * (m + 1) // 2


# --------------------------------------------------------------------------- hand-built answers


@pytest.mark.parametrize("sq", [64, 200, 256])
def test_every_dense_head_is_one_and_one(sq):
    # dense heads are counted from the plan: the reference lists their tiles, the GPU index none
    q, k = torch.randn(1, 2, sq, 16), torch.randn(1, 1, sq, 16)
    plan = plan_of((DENSE,), (DENSE,))
    for index in (ref.build_index(q, k, plan, scale=0.25), build_index_gpu(q, k, plan, scale=0.25)):
        d = den.index_density(index, plan, sq=sq)
        assert torch.equal(d.physical, torch.ones(1, 2, dtype=torch.float64))
        assert torch.equal(d.logical, torch.ones(1, 2, dtype=torch.float64))
        assert d.causal_keys == sq * (sq + 1) // 2 and d.causal_tiles == causal_tile_count(sq)
        assert d.overall() == (1.0, 1.0)


def test_one_vertical_column():
    # column 70 of 256 keys: rows 70..255 read it (186 pairs); query tiles 1..3 walk it, one 64-key step each
    sq, c = 256, 70
    cols = torch.zeros(1, 1, 4, sq, dtype=torch.bool)
    cols[0, 0, 1:, c] = True
    index = index_from_masks(torch.zeros(1, 1, 4, 4, dtype=torch.bool), cols)
    d = den.index_density(index, plan_of((VS, 1, 0)), selection([c], []), sq=sq)
    assert d.causal_keys == 256 * 257 // 2 and d.causal_tiles == 10
    assert d.logical_keys.item() == 186 and d.physical_tiles.item() == 3
    assert d.logical.item() == pytest.approx(186 / 32896) and d.physical.item() == pytest.approx(0.3)


def test_one_far_diagonal_walks_two_tiles_per_query_tile():
    # diagonal 100: rows 100..255, one key each (156 pairs). Query tile 1 reads keys 0..27 (tile 0), tile 2
    # keys 28..91 (tiles 0, 1), tile 3 keys 92..155 (tiles 1, 2): 5 tiles of 10, for 0.5 % of the keys
    sq, delta = 256, 100
    tiles = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    tiles[0, 0, 1, 0] = tiles[0, 0, 2, 0] = tiles[0, 0, 2, 1] = tiles[0, 0, 3, 1] = tiles[0, 0, 3, 2] = True
    assert torch.equal(tiles[0, 0], tiles_of(brute_keys([], [delta], sq)))
    index = index_from_masks(tiles, torch.zeros(1, 1, 4, sq, dtype=torch.bool))
    d = den.index_density(index, plan_of((VS, 0, 1)), selection([], [delta]), sq=sq)
    assert d.logical_keys.item() == 156 and d.physical_tiles.item() == 5
    assert d.physical.item() > 50 * d.logical.item()


def test_a_column_on_a_diagonal_is_counted_once():
    sq = 256
    cols, diags = [10, 70, 200], [0, 60, 130]
    keys = brute_keys(cols, diags, sq)
    tiles = tiles_of(brute_keys([], diags, sq))[None, None]
    index = index_from_masks(tiles, torch.zeros(1, 1, 4, sq, dtype=torch.bool))
    d = den.index_density(index, plan_of((VS, 3, 3)), selection(cols, diags), sq=sq)
    assert d.logical_keys.item() == keys.sum().item()


def test_a_far_diagonal_walks_one_block_per_query_tile_in_the_index():
    # diagonal 200, planted in the data, beyond the forced run 0..99 (blocks 0, 64, 128): the index reads it as one
    # block per query tile (start lo - 200) where aligned tiles took two, so the last tile walks 4 blocks, not 5
    sq, delta = 512, 200
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, sq, 16, generator=g), torch.randn(1, 1, sq, 16, generator=g)
    k[:, :, : sq - delta] += 3 * q[:, :, delta:]
    plan = plan_of((VS, 0, 101))
    picks = den.selection_of(q, k, plan, scale=0.25)
    assert delta in picks.diagonals[0, 0].tolist()
    index = ref.build_index(q, k, plan, scale=0.25)
    lo = sq - BLOCK
    assert index.block_start[0, 0, -1, : index.block_count[0, 0, -1]].tolist() == [lo - 200, lo - 128, lo - 64, lo]
    # the aligned key tiles the same picks cross in the last query tile
    assert tiles_of(brute_keys([], picks.diagonals[0, 0].tolist(), sq))[-1].sum().item() == 5


def test_scattered_slashes_cost_more_tiles_per_kept_key_than_adjacent_ones():
    # the same number of diagonals and columns: adjacent diagonals share tiles, scattered ones each cross
    # two key tiles of every query tile
    sq = 2048
    adjacent, scattered = range(300, 316), range(100, 1700, 100)
    ratios = []
    for diags in (adjacent, scattered):
        keys = brute_keys([], diags, sq)
        index = index_from_masks(tiles_of(keys)[None, None], torch.zeros(1, 1, sq // BLOCK, sq, dtype=torch.bool))
        d = den.index_density(index, plan_of((VS, 0, len(diags))), selection([], diags), sq=sq)
        assert d.logical_keys.item() == keys.sum().item()
        assert d.physical.item() > d.logical.item()
        ratios.append(d.physical.item() / d.logical.item())
    assert ratios[1] > 4 * ratios[0], ratios


def test_forced_dense_heads_and_offsets():
    sq = 192
    q, k = torch.randn(1, 2, sq, 16), torch.randn(1, 1, sq, 16)
    plan = plan_of((BS, 1), (BS, 1))
    index = ref.build_index(q, k, plan, scale=0.25)
    d = den.index_density(index, plan, sq=sq, force_dense=torch.tensor([[True, False]]))
    assert d.physical[0, 0].item() == 1.0 and d.logical[0, 0].item() == 1.0
    assert d.physical[0, 1].item() < 1.0 and d.logical[0, 1].item() < d.physical[0, 1].item()
    # keys already cached: rows at positions 100.., every one of 100 + sq keys causal for the last row
    qo = den.index_density(ref.build_index(q, torch.randn(1, 1, 100 + sq, 16), plan_of((DENSE,), (DENSE,)),
                                           scale=0.25, q_offset=100),
                           plan_of((DENSE,), (DENSE,)), sq=sq, skv=100 + sq, q_offset=100)
    assert qo.causal_keys == sum(101 + i for i in range(sq)) and qo.logical[0, 0].item() == 1.0


def test_bad_input_is_named():
    sq = 128
    index = index_from_masks(torch.zeros(1, 1, 2, 2, dtype=torch.bool), torch.zeros(1, 1, 2, sq, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs their picks"):
        den.index_density(index, plan_of((VS, 1, 1)), sq=sq)
    with pytest.raises(ValueError, match="query tiles"):
        den.index_density(index, plan_of((DENSE,)), sq=300)
    with pytest.raises(ValueError, match="plan has 2 heads"):
        den.index_density(index, plan_of((DENSE,), (DENSE,)), sq=sq)


# --------------------------------------------------------------------------- both builders, brute force


@pytest.mark.parametrize("family,dtype", [("structured", torch.float32), ("scattered", torch.float16)])
def test_brute_force_on_both_builders(family, dtype):
    sq, d = 640, 32
    q, k, _ = workload.family_qkv(family, sq, num_q_heads=4, num_kv_heads=2, head_dim=d, dtype=dtype, device="cpu",
                                  seed=2)
    plan = plan_of((VS, 40, 120), (ASHAPE, 70, 150), (BS, 3), (DENSE,))
    scale = d ** -0.5
    picks = den.selection_of(q, k, plan, scale=scale)
    reference_index = ref.build_index(q, k, plan, scale=scale)
    causal = torch.arange(sq)[None] <= torch.arange(sq)[:, None]
    listed = ref.index_to_mask(reference_index, range(0, sq), sq)[0] & causal
    cols, diags = picks.columns[0, 0], picks.diagonals[0, 0]
    vs_keys = brute_keys(cols[cols >= 0].tolist(), diags[diags >= 0].tolist(), sq)
    # the picks are what the reference turned into its index: every key on their diagonals lies in its blocks,
    # at most one block a diagonal, and its leftover columns are the picked columns outside the blocks
    diag_keys = brute_keys([], diags[diags >= 0].tolist(), sq)
    block_keys = ref.block_keys(reference_index, sq)[0, 0][torch.arange(sq) // BLOCK]  # [Sq, Skv]
    assert (block_keys | ~diag_keys).all()
    assert (reference_index.block_count[0, 0] <= len(ref.diagonal_blocks(diags[diags >= 0].tolist()))).all()
    assert (listed[0] | ~vs_keys).all()
    leftover = reference_index.col_count[0, 0].tolist()
    for name, index in (("reference", reference_index), ("gpu", build_index_gpu(q, k, plan, scale=scale))):
        got = den.index_density(index, plan, picks, sq=sq)
        assert got.logical_keys[0, 0].item() == vs_keys.sum().item(), name
        for h in (1, 2, 3):  # A-shape, block-sparse, dense: the causal keys of the listed tiles
            assert got.logical_keys[0, h].item() == listed[h].sum().item(), (name, h)
        walked = reference_index.block_count[0, 0].sum().item() + sum(-(-c // BLOCK) for c in leftover)
        assert got.physical_tiles[0, 0].item() == walked, name
        a_tiles = reference_index.block_count[0, 1].sum().item()  # the reference lists A-shape tiles
        assert got.physical_tiles[0, 1].item() == a_tiles, name
        assert got.physical_tiles[0, 2].item() == reference_index.block_count[0, 2].sum().item(), name
        assert got.physical[0, 3].item() == 1.0 and got.logical[0, 3].item() == 1.0, name
        assert (got.physical >= got.logical).all(), name


def test_picks_from_the_gpu_estimate_match_the_torch_one():
    # on CUDA vs_scores takes the GPU index's own estimate: under the interpreter it gives the same picks
    q, k, _ = workload.scattered_qkv(512, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                                     device="cpu", seed=4)
    plan = plan_of((VS, 40, 120), (VS, 30, 60), (DENSE,), (VS, 100, 300))
    torch_picks = den.selection_of(q, k, plan, scale=32 ** -0.5)
    gpu_picks = den.key_selection(*vs_estimate(q, k, scale=32 ** -0.5), plan)
    assert torch.equal(torch_picks.columns, gpu_picks.columns)
    assert torch.equal(torch_picks.diagonals, gpu_picks.diagonals)
    # a head keeps its own budget (floored at the minima), a dense head none
    assert ((torch_picks.columns[0] >= 0).sum(-1) == torch.tensor([40, 30, 0, 100])).all()
    assert ((torch_picks.diagonals[0] >= 0).sum(-1) == torch.tensor([120, 60, 0, 300])).all()
