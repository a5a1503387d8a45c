"""The peers' inputs (benchmarks/peers.py) hold the keys our index holds: FlashInfer's block layout and MInference's
vertical/slash indices, expanded to dense [S, S] key masks per head and compared with brute force. CPU, small
shapes, fp32; the peers themselves are not needed (nor imported)."""
from __future__ import annotations

import os
import re
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks/

from benchmarks import peers  # noqa: E402
from minference_fx.kernels import density as den  # noqa: E402
from minference_fx.kernels import reference as ref  # noqa: E402
from minference_fx.plan import HeadPlan, LayerPlan, Pattern  # noqa: E402

BLOCK = ref.BLOCK
# budgets per head differ, so heads keep different numbers of picks and the selection is -1 padded
BUDGETS = ((30, 50), (40, 70), (64, 120), (100, 200))


def _case(sq, seed=0, hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, sq, d, generator=g)
    k = torch.randn(1, hkv, sq, d, generator=g)
    plan = LayerPlan(tuple(HeadPlan(Pattern.VERTICAL_SLASH, *BUDGETS[h % len(BUDGETS)]) for h in range(hq)))
    scale = d ** -0.5
    return ref.build_index(q, k, plan, scale=scale), den.selection_of(q, k, plan, scale=scale)


def _causal(sq):
    i = torch.arange(sq)
    return i[None, :] <= i[:, None]


def _blocks_to_keys(blocks, sq):
    """bool [H, M, N] block mask -> [H, Sq, Skv] key mask (whole blocks, no causal cut)."""
    return blocks.repeat_interleave(BLOCK, 1)[:, :sq].repeat_interleave(BLOCK, 2)[:, :, :sq]


