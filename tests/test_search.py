"""The offline search on a tiny random model: a valid config with provenance that the backend loads."""
import json

import pytest
import torch

from minference_fx import ConfigMismatchError, load_config
from minference_fx.config import check_fits, model_identity_from_hf
from minference_fx import observe
from minference_fx.kernels import guard, reference
from minference_fx.plan import LISTED_PATTERNS, HeadPlan, LayerPlan, Pattern
from minference_fx.search import METRICS, LayerScores, candidates_for, choose_heads, sample_rows, score_layer, search
from tiny_models import tiny_model


def _samples(n=2, length=640, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, length), generator=g) for _ in range(n)]


def test_search_writes_a_valid_config_the_backend_loads(tmp_path):
    model = tiny_model("llama")
    lines = []
    config = search(model, _samples(), data_name="random ids", seed=0, bound=0.2, progress=lines.append,
                    state_path=tmp_path / "state.json", min_sparse_len=0,
                    guard_defaults={"guard_threshold": 0.7, "guard_escalation": [500, 900]})
    assert config.validate() == []
    assert (config.min_sparse_len, config.guard_threshold, config.guard_escalation) == (0, 0.7, (500, 900))
    assert config.provenance.lengths == [640] and config.provenance.seed == 0
    assert "relative L2 error" in config.provenance.metric and config.provenance.date
    assert "recall >= 0.9" in config.provenance.metric and "mean density" in config.provenance.metric
    assert config.model.fingerprint == model_identity_from_hf(model.config).fingerprint
    assert len(lines) == 4  # 2 samples x 2 layers
    assert all(h.score is not None and h.score <= 0.2 for layer in config.layers for h in layer)
    path = tmp_path / "searched.json"
    config.save(path)
    ids = torch.randint(0, 128, (1, 150))
    compiled = torch.compile(model, backend="minference", options={"config": str(path), "inner": "aot_eager"})
    with torch.no_grad():
        assert torch.isfinite(compiled(ids, use_cache=False).logits).all()


def test_search_resumes_from_its_state(tmp_path):
    model = tiny_model("llama")
    state = tmp_path / "state.json"
    first = search(model, _samples(), data_name="x", state_path=state, progress=lambda s: None)
    assert len(json.loads(state.read_text())["done"]) == 4
    calls = []
    again = search(model, _samples(), data_name="x", state_path=state, progress=calls.append)
    assert calls == []  # nothing recomputed
    assert again.layers == first.layers
    # fewer samples, other samples or another rope scaling: the saved scores are not theirs, so all is scored again
    saved = state.read_text()
    scaled = tiny_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    for other_model, samples in ((model, _samples(1)), (model, _samples(seed=1)), (scaled, _samples())):
        state.write_text(saved)
        calls = []
        search(other_model, samples, data_name="x", state_path=state, progress=calls.append)
        assert len(calls) == 2 * len(samples)


def test_a_tight_bound_keeps_dense_and_a_loose_one_picks_the_cheapest():
    model = tiny_model("llama")
    rule = dict(target_density=None, recall_min=0.0)
    tight = search(model, _samples(1), data_name="x", bound=0.0, progress=lambda s: None, **rule)
    loose = search(model, _samples(1), data_name="x", bound=10.0, progress=lambda s: None, **rule)
    assert all(h.pattern.value == "dense" or h.score == 0.0 for layer in tight.layers for h in layer)
    assert all(h.pattern.value != "dense" for layer in loose.layers for h in layer)


def test_config_searched_for_one_model_is_refused_for_another(tmp_path):
    config = search(tiny_model("llama"), _samples(1), data_name="x", progress=lambda s: None)
    other = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ConfigMismatchError, match="layers"):
        check_fits(load_config(config.to_dict()), model_identity_from_hf(other.config))


