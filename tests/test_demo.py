"""``minference-fx demo``: the answer check, and the whole demo on CPU at a short prompt (real SmolLM2 + Austen)."""
import pytest

from minference_fx.tools import demo
from asset_helpers import fetch_or_skip


@pytest.mark.parametrize("answer", [" green teapot.", "green\nteapot", " green\ntea-\npot", "a green tea-  \n pot"])
def test_found_reads_through_line_breaks_and_hyphenation(answer):
    assert demo.found("green teapot", answer)


@pytest.mark.parametrize("answer", [" green tea", " blue teapot", "green tea-pot", " red\ntea-\npot"])
def test_found_refuses_other_answers(answer):
    assert not demo.found("green teapot", answer)


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_the_summary_gives_a_prefill_ratio_only_where_the_op_can_be_sparse(device):
    result = demo.DemoResult(device, "bfloat16", 4096, "uniform", "green teapot", " green teapot.", " green teapot.",
                             3.0, 1.5, 9.0, [demo.LayerRow(0, 0.25, 0.99)], {}, "")
    text = result.summary()
    assert "dense 3.00 s, sparse 1.50 s" in text
    assert ("(x2.00)" in text) == (device != "cpu") and ("not by sparsity" in text) == (device == "cpu")


def test_demo_on_cpu_at_a_short_prompt():
    lines = []
    result = fetch_or_skip(demo.run_demo, 512, device="cpu", progress=lines.append)
    assert "30/30 attention sites rewritten" in result.inspection
    assert len(result.layers) == 30 and all(0 < r.density <= 1 for r in result.layers)
    assert result.dense_pass, f"dense SmolLM2 should retrieve the needle at 512 tokens: {result.dense_answer!r}"
    assert result.sparse_pass == result.dense_pass, (result.sparse_answer, result.dense_answer)
    text = result.summary()
    assert "answer (sparse)" in text and "mean physical density" in text
    # the CPU's op is masked dense attention: no ratio that would read as a sparse speed-up
    assert " s (x" not in text and "not by sparsity" in text
