"""The runtime guard: estimate of captured mass, heads under the threshold run dense; near-dense heads."""
import pytest
import torch

from minference_fx.kernels import guard, reference
from minference_fx.kernels.attend import sparse_attention_triton
from minference_fx.kernels.index import build_index_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

OP = torch.ops.minference.sparse_attention.default
TINY_VS = HeadPlan(Pattern.VERTICAL_SLASH, 0, 0)  # 30 columns, 50 diagonals


def _qkv(sq=640, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, sq, d, generator=g), torch.randn(1, hkv, sq, d, generator=g), torch.randn(1, hkv, sq, d, generator=g))


def test_captured_mass_is_the_last_tile_rows_mass_under_the_index():
    q, k, _ = _qkv()
    plan = LayerPlan((TINY_VS,) * 4)
    index = reference.build_index(q, k, plan, scale=0.25)
    got = guard.captured_mass(guard.vertical_scores(q, k, scale=0.25), index, 64)
    # brute force: softmax of the last 64 rows, summed over the keys the index lets them read
    rows = range(576, 640)
    allowed = reference.index_to_mask(index, rows, 640) & reference.base_allowed(torch.arange(576, 640), 640)
    scores = q[:, :, 576:] @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    causal = reference.base_allowed(torch.arange(576, 640), 640)
    prob = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    want = (prob * allowed).sum(-1).mean(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got < 0.9).all()  # random q/k: tiny budgets miss most of the mass


def test_op_runs_a_starved_head_dense_and_leaves_it_sparse_without_guard():
    q, k, v = _qkv()
    args = (None, None, 0.25, 0, 0, [2, 2, 2, 2], [0] * 4, [0] * 4, 0)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    before = guard.STATS.heads_forced_dense
    guarded = OP(q, k, v, *args, 0.99)
    assert guard.STATS.heads_forced_dense - before == 4
    torch.testing.assert_close(guarded, dense, rtol=1e-5, atol=1e-5)
    unguarded = OP(q, k, v, *args, 0.0)
    assert (unguarded - dense).abs().max() > 1e-3


@pytest.mark.parametrize("batch, plan", [
    (1, LayerPlan((TINY_VS, HeadPlan(Pattern.DENSE), TINY_VS, HeadPlan(Pattern.A_SHAPE, 64, 64)))),
    # block-sparse heads share the vertical-slash heads' estimate, as rows after theirs: with two batch rows
    # the vertical-slash rows are a strided slice of it
    (2, LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 2), TINY_VS, HeadPlan(Pattern.DENSE), TINY_VS))),
    (2, LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 2), HeadPlan(Pattern.A_SHAPE, 64, 64),
                   HeadPlan(Pattern.BLOCK_SPARSE, 3), HeadPlan(Pattern.DENSE)))),
])
def test_gpu_index_mass_matches_the_reference_estimate(batch, plan):
    q, k, _ = _qkv(sq=320)
    q, k = q.expand(batch, -1, -1, -1) * torch.linspace(1, 2, batch)[:, None, None, None], k.expand(batch, -1, -1, -1)
    checked = [h for h, hp in enumerate(plan.heads) if hp.pattern in (Pattern.VERTICAL_SLASH, Pattern.BLOCK_SPARSE)]
    unchecked = [h for h in range(4) if h not in checked]
    mass = torch.full((batch, 4), -1.0)
    index = build_index_gpu(q, k, plan, scale=0.25, mass_out=mass)
    reference_index = reference.build_index(q, k, plan, scale=0.25)
    want = guard.captured_mass(guard.vertical_scores(q, k, scale=0.25), reference_index, 64)
    torch.testing.assert_close(mass[:, checked], want[:, checked], rtol=1e-4, atol=1e-5)
    assert (mass[:, checked] < 1).all()  # random q/k: tiny budgets miss mass, so an unwritten 1 would show
    assert (mass[:, unchecked] == -1).all()  # other heads untouched
    assert index.block_count.shape == (batch, 4, 5)
    # the estimate's picks are the same with the guard's block-sparse rows added after them, or without
    alone = build_index_gpu(q, k, plan, scale=0.25)
    for name in ("block_count", "block_start", "col_count", "col_index"):
        assert torch.equal(getattr(index.padded(), name), getattr(alone.padded(), name)), name


def test_kernel_forced_dense_equals_reference_on_densified_index():
    q, k, v = _qkv(sq=200)
    plan = LayerPlan((TINY_VS,) * 4)
    index = reference.build_index(q, k, plan, scale=0.25)
    force = torch.tensor([[True, False, True, False]])
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=0.25, force_dense=force)
    want = reference.sparse_attention_reference(q, k, v, plan, scale=0.25, index=guard.densify(index, force, 200, 200, 0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_backend_guard_option_makes_starved_heads_dense():
    from tiny_models import tiny_model

    from minference_fx.config import default_config, model_identity_from_hf

    model = tiny_model("llama")
    config = default_config(model_identity_from_hf(model.config), budgets=(0, 0), min_sparse_len=0)
    ids = torch.randint(0, 128, (1, 640))
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        opts = {"config": config, "inner": "eager"}
        guarded = torch.compile(model, backend="minference", options={**opts, "guard_threshold": 1.0})(ids, use_cache=False).logits
        torch._dynamo.reset()
        off = torch.compile(model, backend="minference", options={**opts, "guard_threshold": 0.0})(ids, use_cache=False).logits
    torch.testing.assert_close(guarded, dense, rtol=1e-5, atol=1e-5)
    assert (off - dense).abs().max() > 1e-4


@pytest.mark.parametrize("sq, skv, q_offset", [(1, 1, 0), (64, 64, 0), (65, 65, 0), (200, 200, 0), (640, 640, 0),
                                               (64, 1064, 1000), (100, 300, 200), (130, 200, 70)])
def test_causal_tiles_counts_the_tile_pairs_holding_a_causal_pair(sq, skv, q_offset):
    from minference_fx.kernels.reference import BLOCK

    rows = torch.arange(sq) + q_offset
    keys = torch.arange(skv)
    causal = keys[None, :] <= rows[:, None]
    m, n = -(-sq // BLOCK), -(-skv // BLOCK)
    padded = torch.zeros(m * BLOCK, n * BLOCK, dtype=torch.bool)
    padded[:sq, :skv] = causal
    want = int(padded.view(m, BLOCK, n, BLOCK).any(3).any(1).sum())
    assert guard.causal_tiles(sq, skv, q_offset) == want


def test_near_dense_counts_leftover_columns_as_tiles():
    """A head listing 9 of 10 tiles and 64 leftover columns holds 10 tile-equivalents: near-dense; 8 tiles and
    no column is under 90 %."""
    from minference_fx.kernels.reference import SparseIndex

    block_count = torch.tensor([[[1, 2, 3, 3]], [[1, 2, 3, 2]]], dtype=torch.int32)  # 9 and 8 of 10 tiles
    col_count = torch.tensor([[[0, 0, 0, 64]], [[0, 0, 0, 0]]], dtype=torch.int32)
    index = SparseIndex(block_count, torch.zeros(2, 1, 4, 4, dtype=torch.int32), col_count,
                        torch.zeros(2, 1, 4, 64, dtype=torch.int32))
    assert guard.causal_tiles(256, 256, 0) == 10
    assert guard.near_dense(index, 256, 256, 0).tolist() == [[True], [False]]
