"""Every HF attention form the tests cover is rewritten, with and without a cache, on whichever torch /
transformers runs the suite: CI runs it on the oldest and the newest tested stack, so a form rewritten on one
and not the other fails here."""
import pytest
import torch

from minference_fx import inspect
from tiny_models import tiny_model

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3", "gpt2", "falcon", "gpt_neox_japanese", "olmo2",
            "starcoder2", "stablelm")
# what stays dense, and why (a reason the report must give); these have no SDPA attention in transformers
DENSE = {("gemma2", "eager"): "tanh"}
NO_SDPA = {"gpt_neox_japanese", "gemma2"}


FORMS = [(family, attn) for family in FAMILIES + ("gemma2",) for attn in ("sdpa", "eager")
         if not (attn == "sdpa" and family in NO_SDPA)]


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("family,attn", FORMS)
def test_form_is_rewritten_with_and_without_a_cache(family, attn, use_cache):
    model = tiny_model(family, attn)
    ids = torch.randint(0, 128, (1, 40))
    report = inspect(model, ids, use_cache=use_cache)
    assert [r.layer for r in report.rows] == [0, 1], report
    reason = DENSE.get((family, attn))
    for row in report.rows:
        if reason:
            assert row.decision == "dense" and reason in row.reason, report
        else:
            assert row.decision == "sparse", report
