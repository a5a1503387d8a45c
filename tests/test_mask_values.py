"""Masks decided by what they compute: the mask subgraph run on small sizes (``passes.mask_values``)."""
import pytest
import torch
import torch.nn.functional as F

from minference_fx import inspect
from minference_fx.backend import recent_reports
from minference_fx.passes import masks
from minference_fx.passes.site import MaskInfo, MaskKind


def _qkv(s=40):
    return [torch.randn(1, 2, s, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]


class DifferenceMask(torch.nn.Module):
    """Causal (and optionally windowed) by the difference of positions: a spelling the symbolic reader has no
    term for (it subtracts one range from another)."""

    def __init__(self, window=0, shift=0):
        super().__init__()
        self.window, self.shift = window, shift

    def forward(self, q, k, v):
        s = q.shape[-2]
        gap = torch.arange(s, device=q.device)[:, None] - torch.arange(s, device=q.device)[None, :] + self.shift
        keep = gap >= 0
        if self.window:
            keep = keep & (gap < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("window", [0, 24])
def test_a_causal_mask_spelt_otherwise_is_read_from_its_values(window):
    model = DifferenceMask(window)
    q, k, v = _qkv()
    torch._dynamo.reset()
    out = torch.compile(model, backend="minference", dynamic=False,
                        options={"inner": "eager", "min_sparse_len": 0, "verify": True})(q, k, v)
    (row,) = recent_reports()[-1].rows
    assert row.decision == "sparse", row.reason
    assert row.mask == (f"sliding_window({window})" if window else "causal")
    torch.testing.assert_close(out, model(q, k, v), rtol=1e-5, atol=1e-5)


class FloatWindow(torch.nn.Module):
    def forward(self, q, k, v):
        s = q.shape[-2]
        gap = torch.arange(s)[:, None] - torch.arange(s)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < 24.0))


class ArgumentWindow(torch.nn.Module):
    def forward(self, q, k, v, window):
        s = q.shape[-2]
        gap = torch.arange(s)[:, None] - torch.arange(s)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < window))


class ComputedWindow(torch.nn.Module):
    def forward(self, q, k, v):
        s = q.shape[-2]
        gap = torch.arange(s)[:, None] - torch.arange(s)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < torch.tensor(2) ** 5))


@pytest.mark.parametrize("model, window", [(DifferenceMask(), None), (DifferenceMask(24), None), (FloatWindow(), None),
                                           (ArgumentWindow(), 12), (ComputedWindow(), None)],
                         ids=["causal", "window-24", "float-bound", "argument-bound", "computed-bound"])
def test_a_mask_read_only_from_its_values_stays_dense_where_the_length_varies(model, window):
    """Values at a few small sizes were read as causal where the window was wider than every size tried (a float
    bound, an argument, a constant computed in the graph); the op then attended past the window."""
    q, k, v = _qkv(64)
    extra = () if window is None else (window,)
    torch._dynamo.reset()
    out = torch.compile(model, backend="minference", dynamic=True,
                        options={"inner": "eager", "min_sparse_len": 0})(q, k, v, *extra)
    (row,) = recent_reports()[-1].rows
    assert row.decision == "dense" and "not read from its values" in row.reason, row.reason
    torch.testing.assert_close(out, model(q, k, v, *extra), rtol=1e-5, atol=1e-5)


def test_a_shifted_mask_is_not_taken_for_causal():
    """Query i reads keys up to i + 1: no plain causal rule; left dense."""
    (row,) = inspect(DifferenceMask(shift=1), *_qkv(), options={"min_sparse_len": 0}).rows
    assert row.decision == "dense"


def test_a_reading_the_values_contradict_is_refused(monkeypatch):
    """A reader bug (a window the mask does not have) is caught by the mask's values, and the site stays dense."""
    real = masks.analyse
    monkeypatch.setattr(masks, "analyse", lambda site, writes=None: MaskInfo(MaskKind.SLIDING_WINDOW, window=3)
                        if real(site, writes).kind == MaskKind.CAUSAL else real(site, writes))

    class Tril(torch.nn.Module):
        def forward(self, q, k, v):
            s = q.shape[-2]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool).tril())

    (row,) = inspect(Tril(), *_qkv(), options={"min_sparse_len": 0}).rows
    assert row.decision == "dense" and "not the sliding_window(3) rule" in row.reason, row.reason


def test_a_mask_written_in_place_later_is_not_read_from_its_construction():
    class WrittenAfter(torch.nn.Module):
        def forward(self, q, k, v):
            s = q.shape[-2]
            keep = torch.arange(s)[:, None] - torch.arange(s)[None, :] >= 0
            keep[5, 0] = False
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    (row,) = inspect(WrittenAfter(), *_qkv(), options={"min_sparse_len": 0}).rows
    assert row.decision == "dense"