def _tiles_of(mask):
    """bool [H, Sq, Skv] -> [H, M, N]: the 64 x 64 blocks that hold a True."""
    H, sq, skv = mask.shape
    m, n = -(-sq // BLOCK), -(-skv // BLOCK)
    padded = torch.nn.functional.pad(mask, (0, n * BLOCK - skv, 0, m * BLOCK - sq))
    return padded.view(H, m, BLOCK, n, BLOCK).any(4).any(2)


def flashinfer_keys(layout: peers.FlashInferLayout) -> torch.Tensor:
    """bool [H, Sq, Skv]: what the variable block-sparse wrapper reads with causal=True, as its plan builds it
    (flashinfer/sparse.py, VariableBlockSparseAttentionWrapper.plan): each (head, block row) is one request whose
    keys are its marked column blocks gathered in ascending order, under the batch-prefill causal mask aligned at
    the end of the request (query t of R reads gathered key g when g <= t + L - R)."""
    mask, rows, cols = layout.block_mask_map, layout.block_row_sz, layout.block_col_sz
    H, M, N = mask.shape
    sq, skv = int(rows[0].sum()), int(cols[0].sum())
    row_start = (torch.cumsum(rows, 1) - rows).tolist()
    col_start = (torch.cumsum(cols, 1) - cols).tolist()
    out = torch.zeros(H, sq, skv, dtype=torch.bool)
    for h in range(H):
        for m in range(M):
            keys = [c for n in mask[h, m].nonzero().flatten().tolist()
                    for c in range(col_start[h][n], col_start[h][n] + int(cols[h, n]))]
            length, r = len(keys), int(rows[h, m])
            for t in range(r):
                out[h, row_start[h][m] + t, keys[: max(t + length - r + 1, 0)]] = True
    return out


def on_lines(columns, offsets, sq) -> torch.Tensor:
    """bool [H, Sq, Sq]: the causal pairs (i, j) with j among ``columns[h]`` or i - j among ``offsets[h]``."""
    i, j = torch.arange(sq)[:, None], torch.arange(sq)[None, :]
    return torch.stack([(torch.isin(j, c) | torch.isin(i - j, d)) & (j <= i) for c, d in zip(columns, offsets)])


def selection_keys(selection: den.KeySelection, sq) -> torch.Tensor:
    """bool [H, Sq, Sq]: the causal pairs on a picked column or diagonal, the -1 padding dropped."""
    return on_lines([c[c >= 0] for c in selection.columns[0]], [d[d >= 0] for d in selection.diagonals[0]], sq)


def minference_reads(v_idx, s_idx, sq) -> torch.Tensor:
    """bool [H, Sq, Sq]: the keys MInference's kernel reads, as its index converter (csrc/vertical_slash_index.cu,
    convert_vertical_slash_indexes_kernel) lays them out, in our own words: per query block [start, start + 64),
    slash s (below the block's end) is the 64-key range ending at max(start + 64 - s, 64); ranges in ascending
    order merge, and one ending at most 64 keys past the open range extends it by 64; a column is read when it
    lies before the last range and in none (the block part is causal, the columns all precede the block)."""
    H = v_idx.shape[1]
    out = torch.zeros(H, sq, sq, dtype=torch.bool)
    for h in range(H):
        vs = sorted(v_idx[0, h].tolist())
        ss = sorted(s_idx[0, h].tolist(), reverse=True)
        for start in range(0, sq, BLOCK):
            end = start + BLOCK
            ranges = []
            for e in (max(end - s, BLOCK) for s in ss if s < end):
                if ranges and e <= ranges[-1][1]:
                    continue
                if ranges and e <= ranges[-1][1] + BLOCK:
                    ranges[-1][1] += BLOCK
                else:
                    ranges.append([e - BLOCK, e])
            rows = slice(start, min(end, sq))
            for a, b in ranges:
                out[h, rows, a:min(b, sq)] = True
            last = ranges[-1][1] if ranges else end
            cols = [c for c in vs if c < last and not any(a <= c < b for a, b in ranges)]
            out[h, rows, cols] = True
    return out & _causal(sq)


# --------------------------------------------------------------------------- FlashInfer


@pytest.mark.parametrize("sq,seed", [(1000, 0), (768, 1)])
def test_flashinfer_layout_is_the_tiles_plus_the_extra_blocks(sq, seed):
    index, _ = _case(sq, seed)
    layout = peers.flashinfer_layout(index, sq)
    listed = ref.index_to_mask(index, range(0, sq), sq)[0]  # [H, Sq, Skv]: whole tiles and single columns
    assert int(index.col_count.sum()) > 0, "the case must have leftover columns for this test to mean anything"

    # the blocks: exactly those holding a listed tile or a listed column
    assert torch.equal(layout.block_mask_map, _tiles_of(listed))
    no_cols = ref.SparseIndex(index.block_count, index.block_start, torch.zeros_like(index.col_count),
                              torch.full_like(index.col_index, -1))
    tiles_only = ref.index_to_mask(no_cols, range(0, sq), sq)[0]
    assert torch.equal(_tiles_of(tiles_only), ref.covering_tiles(index, sq)[0])
    # what FlashInfer walks beyond our blocks: the tiles of the leftover columns and diagonal blocks' second tiles
    assert layout.extra_blocks == int(layout.block_mask_map.sum() - index.block_count[0].sum()) > 0

    # the keys FlashInfer reads: those blocks cut by the causal mask, a superset of ours
    reads = flashinfer_keys(layout)
    assert torch.equal(reads, _blocks_to_keys(layout.block_mask_map, sq) & _causal(sq))
    ours = listed & _causal(sq)
    assert torch.equal(reads & ours, ours)
    assert (reads & ~ours).any()  # the column blocks' other keys

    # the sizes: 64 each, the last block the rest
    rows, cols = layout.block_row_sz, layout.block_col_sz
    assert rows.dtype == cols.dtype == torch.int32
    assert (rows.sum(1) == sq).all() and (cols.sum(1) == sq).all()
    assert int(rows[0, -1]) == (sq - 1) % BLOCK + 1


def test_flashinfer_layout_refuses_a_row_without_its_diagonal_block():
    sq = 256
    index, _ = _case(sq)
    tiles = index.block_start.clone()
    # drop query block 2's diagonal tile of head 1: the causal alignment to the gathered keys would be off
    row = tiles[0, 1, 2]
    row[row == 2] = -1
    tiles[0, 1, 2] = torch.cat([row[row >= 0], row[row < 0]])
    count = index.block_count.clone()
    count[0, 1, 2] -= 1
    broken = ref.SparseIndex(count, tiles, index.col_count, index.col_index)
    with pytest.raises(ValueError, match="head 1 query block 2"):
        peers.flashinfer_layout(broken, sq)
    # the expansion shows why: with the diagonal block missing, the end-aligned mask cuts block 2's rows short
    blocks = peers.block_mask_of(broken, sq)[0]
    layout = peers.FlashInferLayout(blocks, peers._block_sizes(sq, 4, "cpu"), peers._block_sizes(sq, 4, "cpu"), 0)
    meant = _blocks_to_keys(blocks, sq) & _causal(sq)
    reads = flashinfer_keys(layout)
    assert torch.equal(reads[0], meant[0]) and not torch.equal(reads[1, 128:192], meant[1, 128:192])


def test_flashinfer_needs_square_attention():
    index, _ = _case(128)
    with pytest.raises(ValueError, match="as many keys as queries"):
        peers.flashinfer_layout(index, 128, 192)


# --------------------------------------------------------------------------- MInference


@pytest.mark.parametrize("sq,seed", [(1000, 0), (704, 2)])
def test_minference_indices_are_the_selection(sq, seed):
    index, selection = _case(sq, seed)
    v_idx, s_idx = peers.minference_indices(selection)
    assert v_idx.dtype == s_idx.dtype == torch.int32 and (v_idx >= 0).all() and (s_idx >= 0).all()
    assert (selection.columns < 0).any() and (v_idx == peers.MINFERENCE_FAR).any()  # the padding is exercised

    expected = selection_keys(selection, sq)
    # MInference's convention: v_idx key positions, s_idx offsets row - key; the padding names no key
    assert torch.equal(on_lines(v_idx[0].long(), s_idx[0].long(), sq), expected)
    # and our index holds every one of those keys: the two peers see the same picks
    listed = ref.index_to_mask(index, range(0, sq), sq)[0]
    assert torch.equal(listed & expected, expected)


@pytest.mark.parametrize("sq,seed", [(1000, 0), (832, 3)])
def test_minference_reads_every_pick_and_little_else(sq, seed):
    _, selection = _case(sq, seed)
    v_idx, s_idx = peers.minference_indices(selection)
    reads = minference_reads(v_idx, s_idx, sq)
    expected = selection_keys(selection, sq)
    assert torch.equal(reads & expected, expected)
    # what it reads beyond the picks lies in the 64-key slash ranges (up to 64 more where ranges merge)
    offset = torch.arange(sq)[:, None] - torch.arange(sq)[None, :]  # i - j, >= 0 where causal
    for h in range(reads.shape[0]):
        near = ((torch.arange(sq)[:, None] - s_idx[0, h][None].long()).abs() < 2 * BLOCK).any(-1)  # per offset
        assert not (reads[h] & ~expected[h] & ~near[offset.clamp(min=0)]).any()

    # slashes counted from the last row instead of from the diagonal would miss picks: the check has teeth
    misread = torch.where(s_idx < sq, sq - 1 - s_idx, s_idx)
    wrong = minference_reads(v_idx, misread, sq)
    assert not torch.equal(wrong & expected, expected)


# --------------------------------------------------------------------------- the adapters, with stand-in peers


def _masked_attention(q, k, v, keys, scale):
    """[H, Sq, D]: attention of q [H, Sq, D] over k, v [H, Skv, D] restricted to keys [H, Sq, Skv]."""
    return ref._masked_softmax(q @ k.transpose(-1, -2) * scale, keys) @ v


class _StandInWrapper:
    """FlashInfer's VariableBlockSparseAttentionWrapper as its docstrings describe it (q [Hq, S, D], k/v
    [Hkv, S, D], one layout per kv head), computed densely from :func:`flashinfer_keys`."""

    def __init__(self, workspace):
        self.workspace = workspace

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads, head_dim, causal=False,
             sm_scale=None, q_data_type="float16"):
        assert causal and block_mask_map.shape[0] == num_kv_heads == block_row_sz.shape[0] == block_col_sz.shape[0]
        self.keys = flashinfer_keys(peers.FlashInferLayout(block_mask_map, block_row_sz, block_col_sz, 0))
        self.scale, self.group = sm_scale, num_qo_heads // num_kv_heads

    def run(self, q, k, v):
        assert q.shape[0] == k.shape[0] * self.group and k.shape[0] == self.keys.shape[0]
        return _masked_attention(q, k, v, self.keys, self.scale)


