"""``minference-fx bench prefill`` end to end on a tiny Llama (CPU), plus its bookkeeping and CLI wiring."""
import json
import types

import pytest
import torch

from minference_fx import cli
from minference_fx.options import BackendOptions
from minference_fx.tools import assets
from minference_fx.tools import bench_prefill as bp
from asset_helpers import fetch_or_skip
from tiny_models import rows_since

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
LENGTHS = [96, 160, 224]
# the default budgets (vertical 1000, slash 6096) cover every key at these lengths, so sparse = dense;
# min_sparse_len=64 makes the op take its sparse branch (the tuned crossover would keep them dense)
OPTIONS = {"min_sparse_len": 64}
# The tests of what reaches the minference variants (budgets, a pattern, a model directory) check the bench's plumbing,
# which does not depend on the inner compiler: they skip Inductor's C++ codegen (seconds per graph on CPU). The
# minference variant under Inductor, the default, is run end to end below with and without masks, and again under
# reduce-overhead in test_inductor_and_reduce_overhead.
PLUMBING = {**OPTIONS, "inner": "aot_eager"}


def _assert_speedup_is_the_cells_ratio(result, length, variant, baseline):
    """A speed-up is the baseline's time over the variant's, both measured: None (a missing time) fails."""
    assert result.speedup(length, variant, baseline) == pytest.approx(
        result.cell(length, baseline).ttft_ms / result.cell(length, variant).ttft_ms)


def _cells(data):
    return {(c["length"], c["variant"]): c for c in data["cells"]}


def _variant(data, name):
    return next(v for v in data["variants"] if v["variant"] == name)


def test_eager_and_minference_end_to_end(tmp_path):
    out = tmp_path / "prefill.json"
    result = bp.bench_prefill(LENGTHS, layers=2, variants=("eager", "minference"), isolate=False, reps=1,
                              config_overrides=TINY, minference_options=OPTIONS, out=out, command="test")
    data = json.loads(out.read_text())
    cells = _cells(data)
    assert set(cells) == {(n, v) for n in LENGTHS for v in ("eager", "minference")}
    for c in cells.values():
        assert c["status"] == "ok" and c["ttft_ms"] > 0 and c["first_call_s"] > 0 and c["finite"], c
    mf = _variant(data, "minference")
    assert mf["minference"]["sites"] == 2 and mf["minference"]["rewritten"] == 2  # one attention per layer, replaced
    assert mf["graphs_first_call"] == 1 and mf["graph_breaks"] == 0
    assert mf["recompiles"] == 0  # the sequence dim is marked dynamic: one graph for the three lengths
    assert mf["compile_s"] > 0
    assert mf["minference"]["min_sparse_len_resolved"] == 64
    for n in LENGTHS:
        sparse, dense = cells[(n, "minference")], cells[(n, "eager")]
        assert sparse["path"] == "sparse"
        assert sparse["guard"]["heads_checked"] > 0 and sparse["guard"]["heads_forced_dense"] == 0
        # covering budgets keep every tile: each vertical-slash head is near-dense and runs dense
        assert sparse["guard"]["heads_listed"] > 0 and sparse["guard"]["heads_near_dense"] == sparse["guard"]["heads_listed"]
        assert sparse["next_token"] == dense["next_token"]  # covering budgets: the same greedy token
        assert data["speedups"][str(n)]["minference"]["eager"] == pytest.approx(dense["ttft_ms"] / sparse["ttft_ms"])
    assert _variant(data, "eager")["recompiles"] is None
    # a profiled forward shows what ran: SDPA in eager, the custom op in the compiled model, and SDPA there only
    # inside it: every head is routed by then and the index skipped, so each op is one SDPA call
    assert any("scaled_dot_product" in k for k in _variant(data, "eager")["attention_kernels"])
    ran = mf["attention_kernels"]
    assert ran.get("minference::sparse_attention") == 2 and ran.get("aten::scaled_dot_product_attention") == 2
    assert data["gpu"] and data["torch"] == torch.__version__ and data["transformers"] and data["layers"] == 2
    table = result.table()
    assert "2/2 attention sites rewritten" in table and table.count("\n") >= 1 + 2 * len(LENGTHS)


