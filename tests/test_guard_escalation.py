"""The guard's escalation (option ``guard_escalation``): a vertical-slash head the quality guard finds weak first
takes an index at larger budgets, and runs dense only if it is still weak there. On the CPU op and on the GPU
path (Triton under the interpreter here)."""
import pytest
import torch
import transformers

from minference_fx import default_config, dense, inspect, model_identity_from_hf
from minference_fx.autotune.cache import DEFAULT_ENTRIES
from minference_fx.call_masks import CallMasks
from minference_fx.kernels import reference
from minference_fx.options import BackendOptions
from minference_fx.plan import HeadPlan, LayerPlan, Pattern, escalated_plan
from minference_fx.sparse_path import sparse_on_cpu, sparse_on_gpu
from minference_fx.tools.tiny import tiny_config

S, D, HOT = 512, 32, 90
SCALE = D ** -0.5
SMALL = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 30, 50), HeadPlan(Pattern.A_SHAPE, 64, 128)))
ESCALATION = (128, 50)


def _hot_columns_qkv():
    """One kv head whose attention sits on HOT scattered key columns, far more than 30 columns hold: a
    vertical-slash head of 30 columns keeps well under 0.8 of the mass, one of 128 nearly all of it."""
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(D, generator=g)
    direction /= direction.norm()
    q = 0.1 * torch.randn(1, 2, S, D, generator=g) + 5.0 * direction
    k = 0.1 * torch.randn(1, 1, S, D, generator=g)
    hot = torch.randperm(S - 64, generator=g)[:HOT]  # none among the last rows, which read the estimate
    k[0, 0, hot] += 5.0 * direction
    v = torch.randn(1, 1, S, D, generator=g)
    return q, k, v


def test_escalated_plan_raises_vertical_slash_budgets_drops_the_other_heads_and_is_none_when_nothing_rises():
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 64, 2000), HeadPlan(Pattern.VERTICAL_SLASH, 3000, 10),
                      HeadPlan(Pattern.A_SHAPE, 64, 128), HeadPlan(Pattern.BLOCK_SPARSE, 4), HeadPlan(Pattern.DENSE)))
    up = escalated_plan(plan, (1000, 6096))
    assert up.heads[:2] == (HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096), HeadPlan(Pattern.VERTICAL_SLASH, 3000, 6096))
    assert all(h.pattern is Pattern.DENSE for h in up.heads[2:])
    # nothing to raise: the fallback index would be the call's own, so there is none to build
    assert escalated_plan(plan, (64, 10)) is None


def test_take_index_takes_the_chosen_rows_and_pads_the_narrower_tables():
    def index(b, h, m, tiles, cols, fill):
        return reference.SparseIndex(torch.full((b, h, m), fill, dtype=torch.int32),
                                     torch.full((b, h, m, tiles), fill, dtype=torch.int16),
                                     torch.full((b, h, m), fill, dtype=torch.int32),
                                     torch.full((b, h, m, cols), fill, dtype=torch.int32))
    base, other = index(2, 3, 4, 2, 5, 1), index(2, 3, 4, 6, 3, 7)
    take = torch.tensor([[False, True, False], [True, False, False]])
    got = dense.take_index(base, other, take)
    assert got.block_start.shape[-1] == 6 and got.col_index.shape[-1] == 5
    assert got.block_start.dtype == torch.int16
    for b in range(2):
        for h in range(3):
            want_tiles = [7] * 6 if take[b, h] else [1, 1] + [reference.NO_BLOCK] * 4
            want_cols = [7, 7, 7, -1, -1] if take[b, h] else [1] * 5
            assert got.block_start[b, h, 0].tolist() == want_tiles
            assert got.col_index[b, h, 0].tolist() == want_cols
            assert int(got.block_count[b, h, 0]) == (7 if take[b, h] else 1)


def test_a_weak_head_runs_at_the_escalated_budgets_instead_of_dense_on_the_cpu_op():
    q, k, v = _hot_columns_qkv()
    masks = CallMasks()
    plain = sparse_on_cpu(q, k, v, SMALL, SCALE, masks, 0.8)
    assert plain.weak.tolist() == [[True, False]] and plain.ran_dense[0, 0]  # the premise: weak at 30 columns
    escalated = sparse_on_cpu(q, k, v, SMALL, SCALE, masks, 0.8, escalated=escalated_plan(SMALL, ESCALATION))
    assert escalated.weak.tolist() == [[False, False]] and not escalated.ran_dense.any()
    # head 0 reads the escalated index's keys, head 1 its own A-shape ones
    up = reference.build_index(q, k, escalated_plan(SMALL, ESCALATION), scale=SCALE)
    own = reference.build_index(q, k, SMALL, scale=SCALE)
    want = reference.sparse_attention_reference(q, k, v, SMALL, scale=SCALE,
                                                index=dense.take_index(own, up, torch.tensor([[True, False]])))
    torch.testing.assert_close(escalated.out, want.to(q.dtype), rtol=1e-5, atol=1e-5)
    dense_out = torch.nn.functional.scaled_dot_product_attention(q[:, :1], k, v, is_causal=True, scale=SCALE)
    assert not torch.allclose(escalated.out[:, :1], dense_out, atol=1e-3)  # not the dense fallback