def _stand_in_minference(query, key, value, v_idx, s_idx):
    assert query.shape == key.shape == value.shape  # one kv head per query head
    reads = minference_reads(v_idx, s_idx, query.shape[2])
    return _masked_attention(query[0], key[0], value[0], reads, query.shape[-1] ** -0.5)[None]


def test_adapters_feed_the_peers_our_keys(monkeypatch):
    from minference_fx.tools import bench

    sq, hq, hkv, d = 320, 4, 2, 16
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, sq, d, generator=g) for h in (hq, hkv, hkv))
    plan = LayerPlan(tuple(HeadPlan(Pattern.VERTICAL_SLASH, *BUDGETS[h]) for h in range(hq)))
    scale = d ** -0.5
    index, selection = ref.build_index(q, k, plan, scale=scale), den.selection_of(q, k, plan, scale=scale)
    case = bench.KernelCase("structured", q, k, v, scale, index, None)
    sparse = types.ModuleType("flashinfer.sparse")
    sparse.VariableBlockSparseAttentionWrapper = _StandInWrapper
    pit = types.ModuleType("minference.ops.pit_sparse_flash_attention_v2")
    pit.vertical_slash_sparse_attention = _stand_in_minference
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.sparse", sparse)
    monkeypatch.setitem(sys.modules, "minference", types.ModuleType("minference"))
    monkeypatch.setitem(sys.modules, "minference.ops", types.ModuleType("minference.ops"))
    monkeypatch.setitem(sys.modules, "minference.ops.pit_sparse_flash_attention_v2", pit)
    monkeypatch.setattr(bench, "_ms", lambda fn, reps: (fn(), 1.0)[1])

    group = hq // hkv
    k_rep, v_rep = k[0].repeat_interleave(group, 0), v[0].repeat_interleave(group, 0)
    _, _, out, extra_blocks = peers.run_flashinfer(case, reps=1)
    blocks = peers.block_mask_of(index, sq)[0]
    assert out.shape == q.shape and extra_blocks == int(blocks.sum() - index.block_count.sum())
    expected = _masked_attention(q[0], k_rep, v_rep, _blocks_to_keys(blocks, sq) & _causal(sq), scale)
    torch.testing.assert_close(out[0], expected)

    # heads that gather too many keys for one plan go in chunks, with the same output
    gathered = (blocks.sum((-1, -2)) * 64).tolist()
    monkeypatch.setattr(peers, "FLASHINFER_MAX_GATHERED", gathered[0] + gathered[1])
    chunks = [list(r) for r in peers.flashinfer_head_chunks(peers.flashinfer_layout(index, sq))]
    assert chunks[0] == [0, 1] and sum(chunks, []) == list(range(hq)) and len(chunks) >= 2
    _, _, chunked, _ = peers.run_flashinfer(case, reps=1)
    torch.testing.assert_close(chunked, out)

    _, out = peers.run_minference(case, selection, reps=1)
    v_idx, s_idx = peers.minference_indices(selection)
    expected = _masked_attention(q[0], k_rep, v_rep, minference_reads(v_idx, s_idx, sq), scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out[0], expected)
    with pytest.raises(ValueError, match="head_dim"):
        peers.run_minference(bench.KernelCase("structured", q, k, v, 0.5, index, None), selection, reps=1)