def test_an_all_ones_attention_mask_reaches_the_op_as_padding(tmp_path):
    """--attention-mask: the forwards get the mask generate() passes; the sites see a padding mask, are still
    rewritten, and give eager's tokens."""
    from minference_fx.backend import recent_reports

    before = recent_reports()
    out = tmp_path / "prefill.json"
    bp.bench_prefill(LENGTHS[:2], layers=2, variants=("eager", "minference"), isolate=False, reps=1,
                     config_overrides=TINY, minference_options=OPTIONS, out=out, command="test", attention_mask=True)
    data = json.loads(out.read_text())
    assert data["attention_mask"].startswith("all ones")
    rows = rows_since(before)
    assert rows and all(r.decision == "sparse" and r.mask == "causal+padding" for r in rows), rows
    cells = _cells(data)
    for n in LENGTHS[:2]:
        assert cells[(n, "minference")]["next_token"] == cells[(n, "eager")]["next_token"]
    assert _variant(data, "minference")["recompiles"] == 0


def test_a_left_padded_batch_keeps_unequal_prompts_with_generates_positions():
    """PromptBatch: row r keeps n - F*n*r/(B-1) tokens at the right, padding at the left is masked and its ids
    zeroed, and positions count from each row's first real token (as generate passes them)."""
    prompts = bp.PromptBatch(batch=3, pad_fraction=0.5)
    assert prompts.kept(100) == [100, 75, 50] and prompts.masked
    rows = [torch.arange(1, 11).unsqueeze(0) + 100 * r for r in range(3)]
    got = prompts.inputs(lambda n, row: rows[row][:, :n], 10)
    mask = got["attention_mask"]
    assert mask.tolist() == [[1] * 10, [0] * 2 + [1] * 8, [0] * 5 + [1] * 5]
    assert got["position_ids"][2].tolist() == [1] * 5 + list(range(5))
    assert got["position_ids"][0].tolist() == list(range(10))
    assert (got["input_ids"][mask == 0] == 0).all() and torch.equal(got["input_ids"][mask == 1],
                                                                     torch.cat(rows)[mask == 1])
    same = bp.PromptBatch(batch=2, attention_mask=True).inputs(lambda n, row: rows[row][:, :n], 10)
    assert set(same) == {"input_ids", "attention_mask"} and bool(same["attention_mask"].all())
    assert set(bp.PromptBatch(batch=2).inputs(lambda n, row: rows[row][:, :n], 10)) == {"input_ids"}
    for bad, match in ((dict(batch=0), "batch"), (dict(batch=2, pad_fraction=1.0), "pad_fraction"),
                       (dict(batch=1, pad_fraction=0.5), "batch >= 2")):
        with pytest.raises(ValueError, match=match):
            bp.PromptBatch(**bad)


def test_a_padded_batch_reaches_the_op_as_padding_and_gives_eagers_tokens(tmp_path):
    """--batch 3 --pad-fraction 0.5: one forward holds three prompts of unequal lengths; every site sees a padding
    mask and is rewritten; every row's token equals eager's, every row's logits are finite; no recompiles."""
    from minference_fx.backend import recent_reports

    before = recent_reports()
    out = tmp_path / "prefill.json"
    bp.bench_prefill(LENGTHS[:2], layers=2, variants=("eager", "minference"), isolate=False, reps=1,
                     config_overrides=TINY, minference_options=OPTIONS, out=out, command="test", batch=3,
                     pad_fraction=0.5)
    data = json.loads(out.read_text())
    assert data["batch"] == 3 and data["attention_mask"].startswith("left padding")
    rows = rows_since(before)
    assert rows and all(r.decision == "sparse" and r.mask == "causal+padding" and r.shapes.startswith("q 3x") for r in rows), rows
    cells = _cells(data)
    for n in LENGTHS[:2]:
        assert cells[(n, "minference")]["finite"] and cells[(n, "eager")]["finite"]
        assert cells[(n, "minference")]["row_tokens"] == cells[(n, "eager")]["row_tokens"]
        assert len(cells[(n, "eager")]["row_tokens"]) == 3
    assert _variant(data, "minference")["recompiles"] == 0


