"""Masks built from position ids (transformers 5.24's spelling) and decode steps without a mask, on both stacks:
the pass reads them when they are causal, and leaves near-misses dense with a reason."""
import pytest
import torch
import torch.nn.functional as F

from minference_fx import inspect
from minference_fx.backend import recent_reports

OPTIONS = {"min_sparse_len": 0}


def _qkv(s=48, q_rows=None):
    q = torch.randn(1, 2, q_rows or s, 16, generator=torch.Generator().manual_seed(0))
    k, v = (torch.randn(1, 2, s, 16, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    return q, k, v


def _packed_positions(s=48, cut=20):
    return torch.cat([torch.arange(cut), torch.arange(s - cut)])[None]


class PositionMask(torch.nn.Module):
    """Keys at or before the query by position id, within the query's run of consecutive ids, as transformers
    5.24 builds it. ``variant`` spoils one part, so the mask stops being causal or stops proving it."""

    def __init__(self, variant=""):
        super().__init__()
        self.variant = variant

    def forward(self, q, k, v, position_ids):
        s = q.shape[-2]
        first = position_ids[:, :1] - 1
        if self.variant == "append":  # steps aligned one position late: runs split after the break
            steps = torch.diff(position_ids, append=position_ids[:, -1:] + 1, dim=-1)
        else:
            steps = torch.diff(position_ids, prepend=first, dim=-1)
        runs = (steps != 1).cumsum(-1)
        if self.variant == "other runs":  # runs of a different table
            runs = (torch.diff(position_ids.flip(-1), prepend=first, dim=-1) != 1).cumsum(-1)
        positions = position_ids.expand(q.shape[0], -1)
        b = torch.arange(q.shape[0])[:, None, None, None]
        qi = torch.arange(s)[None, None, :, None]
        ki = torch.arange(s)[None, None, None, :]
        keep = torch.ones((), dtype=torch.bool) & (positions[b, ki] <= positions[b, qi])
        if self.variant != "no runs":
            keep = keep & (runs[b, qi] == runs[b, ki])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(q.shape[0], 1, s, s))


@pytest.mark.parametrize("position_ids", [_packed_positions(), torch.arange(48)[None]], ids=["packed", "one document"])
def test_position_ids_compared_within_their_runs_are_packed_documents(position_ids):
    model = PositionMask()
    q, k, v = _qkv()
    torch._dynamo.reset()
    out = torch.compile(model, backend="minference", options={**OPTIONS, "inner": "eager", "verify": True})(
        q, k, v, position_ids)
    (row,) = recent_reports()[-1].rows
    assert row.decision == "sparse" and row.mask == "packed_documents", row
    torch.testing.assert_close(out, model(q, k, v, position_ids), rtol=1e-5, atol=1e-5)


def test_packed_documents_read_from_position_ids_keep_each_document_apart():
    """The second document's first query reads only itself: the rewritten op gets the runs as document ids."""
    model = PositionMask()
    q, k, v = _qkv()
    torch._dynamo.reset()
    out = torch.compile(model, backend="minference", options={**OPTIONS, "inner": "eager"})(q, k, v, _packed_positions())
    # eager attention keeps the documents apart too: the check is the op's only where the site was rewritten
    (row,) = recent_reports()[-1].rows
    assert row.decision == "sparse" and row.mask == "packed_documents", row
    torch.testing.assert_close(out[0, :, 20], v[0, :, 20], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["no runs", "append", "other runs"])
def test_position_comparisons_that_do_not_prove_causal_stay_dense(variant):
    """Without the runs of the same ids at the same positions, pos[kv] <= pos[q] is not causal (a second document
    would read the first's keys); the site stays dense and says why."""
    q, k, v = _qkv()
    (row,) = inspect(PositionMask(variant), q, k, v, _packed_positions(), options=OPTIONS).rows
    assert row.decision == "dense" and row.reason, row


class NoMask(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_one_query_row_without_a_mask_is_a_decode_step():
    q, k, v = _qkv(q_rows=1)
    torch._dynamo.reset()
    out = torch.compile(NoMask(), backend="minference", options={**OPTIONS, "inner": "eager", "verify": True})(q, k, v)
    (row,) = recent_reports()[-1].rows
    assert row.decision == "sparse" and "q_offset=last key" in row.mask, row
    torch.testing.assert_close(out, NoMask()(q, k, v), rtol=1e-5, atol=1e-5)


def test_a_decode_step_over_a_growing_cache_reads_every_key():
    """The key length is symbolic (dynamic): the query offset follows it, so every key stays visible."""
    torch._dynamo.reset()
    compiled = torch.compile(NoMask(), backend="minference", dynamic=True, options={**OPTIONS, "inner": "eager"})
    for length in (30, 47, 64):
        q, k, v = _qkv(length, q_rows=1)
        torch.testing.assert_close(compiled(q, k, v), NoMask()(q, k, v), rtol=1e-5, atol=1e-5)
    assert recent_reports()[-1].rows[0].decision == "sparse"


def test_several_query_rows_without_a_mask_stay_bidirectional_and_dense():
    (row,) = inspect(NoMask(), *_qkv(), options=OPTIONS).rows
    assert row.decision == "dense" and "bidirectional" in row.reason
