"""RULER-style tasks (minference_fx.tools.ruler), the stdlib code corpus and their place in the eval.

The generators run on the SmolLM2 tokenizer and Austen (cached project assets: skipped with the reason when the
registries are out of reach), the eval end to end on a tiny random model with SmolLM2's vocabulary.
"""
import json
import math
import random
import re
import sys
from collections import Counter

import pytest
import torch

from minference_fx.tools import evaluate, ruler, stdlib_code
from asset_helpers import fetch_or_skip

HAYSTACK_TASKS = [name for name, spec in ruler.TASKS.items() if spec.reads_haystack]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from minference_fx.tools.assets import smollm2_dir

    return AutoTokenizer.from_pretrained(fetch_or_skip(smollm2_dir))


@pytest.fixture(scope="module")
def austen():
    from minference_fx.tools.assets import austen_text

    return fetch_or_skip(austen_text)


@pytest.fixture(scope="module")
def code():
    return stdlib_code.stdlib_code(max_chars=300_000)


# -- generators ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(ruler.TASKS))
def test_generators_are_deterministic_per_seed(tok, austen, name):
    first, again = (ruler.generate(name, tok, austen, 1024, 3, depth=0.4) for _ in range(2))
    assert first == again
    other = ruler.generate(name, tok, austen, 1024, 4, depth=0.4)
    assert other.ids != first.ids and other.answers != first.answers


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("length", [1000, 3000])
def test_prompts_have_the_requested_length(tok, austen, code, length, chat):
    """The haystack tasks are exact; frequent words is exact when its noise word is one token (SmolLM2's is)."""
    assert len(tok(" " + ruler.NOISE_WORD, add_special_tokens=False).input_ids) == 1
    for name in ruler.TASKS:
        for haystack in (austen, code.text):
            sample = ruler.generate(name, tok, haystack, length, 0, depth=0.7, chat=chat)
            assert len(sample.ids) == length, (name, len(sample.ids))
            assert sample.context_start + sample.context_length < length
            assert sample.new_tokens >= len(sample.answers) * 2


@pytest.mark.parametrize("name", HAYSTACK_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9])
def test_the_first_answer_sits_at_the_requested_depth(tok, austen, name, depth):
    """Moved back to a sentence start by at most 1/64 of the haystack, so within 2 % of the depth asked."""
    sample = ruler.generate(name, tok, austen, 4096, 1, depth=depth)
    first = sample.answer_positions[0]
    assert sample.depth == depth
    assert depth - 0.02 <= (first - sample.context_start) / sample.context_length <= depth + 0.005
    # the insert starts there and carries the first answer
    assert sample.answers[0] in tok.decode(sample.ids[first : first + 20])


def test_multikey_asks_one_key_among_distractors(tok, austen):
    sample = ruler.niah_multikey(tok, austen, 4096, 0, depth=0.3, keys=4)
    text = tok.decode(sample.ids)
    needles = dict(re.findall(r"One of the secret numbers of the ([a-z]+-[a-z]+) is (\d{7})\.", text))
    assert len(needles) == 4 and len(set(needles.values())) == 4 and len(sample.answers) == 1  # distinct keys, values
    asked = re.search(r"What is the secret number of the ([a-z]+-[a-z]+) mentioned", text).group(1)
    assert needles[asked] == sample.answers[0]


def test_multivalue_hides_every_value_under_one_key(tok, austen):
    sample = ruler.niah_multivalue(tok, austen, 4096, 0, depth=0.2, values=4)
    text = tok.decode(sample.ids)
    assert len(set(sample.answers)) == 4 and len(sample.answer_positions) == 4
    key = text.split("What are all the secret numbers of the ")[1].split(" mentioned")[0]
    for value, at in zip(sample.answers, sample.answer_positions):
        assert f"One of the secret numbers of the {key} is {value}." in tok.decode(sample.ids[at : at + 25])