def test_append_refuses_results_with_another_attention_mask():
    meta = {"layers": 1, "config": {}, "dtype": "float32", "device": "cpu"}
    earlier = bp.PrefillResult(dict(meta), [], [])  # a file from before --attention-mask was recorded
    bp._take_earlier(bp.PrefillResult(dict(meta, attention_mask=None), [], []), earlier, ["eager"])
    with pytest.raises(ValueError, match="attention_mask"):
        bp._take_earlier(bp.PrefillResult(dict(meta, attention_mask="all ones (as generate passes)"), [], []),
                         earlier, ["eager"])


def test_a_progress_file_an_earlier_job_left_is_not_taken_for_this_runs(tmp_path, monkeypatch):
    """A child that dies before its first cell wrote nothing; the file beside --out was a killed job's."""
    out = tmp_path / "prefill.json"
    earlier = bp.PrefillResult({}, [bp.Cell(96, "eager", ttft_ms=1.0)], [bp.VariantSummary("eager")])
    earlier.save(f"{out}.eager.part.json")
    monkeypatch.setattr(bp.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=1))
    part = bp._run_child("eager", {"lengths": [96]}, False, out)
    assert [c.status for c in part.cells] == ["error: the variant's process exited with 1 before this length"]
    assert part.variants[0].error == "the variant's process exited with 1"


def test_own_processes_and_append(tmp_path):
    """Each variant in a child process with empty compile caches; --append keeps the variants already there."""
    out = tmp_path / "prefill.json"
    bp.bench_prefill(LENGTHS[:2], layers=1, variants=("eager",), isolate=True, reps=1, config_overrides=TINY, out=out)
    first = json.loads(out.read_text())
    assert first["isolated_processes"] and first["cold_caches"] and first["parameters"] > 0
    assert all(c["status"] == "ok" for c in first["cells"]) and len(first["cells"]) == 2
    assert not list(tmp_path.glob("*.part.json"))  # the child's progress file is merged, then removed
    # a second run of the same model adds a variant (here the same eager model under torch's own SDPA priority)
    result = bp.bench_prefill(LENGTHS[:2], layers=1, variants=("eager-default",), isolate=False, reps=1,
                              config_overrides=TINY, out=out, append=True)
    data = json.loads(out.read_text())
    assert {v["variant"] for v in data["variants"]} == {"eager", "eager-default"}
    assert set(_cells(data)) == {(n, v) for n in LENGTHS[:2] for v in ("eager", "eager-default")}
    assert data["earlier_commands"] == ["bench_prefill(...)"]
    _assert_speedup_is_the_cells_ratio(result, LENGTHS[0], "eager-default", "eager")
    with pytest.raises(ValueError, match="another"):  # another model shape is refused, not mixed in
        bp.bench_prefill(LENGTHS[:1], layers=2, variants=("eager",), isolate=False, config_overrides=TINY, out=out,
                         append=True)


def test_budgets_reach_the_minference_variants(tmp_path):
    """--budgets: every head vertical-slash with those budgets; the smallest ones leave tiles out at 224 tokens,
    so the heads are no longer near-dense as with the default budgets (test above); eager is untouched."""
    out = tmp_path / "prefill.json"
    result = bp.bench_prefill(LENGTHS[-1:], layers=1, variants=("eager", "minference"), isolate=False, reps=1,
                              config_overrides=TINY, minference_options=PLUMBING, out=out, budgets=(30, 50))
    data = json.loads(out.read_text())
    assert data["semantic_config"] == "every head vertical-slash [30, 50]"
    cell = _cells(data)[(LENGTHS[-1], "minference")]
    assert cell["path"] == "sparse" and cell["finite"]
    assert cell["guard"]["heads_listed"] == 4 and cell["guard"]["heads_near_dense"] == 0
    assert "(30, 50)" in _variant(data, "minference")["description"]
    assert "semantic config: every head vertical-slash [30, 50]" in result.table()
    assert "(30, 50)" not in _variant(data, "eager")["description"]
    _assert_speedup_is_the_cells_ratio(result, LENGTHS[-1], "minference", "eager")
    with pytest.raises(ValueError, match="not both"):
        bp.bench_prefill(LENGTHS[:1], budgets=(30, 50), config_path=str(out))
    with pytest.raises(ValueError, match="does not exist"):
        bp.bench_prefill(LENGTHS[:1], config_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="another"):  # results of other budgets are not mixed in
        bp.bench_prefill(LENGTHS[-1:], layers=1, variants=("eager",), isolate=False, config_overrides=TINY, out=out,
                         append=True)


