"""Which HF architectures the backend rewrites, and exactly (CPU; not a test: CI covers a subset).

usage: python scripts/survey_architectures.py [family ...]   (default: every family of minference_fx.tools.tiny)

For each tiny random-weight family (``minference_fx.tools.tiny``) and each attention spelling (``sdpa``,
``eager``): the report's decision per layer (with the mask it read, or why it stayed dense), then, when
every site is rewritten, the largest |logit difference| of the compiled model at budgets that cover
every key (sparse from length 0) against the model itself — exact up to float rounding when the
rewrite is right. The same again for a batch of two with the second prompt left-padded (valid
positions compared). Softmax calls that look like attention but that no site holds are named after "not read:".
"""
from __future__ import annotations

import logging
import sys
import warnings

import torch

from minference_fx import inspect
from minference_fx.config import default_config, model_identity_from_hf
from minference_fx.plan import Pattern
from minference_fx.tools.tiny import FAMILIES, tiny_model

LENGTH = 150  # > 2 index tiles and past the tiny sliding windows


def survey(name: str, attn: str, padded: bool) -> str:
    model = tiny_model(name, attn)
    batch = 2 if padded else 1
    ids = torch.randint(0, model.config.vocab_size, (batch, LENGTH))
    mask = torch.ones(batch, LENGTH, dtype=torch.long)
    mask[-1, :37] = 0 if padded else 1
    given = dict(attention_mask=mask) if padded else {}
    inspection = inspect(model, ids, use_cache=False, **given)
    rows = inspection.rows
    sites = "; ".join(f"L{r.layer} {r.decision} {r.mask}" + ("" if r.decision == "sparse" else f" ({r.reason})")
                      for r in rows)
    line = f"{name:<11} {attn:<6} {'padded' if padded else 'single':<7} {len(rows)} sites: {sites}"
    if inspection.unread:  # softmax calls that look like attention but no site holds
        line += " | not read: " + "; ".join(inspection.unread)
    if rows and all(r.decision == "sparse" for r in rows):
        config = default_config(model_identity_from_hf(model.config), pattern=Pattern.VERTICAL_SLASH,
                                budgets=(1 << 20, 1 << 20), min_sparse_len=0)
        compiled = torch.compile(model, backend="minference", options={"config": config, "inner": "aot_eager"})
        with torch.no_grad():
            got = compiled(ids, use_cache=False, **given).logits
            want = model(ids, use_cache=False, **given).logits
        torch._dynamo.reset()
        valid = mask.bool()
        line += f" | covering budgets: max |diff| {(got[valid] - want[valid]).abs().max().item():.1e}"
    return line


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("minference_fx").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    for name in sys.argv[1:] or list(FAMILIES):
        for attn in ("sdpa", "eager"):
            for padded in (False, True):
                torch.manual_seed(0)
                try:
                    print(survey(name, attn, padded), flush=True)
                except Exception as e:  # noqa: BLE001 - a survey reports and goes on
                    print(f"{name:<11} {attn:<6} ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
