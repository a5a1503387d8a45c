"""Budget growth (option ``budget_growth``, a config's ``defaults.budget_growth``): past a number of keys, the
vertical-slash and block-sparse budgets grow with the prompt, inside the op, so a longer prompt needs no recompile."""
import json

import pytest
import torch
import transformers

from minference_fx import ConfigError, default_config, inspect, load_config, model_identity_from_hf, sparse_attention
from minference_fx.options import BackendOptions
from minference_fx.plan import (GROWTH_STEPS_PER_OCTAVE, MAX_BUDGET, HeadPlan, LayerPlan, Pattern, grown_plan,
                                growth_factor, is_budget_growth)
from minference_fx.tools.tiny import tiny_config

PLAN = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 100, 30), HeadPlan(Pattern.A_SHAPE, 64, 128),
                  HeadPlan(Pattern.BLOCK_SPARSE, 3), HeadPlan(Pattern.DENSE)))


def test_listed_budgets_grow_past_the_length_and_the_others_stay():
    grown = grown_plan(PLAN, (1000, 0.5), 4000)  # (4000 / 1000) ** 0.5 = 2
    assert grown.heads == (HeadPlan(Pattern.VERTICAL_SLASH, 200, 60), HeadPlan(Pattern.A_SHAPE, 64, 128),
                           HeadPlan(Pattern.BLOCK_SPARSE, 6), HeadPlan(Pattern.DENSE))
    # the ratio 1.5 is rounded up to 2 ** (5 / 8) (steps of an eighth of an octave): 100 * 2 ** (5 / 16) = 124.2
    assert growth_factor((1000, 0.5), 1500) == pytest.approx(2 ** (5 / 16))
    assert grown_plan(PLAN, (1000, 0.5), 1500).heads[0] == HeadPlan(Pattern.VERTICAL_SLASH, 125, 38)
    # exponent 1 keeps the share of the row the budgets held at the length (to within the step)
    assert grown_plan(PLAN, (1000, 1.0), 4000).heads[0] == HeadPlan(Pattern.VERTICAL_SLASH, 400, 120)
    # every length of a step reads one plan: few plans (and pinned tables) whatever the prompt lengths
    plans = {grown_plan(PLAN, (1000, 0.5), keys) for keys in range(1001, 64001, 7)}
    assert len(plans) == 6 * GROWTH_STEPS_PER_OCTAVE
    assert grown_plan(PLAN, (1000, 0.5), 1000) is PLAN and grown_plan(PLAN, (), 10**6) is PLAN
    huge = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, MAX_BUDGET, 1),))
    assert grown_plan(huge, (1, 1.0), 4).heads[0].budget_a == MAX_BUDGET


@pytest.mark.parametrize("bad", [(1000,), (0, 0.5), (1000, 0.0), (1000, 1.5), (1000, float("nan")), (True, 0.5),
                                 "32768,0.5", (1000.0, 0.5)])
def test_a_bad_growth_is_named_by_the_option_and_the_config(bad):
    assert not is_budget_growth(bad)
    with pytest.raises(ValueError, match="budget_growth"):
        BackendOptions.from_user({"budget_growth": bad})
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", "sdpa"))
    doc = json.loads(default_config(model_identity_from_hf(model.config)).to_json())
    doc["defaults"]["budget_growth"] = list(bad) if isinstance(bad, tuple) else bad
    with pytest.raises(ConfigError, match="defaults.budget_growth"):
        load_config(doc)


def test_a_config_round_trips_its_growth(tmp_path):
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", "sdpa"))
    config = default_config(model_identity_from_hf(model.config))
    assert config.budget_growth == ()
    config.defaults["budget_growth"] = [32768, 0.5]
    path = tmp_path / "c.json"
    config.save(str(path))
    assert load_config(str(path)).budget_growth == (32768, 0.5)


def _op(q, k, v, plan, **growth):
    return sparse_attention(q, k, v, None, None, q.shape[-1] ** -0.5, 0, 0, *plan.op_arguments(), 0, 0.0, -1, 0, 0,
                            **growth)


def test_the_op_reads_the_grown_plan_past_the_length_and_its_own_before():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 512, 16, generator=g) for _ in range(3))
    # past the index's least budgets (30 columns, 50 diagonals), so that growing them reads more keys
    small = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 40, 60), HeadPlan(Pattern.BLOCK_SPARSE, 2)) * 2)
    grown = _op(q, k, v, small, grow_from=128, grow_exponent=1.0)
    torch.testing.assert_close(grown, _op(q, k, v, grown_plan(small, (128, 1.0), 512)), rtol=0, atol=0)
    assert not torch.equal(grown, _op(q, k, v, small))  # the premise: 4x the budgets reads other keys
    torch.testing.assert_close(_op(q, k, v, small, grow_from=512, grow_exponent=1.0), _op(q, k, v, small), rtol=0, atol=0)
    with pytest.raises(ValueError, match="grow_from"):
        _op(q, k, v, small, grow_from=128, grow_exponent=0.0)
    with pytest.raises(ValueError, match="grow_from"):
        _op(q, k, v, small, grow_from=-1, grow_exponent=0.5)