def test_a_shape_budgets_reach_the_minference_variants(tmp_path):
    """--pattern a_shape --budgets S W: every head A-shape (sink S, window W); the guard checks none of them
    (it checks vertical-slash heads), and the results name the pattern."""
    out = tmp_path / "prefill.json"
    result = bp.bench_prefill(LENGTHS[-1:], layers=1, variants=("minference",), isolate=False, reps=1,
                              config_overrides=TINY, minference_options=PLUMBING, out=out, budgets=(16, 48),
                              pattern="a_shape")
    data = json.loads(out.read_text())
    assert data["semantic_config"] == "every head a-shape [16, 48]"
    cell = _cells(data)[(LENGTHS[-1], "minference")]
    assert cell["status"] == "ok" and cell["path"] == "sparse" and cell["finite"]
    assert cell["guard"]["heads_checked"] == 0
    mf = _variant(data, "minference")
    assert "a-shape (16, 48)" in mf["description"]
    assert list(mf["minference"]["plans"]) and all("a_shape" in plan for plan in mf["minference"]["plans"])
    assert "every head a-shape [16, 48]" in result.table()
    with pytest.raises(ValueError, match="needs budgets"):
        bp.bench_prefill(LENGTHS[:1], pattern="a_shape")
    with pytest.raises(ValueError, match="unknown pattern"):
        bp.bench_prefill(LENGTHS[:1], budgets=(16, 48), pattern="block_sparse")