def test_variable_tracking_chain_reads_in_order_after_its_depth(tok, austen):
    sample = ruler.variable_tracking(tok, austen, 4096, 2, depth=0.4, hops=4, chains=2)
    text = tok.decode(sample.ids)
    names = sample.answers
    assert len(names) == 5 and sample.answer_positions == sorted(sample.answer_positions)
    value = text.split(f"VAR {names[0]} = ")[1].split(".")[0]
    assert value.isdigit() and f"holding {value} are:" in text
    for prev, name in zip(names, names[1:]):
        assert f"VAR {name} = VAR {prev}." in text
    assigned = re.findall(r"VAR ([A-Z]{5}) = ", text)
    assert len(assigned) == 10 and set(names) < set(assigned)  # the distractor chain: 5 more variables


def test_frequent_words_answers_are_the_three_most_frequent_after_the_noise(tok, austen):
    sample = ruler.freq_words(tok, austen, 4096, 5)
    context = tok.decode(sample.ids[sample.context_start : sample.context_start + sample.context_length])
    counts = Counter(context.split()).most_common()
    assert counts[0][0] == ruler.NOISE_WORD
    assert [w for w, _ in counts[1:4]] == sample.answers
    assert counts[3][1] > counts[4][1]  # no tie at the cut
    with pytest.raises(ValueError, match="too few"):
        ruler.freq_words(tok, austen, 90, 0)


def test_chat_prompts_need_a_template_and_end_with_the_answer_prefix(tok, austen):
    sample = ruler.niah_multikey(tok, austen, 1024, 0, chat=True)
    text = tok.decode(sample.ids)
    assert text.rstrip().endswith(f"The secret number of the {text.split('secret number of the ')[-1]}")
    assert "<|im_start|>assistant\n" in text and text.index("<|im_start|>user") < text.index("One of the secret")
    plain = tok.decode(ruler.niah_multikey(tok, austen, 1024, 0, chat=False).ids)
    assert "<|im_start|>" not in plain and "\nAnswer: The secret number of the" in plain

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="has none"):
        ruler.prompt_frame(NoTemplate(), "i", "q", "a", chat=True)


def test_bad_requests_name_the_problem(tok, austen):
    with pytest.raises(ValueError, match="outside"):
        ruler.niah_multikey(tok, austen, 1024, 0, depth=1.5)
    with pytest.raises(ValueError, match="cannot hold"):
        ruler.niah_multivalue(tok, austen, 60, 0, values=8)
    with pytest.raises(ValueError, match="fewer than"):
        ruler.niah_multikey(tok, "A short text.\n" * 20, 2048, 0)
    with pytest.raises(ValueError, match="known: niah_multikey"):
        ruler.generate("cwe", tok, austen, 1024, 0)


# -- scorer --------------------------------------------------------------------


def test_scorer_counts_the_expected_strings_found():
    answers = ["1234567", "7654321", "ABCDE", "qwerty"]
    assert ruler.score(" 1234567, 7654321, ABCDE and qwerty.", answers) == 1.0
    assert ruler.score("1234567 and abcde", answers) == 0.5  # case does not matter
    assert ruler.score("I do not know.", answers) == 0.0
    assert ruler.score(" 5550001, 5550002 (the distractors' values)", answers) == 0.0
    assert ruler.score(" 5550001, 1234567", ["1234567"]) == 1.0  # extra strings cost nothing
    with pytest.raises(ValueError, match="at least one"):
        ruler.score("x", [])


# -- the code corpus -----------------------------------------------------------


def test_the_stdlib_corpus_is_deterministic_and_not_empty():
    a, b = stdlib_code.stdlib_code(max_chars=200_000), stdlib_code.stdlib_code(max_chars=200_000)
    assert a == b and a.sha256 == b.sha256 and len(a.text) >= 200_000
    assert a.text.startswith("# file: ") and "def " in a.text and a.files > 1
    assert stdlib_code.stdlib_code(seed=1, max_chars=200_000).text != a.text
    assert a.describe()["python"] and "text" not in a.describe()