def test_an_escalation_too_small_still_runs_dense():
    q, k, v = _hot_columns_qkv()
    result = sparse_on_cpu(q, k, v, SMALL, SCALE, CallMasks(), 0.8, escalated=escalated_plan(SMALL, (31, 50)))
    assert result.weak[0, 0] and result.ran_dense[0, 0]


def test_the_gpu_path_escalates_as_the_cpu_op_does():
    q, k, v = _hot_columns_qkv()
    masks = CallMasks()
    want = sparse_on_cpu(q, k, v, SMALL, SCALE, masks, 0.8, escalated=escalated_plan(SMALL, ESCALATION))
    got = sparse_on_gpu(q, k, v, SMALL, SCALE, masks, 0.8, DEFAULT_ENTRIES["sparse_attention"],
                        DEFAULT_ENTRIES["dense_walk"], escalated=escalated_plan(SMALL, ESCALATION))
    assert got.weak.tolist() == want.weak.tolist() == [[False, False]]
    torch.testing.assert_close(got.out, want.out, rtol=2e-4, atol=2e-4)
    plain = sparse_on_gpu(q, k, v, SMALL, SCALE, masks, 0.8, DEFAULT_ENTRIES["sparse_attention"],
                          DEFAULT_ENTRIES["dense_walk"])
    assert plain.weak[0, 0]


@pytest.mark.parametrize("bad", [(1000,), (0, 6096), "1000,6096", (True, 6096), (1000, 2**31)])
def test_guard_escalation_option_names_the_bad_value(bad):
    with pytest.raises(ValueError, match="guard_escalation"):
        BackendOptions.from_user({"guard_escalation": bad})


def test_a_config_carries_the_escalation_and_the_option_overrides_it():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", "sdpa")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    config = default_config(model_identity_from_hf(model.config))
    config.defaults["guard_escalation"] = [512, 2048]
    from_config = inspect(model, ids, use_cache=False, options={"config": config, "min_sparse_len": 0})
    assert "512, 2048)" in from_config.diff() and "first try (512, 2048)" in str(from_config)
    wins = inspect(model, ids, use_cache=False, options={"config": config, "min_sparse_len": 0,
                                                        "guard_escalation": (1000, 6096)})
    assert "1000, 6096)" in wins.diff() and "512, 2048)" not in wins.diff()
    off = inspect(model, ids, use_cache=False, options={"config": config, "min_sparse_len": 0, "guard_escalation": ()})
    assert "512, 2048)" not in off.diff() and "first try" not in str(off)


def test_the_cli_reads_0_0_as_no_escalation_and_leaves_it_to_the_config_when_not_given():
    from minference_fx import cli

    def options(*argv):
        return cli._minference_options(cli.build_parser().parse_args(["bench", "prefill", *argv]))

    assert options() is None  # the config's escalation, or none without one
    assert options("--guard-escalation", "0", "0") == {"guard_escalation": ()}
    assert options("--guard-escalation", "1000", "6096", "--guard-threshold", "0.65") == {
        "guard_escalation": (1000, 6096), "guard_threshold": 0.65}
    for bad in (("0", "6096"), ("-1", "-1")):  # only 0 0 means none; the option names anything else
        with pytest.raises(ValueError, match="guard_escalation"):
            BackendOptions.from_user(options("--guard-escalation", *bad))


MIXED = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 3), HeadPlan(Pattern.VERTICAL_SLASH, 30, 50)))


# not "gpu": a parameter id is a keyword, and conftest skips items with that one where there is no CUDA
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_a_weak_block_sparse_head_runs_dense_with_or_without_an_escalation(path):
    """The guard checks block-sparse heads too. Three tiles a query tile (sink, diagonal and one pick) hold a
    fraction of the 90 scattered hot keys, so head 0 is weak and runs dense. The escalation raises only
    vertical-slash heads: its plan lists nothing for head 0, which must then still run dense, never on the
    empty row (on the GPU path, Triton under the interpreter here)."""
    q, k, v = _hot_columns_qkv()
    masks = CallMasks()

    def run(threshold, escalated=None):
        if path == "reference":
            return sparse_on_cpu(q, k, v, MIXED, SCALE, masks, threshold, escalated=escalated)
        return sparse_on_gpu(q, k, v, MIXED, SCALE, masks, threshold, DEFAULT_ENTRIES["sparse_attention"],
                             DEFAULT_ENTRIES["dense_walk"], escalated=escalated)

    dense_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE,
                                                                 enable_gqa=True)
    unguarded = run(0.0)
    assert (unguarded.out[:, 0] - dense_out[:, 0]).abs().max() > 1e-2  # the premise: its index misses mass
    plain = run(0.8)
    assert plain.weak[0, 0] and plain.ran_dense[0, 0]
    torch.testing.assert_close(plain.out[:, 0], dense_out[:, 0], rtol=2e-4, atol=2e-4)
    escalated = run(0.8, escalated_plan(MIXED, ESCALATION))
    assert escalated.ran_dense[0, 0] and not escalated.ran_dense[0, 1]  # head 1 is rescued by the escalation
    torch.testing.assert_close(escalated.out[:, 0], dense_out[:, 0], rtol=2e-4, atol=2e-4)


def test_the_guard_checks_block_sparse_heads_and_not_a_shape_ones():
    plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, 3), HeadPlan(Pattern.A_SHAPE, 64, 128),
                      HeadPlan(Pattern.VERTICAL_SLASH, 30, 50), HeadPlan(Pattern.DENSE)))
    assert dense.guarded_heads(plan) == (True, False, True, False)