def test_no_attention_adds_q_k_v_per_group():
    q, k, v = torch.randn(2, 4, 5, 3), torch.randn(2, 2, 5, 3), torch.randn(2, 2, 5, 3)
    out, weights = bp._no_attention(None, q, k, v, None, scaling=0.5)
    assert weights is None and out.shape == (2, 5, 4, 3)  # [B, S, H, D], as HF's attention functions return
    for h in range(4):  # query heads 0-1 share KV head 0, 2-3 KV head 1
        torch.testing.assert_close(out[:, :, h], (q[:, h] + k[:, h // 2] + v[:, h // 2]))


@pytest.mark.slow
def test_the_no_attention_bound_compiles_without_attention_and_restores_the_model():
    """inductor-noattn: no attention op in the compiled graph, and the model runs SDPA again afterwards (an
    in-process run's next variant must not time the bound)."""
    model = bp.build_model(bp.llama3_8b_config(layers=2, max_len=256, **TINY), "cpu", torch.float32)
    ids = bp.prompt_ids(LENGTHS[0], TINY["vocab_size"], 0, "cpu")
    with torch.inference_mode():
        dense = model(input_ids=ids, use_cache=False).logits
    cells, summary = bp.run_variant(model, "inductor-noattn", LENGTHS[:2], reps=1)
    assert [c.status for c in cells] == ["ok", "ok"] and all(c.finite for c in cells)
    assert summary.recompiles == 0 and "bound" in summary.description
    assert not any("scaled_dot_product" in k for k in summary.attention_kernels), summary.attention_kernels
    assert model.config._attn_implementation == "sdpa"
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, dense)


@pytest.mark.slow
def test_inductor_and_reduce_overhead(tmp_path):
    out = tmp_path / "prefill.json"
    result = bp.bench_prefill(LENGTHS, layers=2, variants=("inductor",), reduce_overhead=True, isolate=False, reps=1,
                              config_overrides=TINY, minference_options=OPTIONS, out=out)
    data = json.loads(out.read_text())
    assert set(_cells(data)) == {(n, v) for n in LENGTHS for v in ("inductor", "minference-ro")}
    assert all(c["status"] == "ok" and c["finite"] for c in data["cells"])
    for name in ("inductor", "minference-ro"):
        assert _variant(data, name)["recompiles"] == 0 and _variant(data, name)["compile_s"] > 0
    ro = _variant(data, "minference-ro")
    assert ro["minference"]["rewritten"] == 2 and "reduce-overhead" in ro["description"]
    for n in LENGTHS:  # covering budgets: same token as Inductor's dense attention
        assert _cells(data)[(n, "minference-ro")]["next_token"] == _cells(data)[(n, "inductor")]["next_token"]
    _assert_speedup_is_the_cells_ratio(result, LENGTHS[0], "minference-ro", "inductor")


def test_table_with_oom_and_errors():
    result = bp.PrefillResult({}, [
        bp.Cell(32768, "eager", ttft_ms=100.0, first_call_s=0.2),
        bp.Cell(32768, "minference", ttft_ms=25.0, first_call_s=30.0, path="sparse", launch="launch 64/64/4/3",
                guard={"calls": 2, "heads_checked": 64, "heads_forced_dense": 60, "heads_listed": 64,
                       "heads_near_dense": 3}),
        bp.Cell(32768, "inductor", status="oom"),
    ], [bp.VariantSummary("eager"), bp.VariantSummary("inductor", compiled=True, error="compile failed"),
        bp.VariantSummary("minference", compiled=True, compile_s=29.9, recompiles=0, minference={
            "graphs": 1, "sites": 32, "rewritten": 32, "min_sparse_len": -1, "min_sparse_len_resolved": 8192,
            "guard_threshold": 0.5})])
    assert result.speedup(32768, "minference", "eager") == 4.0
    assert result.speedup(32768, "minference", "inductor") is None
    table = result.table()
    assert "oom" in table and "guard dense 60/64; near-dense 3/64" in table and "32/32 attention sites rewritten" in table
    assert "sparse; launch 64/64/4/3; guard" in table
    assert "inductor: compile failed" in table
    head, *rows = table.splitlines()[:4]
    width = head.index("note")  # the columns before the note have a fixed width ('-' padded)
    assert all(len(row) >= width and row[width - 2:width] == "  " and row[width - 3] != " " for row in rows)


def test_oom_is_recognised_through_wrappers():
    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        except Exception as inner:
            raise RuntimeError("backend failed") from inner
    except RuntimeError as exc:
        assert bp._is_oom(exc)
    assert not bp._is_oom(ValueError("shape mismatch"))


def test_llama3_8b_shape_and_last_token_logits():
    cfg = bp.llama3_8b_config(layers=32, max_len=262144)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) \
        == (4096, 32, 8, 14336, 128256)
    assert cfg.max_position_embeddings == 262144 and cfg.rope_parameters["rope_theta"] == 500000.0
    model = bp.build_model(bp.llama3_8b_config(layers=1, max_len=64, **TINY), "cpu", torch.float32)
    assert bp._last_logits_kwarg(model) == {"logits_to_keep": 1}
    est = bp.memory_estimate_gib(32, 131072)
    assert 14 < est["weights"] < 16 and est["hf_compiled_mask_bool"] == 16.0
    four = bp.memory_estimate_gib(32, 131072, batch=4)  # activations and HF's mask grow with the batch
    assert four["weights"] == est["weights"] and four["hf_compiled_mask_bool"] == 64.0
    assert four["hidden"] == 4 * est["hidden"]


def test_cli_wiring(monkeypatch, capsys):
    from minference_fx import cli

    seen = {}

    def fake(lengths, **kwargs):
        seen.update(kwargs, lengths=lengths)
        return bp.PrefillResult({}, [], [])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bp, "bench_prefill", fake)
    assert cli.main(["bench", "prefill", "--lengths", "32k,128k,256k", "--layers", "8", "--reduce-overhead",
                     "--variants", "eager,minference", "--reps", "2"]) == 0
    assert seen["lengths"] == [32768, 131072, 262144] and seen["layers"] == 8 and seen["reduce_overhead"]
    assert seen["variants"] == ("eager", "minference") and seen["reps"] == 2 and seen["isolate"]
    assert seen["budgets"] is None and seen["config_path"] is None
    assert "length" in capsys.readouterr().out
    assert seen["minference_options"] is None
    assert seen["attention_mask"] is False
    assert cli.main(["bench", "prefill", "--budgets", "500", "2000", "--guard-threshold", "0.5", "--attention-mask"]) == 0
    assert seen["budgets"] == (500, 2000) and seen["minference_options"] == {"guard_threshold": 0.5}
    assert seen["attention_mask"] is True and seen["batch"] == 1 and seen["pad_fraction"] == 0.0
    assert cli.main(["bench", "prefill", "--batch", "4", "--pad-fraction", "0.25"]) == 0
    assert seen["batch"] == 4 and seen["pad_fraction"] == 0.25
    assert seen["pattern"] == "vertical_slash"
    assert cli.main(["bench", "prefill", "--budgets", "1000", "6096", "--pattern", "a_shape"]) == 0
    assert seen["pattern"] == "a_shape" and seen["budgets"] == (1000, 6096)


