"""Compiled tiny HF models vs eager dense: every attention found, rewritten, and exact at covering budgets."""
import pytest
import torch
import transformers

from minference_fx import ConfigMismatchError, inspect
from minference_fx.backend import recent_reports
from minference_fx.plan import Pattern
from minference_fx.tools import cache_kwargs
from tiny_models import (covering_config, rows_since, sliding_cache_chunks, small_budget_config, sparse_rows_since,
                         tiny_model, wrong_config)

CASES = [(f, a) for f in ("llama", "qwen2", "mistral") for a in ("sdpa", "eager")]


def _compile(model, config, inner="aot_eager", **extra):
    """Compiled with ``verify``: each graph's first call is also checked site by site against the traced model."""
    return torch.compile(model, backend="minference", options={"config": config, "inner": inner, "verify": True, **extra})


@pytest.mark.parametrize("family,attn", CASES)
def test_every_layer_found_and_rewritten(family, attn):
    model = tiny_model(family, attn)
    ids = torch.randint(0, 128, (1, 80))
    report = inspect(model, ids, use_cache=False)
    rows = report.rows
    assert [r.layer for r in rows] == [0, 1]
    assert all(r.decision == "sparse" for r in rows), report
    assert all(r.gqa == "repeat_kv" for r in rows)
    if family == "mistral":
        assert all(r.mask == "sliding_window(24)" for r in rows), report
    assert "minference.sparse_attention" in report.diff()


@pytest.mark.parametrize("family,attn", CASES)
@pytest.mark.parametrize("pattern", [Pattern.VERTICAL_SLASH, Pattern.BLOCK_SPARSE])
def test_covering_budgets_equal_dense(family, attn, pattern):
    model = tiny_model(family, attn)
    ids = torch.randint(0, 128, (1, 150))  # > 2 tiles, and past mistral's window
    before = list(recent_reports())
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        sparse = _compile(model, covering_config(model, pattern))(ids, use_cache=False).logits
    sparse_rows_since(before)  # covering budgets equal dense by design
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


MORE_CASES = [("qwen3", "sdpa"), ("gemma3", "eager"), ("phi3", "sdpa"), ("gpt2", "eager"), ("gpt2", "sdpa"),
              ("falcon", "eager"), ("gpt2_upcast", "eager"), ("gpt_neox_japanese", "eager")]


@pytest.mark.parametrize("family,attn", MORE_CASES)
def test_more_architectures_rewritten_and_exact_at_covering_budgets(family, attn):
    """Other HF families, both attention spellings among them: GPT-2 eager casts with ``.type()``, Falcon eager
    divides in place (``/=``), Gemma 3 alternates sliding-window layers, Qwen 3 normalises q and k; GPT-2 with
    ``reorder_and_upcast_attn`` and GPT-NeoX-Japanese compute the scores with ``baddbmm`` on [B·H, S, D] views."""
    model = tiny_model(family, attn)
    ids = torch.randint(0, 128, (1, 150))
    report = inspect(model, ids, use_cache=False)
    assert [r.layer for r in report.rows] == [0, 1] and all(r.decision == "sparse" for r in report.rows), report
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        sparse = _compile(model, covering_config(model))(ids, use_cache=False).logits
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_soft_capped_scores_are_found_left_dense_and_said_why():
    """Gemma 2 eager soft-caps its logits (÷ cap, tanh, × cap): not something the kernel computes."""
    model = tiny_model("gemma2", "eager")
    ids = torch.randint(0, 128, (1, 150))
    report = inspect(model, ids, use_cache=False)
    assert [r.layer for r in report.rows] == [0, 1], report
    assert all(r.decision == "dense" and "tanh" in r.reason for r in report.rows), report
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        compiled = _compile(model, covering_config(model))(ids, use_cache=False).logits
    torch.testing.assert_close(compiled, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_small_budgets_are_finite_and_differ(family):
    model = tiny_model(family)
    ids = torch.randint(0, 128, (1, 200))
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        sparse = _compile(model, small_budget_config(model))(ids, use_cache=False).logits
    assert torch.isfinite(sparse).all()
    assert (sparse - dense).abs().max() > 1e-3


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("gpt2", "sdpa"), ("gpt2", "eager"), ("gemma3", "sdpa"),
                                         ("gpt_neox_japanese", "eager")])