def test_the_corpus_order_is_sorted_then_seeded_and_skips_tests_and_bad_files(tmp_path):
    for rel in ("b.py", "a.py", "pkg/c.py", "pkg/d.txt", "test/t.py", "site-packages/s.py", "pkg/tests/u.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"x = {rel!r}\n")
    (tmp_path / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8
    assert stdlib_code.source_files(tmp_path) == ["a.py", "b.py", "latin.py", "pkg/c.py"]
    corpus = stdlib_code.stdlib_code(seed=7, root=tmp_path)
    expected = ["a.py", "b.py", "latin.py", "pkg/c.py"]
    random.Random(7).shuffle(expected)
    assert [line[len("# file: "):] for line in corpus.text.splitlines() if line.startswith("# file: ")] == \
        [p for p in expected if p != "latin.py"]
    assert corpus.files == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no Python sources"):
        stdlib_code.stdlib_code(root=empty)


# -- the eval ------------------------------------------------------------------


def test_perplexity_of_the_last_tokens_matches_the_full_logits():
    from minference_fx.tools.tiny import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits[-33:-1], ids[0, -32:])
    assert evaluate.perplexity(model, ids, scored=32) == pytest.approx(math.exp(nll.item()), rel=1e-5)
    full = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    assert evaluate.perplexity(model, ids) == pytest.approx(math.exp(full.item()), rel=1e-5)


def test_eval_runs_ruler_and_code_perplexity_end_to_end(tok, austen, code, tmp_path):
    """A tiny random model with SmolLM2's vocabulary: the scores mean nothing, the rows and fields must be there."""
    from minference_fx.plan import Pattern
    from minference_fx.tools.tiny import tiny_model

    model = tiny_model("llama", vocab_size=len(tok))
    config = evaluate.uniform_config(model, Pattern.VERTICAL_SLASH, (30, 50))
    lines = []
    results = evaluate.run_eval(model, tok, austen, lengths=[512], tasks=("ppl", "ppl-code", "ruler", "ruler-code"),
                                config=config, config_name="uniform", depths=(0.5,), code=code,
                                ruler_tasks=("niah_multikey", "freq_words"), chat=False, ppl_tokens=64,
                                progress=lines.append)
    assert [(c.haystack, c.task) for c in results.ruler] == [
        ("austen", "niah_multikey"), ("austen", "freq_words"), ("code", "niah_multikey")]
    for cell in results.ruler:
        assert 0.0 <= cell.dense_score <= 1.0 and 0.0 <= cell.sparse_score <= 1.0 and cell.answers
    assert [r.scored for r in results.ppl + results.ppl_code] == [64, 64]
    assert all(math.isfinite(r.dense) and math.isfinite(r.sparse) for r in results.ppl + results.ppl_code)
    assert results.code_corpus == code.describe()
    table = results.table()
    for column in ("mk-niah", "fwe", "mk-niah code", "worst diff", "ppl ratio", "code ppl ratio"):
        assert column in table
    doc = json.loads(json.dumps(results.to_json()))
    assert {s["task"] for s in doc["ruler_summary"]} == {"niah_multikey", "freq_words"}
    assert evaluate.EvalResults.from_json(doc) == results
    assert any(line.startswith("ruler code niah_multikey L=512") for line in lines)
    with pytest.raises(ValueError, match="known: ppl"):
        evaluate.run_eval(model, tok, austen, lengths=[512], tasks=("rulers",), config=config, config_name="u")
    with pytest.raises(ValueError, match="no RULER-style task"):
        evaluate.run_eval(model, tok, austen, lengths=[512], tasks=("ruler",), config=config, config_name="u",
                          ruler_tasks=("cwe",))


def test_configs_compared_in_one_process_share_one_dense_side(tok, austen, code, monkeypatch):
    """Two configs run with one dense memo: the second run computes no dense answer or perplexity, its dense
    fields are the first run's, and its sparse ones are its own config's."""
    from minference_fx.plan import Pattern
    from minference_fx.tools.tiny import tiny_model

    model = tiny_model("llama", vocab_size=len(tok))
    dense_calls = []
    answer, ppl = evaluate.greedy_answer, evaluate.perplexity

    def counted_answer(model, ids, *, prefill=None, new_tokens=7):
        if prefill is None:
            dense_calls.append("answer")
        return answer(model, ids, prefill=prefill, new_tokens=new_tokens)

    def counted_perplexity(model, ids, *, compiled=None, scored=None):
        if compiled is None:
            dense_calls.append("ppl")
        return ppl(model, ids, compiled=compiled, scored=scored)

    monkeypatch.setattr(evaluate, "greedy_answer", counted_answer)
    monkeypatch.setattr(evaluate, "perplexity", counted_perplexity)
    memo, runs = evaluate.DenseMemo(), []
    for budgets in ((8, 8), (1024, 1024)):  # the guard off: the few keys of the first stay sparse
        config = evaluate.uniform_config(model, Pattern.VERTICAL_SLASH, budgets).with_guard_threshold(0)
        runs.append(evaluate.run_eval(model, tok, austen, lengths=[512], tasks=("ppl", "niah", "ruler"), config=config,
                                      config_name=str(budgets), depths=(0.5,), ruler_tasks=("niah_multikey",),
                                      chat=False, ppl_tokens=64, progress=lambda line: None, dense_memo=memo))
        if budgets == (8, 8):
            first_dense_calls = len(dense_calls)
    assert first_dense_calls == 3 and len(dense_calls) == 3  # ppl, one needle, one RULER prompt: once each
    first, second = runs
    assert [r.dense for r in second.ppl] == [r.dense for r in first.ppl]
    assert [c.dense_answer for c in second.niah] == [c.dense_answer for c in first.niah]
    assert [(c.dense_answer, c.dense_score) for c in second.ruler] == [(c.dense_answer, c.dense_score) for c in first.ruler]
    # each sparse run is its own config's: every key (second) gives the dense perplexity, a few keys (first) do not
    assert second.ppl[0].sparse == pytest.approx(second.ppl[0].dense, rel=1e-4)
    assert first.ppl[0].sparse != pytest.approx(first.ppl[0].dense, rel=1e-4)


def test_the_plot_draws_scores_and_ppl_ratio(tmp_path):
    pytest.importorskip("matplotlib")
    results = evaluate.EvalResults("m", "c", [1024, 2048], "cpu")
    for n in (1024, 2048):
        results.ppl.append(evaluate.PerplexityRow(n, 10.0, 10.1, 0.01, 1.0, 2.0))
        results.ppl_code.append(evaluate.PerplexityRow(n, 3.0, 3.0, 0.0, 1.0, 2.0))
        results.ruler.append(evaluate.RulerCell(n, "variable_tracking", "austen", 0.5, 0, ["A"], 1.0, 0.8, "A", "B"))
    assert evaluate.save_png(results, tmp_path / "r.png") == str(tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_the_plot_is_left_out_without_matplotlib(monkeypatch, tmp_path):
    """matplotlib comes with the [eval] extra only: without it the eval writes no PNG and says so with None."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    results = evaluate.EvalResults("m", "c", [1024], "cpu")
    results.ppl.append(evaluate.PerplexityRow(1024, 10.0, 10.1, 0.01, 1.0, 2.0))
    assert evaluate.save_png(results, tmp_path / "r.png") is None
    assert not (tmp_path / "r.png").exists()


def test_quality_table_shows_mean_scores_and_ratios():
    results = evaluate.EvalResults("m", "c", [1024], "cpu")
    results.ppl.append(evaluate.PerplexityRow(1024, 10.0, 10.1, 0.01, 1.0, 2.0))
    # answers as the scores say: seed 0 loses "2", seed 1 swaps "1" for "2"
    for seed, (dense, sparse, dense_answer, sparse_answer) in enumerate([(1.0, 0.5, "1 2", "1"), (0.5, 0.5, "1", "2")]):
        results.ruler.append(evaluate.RulerCell(1024, "niah_multivalue", "austen", 0.5, seed, ["1", "2"], dense,
                                                sparse, dense_answer, sparse_answer))
    results.ruler.append(evaluate.RulerCell(1024, "niah_multivalue", "code", 0.5, 0, ["1"], 1.0, 1.0, "1", "1"))
    row = [line for line in results.table().splitlines() if line.strip().startswith("1024") and "|" in line][0]
    # 2 strings lost, 1 gained of 5: p = 2 * P(Binom(3, 1/2) <= 1) = 1.0
    assert row.split() == ["1024", "75.0|50.0", "100.0|100.0", "-25.0", "2/1/5", "1.00", "1.0100"]
    summary = {(s.haystack, s.task): s for s in results.ruler_scores()}
    assert (summary["austen", "niah_multivalue"].lost, summary["austen", "niah_multivalue"].gained) == (2, 1)


def test_every_task_runs_as_many_prompts_and_the_aggregation_one_starts_at_the_given_seeds():
    assert ruler.prompts_of("variable_tracking", [0.1, 0.9], [0, 1]) == [(0.1, 0), (0.1, 1), (0.9, 0), (0.9, 1)]
    assert ruler.prompts_of("freq_words", [0.1, 0.5, 0.9], [0]) == [(None, 0), (None, 1), (None, 2)]
    assert ruler.prompts_of("freq_words", [0.5], [0, 1]) == [(None, 0), (None, 1)]
    seeded = ruler.prompts_of("freq_words", [0.1, 0.9], [0, 1])
    assert [s for _, s in seeded] == [0, 1, 2, 3]  # distinct prompts, never one prompt twice


def test_sign_test_of_lost_against_gained_strings():
    assert evaluate.sign_test(0, 0) == 1.0
    assert evaluate.sign_test(2, 0) == 0.5  # 2 * (1/4): two lost strings alone prove nothing
    assert evaluate.sign_test(5, 0) == pytest.approx(2 / 32)
    assert evaluate.sign_test(0, 6) == evaluate.sign_test(6, 0) == pytest.approx(2 / 64)
    assert evaluate.sign_test(10, 1) == pytest.approx(2 * 12 / 2048)


def test_string_changes_skip_cells_without_a_sparse_run_and_ignore_case():
    cells = [evaluate.RulerCell(1024, "variable_tracking", "code", 0.5, 0, ["VAR AB", "VAR CD"], 1.0, 0.5,
                                "var ab, var cd", "VAR AB"),
             evaluate.RulerCell(1024, "variable_tracking", "code", 0.9, 0, ["VAR EF"], 1.0, None, "VAR EF", "")]
    assert evaluate.string_changes(cells) == (2, 1, 0)


def test_eval_cli_passes_the_ruler_options(monkeypatch):
    from minference_fx import cli
    from test_assets_eval import stub_eval

    seen = stub_eval(monkeypatch)
    assert cli.main(["eval", "--budgets", "200", "700", "--lengths", "1k", "--tasks", "ruler,ppl-code"]) == 0
    assert seen["tasks"] == ("ruler", "ppl-code") and seen["chat"] is None and seen["ppl_tokens"] is None
    assert seen["ruler_tasks"] == tuple(ruler.TASKS)  # the default lists every task
    assert cli.main(["eval", "--budgets", "200", "700", "--lengths", "1k", "--tasks", "ruler", "--prompt", "plain",
                     "--ruler-tasks", "variable_tracking", "--ppl-tokens", "1024"]) == 0
    assert seen["chat"] is False and seen["ruler_tasks"] == ("variable_tracking",) and seen["ppl_tokens"] == 1024