@pytest.mark.gpu
def test_gpu_small_model_all_variants(tmp_path):
    """On a GPU: every variant runs (reduce-overhead included, CUDA graphs not skipped) and nothing recompiles."""
    shape = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
    lengths = [2048, 4096, 6144]
    result = bp.bench_prefill(lengths, layers=2, variants=("eager", "inductor", "minference", "minference-noguard",
                                                           "minference-noroute"), reduce_overhead=True, isolate=False, reps=2, config_overrides=shape,
                              minference_options={"min_sparse_len": 1024}, out=tmp_path / "p.json")
    print(result.table())
    assert all(c.status == "ok" and c.finite for c in result.cells), [c for c in result.cells if c.status != "ok"]
    for v in result.variants:
        if v.compiled:
            assert v.recompiles == 0 and v.graph_breaks == 0, v
        if v.minference:
            assert v.minference["rewritten"] == v.minference["sites"] == 2
    assert result.summary("minference-ro").cudagraph_skips == 0
    assert any("sparse" in k.lower() or "minference" in k for k in result.summary("minference-noguard").attention_kernels)


def test_smollm2_yarn_factor_covers_the_longest_prompt():
    assert assets.smollm2_yarn_factor(8192) == 1.0
    assert assets.smollm2_yarn_factor(8193) == 2.0
    assert assets.smollm2_yarn_factor(131072) == 16.0
    assert all(8192 * assets.smollm2_yarn_factor(n) >= n for n in (1, 5000, 40000, 1 << 20))


def test_a_local_model_directory_is_benchmarked_with_its_own_weights(tmp_path):
    """--model DIR: the HF model saved there (no tokenizer: random ids), all its layers rewritten; the results
    name the directory and its shape."""
    from minference_fx.tools.tiny import tiny_model

    saved = tiny_model("qwen2")
    saved.save_pretrained(tmp_path / "model")
    out = tmp_path / "prefill.json"
    result = bp.bench_prefill(LENGTHS[:2], variants=("eager", "minference"), isolate=False, reps=1,
                              minference_options=PLUMBING, out=out, model_name=str(tmp_path / "model"))
    data = json.loads(out.read_text())
    layers = saved.config.num_hidden_layers
    assert data["model"].startswith(str(tmp_path / "model")) and "Qwen2Config" in data["model"]
    assert data["layers"] == layers and data["config"]["num_attention_heads"] == saved.config.num_attention_heads
    assert data["prompt"] == "random token ids (no tokenizer)"
    mf = _variant(data, "minference")["minference"]
    assert mf["sites"] == mf["rewritten"] == layers
    cells = _cells(data)
    assert all(c["status"] == "ok" and c["finite"] for c in cells.values())
    for n in LENGTHS[:2]:  # the default budgets cover these lengths: the same greedy token as eager
        assert cells[(n, "minference")]["next_token"] == cells[(n, "eager")]["next_token"]
    _assert_speedup_is_the_cells_ratio(result, LENGTHS[0], "minference", "eager")


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model 'gpt2'.*smollm2"):
        bp.bench_prefill([96], model_name="gpt2", isolate=False)


def test_smollm2_prefill_runs_real_weights_on_prose():
    result = fetch_or_skip(bp.bench_prefill, [96], variants=("eager",), isolate=False, reps=1, guard_probe=False,
                           model_name="smollm2", command="test")
    cell = result.cell(96, "eager")
    assert cell.status == "ok" and cell.finite
    assert result.meta["layers"] == 30 and result.meta["model_name"] == "smollm2"
    assert "real weights" in result.meta["model"]
    from minference_fx.tools.assets import load_smollm2

    _, tokenizer = load_smollm2()
    ids = bp.text_prompt_ids(tokenizer, 96, seed=0, device="cpu")
    text = tokenizer.decode(ids[0])
    assert ids.shape == (1, 96)
    # real prose: mostly letters and spaces, unlike random token ids
    assert sum(ch.isalpha() or ch.isspace() for ch in text) > 0.9 * len(text)