def test_batch_two_left_padding_matches_eager(family, attn):
    """GPT-2 views its attention_mask to [B, S] first; Gemma 3 pads sliding-window layers."""
    model = tiny_model(family, attn)
    ids = torch.randint(0, 128, (2, 100))
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :37] = 0
    with torch.no_grad():
        dense = model(ids, attention_mask=mask, use_cache=False).logits
        report = inspect(model, ids, attention_mask=mask, use_cache=False)
        sparse = _compile(model, covering_config(model))(ids, attention_mask=mask, use_cache=False).logits
    assert report.rows and all(r.mask.endswith("padding") and r.decision == "sparse" for r in report.rows), report
    valid = mask.bool()
    torch.testing.assert_close(sparse[valid], dense[valid], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_through_the_cache_equals_one_pass():
    """Prefill in chunks (each chunk's queries sit after the cached keys: a query offset) gives the one-pass
    logits at covering budgets, and the chunks after the first are rewritten too."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 230))
    compiled = _compile(model, covering_config(model))
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        chunks = [compiled(ids[:, a:b], **cache_kwargs(model, cache), use_cache=True).logits
                  for a, b in ((0, 120), (120, 170), (170, 230))]
    later = [r for rep in recent_reports()[-2:] for r in rep.rows]
    assert later and all(r.decision == "sparse" and "q_offset" in r.mask for r in later), later
    torch.testing.assert_close(torch.cat(chunks, dim=1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_cache_chunks_read_keys_from_the_window_start_with_padding(attn):
    """A sliding-window cache holds keys from ``max(past - window + 1, 0)`` on: the chunks after the first are
    rewritten with that key offset (once it is symbolic, the mask pass reads it rather than leaving them dense),
    and with a left-padded batch the padding mask is read from the window's start. Logits equal eager's chunk
    by chunk at covering budgets."""
    # window 24: the later chunks' keys start at 17 and 47, and row 1's padding (60) runs into both
    # dynamic=True lifts self.scaling to a graph input: SDPA takes it as scale=, eager attention multiplies by it
    model = tiny_model("mistral", attn)
    compiled = torch.compile(model, backend="minference", dynamic=True,
                             options={"config": covering_config(model), "inner": "aot_eager", "verify": True})
    want, got, reports, valid = sliding_cache_chunks(model, compiled, 100, 60, ((0, 40), (40, 70), (70, 100)))
    rows = [r for rep in reports for r in rep.rows]
    assert rows and all(r.decision == "sparse" for r in rows), rows
    assert any("k_offset" in r.mask for r in rows), rows
    for w, g, real in zip(want, got, valid):
        torch.testing.assert_close(g[real], w[real], rtol=1e-5, atol=1e-5)


def test_sliding_window_generate_keeps_later_prompts_sparse():
    """After a ``generate`` with decode steps, Dynamo makes the sliding cache's length dynamic and the window's
    first key ``max(len - window + 1, 0)`` symbolic: later prompts' prefills still run sparse (they ran dense
    before the mask pass read key offsets), and the tokens equal eager's."""
    model = tiny_model("mistral")
    prompts = [torch.randint(0, 128, (1, n)) for n in (40, 57, 91)]
    with torch.no_grad():
        eager_tokens = [model.generate(ids, max_new_tokens=4, do_sample=False) for ids in prompts]
    model.compile(backend="minference", options={"config": covering_config(model), "inner": "aot_eager", "verify": True})
    before = recent_reports()
    with torch.no_grad():
        for ids, want in zip(prompts, eager_tokens):
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
    rows = sparse_rows_since(before)
    assert any("k_offset" in r.mask for r in rows), rows