def _call(seed=0, b=1, hq=4, hkv=2, s=200, d=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    k[:, :, :3] *= 4  # a few sink-like keys, so the patterns differ
    return observe.AttentionCall(0, q, k, v, None, None, d ** -0.5, 0, 0, out=torch.empty(0))


def test_scores_on_every_row_equal_the_reference():
    call = _call()
    cands = [HeadPlan(Pattern.A_SHAPE, 4, 64), HeadPlan(Pattern.VERTICAL_SLASH, 30, 50),
             HeadPlan(Pattern.BLOCK_SPARSE, 1), HeadPlan(Pattern.DENSE)]
    scores = score_layer(call, cands, last_rows=200)  # the sample is then every row, weight 1
    q, k, v = call.q, call.k, call.v
    dense = reference.dense_attention_reference(q, k, v, scale=call.scale)
    for c, cand in enumerate(cands):
        plan = LayerPlan((cand,) * 4)
        index = reference.build_index(q, k, plan, scale=call.scale)
        if cand.pattern in LISTED_PATTERNS:  # what the op runs: near-dense is dense
            index = guard.densify(index, guard.near_dense(index, 200, 200, 0), 200, 200, 0)
        out = reference.sparse_attention_reference(q, k, v, plan, scale=call.scale, index=index)
        err = (out - dense).pow(2).sum((0, 2, 3)).sqrt() / dense.pow(2).sum((0, 2, 3)).sqrt()
        torch.testing.assert_close(scores["errors"][c], err, atol=1e-5, rtol=1e-4)
        keys = reference.index_to_mask(index, range(0, 200), 200)
        allowed = reference.base_allowed(torch.arange(200), 200)
        group = 2
        prob = reference._masked_softmax(q @ k.repeat_interleave(group, 1).transpose(-1, -2) * call.scale,
                                         allowed.expand(1, 4, -1, -1))
        mass = (prob * (keys & allowed)).sum(-1)
        torch.testing.assert_close(scores["recall"][c], mass.mean((0, 2)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores["recall_last"][c], mass.mean((0, 2)), atol=1e-5, rtol=1e-5)
    assert (scores["errors"][-1] == 0).all() and (scores["densities"][-1] == 1).all()


def test_sampled_rows_estimate_the_whole_sequence():
    call = _call(s=1024)
    cands = [HeadPlan(Pattern.A_SHAPE, 4, 128), HeadPlan(Pattern.BLOCK_SPARSE, 4)]
    full = score_layer(call, cands, last_rows=1024)
    est = [score_layer(call, cands, last_rows=64, strata=128, generator=torch.Generator().manual_seed(i))
           for i in range(4)]
    for m in ("errors", "recall"):
        mean = torch.stack([e[m] for e in est]).mean(0)
        torch.testing.assert_close(mean, full[m], atol=0.03, rtol=0.1)
    torch.testing.assert_close(est[0]["densities"], full["densities"])  # the index is built from every row


def test_sample_rows_weights_cover_the_sequence():
    rows, weights, n_last = sample_rows(1000, last_rows=100, strata=30, generator=torch.Generator().manual_seed(0))
    assert n_last == 100 and rows.numel() == 130
    assert rows[-100:].tolist() == list(range(900, 1000))
    assert len(set(rows.tolist())) == 130 and int(rows.max()) < 1000
    assert float(weights.sum()) == pytest.approx(1000)
    rows, weights, _ = sample_rows(100, last_rows=64, strata=64)
    assert rows.tolist() == list(range(100)) and (weights == 1).all()


def _scores(err, dens, rec):
    """LayerScores of one sample from nested [candidate][head] lists."""
    s = LayerScores.empty(len(err), len(err[0]))
    s.add({"errors": torch.tensor(err), "densities": torch.tensor(dens), "recall": torch.tensor(rec),
           "recall_last": torch.tensor(rec)})
    return s


def test_choice_meets_the_density_target_by_least_error_per_density():
    cands = [HeadPlan(Pattern.A_SHAPE, 1, 8), HeadPlan(Pattern.VERTICAL_SLASH, 30, 50), HeadPlan(Pattern.DENSE)]
    # two heads: head 0 loses little going sparse, head 1 much; head 1's cheapest candidate misses the recall floor
    err = [[0.10, 0.50], [0.06, 0.20], [0.0, 0.0]]
    dens = [[0.1, 0.1], [0.3, 0.3], [1.0, 1.0]]
    rec = [[0.9, 0.5], [0.95, 0.85], [1.0, 1.0]]
    s = _scores(err, dens, rec)
    free = choose_heads([s], cands, bound=0.05)
    assert free.picks == [[2, 2]] and free.mean_density == 1.0
    tight = choose_heads([s], cands, bound=0.05, recall_min=0.8, target_density=0.65)
    # head 0 goes first (0.06 error for 0.7 saved beats 0.2 for 0.7), then head 1 must move too: only to VS
    assert tight.picks == [[1, 2]] and tight.mean_density == pytest.approx(0.65)
    tighter = choose_heads([s], cands, bound=0.05, recall_min=0.8, target_density=0.2)
    assert tighter.picks == [[0, 1]]  # head 1 never takes the candidate under the recall floor
    assert tighter.mean_density == pytest.approx(0.2)
    slack = choose_heads([s], cands, bound=0.5, recall_min=0.0, target_density=0.45, spend_slack=True)
    # bound 0.5 lets both start at the cheapest (0.1); slack 0.35 buys the best error per density first
    assert slack.picks == [[0, 2]] or slack.picks == [[1, 1]]
    assert slack.mean_density <= 0.45 + 1e-9


def test_candidate_ladder_is_cheap_first_and_dense_last():
    cands = candidates_for(8192)
    assert cands[-1].pattern is Pattern.DENSE and len(set(cands)) == len(cands)
    assert {c.pattern for c in cands} == set(Pattern)
    assert min(c.budget_a for c in cands if c.pattern is Pattern.BLOCK_SPARSE) == 4
    assert set(METRICS) == {"errors", "densities", "recall", "recall_last"}


def test_shipped_smollm2_config_is_mostly_sparse_and_names_its_rule():
    from pathlib import Path

    from minference_fx import configs

    path = Path(configs.__file__).parent / "smollm2_135m_instruct_8k.json"
    config = load_config(path)
    assert config.validate() == []
    heads = [h for layer in config.layers for h in layer]
    assert len(heads) == 270 and sum(h.pattern is Pattern.DENSE for h in heads) <= 27
    assert "recall" in config.provenance.metric and "mean density" in config.provenance.metric


def test_cli_search_loads_smollm2_with_yarn_past_8k(tmp_path, monkeypatch):
    """``search --model smollm2`` loads the model as eval does (YaRN x2 past 8K), says so, passes the target on."""
    from minference_fx import cli
    from minference_fx.tools import assets
    from minference_fx import search as search_module
    from minference_fx.config import default_config

    class Tokenizer:
        def __call__(self, text, return_tensors):
            return type("Out", (), {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])})

    loads, searches = [], []

    def fake_load(dtype, yarn_factor=None):
        loads.append(yarn_factor)
        return tiny_model("llama"), Tokenizer()

    def fake_search(model, samples, **kwargs):
        searches.append(dict(kwargs, lengths=[s.shape[-1] for s in samples], device=next(model.parameters()).device))
        return default_config(model_identity_from_hf(model.config))

    monkeypatch.setattr(assets, "load_smollm2", fake_load)
    monkeypatch.setattr(search_module, "search", fake_search)
    data = tmp_path / "text.txt"
    data.write_text("It is a truth universally acknowledged. " * 1000)
    common = ["search", "--data", str(data), "--samples", "1", "--out", str(tmp_path / "c.json")]
    assert cli.main([*common, "--lengths", "16k", "--target-density", "0.26"]) == 0
    assert cli.main([*common, "--lengths", "8k"]) == 0
    assert cli.main([*common, "--lengths", "16k", "--yarn", "0"]) == 0
    assert loads == [2.0, None, None]
    assert [s["lengths"] for s in searches] == [[16384], [8192], [16384]]
    assert [s["target_density"] for s in searches] == [0.26, 0.24, 0.24]
    # on the GPU when there is one (it ran on a GPU machine's CPU before: 25 s a layer at 32K), else where asked
    assert {s["device"].type for s in searches} == {"cuda" if torch.cuda.is_available() else "cpu"}
    # the model goes where --device says (meta: a device this CPU-only test can tell apart from where it was built)
    assert cli.main([*common, "--lengths", "8k", "--device", "meta"]) == 0 and searches[-1]["device"].type == "meta"
    assert "YaRN x2" in searches[0]["data_name"] and "YaRN" not in searches[1]["data_name"]
    # the guard settings and the shortest sparse prompt go into the config's defaults; 0 0 writes no escalation
    assert cli.main([*common, "--lengths", "8k", "--guard-threshold", "0.8", "--guard-escalation", "1000", "6096",
                     "--min-sparse-len", "16384"]) == 0
    assert searches[-1]["guard_defaults"] == {"guard_threshold": 0.8, "guard_escalation": [1000, 6096]}
    assert searches[-1]["min_sparse_len"] == 16384
    assert cli.main([*common, "--lengths", "8k", "--guard-escalation", "0", "0"]) == 0
    assert searches[-1]["guard_defaults"] == {"guard_escalation": None} and searches[-1]["min_sparse_len"] == -1
    assert searches[0]["guard_defaults"] == {}
    with pytest.raises(SystemExit, match="only with --model smollm2"):
        cli.main([*common, "--model", "llama", "--yarn", "2"])
    # several sources: --samples windows of each, all named in the provenance
    code = tmp_path / "code"
    code.mkdir()
    (code / "mod.py").write_text("def f(x):\n    return x + 1\n" * 2000)
    monkeypatch.setattr(cli.stdlib_code, "stdlib_root", lambda: code)
    assert cli.main([*common[:2], f"code,{data}", *common[3:], "--lengths", "8k", "--samples", "2"]) == 0
    assert searches[-1]["lengths"] == [8192] * 4
    assert searches[-1]["data_name"].startswith("Python ") and searches[-1]["data_name"].endswith(f" + {data}")
    with pytest.raises(SystemExit, match="'prose' is not 'austen', 'code' or a text file"):
        cli.main([*common[:2], "prose", *common[3:]])
    # a tiny family or a config.json has no tokenizer: refused before the model is built
    monkeypatch.setattr(cli, "build_model", lambda *a: pytest.fail("built a model it cannot tokenize for"))
    for model in ("llama", str(tmp_path / "config.json")):
        with pytest.raises(SystemExit, match=f"search --model {model}: needs a tokenizer"):
            cli.main([*common, "--model", model])