def test_minference_prefill_gets_every_head_at_our_budgets_and_kv_per_query_head(monkeypatch):
    from minference_fx.tools import bench

    sq, hq, hkv, d = 192, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, sq, d, generator=g) for h in (hq, hkv, hkv))
    plan = LayerPlan(tuple(HeadPlan(Pattern.VERTICAL_SLASH, *BUDGETS[h]) for h in range(hq)))
    case = bench.KernelCase("structured", q, k, v, d ** -0.5, ref.build_index(q, k, plan, scale=d ** -0.5), None)
    calls = []

    def stand_in(query, key, value, kwargs):  # MInference's signature: (query, key, value, prefill_kwargs)
        calls.append((key, value, kwargs))
        return query * 2

    forward = types.ModuleType("minference.modules.minference_forward")
    forward.minference_prefill_forward = stand_in
    pit = types.ModuleType("minference.ops.pit_sparse_flash_attention_v2")
    pit.vertical_slash_sparse_attention = _stand_in_minference
    for name, module in (("minference", types.ModuleType("minference")), ("minference.ops", None),
                         ("minference.ops.pit_sparse_flash_attention_v2", pit), ("minference.modules", None),
                         ("minference.modules.minference_forward", forward)):
        monkeypatch.setitem(sys.modules, name, module or types.ModuleType(name))
    monkeypatch.setattr(peers, "stub_missing_modules", lambda names: [])
    monkeypatch.setattr(bench, "_ms", lambda fn, reps: (fn(), 1.0)[1])

    ms, out = peers.run_minference_prefill(case, plan, reps=1)
    assert ms == 1.0 and torch.equal(out, q * 2)
    key, value, kwargs = calls[-1]
    torch.testing.assert_close(key, k.repeat_interleave(hq // hkv, 1))
    torch.testing.assert_close(value, v.repeat_interleave(hq // hkv, 1))
    assert kwargs["layer_idx"] == 0 and kwargs["num_hidden_layers"] == 1
    assert kwargs["attn_forward_config"]["best_pattern"][0] == {
        str(h): ("vertical_and_slash", *BUDGETS[h], 1) for h in range(hq)}
    with pytest.raises(ValueError, match="head_dim"):
        peers.run_minference_prefill(bench.KernelCase("structured", q, k, v, 0.5, case.index, None), plan, reps=1)
    with pytest.raises(ValueError, match="head 1 is"):
        peers.minference_prefill_kwargs(LayerPlan((plan.heads[0], HeadPlan(Pattern.DENSE, 0, 0))))


def test_minference_imports_get_stubs_for_missing_extensions_and_bool_package_checks(monkeypatch):
    from transformers.utils import import_utils

    names = ("json", "mfx_surely_missing_ext", "mfx_surely_missing_ext.language")
    try:
        assert peers.stub_missing_modules(names) == list(names[1:])
        assert sys.modules["mfx_surely_missing_ext.language"].__spec__.name == "mfx_surely_missing_ext.language"
        assert peers.stub_missing_modules(names) == []  # already there
    finally:
        for name in names[1:]:
            sys.modules.pop(name, None)
    monkeypatch.setattr(import_utils, "_is_package_available", lambda name, *a, **kw: (False, None))
    with peers.package_checks_as_bools():
        assert import_utils._is_package_available("vllm") is False
    assert import_utils._is_package_available("vllm") == (False, None)


# --------------------------------------------------------------------------- the rest of the harness


def test_relative_error():
    ref_out = torch.ones(1, 2, 8, 4)
    assert peers.relative_error(ref_out.clone(), ref_out) == 0.0
    off = ref_out.clone()
    off[0, 1] += 0.5  # half of the entries off by 0.5 against a norm of 1 per entry
    assert peers.relative_error(off, ref_out) == pytest.approx(0.5 / 2 ** 0.5)
    with pytest.raises(ValueError):
        peers.relative_error(off[:, :1], ref_out)


def test_missing_peer_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert peers.peer_status("flashinfer") == peers.NOT_INSTALLED == peers.peer_status("minference")
    assert peers.peer_status("minference-prefill") == peers.NOT_INSTALLED
    row = peers.PeerRow("structured", 32768, 1.0, 4.0, 5.0, 0.01, 20.0, "cudnn",
                        notes={"flashinfer": peers.NOT_INSTALLED})
    row.minference_ms, row.minference_error = 8.0, 0.02
    table = peers.format_peer_rows([row])
    assert "flashinfer: not installed" in table
    assert " 0.50" in table.splitlines()[1]  # ours 4.0 ms kernel over MInference's 8.0
    with pytest.raises(ValueError, match="unknown peer"):
        peers.bench_peers([1024], peers=("flashinfer", "xformers"))


def test_the_package_does_not_import_the_benchmarks():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("minference_fx", "autotune", "passes"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as fh:
                        assert not re.search(r"^\s*(from|import)\s+benchmarks\b", fh.read(), re.M), name