def test_autograd_on_leaves_attention_dense_says_why_and_backward_matches_eager():
    """A forward with grad enabled (a training step, or a prefill without no_grad) would make AOTAutograd
    trace a backward through the op, which has none: the sites stay dense with the reason, a warning says
    so, the gradients equal eager's; the same model under no_grad is rewritten."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 96))
    model(ids, labels=ids).loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = _compile(model, covering_config(model))
    with pytest.warns(UserWarning, match="inference_mode"):
        compiled(ids, labels=ids).loss.backward()
    rows = recent_reports()[-1].rows
    assert rows and all(r.decision == "dense" and "require grad" in r.reason for r in rows), rows
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        compiled(ids)
    assert all(r.decision == "sparse" for r in recent_reports()[-1].rows), recent_reports()[-1]


def test_generate_matches_eager_and_lengths_do_not_recompile():
    """``generate`` through the backend: compiled in place (``model.compile``), since the wrapper that
    ``torch.compile(model)`` returns hands ``.generate`` to the uncompiled model. Prefills are rewritten,
    the tokens equal eager's, and new prompt lengths compile nothing after the first dynamic graphs."""
    model = tiny_model("llama")
    prompts = [torch.randint(0, 128, (1, n)) for n in (40, 57, 91, 120)]
    with torch.no_grad():
        eager_tokens = [model.generate(ids, max_new_tokens=4, do_sample=False) for ids in prompts]
    model.compile(backend="minference", options={"config": covering_config(model), "inner": "aot_eager", "verify": True})
    counts = torch._dynamo.utils.counters
    counts.clear()
    reports_before = recent_reports()
    with torch.no_grad():
        for ids, want in zip(prompts, eager_tokens):
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
            if ids.shape[1] == 91:
                graphs = counts["stats"]["unique_graphs"]
    # static then dynamic graphs for prefill and decode; the fourth prompt length compiles nothing
    assert counts["stats"]["unique_graphs"] == graphs <= 4, dict(counts["stats"])
    rows = rows_since(reports_before)
    prefill = [r for r in rows if "q_offset" not in r.mask]
    decode = [r for r in rows if "q_offset" in r.mask]
    # transformers 5.24's decode steps pass SDPA no mask (one query row reads every key): read as causal there
    assert prefill and decode and all(r.decision == "sparse" for r in rows), rows


def test_three_prompt_lengths_compile_once_with_dynamic_shapes():
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="minference", dynamic=True,
                             options={"config": covering_config(model), "inner": "aot_eager", "verify": True})
    counts = torch._dynamo.utils.counters
    counts.clear()
    with torch.no_grad():
        for length in (70, 133, 301):
            ids = torch.randint(0, 128, (1, length))
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=1e-5, atol=1e-5)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    # dynamic=True may turn the attention scale symbolic; the sites must still be rewritten, not left dense
    report = recent_reports()[-1]
    assert report.rewritten == model.config.num_hidden_layers, report.table()


def test_prompt_lengths_compile_once_after_dynamic():
    model = tiny_model("llama")
    compiled = _compile(model, covering_config(model))
    counts = torch._dynamo.utils.counters
    with torch.no_grad():
        compiled(torch.randint(0, 128, (1, 64)), use_cache=False)
        compiled(torch.randint(0, 128, (1, 96)), use_cache=False)  # first change: marks the length dynamic
        counts.clear()
        for length in (130, 200, 333):
            compiled(torch.randint(0, 128, (1, length)), use_cache=False)
    assert counts["stats"].get("unique_graphs", 0) == 0, dict(counts["stats"])