def test_a_near_dense_candidate_scores_as_dense_and_dense_wins_the_tie():
    """Block-sparse keeping 52 of 55 causal tiles of 640 tokens runs dense in the op: error 0, density 1. The
    choice then takes the dense candidate (cuDNN on the GPU, no index); 49 of 55 stays a sparse candidate."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 640, 16, generator=g)
    k, v = (torch.randn(1, 2, 640, 16, generator=g) for _ in range(2))
    call = observe.AttentionCall(0, q, k, v, None, None, 0.25, 0, 0, out=torch.empty(0))
    cands = [HeadPlan(Pattern.BLOCK_SPARSE, 7), HeadPlan(Pattern.BLOCK_SPARSE, 8), HeadPlan(Pattern.DENSE)]
    scores = score_layer(call, cands, last_rows=64)
    assert (scores["errors"][1] < 1e-6).all() and (scores["densities"][1] == 1).all()
    assert (scores["errors"][0] > 1e-3).all() and (scores["densities"][0] < 1).all()
    layer = LayerScores.empty(3, 4)
    layer.add(scores)
    assert choose_heads([layer], cands, bound=1e-6).picks == [[2] * 4]  # only BS(8) and dense pass: dense
    # an exact tie (same density, same error) goes to dense too
    tie = LayerScores.empty(2, 1)
    tie.add({"errors": torch.zeros(2, 1), "densities": torch.ones(2, 1), "recall": torch.ones(2, 1),
             "recall_last": torch.ones(2, 1)})
    assert choose_heads([tie], cands[1:], bound=0.1).picks == [[1]]