@pytest.mark.parametrize("option, value, arguments, said", [
    ("guard_escalation", (1000, 6096), "1000, 6096)", "first try (1000, 6096) (columns, diagonals), then run dense"),
    ("budget_growth", (4096, 0.5), "0, 0, 4096, 0.5)", "budget growth: past 4096 keys"),
])
def test_an_option_reaches_every_rewritten_op_and_the_report(option, value, arguments, said):
    """The guard's escalation and the budget growth: trailing op arguments, (0, 0) standing in for no escalation
    before a growth."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", "sdpa")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    result = inspect(model, ids, use_cache=False, options={option: value, "min_sparse_len": 0})
    assert result.rewritten and arguments in result.diff() and said in str(result)
    plain = inspect(model, ids, use_cache=False, options={"min_sparse_len": 0})
    assert arguments not in plain.diff() and said not in str(plain)


def test_a_growth_follows_an_escalation_and_a_config_carries_it():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", "sdpa")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 96))
    both = inspect(model, ids, use_cache=False, options={"budget_growth": (4096, 0.5), "min_sparse_len": 0,
                                                         "guard_escalation": (1000, 6096)})
    assert "1000, 6096, 4096, 0.5)" in both.diff()
    config = default_config(model_identity_from_hf(model.config))
    config.defaults["budget_growth"] = [2048, 1.0]
    from_config = inspect(model, ids, use_cache=False, options={"config": config, "min_sparse_len": 0})
    assert "0, 0, 2048, 1.0)" in from_config.diff()  # no escalation: (0, 0) stands in for it
    off = inspect(model, ids, use_cache=False, options={"config": config, "min_sparse_len": 0, "budget_growth": ()})
    assert "2048, 1.0" not in off.diff()


def test_a_compiled_model_with_growth_matches_one_compiled_with_the_grown_config_and_does_not_recompile():
    """Past the growth's length the compiled model runs the grown plan; a longer prompt compiles nothing new."""
    torch._dynamo.reset()
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", "sdpa")).eval()
    config = default_config(model_identity_from_hf(model.config), budgets=(40, 60))
    grown_config = default_config(model_identity_from_hf(model.config), budgets=(80, 120))  # (256 / 64) ** 0.5 = 2
    counts = torch._dynamo.utils.counters
    counts.clear()
    with torch.no_grad():
        growing = torch.compile(model, backend="minference", dynamic=True,
                                options={"config": config, "min_sparse_len": 0, "budget_growth": (64, 0.5),
                                         "guard_threshold": 0.0, "inner": "aot_eager"})
        ids = torch.randint(0, model.config.vocab_size, (1, 256))
        got = growing(ids, use_cache=False).logits
        growing(torch.randint(0, model.config.vocab_size, (1, 300)), use_cache=False)
        frames = counts["stats"]["unique_graphs"]
        want = torch.compile(model, backend="minference", dynamic=True,
                             options={"config": grown_config, "min_sparse_len": 0, "guard_threshold": 0.0,
                                      "inner": "aot_eager"})(
            ids, use_cache=False).logits
        as_listed = torch.compile(model, backend="minference", dynamic=True,
                                  options={"config": config, "min_sparse_len": 0, "guard_threshold": 0.0,
                                           "inner": "aot_eager"})(ids, use_cache=False).logits
    assert frames == 1, dict(counts["stats"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - as_listed).abs().max() > 1e-4  # the premise: the grown budgets read other keys


def test_an_untuned_device_sets_its_crossover_from_the_listed_budgets_not_the_grown_ones(monkeypatch):
    """Without a measured crossover the op derives one from the plan's budgets; grown ones would push it past the
    lengths they grow at, so that growth switched the sparse path off."""
    from minference_fx import op
    from minference_fx.autotune import dispatch
    from minference_fx.call_masks import CallMasks

    asked = []
    monkeypatch.setattr(dispatch, "tuned_min_sparse_len", lambda q, k, plan: asked.append(plan) or 0)
    q = torch.zeros(1, 4, 512, 16)
    small = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 40, 60),) * 4)
    grown = grown_plan(small, (128, 1.0), 512)
    call = op.plan_call(q, q, CallMasks(), 0.25, grown, -1, listed=small)
    assert asked == [small] and call.plan == grown


def test_the_cli_gives_the_growth_to_bench_eval_and_search_and_reads_0_0_as_none():
    from minference_fx import cli

    def args(*argv):
        return cli.build_parser().parse_args(list(argv))

    bench = args("bench", "prefill", "--budget-growth", "32768", "0.5")
    assert cli._minference_options(bench) == {"budget_growth": (32768, 0.5)}
    assert cli._minference_options(args("bench", "prefill")) is None  # the config's
    assert cli._minference_options(args("bench", "prefill", "--budget-growth", "0", "0")) == {"budget_growth": ()}
    assert args("eval", "--budget-growth", "8192", "1").budget_growth == [8192.0, 1.0]
    assert args("search", "--out", "x.json", "--budget-growth", "8192", "0.5").budget_growth == [8192.0, 0.5]
    with pytest.raises(ValueError, match="KEYS must be an integer"):
        cli._minference_options(args("bench", "prefill", "--budget-growth", "1000.5", "0.5"))
    with pytest.raises(ValueError, match="budget_growth"):  # the option checks the exponent
        BackendOptions.from_user(cli._minference_options(args("bench", "prefill", "--budget-growth", "1000", "2")))
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", "sdpa"))
    config = default_config(model_identity_from_hf(model.config))
    assert config.with_budget_growth((8192, 1.0)).budget_growth == (8192, 1.0)
    assert config.with_budget_growth((8192, 1.0)).with_budget_growth(()).budget_growth == ()
    with pytest.raises(ConfigError, match="budget_growth"):
        config.with_budget_growth((8192, 2.0))
    with pytest.raises(ConfigError, match="budget_growth"):  # a lone length was an IndexError
        config.with_budget_growth((8192,))
