"""Tiny random-weight HF models built from configs: no downloads."""
from minference_fx.config import HeadEntry, ModelIdentity, SemanticConfig, default_config, model_identity_from_hf
from minference_fx.plan import Pattern
from minference_fx.tools.tiny import tiny_model  # noqa: F401  (the tests import it from here)


def reports_since(before: list) -> list:
    """Backend reports published after ``before`` (a ``recent_reports()`` list). The history is bounded (64), so
    a slice by its old length comes back empty once it is full; ``before`` keeps its reports alive to compare."""
    from minference_fx.backend import recent_reports

    return [rep for rep in recent_reports() if not any(rep is old for old in before)]


def rows_since(before: list) -> list:
    """The site rows of the reports published after ``before`` (see :func:`reports_since`), in order."""
    return [row for rep in reports_since(before) for row in rep.rows]


def sparse_rows_since(before: list) -> list:
    """:func:`rows_since`, asserted non-empty and every site rewritten to the sparse op (an output that equals
    eager's by design says something only where the op ran)."""
    rows = rows_since(before)
    assert rows and all(r.decision == "sparse" for r in rows), rows
    return rows


def covering_config(model, pattern=Pattern.VERTICAL_SLASH) -> SemanticConfig:
    """Budgets that cover every key (and sparse from length 0): must equal dense attention."""
    budgets = {Pattern.VERTICAL_SLASH: (1 << 20, 1 << 20), Pattern.A_SHAPE: (0, 1 << 20), Pattern.BLOCK_SPARSE: (1 << 20, 0), Pattern.DENSE: (0, 0)}[pattern]
    return default_config(model_identity_from_hf(model.config), pattern=pattern, budgets=budgets, min_sparse_len=0)


def small_budget_config(model) -> SemanticConfig:
    """A-shape with a 1-token sink and 1-token window: far from dense."""
    return default_config(model_identity_from_hf(model.config), pattern=Pattern.A_SHAPE, budgets=(1, 1), min_sparse_len=0)


def wrong_config() -> SemanticConfig:
    return default_config(ModelIdentity(num_layers=32, num_q_heads=8, num_kv_heads=2, head_dim=16), min_sparse_len=0)


def sliding_cache_chunks(model, compiled, length: int, pad: int, bounds: tuple, device="cpu"):
    """A left-padded batch of two (row 1 padded by ``pad``) prefilled chunk by chunk (``bounds``: (start, end)
    pairs) through a fresh cache, by ``model`` and by ``compiled``: ``(eager logits, compiled logits, the reports
    compiled published, per chunk the [2, end - start] bool of real tokens)``."""
    import torch
    from transformers import DynamicCache
    from minference_fx.backend import recent_reports
    from minference_fx.tools import cache_kwargs

    ids = torch.randint(0, 128, (2, length), device=device)
    mask = torch.ones(2, length, dtype=torch.long, device=device)
    mask[1, :pad] = 0

    def chunks(fn):
        cache = DynamicCache(config=model.config)
        return [fn(ids[:, a:b], attention_mask=mask[:, :b], **cache_kwargs(model, cache), use_cache=True).logits
                for a, b in bounds]

    before = recent_reports()
    with torch.no_grad():
        want, got = chunks(model), chunks(compiled)
    return want, got, reports_since(before), [mask[:, a:b].bool() for a, b in bounds]


def per_head_config(model) -> SemanticConfig:
    """The heads of each layer with plans that differ (dense, or A-shape with a sink and a window of 1 or 65 keys),
    rotated from layer to layer, sparse from length 0. A prompt of at most 2 key tiles (128) reads every key in
    each head (row tile and tile 0 are always read), so it equals dense; a longer one reads different tiles in
    each head, so a plan read for the wrong heads changes the output."""
    ident = model_identity_from_hf(model.config)
    kinds = [HeadEntry(Pattern.DENSE, (0, 0), None), HeadEntry(Pattern.A_SHAPE, (1, 1), None),
             HeadEntry(Pattern.A_SHAPE, (65, 1), None), HeadEntry(Pattern.A_SHAPE, (1, 65), None)]
    config = default_config(ident, min_sparse_len=0)
    config.layers = [[kinds[(head + 3 * layer) % len(kinds)] for head in range(ident.num_q_heads)]
                     for layer in range(ident.num_layers)]
    return config