def test_a_graph_break_in_the_decoder_stack_is_no_config_mismatch():
    """A graph break after layer 0 (here a hook; HF's sdpa with output_attentions=True makes one too) hands the
    backend graphs of a few layers that read the mask as an input: their sites stay dense with that reason, so
    no plan applies and the config's layer count is not held against them (it failed the compile); the logits
    are the model's."""
    model = tiny_model("llama")
    model.model.layers[0].register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())
    ids = torch.randint(0, 128, (1, 100))
    before = recent_reports()
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        sparse = _compile(model, covering_config(model))(ids, use_cache=False).logits
    rows = rows_since(before)
    assert rows and all(r.decision == "dense" and "mask" in r.reason for r in rows), rows
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_layers_compiled_one_by_one_refuse_a_config_of_several():
    """Each decoder layer compiled on its own numbers its site 0 (by call order) in one graph reused for every
    layer, so each would run layer 0's plan: the config is refused, as a whole model of one layer would be."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.compile(backend="minference", options={"config": covering_config(model), "inner": "aot_eager", "verify": True})
    with torch.no_grad(), pytest.raises(Exception, match="config is for 2 layers, the model has 1"):
        model(torch.randint(0, 128, (1, 100)), use_cache=False)


def test_wrong_config_names_the_mismatch():
    model = tiny_model("llama")
    with torch.no_grad(), pytest.raises(Exception) as err:
        _compile(model, wrong_config())(torch.randint(0, 128, (1, 40)), use_cache=False)
    chain = [err.value] + [e for e in (err.value.__cause__, err.value.__context__) if e is not None]
    assert any(isinstance(e, ConfigMismatchError) for e in chain) or "ConfigMismatchError" in str(err.value)
    # the layer count joins the heads' mismatch: alone, fewer layers than the config may be a graph break
    assert "32 layers, the model has 2" in str(err.value) and "GQA group 2, config has 4" in str(err.value)
    assert "head dim" not in str(err.value)  # head dim 16 matches


def test_inductor_end_to_end():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 128, (1, 70))
    before = list(recent_reports())
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        sparse = _compile(model, covering_config(model), inner="inductor")(ids, use_cache=False).logits
    sparse_rows_since(before)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_packed_sequences_from_position_ids():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 130))
    position_ids = torch.cat([torch.arange(70), torch.arange(60)])[None]
    with torch.no_grad():
        dense = model(ids, position_ids=position_ids, use_cache=False).logits
        report = inspect(model, ids, position_ids=position_ids, use_cache=False)
        sparse = _compile(model, covering_config(model))(ids, position_ids=position_ids, use_cache=False).logits
    # 5.17 compares key and query indices, 5.24 the position ids gathered at them (causal within a document)
    assert all(r.mask == "packed_documents" and r.decision == "sparse" for r in report.rows), report
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_torch_logs_show_the_report(tmp_path):
    import subprocess
    import sys

    code = (
        "import torch, torch.nn.functional as F\n"
        "f = lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
        "torch.compile(f, backend='minference', options={'inner': 'eager'})(torch.randn(1, 2, 8, 4))\n"
    )
    env = {**__import__("os").environ, "TORCH_LOGS": "+minference_fx"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1/1 attention sites rewritten" in done.stderr


def test_a_config_for_more_heads_is_refused_unless_a_head_offset_says_the_graph_holds_a_share():
    """A config for twice the heads once ran its first heads on this model without a word; with
    ``head_offset`` (one tensor-parallel rank's share of the heads) it is the rank's slice, as meant."""
    import dataclasses

    from minference_fx.config import default_config, model_identity_from_hf

    model = tiny_model("llama")
    ident = model_identity_from_hf(model.config)
    wider = default_config(dataclasses.replace(ident, num_q_heads=2 * ident.num_q_heads,
                                               num_kv_heads=2 * ident.num_kv_heads, fingerprint=""), min_sparse_len=0)
    ids = torch.randint(0, 128, (1, 64))
    with torch.no_grad(), pytest.raises(Exception, match=f"{ident.num_q_heads} query heads, config has {2 * ident.num_q_heads}"):
        _compile(model, wider)(ids, use_cache=False)
    torch._dynamo.reset()
    before = list(recent_reports())
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        share = _compile(model, wider, head_offset=ident.num_q_heads)(ids, use_cache=False).logits
    sparse_rows_since(before)
    assert torch.isfinite(share).all() and share.shape == dense.shape
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="head_offset 1 splits a GQA group of 2 query heads"):
        _compile(model, wider, head_offset=1)(ids, use_cache=False)  # its heads would span two kv heads' groups


def test_a_config_for_a_multimodal_models_language_model_is_taken_beside_its_vision_tower():
    """The vision tower, traced as a graph of its own with no site to rewrite, refused the config as made for
    another model (its own CLIP identity), and the whole compile failed."""
    from minference_fx.config import default_config, model_identity_from_hf

    text = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_id=127, vision_feature_layer=-1)).eval()
    config = default_config(model_identity_from_hf(model.config), min_sparse_len=0)
    ids = torch.randint(0, 100, (1, 40))
    ids[0, 1:5] = 127  # the image's 4 patches
    with torch.no_grad():
        rows = inspect(model, input_ids=ids, pixel_values=torch.randn(1, 3, 28, 28), options={"config": config}).rows
    assert sorted(r.decision for r in rows) == ["dense", "dense", "sparse", "sparse"], rows