def test_a_local_model_directory_with_a_tokenizer_gets_prose():
    """SmolLM2's converted directory, given as a path: its tokenizer makes the prompt, as for --model smollm2."""
    from minference_fx.tools.assets import smollm2_dir

    path = fetch_or_skip(smollm2_dir)
    result = bp.bench_prefill([96], variants=("eager",), isolate=False, reps=1, guard_probe=False,
                              model_name=str(path))
    assert result.meta["prompt"] == "Austen's novels through the model's tokenizer"
    assert result.meta["layers"] == 30 and result.cell(96, "eager").finite
    _, tokenizer = bp.build_local(str(path), "cpu", torch.float32)
    assert tokenizer is not None and bp.text_prompt_ids(tokenizer, 96, 0, "cpu").shape == (1, 96)


def test_launch_config_says_whose_config_a_length_runs(monkeypatch):
    from minference_fx.autotune import cache, dispatch

    q, k = torch.empty(1, 8, 1, 64), torch.empty(1, 2, 1, 64)
    at_128k = dispatch.tune_key("sparse_attention", q.device, q.dtype, 64, 4, 131072)
    monkeypatch.setattr(cache, "_tables", lambda path=None: [cache.Table({at_128k: cache.TuneEntry(64, 64, 4, 3)})])
    assert bp._launch_config(q, k, 131072) == "launch 64/64/4/3"
    assert bp._launch_config(q, k, 262144) == "launch 64/64/4/3 (tuned at 131072)"
    assert bp._launch_config(q, k[:, :1], 131072) == "launch 64/64/4/2 (untuned default)"  # group 8: no entry


def test_min_sparse_len_reaches_the_minference_variants_as_the_option():
    def options(*argv):
        return cli._minference_options(cli.build_parser().parse_args(["bench", "prefill", *argv]))

    assert options() is None  # the config's
    assert options("--min-sparse-len", "32768") == {"min_sparse_len": 32768}
    assert BackendOptions.from_user(options("--min-sparse-len", "-1")).min_sparse_len == -1  # the tuned crossover
    with pytest.raises(ValueError, match="min_sparse_len"):
        BackendOptions.from_user(options("--min-sparse-len", "-5"))


@pytest.mark.parametrize("argv, named", [
    (["kernels", "--budget-growth", "32768", "0.5"], "--budget-growth (read by bench prefill and breakdown)"),
    (["kernels", "--config", "c.json", "--reps", "5"], "--config (read by bench prefill and breakdown), --reps"),
    (["prefill", "--families", "scattered"], "--families (read by bench kernels)"),
    (["breakdown", "--budgets", "500", "2000"], "--budgets (read by bench kernels and prefill)"),
])
def test_bench_refuses_options_it_does_not_read(monkeypatch, argv, named):
    """An option the chosen benchmark would ignore stops the command before any GPU work, named with the benchmarks
    that read it (bench kernels once accepted --guard-escalation and timed its op column without it)."""
    from minference_fx import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bp, "bench_prefill", lambda *a, **k: pytest.fail("ran with an unread option"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", *argv])
    assert named in str(stop.value)


def test_bench_option_table_covers_every_bench_option():
    """Every option of `bench` is read by at least one benchmark in cli.BENCH_OPTIONS, so none escapes the check."""
    from minference_fx import cli

    options = set(vars(cli.build_parser().parse_args(["bench", "kernels"]))) - {"command", "what", "run"}
    assert options == set().union(*cli.BENCH_OPTIONS.values())


def test_bench_kernels_passes_the_escalation_to_its_op_column(monkeypatch):
    from minference_fx import cli
    from minference_fx.tools import bench

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_kernels", lambda lengths, **kwargs: seen.update(kwargs) or [])
    assert cli.main(["bench", "kernels", "--lengths", "512k", "--guard-escalation", "4000", "24384"]) == 0
    assert seen["escalation"] == (4000, 24384)
    assert cli.main(["bench", "kernels", "--lengths", "512k"]) == 0
    assert seen["escalation"] == ()
