"""The passes on hand-written attention: what is rewritten, what stays dense and why."""
import functools
import math
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from minference_fx import inspect
from minference_fx.backend import recent_reports
from minference_fx.passes.layers import ModuleTree


def _qkv(b=1, hq=4, hkv=2, s=96, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g))


class Causal(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class FloatMask(torch.nn.Module):
    def forward(self, q, k, v, bias):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=bias)


class Dropout(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1, enable_gqa=True)


class Bidirectional(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


class SeqMajor(torch.nn.Module):
    """[B, S, H, D] activations, permuted at the call."""

    def forward(self, q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)


def _only_row(report):
    (row,) = report.rows
    return row


def test_is_causal_enable_gqa_is_rewritten_and_exact():
    q, k, v = _qkv()
    row = _only_row(inspect(Causal(), q, k, v))
    assert (row.decision, row.mask, row.gqa) == ("sparse", "causal", "enable_gqa")
    opts = {"inner": "eager", "min_sparse_len": 0}
    out = torch.compile(Causal(), backend="minference", options=opts)(q, k, v)
    torch.testing.assert_close(out, Causal()(q, k, v), rtol=1e-5, atol=1e-5)


def test_rewritten_reason_names_the_length_dense_runs_below():
    q, k, v = _qkv()
    assert "tuned crossover" in _only_row(inspect(Causal(), q, k, v)).reason
    assert _only_row(inspect(Causal(), q, k, v, options={"min_sparse_len": 4096})).reason.endswith(
        "dense below 4096 query tokens")
    # 0 runs every prompt sparse: there is no length below it to name
    assert _only_row(inspect(Causal(), q, k, v, options={"min_sparse_len": 0})).reason == (
        "rewritten; sparse at every length")


class StrictCausal(torch.nn.Module):
    """A token does not see itself: row 0 has no key, which eager softmax turns into the mean of V."""

    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v):
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=0), self.fill)
        return att.softmax(-1) @ v


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e4])
def test_a_mask_that_leaves_rows_without_keys_stays_dense_and_matches_eager(fill):
    q, k, v = _qkv(hq=2, hkv=2)
    row = _only_row(inspect(StrictCausal(fill), q, k, v, options={"min_sparse_len": 0}))
    assert row.decision == "dense" and "leaves the first 1 query row(s) without a key" in row.reason
    got = torch.compile(StrictCausal(fill), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(got, StrictCausal(fill)(q, k, v))  # row 0 too: the mean of V, not zeros


class PositionsOf(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, q, k, v):
        pos = torch.arange(q.shape[-2], dtype=self.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pos[None, None, None, :] <= pos[None, None, :, None])


def test_positions_of_a_dtype_that_rounds_or_wraps_stay_dense():
    q, k, v = _qkv(hq=2, hkv=2, s=300)  # bf16 rounds past 256, uint8 wraps past 255
    assert _only_row(inspect(PositionsOf(torch.int32), q, k, v)).decision == "sparse"
    for dtype in (torch.bfloat16, torch.float16, torch.uint8, torch.int16):
        row = _only_row(inspect(PositionsOf(dtype), q, k, v))
        assert row.decision == "dense" and f"arange of dtype {dtype}" in row.reason, row


class PackedByIds(torch.nn.Module):
    def forward(self, q, k, v, doc):
        b, t = doc.shape
        bi = torch.arange(b)[:, None, None, None]
        qi, ki = torch.arange(t)[None, None, :, None], torch.arange(t)[None, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(ki <= qi) & (doc[bi, qi] == doc[bi, ki]))


def test_packed_sequence_ids_must_be_integers():
    q, k, v = _qkv(hq=2, hkv=2)
    doc = torch.cat([torch.zeros(1, 40), torch.ones(1, 56)], 1).long()
    assert _only_row(inspect(PackedByIds(), q, k, v, doc)).mask.startswith("packed")
    row = _only_row(inspect(PackedByIds(), q, k, v, doc.float()))  # the op would refuse them at run time
    assert row.decision == "dense" and "packed-sequence ids of dtype torch.float32" in row.reason


def test_a_mask_term_along_the_head_axis_that_changes_nothing_is_read_from_its_values():
    class HeadTerm(torch.nn.Module):
        def forward(self, q, k, v):
            t, h = q.shape[-2], q.shape[1]
            qi, ki = torch.arange(t)[None, None, :, None], torch.arange(t)[None, None, None, :]
            head = torch.arange(1)[None, :, None, None].expand(1, h, 1, 1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=(ki <= qi) & (head >= 0))

    # it raised KeyError: -3. The symbolic reader has no per-head term; the mask's values (``head >= 0`` holds for
    # every head) are the causal rule, so it is read from them
    q, k, v = _qkv(hq=2, hkv=2)
    row = _only_row(inspect(HeadTerm(), q, k, v))
    assert row.decision == "sparse" and row.mask == "causal", row.reason
    out = torch.compile(HeadTerm(), backend="minference", options={"inner": "eager", "min_sparse_len": 0, "verify": True})(q, k, v)
    torch.testing.assert_close(out, HeadTerm()(q, k, v), rtol=1e-5, atol=1e-5)


class ScaleOnTheLeft(torch.nn.Module):
    def forward(self, q, k, v):
        t = q.shape[-2]
        att = 0.5 * (q @ k.transpose(-2, -1))  # not 1/sqrt(16): a scale the test can tell apart
        return att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ v


def test_a_scale_on_the_left_of_the_scores_is_read():
    q, k, v = _qkv(hq=2, hkv=2)
    row = _only_row(inspect(ScaleOnTheLeft(), q, k, v))  # it was not found at all
    assert (row.decision, row.mask) == ("sparse", "causal")
    got = torch.compile(ScaleOnTheLeft(), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() > 1e-3

    class MaskFirst(torch.nn.Module):  # the mask on the left as well: the walk must still find the matmul
        def forward(self, q, k, v):
            t = q.shape[-2]
            return (torch.triu(torch.full((t, t), float("-inf")), 1) + 0.5 * (q @ k.transpose(-2, -1))).softmax(-1) @ v

    assert (_only_row(inspect(MaskFirst(), q, k, v)).mask) == "causal"
    got = torch.compile(MaskFirst(), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class TwoDimMask(torch.nn.Module):
    def __init__(self, build):
        super().__init__()
        self.build = build

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.build(q.shape[-2], k.shape[-2]))


TWO_DIM_MASKS = {  # [Q, KV] masks from 1-D positions, as hand-written models build them
    "causal": (lambda sq, sk: torch.arange(sq)[:, None] >= torch.arange(sk)[None, :], "causal"),
    "unsqueezed window": (lambda sq, sk: (torch.arange(sq).unsqueeze(-1) >= torch.arange(sk))
                          & (torch.arange(sq).unsqueeze(-1) < torch.arange(sk) + 20), "sliding_window(20)"),
    "bottom-right": (lambda sq, sk: torch.arange(sq)[:, None] + (sk - sq) >= torch.arange(sk)[None, :], "causal+q_offset=56"),
}


@pytest.mark.parametrize("name", TWO_DIM_MASKS)
def test_two_dim_masks_from_positions_are_read_and_exact(name):
    build, mask = TWO_DIM_MASKS[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 16, generator=g)
    k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(2))
    row = _only_row(inspect(TwoDimMask(build), q, k, v))  # "index (slice, None) of a range" kept these dense
    assert (row.decision, row.mask) == ("sparse", mask)
    got = torch.compile(TwoDimMask(build), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(got, TwoDimMask(build)(q, k, v), rtol=1e-5, atol=1e-5)


class BroadcastPadding(torch.nn.Module):
    """The [B, S] padding mask stood up as [B, 1, 1, S], as older hand-written models combine it."""

    def forward(self, q, k, v, attention_mask):
        t = q.shape[-2]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(t, t, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :])


def test_a_padding_mask_broadcast_by_none_indexing_is_read_and_exact():
    q, k, v = _qkv(b=2, hq=2, hkv=2)
    padding = torch.ones(2, 96, dtype=torch.long)
    padding[1, :30] = 0  # row 1 left-padded
    row = _only_row(inspect(BroadcastPadding(), q, k, v, padding))
    assert (row.decision, row.mask) == ("sparse", "causal+padding")
    got = torch.compile(BroadcastPadding(), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(
        q, k, v, padding)
    torch.testing.assert_close(got, BroadcastPadding()(q, k, v, padding), rtol=1e-5, atol=1e-5)


def test_a_query_index_unsqueezed_onto_the_head_axis_stays_dense():
    class QueryOnHeads(torch.nn.Module):
        def forward(self, q, k, v):
            t = q.shape[-2]
            on_heads = torch.arange(t)[:, None].unsqueeze(-1)  # [T, 1, 1]: the positions moved to the head axis
            return F.scaled_dot_product_attention(q, k, v, attn_mask=(on_heads >= torch.arange(t))[None])

    q, k, v = (torch.randn(1, 96, 96, 16) for _ in range(3))  # as many heads as positions: eager runs it
    row = _only_row(inspect(QueryOnHeads(), q, k, v))
    assert row.decision == "dense" and "moves the axis" in row.reason

    class ExpandedOntoHeads(torch.nn.Module):  # the sizes agree, so only the axis bookkeeping can tell
        def forward(self, q, k, v):
            t = q.shape[-2]
            on_heads = torch.arange(t).unsqueeze(-1).expand(t, t).unsqueeze(-1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=(on_heads >= torch.arange(t))[None])

    row = _only_row(inspect(ExpandedOntoHeads(), q, k, v))  # it was rewritten as causal: off by 3.97
    assert row.decision == "dense" and "moves the axis" in row.reason


def test_unsqueeze_with_its_dim_by_keyword_is_read():
    class ByKeyword(torch.nn.Module):
        def forward(self, q, k, v):
            pos = torch.arange(q.shape[-2])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=pos.unsqueeze(dim=-1) >= pos)

    q, k, v = _qkv(hq=2, hkv=2)
    assert (_only_row(inspect(ByKeyword(), q, k, v)).mask) == "causal"  # it raised IndexError


class BottomRightBias(torch.nn.Module):
    """Causal aligned bottom-right as a finite bias: with more queries than keys the first rows see no key."""

    def forward(self, q, k, v):
        sq, skv = q.shape[-2], k.shape[-2]
        keep = torch.arange(sq)[:, None] + (skv - sq) >= torch.arange(skv)
        scores = 0.25 * (q @ k.transpose(-1, -2))
        return (scores + torch.where(keep, 0.0, torch.finfo(q.dtype).min)).softmax(-1) @ v


def test_a_symbolic_query_offset_that_may_be_negative_stays_dense():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 64, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 2)  # KV - Q is then a symbol, negative here
    row = _only_row(inspect(BottomRightBias(), q, k, v))
    assert row.decision == "dense" and "may be negative" in row.reason
    opts = {"inner": "eager", "min_sparse_len": 0}
    torch.testing.assert_close(torch.compile(BottomRightBias(), backend="minference", options=opts)(q, k, v),
                               BottomRightBias()(q, k, v))  # the op had zeroed the 24 rows eager averages


def test_unknown_float_mask_stays_dense_with_reason():
    q, k, v = _qkv()
    bias = torch.randn(1, 1, 96, 96)
    row = _only_row(inspect(FloatMask(), q, k, v, bias))
    assert row.decision == "dense"
    assert row.mask == "unknown" and "tensor the graph does not compute (l_bias_" in row.reason


def test_dropout_stays_dense_with_reason():
    row = _only_row(inspect(Dropout(), *_qkv()))
    assert row.decision == "dense" and "dropout" in row.reason


def test_a_training_dropout_before_one_of_p_0_stays_dense():
    """Only the last dropout's p was read: 0.0 here, so the 0.5 before it was dropped by the rewrite."""
    class TwoDropouts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights_drop, self.no_drop = torch.nn.Dropout(0.5), torch.nn.Dropout(0.0)

        def forward(self, q, k, v):
            scores = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~_keep(q, k), float("-inf"))
            return self.no_drop(self.weights_drop(scores.softmax(-1))) @ v

    row = _only_row(inspect(TwoDropouts().train(), *_qkv(hq=2)))
    assert row.decision == "dense" and "dropout" in row.reason, row.reason


def test_bidirectional_stays_dense_with_reason():
    row = _only_row(inspect(Bidirectional(), *_qkv()))
    assert row.decision == "dense" and "bidirectional" in row.reason


class LiftedScale(torch.nn.Module):
    """Eager-style attention scaled by a float attribute, which ``dynamic=True`` lifts to a graph input; with
    ``extra``, times a constant or a second such attribute too."""

    def __init__(self, extra: str | None = None):
        super().__init__()
        self.scaling, self.softening, self.extra = 0.25, 0.5, extra

    def forward(self, q, k, v):
        if self.extra == "divided":  # the Annotated Transformer's spelling; dynamic=True makes the head dim symbolic
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.extra == "constant":
            scores = scores * 0.5
        elif self.extra == "attribute":
            scores = scores * self.softening
        n = q.shape[-2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("extra, reason", [(None, None), ("divided", None),
                                           ("constant", "a lifted scale beside constant factors"),
                                           ("attribute", "a second lifted scale")])
def test_a_lifted_scale_alone_is_rewritten_and_beside_other_factors_stays_dense_with_reason(extra, reason):
    """The op takes one scale: a lifted one alone goes to it (one that divides, as its reciprocal); times a constant
    or another lifted one, the site is left dense and says so (rather than dropping a factor). All equal eager."""
    q, k, v = _qkv(hkv=4)
    model = LiftedScale(extra)
    compiled = torch.compile(model, backend="minference", dynamic=True, options={"inner": "eager", "min_sparse_len": 0})
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), rtol=1e-5, atol=1e-5)
    (row,) = recent_reports()[-1].rows
    if reason is None:
        assert row.decision == "sparse", row.reason
    else:
        assert row.decision == "dense" and reason in row.reason


def test_sequence_major_layout_is_rewritten_and_exact():
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv())
    assert _only_row(inspect(SeqMajor(), q, k, v)).decision == "sparse"
    out = torch.compile(SeqMajor(), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, SeqMajor()(q, k, v), rtol=1e-5, atol=1e-5)


class ViewAfterTranspose(torch.nn.Module):
    """SDPA on [B, S, H, D] activations, its output viewed back to [B, S, H * D]: eager allows the ``view``
    because SDPA returns its output in the queries' memory order."""

    def forward(self, x):
        b, s, _ = x.shape
        q = x.view(b, s, 4, 16).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out.transpose(1, 2).view(b, s, 64)


@pytest.mark.parametrize("inner, dynamic", [("eager", False), ("aot_eager", True), ("inductor", False)])
def test_a_view_of_the_transposed_output_works_after_the_rewrite(inner, dynamic):
    """The op's output is contiguous [B, H, S, D]; the rewrite copies it into the traced memory order, so a
    ``.view`` eager allowed still works (it raised "view size is not compatible" before). With ``dynamic`` the
    strides are symbolic, and a second length must not recompile."""
    model = ViewAfterTranspose()
    compiled = torch.compile(model, backend="minference", dynamic=dynamic,
                             options={"inner": inner, "min_sparse_len": 0})
    from tiny_models import reports_since

    before = recent_reports()
    for length in (96, 80) if dynamic else (96,):
        x = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(length))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    reports = reports_since(before)
    assert len(reports) == 1, "one graph for every length"
    assert _only_row(reports[0]).decision == "sparse"


class EinsumAttention(torch.nn.Module):
    """Research-code attention: scores and value product as einsums (or kᵀ as ``mT`` / ``permute``), a triu
    mask filled with ``-finfo.max``; ``swap`` passes each einsum's operands the other way round."""

    def __init__(self, scores: str | None, values: str, key_t: str = "", swap: bool = False):
        super().__init__()
        self.scores, self.values, self.key_t, self.swap = scores, values, key_t, swap

    def forward(self, q, k, v):
        n = q.shape[1] if self.values.endswith("ihd") else q.shape[2]
        if self.key_t == "mT":
            s = q @ k.mT
        elif self.key_t == "permute":
            s = q @ k.permute(0, 1, 3, 2)
        elif self.key_t == "sequence-major":  # [B, S, H, D] q and k, the key turned straight to [B, H, D, S]
            s = q.transpose(1, 2) @ k.permute(0, 2, 3, 1)
        else:
            s = torch.einsum(self.scores, *((k, q) if self.swap else (q, k)))
        s = (s * 0.25).masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -torch.finfo(s.dtype).max)
        p = s.softmax(dim=-1)
        return torch.einsum(self.values, *((v, p) if self.swap else (p, v)))


@pytest.mark.parametrize("scores, values, key_t, swap", [
    ("bhid,bhjd->bhij", "bhij,bhjd->bhid", "", False),
    ("... i d, ... j d -> ... i j", "... i j, ... j d -> ... i d", "", False),
    ("bihd,bjhd->bhij", "bhij,bjhd->bihd", "", False),  # [B, S, H, D] operands and output
    ("bjhd,bihd->bhij", "bjhd,bhij->bihd", "", True),
    (None, "bhij,bhjd->bhid", "mT", False),
    (None, "bhij,bhjd->bhid", "permute", False),
    (None, "bhij,bjhd->bihd", "sequence-major", False),
])
def test_einsum_and_other_key_transposes_are_rewritten_and_exact(scores, values, key_t, swap):
    """Each spelling is found and rewritten as a causal site (it had no report row before); at 96 tokens the
    default budgets cover every key, so the output equals eager's."""
    model = EinsumAttention(scores, values, key_t, swap)
    q, k, v = _qkv(hkv=4)
    if values.endswith("ihd"):
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    row = _only_row(inspect(model, q, k, v))
    assert (row.decision, row.mask) == ("sparse", "causal"), row.reason
    out = torch.compile(model, backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, model(q, k, v), rtol=1e-5, atol=1e-5)


class CastScores(torch.nn.Module):
    def __init__(self, cast: str):
        super().__init__()
        self.cast = cast

    def forward(self, q, k, v):
        n = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + torch.nn.Transformer.generate_square_subsequent_mask(
            n, dtype=q.dtype)
        return F.softmax(getattr(scores, self.cast)(), dim=-1).type_as(q) @ v


@pytest.mark.parametrize("dtype, cast, decision", [(torch.float16, "float", "sparse"), (torch.float32, "float", "sparse"),
                                                   (torch.float32, "half", "dense")])
def test_a_cast_of_the_scores_before_the_softmax_is_read_when_it_widens(dtype, cast, decision):
    """``softmax(scores.float())`` is what the op's fp32 softmax does anyway, so the site is rewritten (it
    stayed dense, "scores pass through float"); a narrowing cast changes the weights, so it stays dense."""
    q, k, v = (t.to(dtype) for t in _qkv(hkv=4))
    model = CastScores(cast)
    row = _only_row(inspect(model, q, k, v))
    assert row.decision == decision, row.reason
    if decision == "dense":
        assert "half between q·kᵀ and the softmax" in row.reason
    out = torch.compile(model, backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, model(q, k, v), rtol=tol, atol=tol)


class UpcastScores(torch.nn.Module):
    """GPT-2's ``reorder_and_upcast_attn`` in 4-D: q and k cast to fp32 for the scores, the weights cast back to
    v's dtype; ``mixed`` upcasts only q (k is fp32 already), so the op could not read both in one dtype."""

    def __init__(self, mixed: bool = False):
        super().__init__()
        self.mixed = mixed

    def forward(self, q, k, v):
        n = q.shape[2]
        k = k.float() if self.mixed else k
        scores = q.float() @ k.float().transpose(-2, -1) * q.shape[-1] ** -0.5
        scores = scores + torch.nn.Transformer.generate_square_subsequent_mask(n)
        return F.softmax(scores, dim=-1).type(v.dtype) @ v


@pytest.mark.parametrize("dtype, mixed, decision", [(torch.float16, False, "sparse"), (torch.bfloat16, False, "sparse"),
                                                    (torch.float32, False, "sparse"), (torch.float16, True, "dense")])
def test_scores_of_q_and_k_upcast_to_fp32_are_read_in_their_own_dtype(dtype, mixed, decision):
    """Products of 16-bit floats are exact in the fp32 the op accumulates in, so it reads q and k below the
    casts and the weights' cast back to v's dtype narrows nothing (it stayed dense: "cast to float16 before the
    value product"); with k already fp32 the casts stay and so does the site."""
    q, k, v = (t.to(dtype) for t in _qkv(hkv=4))
    model = UpcastScores(mixed)
    row = _only_row(inspect(model, q, k, v))
    assert row.decision == decision, row.reason
    out = torch.compile(model, backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, model(q, k, v), rtol=tol, atol=tol)


def _value_product_d_before_i(q, k, v):
    p = torch.einsum("bhid,bhjd->bhij", q, k).masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1),
                                                         float("-inf")).softmax(-1)
    out = torch.einsum("bhij,bhjd->bhdi", p, v)
    return out.view(out.shape[0], -1, out.shape[-1])  # einsum's result is contiguous here


def _summed_dim_broadcast(q, k, v):
    return torch.einsum("bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhij", q[..., :1], k).softmax(-1), v)


@pytest.mark.parametrize("fn,rewritten", [(_value_product_d_before_i, 1), (_summed_dim_broadcast, 0)],
                         ids=["d-before-i-then-view", "size-1-summed-dim"])
def test_einsums_matmul_would_lay_out_or_broadcast_otherwise_run_as_eager(fn, rewritten):
    """A value product whose output puts d before i is copied into einsum's contiguous layout (a ``.view`` of it
    raised "view size is not compatible"); a summed dim of size 1 that einsum broadcasts is left to einsum
    (matmul refused it while the graph was compiled). At 96 tokens the default budgets keep every key, so the
    output alone would match eager whether or not the op ran: the report says which it was."""
    q, k, v = _qkv(hkv=4)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="minference", options={"inner": "aot_eager", "min_sparse_len": 0})
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=1e-5, atol=1e-5)
    assert recent_reports()[-1].rewritten == rewritten, recent_reports()[-1].rows


def _dynamo_graph(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*args)
    (gm,) = graphs
    return gm


@pytest.mark.parametrize("fn", [
    lambda q, k, v: torch.einsum("bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhij", q, k).softmax(dim=-2), v),
    lambda q, k, v: torch.einsum("bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhij", q, k).relu(), v),
    lambda q, k, v: torch.einsum("bhid,bhjd->bhij", q, k).sum(-1),
    lambda q, k, v: torch.einsum("bhid,bhjd->bhidj", q, k).softmax(-1),
], ids=["softmax-over-queries", "relu-weights", "no-softmax", "outer-product"])
def test_einsums_that_are_not_attention_are_left_as_they_are(fn):
    from minference_fx.passes import einsum

    gm = _dynamo_graph(fn, *_qkv(hkv=4))
    before = [n.target for n in gm.graph.nodes]
    assert einsum.run(gm) == 0
    assert [n.target for n in gm.graph.nodes] == before


def _repeat_kv(x, n_rep, keyword=False):
    """HF's repeat_kv: [B, Hkv, S, D] -> [B, Hkv * n_rep, S, D], each kv head next to its copies."""
    b, h, s, d = x.shape
    unsqueezed = x.unsqueeze(dim=2) if keyword else x[:, :, None, :, :]
    return unsqueezed.expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class RepeatedKV(torch.nn.Module):
    """SDPA over repeat_kv'd K/V, with a write into a source or a copy after the copies were made."""

    def __init__(self, write=None, keyword=False):
        super().__init__()
        self.write, self.keyword = write, keyword

    def forward(self, q, k, v):
        k, v = k.clone(), v.clone()
        k2, v2 = _repeat_kv(k, 2, self.keyword), _repeat_kv(v, 2, self.keyword)
        if self.write == "source":
            v.add_(1.0)  # eager reads the copy made before this
        elif self.write == "copy":
            v2[:, 0] = 0.0
        return F.scaled_dot_product_attention(q, k2, v2, is_causal=True)


@pytest.mark.parametrize("write, keyword, gqa", [(None, False, "repeat_kv"), (None, True, "repeat_kv"),
                                                 ("source", False, "-"), ("copy", False, "-")])
def test_repeat_kv_is_looked_through_unless_a_source_or_copy_is_written_after(write, keyword, gqa):
    """The op reads repeat_kv's sources where the attention is; a write into a source or a copy after the copy
    was made would reach only one side, so then the copies are read (it came out wrong by up to 2.4). The
    ``unsqueeze(dim=2)`` spelling is read too (it raised IndexError)."""
    q, k, v = _qkv(hkv=2)
    model = RepeatedKV(write, keyword)
    out = torch.compile(model, backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, model(q, k, v), rtol=1e-5, atol=1e-5)
    row = _only_row(recent_reports()[-1])
    assert (row.decision, row.gqa) == ("sparse", gqa), row


def test_repeat_kv_of_unequal_sources_runs_on_the_copies():
    """K and V repeated from different head counts (2 x 3, 3 x 2): the site reads the 6-head copies, sparse and
    exact (it was looked through to 2 and 3 heads, then left dense as "q/k/v shapes disagree", the report saying
    repeat_kv)."""
    q = torch.randn(1, 6, 40, 8)
    k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 3, 40, 8)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, _repeat_kv(k, 3), _repeat_kv(v, 2), is_causal=True)

    out = torch.compile(attend, backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, attend(q, k, v), rtol=1e-5, atol=1e-5)
    row = _only_row(recent_reports()[-1])
    assert (row.decision, row.gqa) == ("sparse", "-"), row


def test_output_attentions_keeps_eager_attention_dense():
    from tiny_models import tiny_model

    model = tiny_model("llama", "eager")
    report = inspect(model, torch.randint(0, 128, (1, 40)), use_cache=False, output_attentions=True)
    assert [r.layer for r in report.rows] == [0, 1], report
    assert all(r.decision == "dense" and "output_attentions" in r.reason for r in report.rows), report


class MaskedFill(torch.nn.Module):
    """nanoGPT's manual path: a tril buffer applied with masked_fill."""

    def __init__(self, n=96):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, q, k, v):
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class TorchMHA(torch.nn.Module):
    """Two pre-norm blocks of nn.MultiheadAttention with the is_causal hint, as PyTorch-native decoders write them."""

    def __init__(self, batch_first=True, need_weights=False):
        super().__init__()
        self.mha = torch.nn.ModuleList(torch.nn.MultiheadAttention(64, 4, batch_first=batch_first) for _ in range(2))
        self.norm = torch.nn.LayerNorm(64)
        self.batch_first, self.need_weights = batch_first, need_weights

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1 if self.batch_first else 0])
        for mha in self.mha:
            h = self.norm(x)
            x = x + mha(h, h, h, attn_mask=mask, is_causal=True, need_weights=self.need_weights)[0]
        return x


@pytest.mark.parametrize("model", [lambda: EinsumAttention("bhid,bhjd->bhij", "bhij,bhjd->bhid"), TorchMHA,
                                   lambda: _SiteCase(functools.partial(_bmm_chain, product="baddbmm")),
                                   lambda: _SiteCase(_in_place_scale_and_fill)],
                         ids=["einsum", "multihead-attention", "baddbmm", "in-place"])
def test_graphs_the_passes_write_nodes_into_compile_once_across_lengths(model):
    """The einsum, bmm, inplace and unfuse passes add nodes whose fake values are computed on symbolic sizes; without the
    Python dispatcher those sizes were guarded to their traced values, and every new length compiled again."""
    from tiny_models import reports_since

    model = model().eval()
    compiled = torch.compile(model, backend="minference", dynamic=True, options={"inner": "eager", "min_sparse_len": 0})
    before = recent_reports()
    for n in (80, 100, 150):  # not 64: Dynamo would size it as the model width and specialise it
        if isinstance(model, TorchMHA):
            inputs = (torch.randn(2, n, 64, generator=torch.Generator().manual_seed(n)),)
        else:
            inputs = _qkv(hkv=4, s=n, seed=n)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    reports = reports_since(before)
    assert len(reports) == 1, "one graph for every length"
    assert all(r.decision == "sparse" for r in reports[0].rows), reports[0].rows


def _causal_blocked(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)


def _bmm_mask_over_merged_heads(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(n).expand(b * h, n, n)
    return torch.bmm((torch.bmm(q3, k3.transpose(1, 2)) + mask).softmax(-1), v3).view(b, h, n, d)


def _bmm_of_heads_concatenated(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (torch.cat([t[:, i] for i in range(h)]) for t in (q, k, v))  # [H·B, S, D], no reshape to read
    scores = torch.bmm(q3, k3.transpose(1, 2)).masked_fill(_causal_blocked(n), float("-inf"))
    return torch.bmm(scores.softmax(-1), v3)


def _bmm_chain(q, k, v, product="bmm", key_t="transpose", merge="reshape"):
    """Attention on [B·H, S, D] views: ``bmm`` with a masked_fill, or ``baddbmm`` (beta 0, the scale as alpha)
    with an additive triangle and a softmax over dim 2; kᵀ taken after the merge or merged from a 4-D kᵀ."""
    b, h, n, d = q.shape

    def merged(t):
        return t.flatten(0, 1) if merge == "flatten" else t.reshape(b * h, t.shape[2], t.shape[3])

    q3, v3 = merged(q), merged(v)
    k_t = {"transpose": merged(k).transpose(1, 2), "mT": merged(k).mT, "before": merged(k.transpose(-2, -1))}[key_t]
    if product == "bmm":
        scores = (torch.bmm(q3, k_t) * d ** -0.5).masked_fill(_causal_blocked(n), float("-inf"))
        weights = scores.softmax(-1)
    else:
        scores = torch.baddbmm(torch.empty(b * h, n, n), q3, k_t, beta=0.0, alpha=d ** -0.5)
        weights = F.softmax(scores + torch.nn.Transformer.generate_square_subsequent_mask(n), dim=2)
    return torch.bmm(weights, v3).view(b, h, n, d).transpose(1, 2).reshape(b, n, h * d)


@pytest.mark.parametrize("product, key_t, merge", [("bmm", "transpose", "reshape"), ("bmm", "mT", "flatten"),
                                                   ("baddbmm", "before", "reshape"), ("baddbmm", "transpose", "flatten")])
def test_attention_on_merged_heads_is_read_as_4d_and_exact(product, key_t, merge):
    """The 3-D chain is written on the [B, H, S, D] tensors its operands are reshapes of (it stayed dense, "not
    read as attention"); at 96 tokens the default budgets cover every key, so the output equals eager's, and the
    [B, S, H·D] view of the flattened output still works."""
    fn = functools.partial(_bmm_chain, product=product, key_t=key_t, merge=merge)
    q, k, v = _qkv(b=2, hkv=4)
    report = inspect(_SiteCase(fn), q, k, v)
    assert report.unread == () and [(r.decision, r.mask) for r in report.rows] == [("sparse", "causal")], report
    torch._dynamo.reset()
    out = torch.compile(_SiteCase(fn), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), rtol=1e-5, atol=1e-5)


def _bmm_then_split(q, k, v, term="zeros"):
    """GPT-NeoX-Japanese's spelling: the scores from ``baddbmm`` (beta 1 on zeros, or beta 1 on a [Q, KV]
    triangle), viewed back as [B, H, Q, KV] for a 4-D mask, softmax and value product."""
    b, h, n, d = q.shape
    q3, k3 = q.reshape(b * h, n, d), k.reshape(b * h, n, d)
    base = torch.zeros(b * h, n, n) if term == "zeros" else torch.nn.Transformer.generate_square_subsequent_mask(n)
    scores = torch.baddbmm(base, q3, k3.transpose(1, 2), beta=1.0, alpha=d ** -0.5).view(b, h, n, -1)
    if term == "zeros":
        scores = scores.masked_fill(_causal_blocked(n), float("-inf"))
    return F.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("term", ["zeros", "triangle"])
def test_scores_from_merged_heads_viewed_back_as_4d_are_read_and_exact(term):
    fn = functools.partial(_bmm_then_split, term=term)
    q, k, v = _qkv(b=2, hkv=4)
    report = inspect(_SiteCase(fn), q, k, v)
    assert [(r.decision, r.mask) for r in report.rows] == [("sparse", "causal")], report
    torch._dynamo.reset()
    out = torch.compile(_SiteCase(fn), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), rtol=1e-5, atol=1e-5)


def _key_transposed_then_copied(q, k, v):
    scores = q @ k.transpose(-2, -1).contiguous()
    return scores.masked_fill(_causal_blocked(q.shape[-2]), float("-inf")).softmax(-1) @ v


def _scores_divide_a_number(q, k, v):
    scores = (1.0 / (q @ k.transpose(-2, -1))).masked_fill(_causal_blocked(q.shape[-2]), float("-inf"))
    return scores.softmax(-1) @ v


def _in_place_fill(q, k, v):
    scores = _scores(q, k)
    scores.masked_fill_(_causal_blocked(q.shape[-2]), float("-inf"))
    return scores.softmax(-1) @ v


def _in_place_scale_and_fill(q, k, v):
    scores = q @ k.transpose(-2, -1)
    scores *= q.shape[-1] ** -0.5
    return scores.mul_(1.0).masked_fill_(_causal_blocked(q.shape[-2]), float("-inf")).softmax(-1) @ v


def _in_place_fill_on_merged_heads(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
    scores = torch.bmm(q3, k3.transpose(1, 2))
    scores.masked_fill_(_causal_blocked(n), float("-inf"))
    return torch.bmm(scores.softmax(-1), v3).view(b, h, n, d)


@pytest.mark.parametrize("fn", [_in_place_fill, _in_place_scale_and_fill, _in_place_fill_on_merged_heads])
def test_scores_written_in_place_are_read_and_exact(fn):
    """``scores.masked_fill_(...)`` leaves a node nobody uses and a softmax reading ``scores``: written out of place
    (nothing else sees the scores), the chain is read (it was "not read as attention")."""
    q, k, v = _qkv(hkv=4)
    report = inspect(_SiteCase(fn), q, k, v)
    assert report.unread == () and [(r.decision, r.mask) for r in report.rows] == [("sparse", "causal")], report
    torch._dynamo.reset()
    out = torch.compile(_SiteCase(fn), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), rtol=1e-5, atol=1e-5)


def _in_place_fill_after_a_view(q, k, v):
    """A view of the scores taken before the write sees it (exp of the filled last key is 0 but in the last row):
    left as written."""
    scores = _scores(q, k)
    last_key = scores[..., -1:]
    scores.masked_fill_(_causal_blocked(q.shape[-2]), float("-inf"))
    return scores.softmax(-1) @ v + last_key.exp()


@pytest.mark.parametrize("fn, why", [
    (_bmm_mask_over_merged_heads, "attention written with bmm: add takes an operand over the merged [B·H] axis"),
    (_bmm_of_heads_concatenated, "on 3-D [B·H, S, D] operands that are not each a reshape of a 4-D"),
    (_key_transposed_then_copied, "the key side of the score product is contiguous(...)"),
    (_scores_divide_a_number, "through masked_fill, truediv"),
    (_in_place_fill_after_a_view, "have other users too (last_key, masked_fill_, softmax)"),
])
def test_attention_in_a_form_the_pass_does_not_read_is_named_in_the_report_and_runs_as_written(fn, why):
    q, k, v = _qkv(hkv=4)
    report = inspect(_SiteCase(fn), q, k, v)
    assert report.rows == [] and len(report.unread) == 1 and why in report.unread[0], report.unread
    assert "not read as attention, runs as written: " in str(report) and "test_passes.py:" in report.unread[0]
    torch._dynamo.reset()
    out = torch.compile(_SiteCase(fn), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v))


def _router(q, k, v):
    weights = F.linear(q, torch.ones(4, q.shape[-1])).softmax(-1)
    return weights.topk(2, dim=-1).values


def _mixture_over_attention_output(q, k, v):
    """Linear logits over a (dense, bidirectional) attention's output, their softmax weighting a table: a
    product above the linear and one below the softmax, but no attention scores."""
    h = (q @ k.transpose(-2, -1)).softmax(-1) @ v  # read as a site (bidirectional: dense)
    return F.linear(h, torch.ones(8, q.shape[-1])).softmax(-1) @ torch.ones(8, 3)


@pytest.mark.parametrize("kind", ["read", "router", "mixture"])
def test_a_softmax_read_as_attention_or_not_attention_at_all_gets_no_note(kind):
    q, k, v = _qkv(hkv=4)
    module = {"read": FillTriu(), "router": _SiteCase(_router), "mixture": _SiteCase(_mixture_over_attention_output)}[kind]
    report = inspect(module, q, k, v)
    assert report.unread == () and len(report.rows) == (kind != "router")


def test_a_mask_from_a_buffer_stays_dense_and_says_so():
    q, k, _ = _qkv(hkv=4)
    v = torch.randn_like(q)
    row = _only_row(inspect(MaskedFill(), q, k, v))
    assert row.decision == "dense" and "tensor the graph does not compute" in row.reason and "bias" in row.reason


def _scores(q, k):
    return (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5


class FillTriu(torch.nn.Module):
    def forward(self, q, k, v):
        blocked = torch.triu(torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool), diagonal=1)
        return F.softmax(_scores(q, k).masked_fill(blocked, float("-inf")), dim=-1) @ v


class FillTrilEqualsZero(torch.nn.Module):
    def forward(self, q, k, v):
        kept = torch.ones(q.shape[-2], q.shape[-2]).tril()
        return F.softmax(_scores(q, k).masked_fill(kept == 0, float("-inf")), dim=-1) @ v


class AddSquareSubsequent(torch.nn.Module):
    def forward(self, q, k, v):
        return F.softmax(_scores(q, k) + torch.nn.Transformer.generate_square_subsequent_mask(q.shape[-2]), dim=-1) @ v


class SdpaSquareSubsequent(torch.nn.Module):
    def forward(self, q, k, v):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class SdpaBoolTril(torch.nn.Module):
    def forward(self, q, k, v, upper=False):
        kept = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=kept.triu() if upper else kept.tril())


@pytest.mark.parametrize("module", [FillTriu, FillTrilEqualsZero, AddSquareSubsequent, SdpaSquareSubsequent, SdpaBoolTril])
def test_triangular_masks_built_in_forward_are_causal_and_exact(module):
    """[Q, KV] masks from triu/tril of ones or of -inf (generate_square_subsequent_mask), kept or blocked
    (masked_fill), added to the scores or given to SDPA."""
    q, k, _ = _qkv(hkv=4, s=150)
    v = torch.randn_like(q)
    row = _only_row(inspect(module(), q, k, v))
    assert (row.decision, row.mask) == ("sparse", "causal"), row
    out = torch.compile(module(), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, module()(q, k, v), rtol=1e-5, atol=1e-5)


def _positions(q, k, past, key_start):
    """Query and key positions as a cache builds them: queries from ``past``, keys from ``key_start``."""
    return (torch.arange(q.shape[2]) + past)[None, None, :, None], (torch.arange(k.shape[2]) + key_start)[None, None, None, :]


class PaddingAtKeyIndex(torch.nn.Module):
    """Causal at positions, a padding table longer than the keys read at key index j (not position)."""

    def forward(self, q, k, v, table, past, key_start):
        qi, kv = _positions(q, k, past, key_start)
        b, j = torch.arange(q.shape[0])[:, None, None, None], torch.arange(k.shape[2])[None, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv <= qi) & table[b, j], enable_gqa=True)


class DocumentsAtPositions(torch.nn.Module):
    """Packed-sequence ids read at query and key positions, keys starting past 0."""

    def forward(self, q, k, v, table, past, key_start):
        qi, kv = _positions(q, k, past, key_start)
        b = torch.arange(q.shape[0])[:, None, None, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv <= qi) & (table[b, qi] == table[b, kv]),
                                              enable_gqa=True)


class TwoWindows(torch.nn.Module):
    """Two window terms: only the narrower (10) binds."""

    def forward(self, q, k, v, table, past, key_start):
        qi, kv = _positions(q, k, past, key_start)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv <= qi) & (kv > qi - 24) & (kv > qi - 10),
                                              enable_gqa=True)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("module", [PaddingAtKeyIndex, DocumentsAtPositions, TwoWindows])
def test_keys_past_position_0_tables_read_from_their_start_and_windows_are_exact(module, dynamic):
    """Keys at positions ``key_start + j`` (a sliding cache's; symbolic with ``dynamic``): the op's query offset is
    the difference, the padding / document table is cut to the keys from where key 0 reads it, and of two window
    terms the narrower holds. Rows that keep a key equal eager's (they came out wrong, or failed, before)."""
    compiled = torch.compile(module(), backend="minference", dynamic=dynamic,
                             options={"inner": "aot_eager", "min_sparse_len": 0})
    for past, key_start, sq, skv in ((70, 47, 30, 53), (90, 67, 40, 63)):
        g = torch.Generator().manual_seed(sq)
        q, k, v = torch.randn(2, 4, sq, 16, generator=g), torch.randn(2, 2, skv, 16, generator=g), torch.randn(2, 2, skv, 16, generator=g)
        if module is DocumentsAtPositions:
            table = torch.cumsum(torch.rand(2, past + sq + 5, generator=g) < 0.08, 1)
        else:
            table = torch.ones(2, past + sq + 5, dtype=torch.bool)
            table[1, :20] = False
        want, got = module()(q, k, v, table, past, key_start), compiled(q, k, v, table, past, key_start)
        kept = ~torch.isnan(want) & (want != 0)
        torch.testing.assert_close(got[kept], want[kept], rtol=1e-5, atol=1e-5)
    report = recent_reports()[-1]
    assert report.rows and all(r.decision == "sparse" for r in report.rows), report.table()


def test_a_triangle_that_keeps_the_future_is_not_taken_for_causal():
    q, k, _ = _qkv(hkv=4)
    row = _only_row(inspect(SdpaBoolTril(), q, k, torch.randn_like(q), True))
    assert row.decision == "dense" and "no single causal" in row.reason


@pytest.mark.parametrize("batch_first", [True, False])
def test_causal_multihead_attention_is_opened_rewritten_and_exact(batch_first):
    from minference_fx.config import ModelIdentity, default_config
    from minference_fx.plan import Pattern

    model = TorchMHA(batch_first).eval()
    x = torch.randn(2, 150, 64) if batch_first else torch.randn(150, 2, 64)
    report = inspect(model, x)
    assert [(r.layer, r.form, r.mask, r.decision) for r in report.rows] == [
        (0, "sdpa", "causal", "sparse"), (1, "sdpa", "causal", "sparse")], report
    covering = default_config(ModelIdentity(num_layers=2, num_q_heads=4, num_kv_heads=4, head_dim=16),
                              pattern=Pattern.VERTICAL_SLASH, budgets=(1 << 20, 1 << 20), min_sparse_len=0)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend="minference", options={"config": covering, "inner": "aot_eager"})(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class CausalEncoder(torch.nn.Module):
    """A decoder-only stack built from nn.TransformerEncoder: under no_grad each layer is one fused call."""

    def __init__(self, norm_first, activation):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, norm_first=norm_first, activation=activation)
        self.stack = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.stack(x, mask=torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1]), is_causal=True)


@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_fused_encoder_layers_with_a_causal_mask_are_opened_rewritten_and_exact(norm_first, activation):
    from minference_fx.config import ModelIdentity, default_config
    from minference_fx.plan import Pattern

    model = CausalEncoder(norm_first, activation).eval()
    x = torch.randn(2, 150, 64)
    covering = default_config(ModelIdentity(num_layers=2, num_q_heads=4, num_kv_heads=4, head_dim=16),
                              pattern=Pattern.VERTICAL_SLASH, budgets=(1 << 20, 1 << 20), min_sparse_len=0)
    with torch.no_grad():
        report = inspect(model, x)
        want = model(x)
        got = torch.compile(model, backend="minference", options={"config": covering, "inner": "aot_eager"})(x)
    assert [(r.layer, r.mask, r.decision) for r in report.rows] == [(0, "causal", "sparse"), (1, "causal", "sparse")], report
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module,name,why", [
    (lambda: TorchMHA(need_weights=True), "MultiheadAttention", "need_weights=True"),
    (lambda: torch.nn.TransformerEncoderLayer(64, 4, batch_first=True), "TransformerEncoderLayer", "no attention mask"),
])
def test_torch_fused_attention_it_cannot_open_is_reported_not_missed(module, name, why):
    model = module().eval()
    x = torch.randn(1, 50, 64)
    with torch.no_grad():  # the encoder layer's fused fast path only runs without grad
        rows = inspect(model, x).rows
        out = torch.compile(model, backend="minference", options={"inner": "eager"})(x)
        want = model(x)
    assert rows and all(r.decision == "dense" and name in r.reason and why in r.reason and r.form == "fused"
                        for r in rows), rows
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_bad_options_are_named():
    with pytest.raises(Exception, match="inner='fast'"):
        torch.compile(Causal(), backend="minference", options={"inner": "fast"})(*_qkv())


@pytest.mark.parametrize("options, named", [
    ({"min_sparse_len": True}, "min_sparse_len=True"),  # True is an int to Python: it was taken as 1
    ({"guard_threshold": True}, "guard_threshold=True"),  # and as 1.0: every vertical-slash head dense
    ({"head_offset": True}, "head_offset=True"),
    ({"mode": "max_autotune"}, "mode='max_autotune'"),  # ignored under the eager inners before
    ({"inner": "eager", "mode": "reduce-overhead"}, "inner='eager' runs no Inductor"),  # was silently dropped
    ({"inner": "aot_eager", "inductor_config": {"max_autotune": True}}, "inductor_config={'max_autotune': True} is an"),
    ({"observer": "abc"}, "observer='abc'"),  # int('abc') raised in the rewrite
    ({"observer": True}, "observer=True"),  # taken as token 1
    ("semantic.json", "must be a dict"),
])
def test_options_of_the_wrong_kind_are_named(options, named):
    from minference_fx.options import BackendOptions

    with pytest.raises(ValueError, match=re.escape(named)):
        BackendOptions.from_user(options)


def test_the_cli_names_a_bad_config_or_length_in_one_line(tmp_path, capsys):
    from minference_fx.cli import main

    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", "--model", "llama", "--config", str(empty)])
    assert str(exit_.value.code).startswith("minference-fx: invalid semantic config") and "num_layers" in str(exit_.value.code)
    with pytest.raises(SystemExit):
        main(["bench", "kernels", "--lengths", "8x"])
    assert "'8x' is not a positive length" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # 0 ran the whole default demo, -5 failed on a config the user never gave
        main(["demo", "--length", "0"])
    assert "--length: expected a positive integer, got 0" in capsys.readouterr().err
    for argv in (["bench", "prefill", "--reps", "0"], ["bench", "prefill", "--layers", "-1"],
                 ["autotune", "--head-dim", "-1", "--gqa", "4"]):  # --reps 0 ran one rep, the others reached the GPU
        with pytest.raises(SystemExit):
            main(argv)
        assert "expected a positive integer" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["inspect", "--model", "llama", "--layers", "0"])
    assert "expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("root,path,components", [
    ("L['self']", "L['self'].model.layers[3].self_attn", ("model", "layers", "3", "self_attn")),
    ("L['args'][0]", "L['args'][0].model.layers.11.self_attn", ("model", "layers", "11", "self_attn")),
    ("L['self']", "L['self'].stages[0]['blocks'][1].attn", ("stages", "0", "blocks", "1", "attn")),
    ("L['self']", "L['self'].encoder", None),            # no module of the tree there
    ("L['self']", "L['other'].model.layers.3", None),    # another root
    ("L['self']", "L['self'].model.layers[3](x)", None),  # not a module path
])
def test_module_path_is_read_against_the_modules_the_inputs_come_from(root, path, components):
    tree = ModuleTree(root, frozenset({("model", "layers", "3"), ("model", "layers", "11"), ("model", "layers", "11", "self_attn"),
                                       ("stages", "0", "blocks", "1")}))
    assert tree.path_of(path) == components


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_hf_layers_are_read_from_their_module_paths(family, use_cache):
    """Each HF decoder layer's site gets its own index from its module path (not from call order), on every
    supported torch: Dynamo renders the root as L['self'] on one release and L['args'][0] on another."""
    from tiny_models import tiny_model
    from minference_fx import passes

    graphs = []
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(tiny_model(family).eval(), backend=lambda gm, _: graphs.append(gm) or gm.forward)(
            torch.randint(0, 128, (1, 16)), use_cache=use_cache)
    sites = passes.analyse(graphs[0])
    assert [(s.layer, s.layer_from) for s in sites] == [(0, "module path"), (1, "module path")]


def test_backend_resolves_by_name_in_a_fresh_process():
    code = textwrap.dedent("""
        import sys, torch
        import torch.nn.functional as F
        assert "minference_fx" not in sys.modules
        f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        q = torch.randn(1, 2, 16, 8)
        out = torch.compile(f, backend="minference", options={"inner": "eager"})(q, q, q)
        assert "minference_fx" in sys.modules
        torch.testing.assert_close(out, f(q, q, q))
        from minference_fx import recent_reports
        assert recent_reports()[-1].rewritten == 1
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_cli_inspect_builds_any_tiny_family_and_names_unknown_ones(capsys):
    from minference_fx import cli

    assert cli.main(["inspect", "--model", "gemma2", "--attn", "eager", "--seq", "80"]) == 1  # 1: it runs dense
    printed = capsys.readouterr().out
    assert "0/2 attention sites rewritten" in printed and "tanh" in printed
    assert cli.main(["inspect", "--model", "gpt2", "--attn", "eager", "--seq", "80", "--layers", "3"]) == 0
    assert "3/3 attention sites rewritten" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a built-in family .*gemma3.*gpt2"):
        cli.main(["inspect", "--model", "no-such-model"])


def test_hf_flex_attention_is_reported_not_missed():
    from tiny_models import tiny_model

    model = tiny_model("llama", "flex_attention").requires_grad_(False)  # FlexAttention on CPU: no backward
    with torch.no_grad():
        report = inspect(model, torch.randint(0, 128, (1, 128)), use_cache=False)
    assert [r.layer for r in report.rows] == [0, 1], report
    assert all(r.form == "flex" and r.decision == "dense" and "attn_implementation='sdpa'" in r.reason
               for r in report.rows), report


@pytest.mark.parametrize("windows", [(24, 10), (3, 100), (7, 5), (64, 63)])
def test_of_two_window_terms_the_narrower_holds(windows):
    """The terms of a mask are a set, read in no fixed order: whichever comes last, the narrower window holds."""
    from minference_fx.passes.masks import Causal, WindowStart, _mask_info

    causal = Causal((None, 0), (None, 0))
    terms = frozenset({causal, *(WindowStart((None, -w), (None, 0)) for w in windows)})
    assert _mask_info(terms).window == min(windows)


# Masks whose meaning lies in a dtype, an extent, a slice start or a later in-place write: each was once
# rewritten as plain causal (or padding) attention and came out wrong. Now each is read right or left dense.
def _keep(q, k):
    """[1, 1, Q, KV] bool causal mask from positions."""
    return torch.arange(k.shape[2])[None, None, None, :] <= torch.arange(q.shape[2])[None, None, :, None]


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _manual(q, k, v, mask=None, fill=None):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(fill, float("-inf")) if fill is not None else scores + mask
    return torch.softmax(scores, -1) @ v


def _prefix_visible(q, k, v, pad):
    mask = _keep(q, k).expand(q.shape[0], 1, -1, -1).clone()
    mask[..., :16] = True  # a prefix every query sees (prefix-LM), written after the mask was built
    return _sdpa(q, k, v, mask)


def _triu_in_place(q, k, v, pad):
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    mask.triu_(-7)  # a window of 8, written in place
    return _sdpa(q, k, v, mask)


def _add_with_alpha(q, k, v, pad):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    scores = torch.add(scores, torch.where(_keep(q, k), 0.0, -1e4), alpha=1e-6)  # the mask scaled to nothing
    return torch.softmax(scores, -1) @ v


def _floor_divided(q, k, v, pad):
    scores = torch.div(q @ k.transpose(-2, -1), 4.0, rounding_mode="floor")
    return torch.softmax(scores.masked_fill(~_keep(q, k), float("-inf")), -1) @ v


def _meta_llama(q, k, v, pad, cached=16, prefix_fill=0.0, diagonal=1):
    """Meta's reference Llama: a triu of -inf after ``cached`` keys every query sees (hstack with zeros),
    ``type_as``, and the softmax of the scores upcast with ``.float()``."""
    q = q[:, :, cached:]
    n = q.shape[2]
    scores = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])
    mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=diagonal)
    mask = torch.hstack([torch.full((n, cached), prefix_fill), mask]).type_as(q)
    return F.softmax((scores + mask).float(), dim=-1).type_as(q) @ v


class MetaLlamaAttention(torch.nn.Module):
    """Meta's reference Llama attention with its KV cache: keys up to ``start_pos + seqlen``, the mask
    ``hstack([zeros(seqlen, start_pos), triu(full(-inf), 1)])``, the softmax of ``scores.float()``."""

    def __init__(self, heads=4, head_dim=16, max_len=256):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq, self.wk, self.wv = (torch.nn.Linear(heads * head_dim, heads * head_dim, bias=False) for _ in range(3))
        self.register_buffer("cache_k", torch.zeros(1, max_len, heads, head_dim))
        self.register_buffer("cache_v", torch.zeros(1, max_len, heads, head_dim))

    def forward(self, x, start_pos: int):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        self.cache_k[:bsz, start_pos: start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos: start_pos + seqlen] = xv
        keys, values = self.cache_k[:bsz, : start_pos + seqlen], self.cache_v[:bsz, : start_pos + seqlen]
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=x.device), diagonal=1)
        mask = torch.hstack([torch.zeros((seqlen, start_pos), device=x.device), mask]).type_as(xq)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        return torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)


def test_meta_llama_chunks_through_its_cache_are_sparse_and_exact_in_one_graph():
    """``dynamic=True`` makes ``start_pos`` symbolic, so the mask's prefix has a symbolic width: read as the
    query offset (it stayed dense, "a prefix of symbolic width"). Every chunk equals eager's, one graph."""
    from tiny_models import reports_since

    torch.manual_seed(0)
    model, twin = MetaLlamaAttention().eval(), MetaLlamaAttention().eval()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="minference", dynamic=True, options={"inner": "eager", "min_sparse_len": 0})
    x = torch.randn(1, 200, 64)
    before = recent_reports()
    with torch.no_grad():
        for start, end in ((0, 90), (90, 150), (150, 200)):
            torch.testing.assert_close(compiled(x[:, start:end], start), twin(x[:, start:end], start), rtol=1e-5, atol=1e-5)
    (report,) = reports_since(before)
    (row,) = report.rows
    assert row.decision == "sparse" and row.mask.startswith("causal+q_offset=(l_start_pos_"), row


def _zeros_filled(q, k, v, pad, fill=float("-inf"), window=0):
    """A float mask of zeros with the keys causal (and a window) blocks filled."""
    kept = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if window:
        kept = kept & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1 - window)
    return _sdpa(q, k, v, torch.zeros(q.shape[2], k.shape[2]).masked_fill(~kept, fill))


def _written_through(view: str):
    """A bool causal mask whose key 0 is hidden afterwards through ``view`` of it."""
    def attend(q, k, v, pad):
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        if view == "mT":
            mask.mT[0] = False
        elif view == "split":
            mask.split(1, dim=1)[0].fill_(False)
        elif view == "diagonal":
            torch.diagonal(mask).fill_(False)
        else:  # five views deep
            mask.unsqueeze(0).unsqueeze(0).unsqueeze(0).unsqueeze(0).unsqueeze(0)[..., 0] = False
        return _sdpa(q, k, v, mask)
    return attend


def _written_through_type_as(q, k, v, pad):
    mask = torch.zeros(q.shape[2], k.shape[2]).masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1),
                                                          float("-inf"))
    mask.type_as(q)[:, :] = 0  # the same dtype: type_as returns the mask itself, and this clears it
    return _sdpa(q, k, v, mask)


READ_DENSE = {
    "float-ones-tril": (lambda q, k, v, pad: _sdpa(q, k, v, torch.ones(q.shape[2], k.shape[2]).tril()), "dtype torch.float32"),
    "bool-to-float": (lambda q, k, v, pad: _sdpa(q, k, v, _keep(q, k).to(q.dtype)), "dtype torch.float32"),
    "additive-to-bool": (lambda q, k, v, pad: _sdpa(q, k, v, torch.where(_keep(q, k), 0.0, float("-inf")).to(torch.bool)),
                         "conversion of Additive from torch.float32 to torch.bool"),
    "int8-positions": (lambda q, k, v, pad: _sdpa(q, k, v, torch.arange(k.shape[2]).to(torch.int8)[None, None, None, :]
                                                  <= torch.arange(q.shape[2]).to(torch.int8)[None, None, :, None]),
                       "torch.int8"),
    "one-query-row": (lambda q, k, v, pad: _sdpa(q, k, v, _keep(q, k)[..., :1, :]), "query axis"),
    "one-row-expanded": (lambda q, k, v, pad: _sdpa(q, k, v, _keep(q, k)[..., :1, :].expand(-1, -1, q.shape[2], -1)),
                         "broadcasts"),
    "one-batch-row-of-padding": (lambda q, k, v, pad: _sdpa(q, k, v, _causal_padding(q, k, pad)[:1]), "batch axis"),
    "prefix-set-in-place": (_prefix_visible, "modified in place"),
    "triu-in-place": (_triu_in_place, "modified in place"),
    "add-with-alpha": (_add_with_alpha, "pass through add"),
    "floor-division": (_floor_divided, "pass through div"),
    "key-prefix-with-a-bias": (functools.partial(_meta_llama, prefix_fill=1.0), "a key prefix that is not all kept"),
    "key-prefix-the-mask-hides": (functools.partial(_meta_llama, diagonal=-1), "a mask that hides some of it"),
    "zeros-filled-with-a-finite-value": (functools.partial(_zeros_filled, fill=-0.5), "masked_fill with -0.5"),
    "zeros-filled-under-one-broadcast-row": (
        lambda q, k, v, pad: _sdpa(q, k, v, torch.zeros(q.shape[2], k.shape[2]).masked_fill(
            torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)[:1], float("-inf"))), "broadcasts"),
    "hstack-along-the-queries": (  # hstack joins dim 1: the keys of a 2-D mask, the queries of this 3-D one
        lambda q, k, v, pad: _sdpa(q, k, v, torch.hstack([torch.zeros(1, 10, k.shape[2]), torch.triu(
            torch.full((1, q.shape[2] - 10, k.shape[2]), float("-inf")), 1)]).unsqueeze(1)), "other than the keys"),
    "written-through-type-as": (_written_through_type_as, "modified in place"),
    "written-through-mT": (_written_through("mT"), "modified in place"),
    "written-through-a-split": (_written_through("split"), "modified in place"),
    "written-through-torch-diagonal": (_written_through("diagonal"), "modified in place"),
    "written-five-views-deep": (_written_through("five views"), "modified in place"),
}


def _mask_case_inputs(s=200):
    """Two rows, 200 positions (past int8's range); a padding table 8 longer than the keys (read from its end),
    the second row left-padded by 40."""
    q, k, v = _qkv(b=2, hq=2, hkv=2, s=s)
    pad = torch.ones(2, s + 8, dtype=torch.bool)
    pad[1, :48] = False
    return q, k, v, pad


def _causal_padding(q, k, pad, table_of=lambda pad, n: pad[:, -n:]):
    """Causal, and padding read through ``table_of(pad, keys)`` at [b, kv]."""
    b = torch.arange(q.shape[0])[:, None, None, None]
    kv = torch.arange(k.shape[2])[None, None, None, :]
    return _keep(q, k) & table_of(pad, k.shape[2])[b, kv]


class _MaskCase(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend

    def forward(self, q, k, v, pad):
        return self.attend(q, k, v, pad)


def _compile_case(attend):
    torch._dynamo.reset()
    model = _MaskCase(attend)
    return model, torch.compile(model, backend="minference", options={"inner": "eager", "min_sparse_len": 0})


@pytest.mark.parametrize("case", list(READ_DENSE))
def test_masks_whose_meaning_the_pass_cannot_keep_stay_dense_and_say_why(case):
    attend, reason = READ_DENSE[case]
    inputs = _mask_case_inputs()
    model, compiled = _compile_case(attend)
    torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    (row,) = recent_reports()[-1].rows
    assert row.decision == "dense" and reason in row.reason, row.reason


def _padding_from(table_of):
    return lambda q, k, v, pad: _sdpa(q, k, v, _causal_padding(q, k, pad, table_of))


READ_SPARSE = {
    "queries-from-position-1": (lambda q, k, v, pad: _sdpa(q, k, v, torch.arange(k.shape[2])[None, None, None, :]
                                                           <= torch.arange(q.shape[2] + 1)[1:][None, None, :, None]),
                                "causal+q_offset=1"),
    "padding-table-longer-than-keys": (_padding_from(lambda pad, n: pad[:, -n:]), "causal+padding"),
    "padding-from-index-8": (_padding_from(lambda pad, n: pad[:, 8:]), "causal+padding"),
    "padding-as-its-complement": (_padding_from(lambda pad, n: ~(~pad[:, -n:])), "causal+padding"),
    "padding-compared-with-false": (_padding_from(lambda pad, n: (~pad[:, -n:]) == False), "causal+padding"),  # noqa: E712
    "padding-rows-swapped": (_padding_from(lambda pad, n: pad[[1, 0], -n:]), "causal+padding"),
    "meta-llama-after-16-cached-keys": (_meta_llama, "causal+q_offset=16"),
    "two-additive-triangles-summed": (  # causal plus keys 8 or more behind blocked: a window of 8
        lambda q, k, v, pad: _sdpa(q, k, v, torch.triu(torch.full((q.shape[2], k.shape[2]), float("-inf")), 1)
                                   + torch.tril(torch.full((q.shape[2], k.shape[2]), float("-inf")), -8)),
        "sliding_window(8)"),
    "meta-llama-from-an-empty-cache": (functools.partial(_meta_llama, cached=0), "causal"),
    "zeros-filled-with-minus-inf": (_zeros_filled, "causal"),
    # the symbolic reader has no term for these; their values at concrete sizes are the causal / window rule
    "every-other-position": (lambda q, k, v, pad: _sdpa(q, k, v, torch.arange(2 * k.shape[2])[::2][None, None, None, :]
                                                        <= torch.arange(2 * q.shape[2])[::2][None, None, :, None]), "causal"),
    "zeros-filled-under-a-window": (functools.partial(_zeros_filled, window=8), "sliding_window(8)"),
}


@pytest.mark.parametrize("case", list(READ_SPARSE))
def test_tables_and_positions_computed_before_the_mask_are_read_as_computed(case):
    """A padding table sliced, negated, compared or reordered before it is read is passed to the op as
    computed (it once went as the raw input), and positions sliced from 1 keep their start. Meta's reference
    Llama mask (zeros for cached keys hstacked before a triu of -inf) and zeros filled with -inf read causal."""
    attend, mask = READ_SPARSE[case]
    inputs = _mask_case_inputs()
    model, compiled = _compile_case(attend)
    want = model(*inputs)
    kept = want.abs().sum(-1) > 0  # rows that see a key (a padded row's first ones see none)
    torch.testing.assert_close(compiled(*inputs)[kept], want[kept], rtol=1e-5, atol=1e-5)
    (row,) = recent_reports()[-1].rows
    assert (row.decision, row.mask) == ("sparse", mask), row.reason


class MaskFirst(torch.nn.Module):
    """Eager attention written ``mask + scores``: the mask on the left of the add."""

    def forward(self, q, k, v):
        mask = torch.where(_keep(q, k), 0.0, float("-inf"))
        return torch.softmax(mask + q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1) @ v


# Sites whose output the op would not reproduce: each was rewritten (and came out wrong, or raised) before.
def _weights_through(dtype):
    def attend(q, k, v):
        weights = torch.softmax(_manual_scores(q, k), -1)
        return weights.to(dtype).to(q.dtype) @ v
    return attend


def _manual_scores(q, k):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return scores.masked_fill(~_keep(q, k), float("-inf"))


def _key_written_after_its_scores(q, k, v):
    k = k.clone()
    scores = _manual_scores(q, k)
    k.mul_(3.0)  # k updated in place once its scores were taken
    return torch.softmax(scores, -1) @ v + k.sum()


def _key_written_through_a_conversion(q, k, v):
    k = k.clone()
    scores = _manual_scores(q, k)
    k.float().mul_(3.0)  # .float() of an fp32 tensor is the tensor itself: k is written
    return torch.softmax(scores, -1) @ v + k.sum()


def _key_written_through_mT(q, k, v):
    k = k.clone()
    scores = _manual_scores(q, k)
    k.mT[..., 0] = 0.0  # a getattr view
    return torch.softmax(scores, -1) @ v + k.sum()


def _mask_wider_than_the_query(q, k, v):
    scores = q[:1, :1] @ k[:1, :1].transpose(-2, -1)  # [1, 1, S, S] scores
    mask = torch.where(_keep(q, k), 0.0, float("-inf")).expand(q.shape[0], q.shape[1], -1, -1)
    return torch.softmax(scores * 0.25 + mask, -1) @ v[:1, :1]  # [B, H, S, D] through the mask


ROUND_TRIPS_DENSE = {
    "weights-through-int32": (_weights_through(torch.int32), "cast to torch.int32"),
    "weights-through-bf16": (_weights_through(torch.bfloat16), "cast to torch.bfloat16"),
    "key-written-after-its-scores": (_key_written_after_its_scores, "written in place"),
    "key-written-through-a-conversion": (_key_written_through_a_conversion, "written in place"),
    "key-written-through-mT": (_key_written_through_mT, "written in place"),
    "softmax-in-fp16": (lambda q, k, v: F.softmax(_manual_scores(q, k), dim=-1, dtype=torch.float16).float() @ v,
                        "the softmax is computed in torch.float16"),
    # the dtype at its place, not by keyword, was not seen
    "softmax-in-bf16-positional": (lambda q, k, v: torch.softmax(_manual_scores(q, k), -1, torch.bfloat16).float() @ v,
                                   "the softmax is computed in torch.bfloat16"),
    "method-softmax-in-fp16-positional": (lambda q, k, v: _manual_scores(q, k).softmax(-1, torch.float16).float() @ v,
                                          "the softmax is computed in torch.float16"),
    "functional-softmax-in-fp16-positional": (lambda q, k, v: F.softmax(_manual_scores(q, k), -1, 3, torch.float16).float()
                                              @ v, "the softmax is computed in torch.float16"),
    "mask-wider-than-the-query": (_mask_wider_than_the_query, "differs from the query's"),
    "float64": (lambda q, k, v: F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True).float(),
                "float64"),
    "negative-scale": (lambda q, k, v: torch.softmax((q @ k.transpose(-2, -1) * -0.25).masked_fill(~_keep(q, k), float("-inf")),
                                                     -1) @ v, "not a finite number > 0"),
}


class _SiteCase(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend

    def forward(self, q, k, v):
        return self.attend(q, k, v)


@pytest.mark.parametrize("case", list(ROUND_TRIPS_DENSE))
def test_sites_the_op_would_not_reproduce_stay_dense_and_say_why(case):
    attend, reason = ROUND_TRIPS_DENSE[case]
    q, k, v = _qkv(b=2, hq=2, hkv=2, s=96)
    torch._dynamo.reset()
    model = _SiteCase(attend)
    compiled = torch.compile(model, backend="minference", options={"inner": "eager", "min_sparse_len": 0})
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), rtol=1e-5, atol=1e-5)
    (row,) = recent_reports()[-1].rows
    assert row.decision == "dense" and reason in row.reason, row.reason


class LiftedDropout(torch.nn.Module):
    """SDPA with ``dropout_p=self.p``, which ``dynamic=True`` lifts to a graph input."""

    def __init__(self):
        super().__init__()
        self.p = 0.1

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)


def test_a_lifted_dropout_probability_leaves_the_site_dense_instead_of_failing_the_compile():
    q, k, v = _qkv(hkv=4)
    torch._dynamo.reset()
    compiled = torch.compile(LiftedDropout().train(), backend="minference", dynamic=True, options={"inner": "eager"})
    with torch.no_grad():
        out = compiled(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    (row,) = recent_reports()[-1].rows
    assert row.decision == "dense" and "dropout" in row.reason, row.reason


class _Block(torch.nn.Module):
    def __init__(self, d=32, heads=2):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)


class Stages(torch.nn.Module):
    """Two stages of two blocks, ``stages[i].blocks[j]``: the last list index (j) is not the layer."""

    def __init__(self):
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([_Block(), _Block()])})
                                          for _ in range(2))

    def forward(self, x):
        for stage in self.stages:
            for block in stage["blocks"]:
                x = block(x)
        return x


@pytest.mark.parametrize("layers", [2, 4])
def test_a_config_is_refused_where_a_module_path_leaves_the_layer_ambiguous(layers):
    """``stages[i].blocks[j]`` once mapped four blocks onto config layers 0, 1, 0, 1: a 2-layer config ran, the
    right 4-layer one was refused. Now neither is applied by a guess; without a config the sites are rewritten."""
    from minference_fx.config import ModelIdentity, default_config

    x = torch.randn(1, 96, 32)
    config = default_config(ModelIdentity(num_layers=layers, num_q_heads=2, num_kv_heads=2, head_dim=16), min_sparse_len=0)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="several list indices"):
        torch.compile(Stages(), backend="minference", options={"config": config, "inner": "eager"})(x)
    torch._dynamo.reset()
    model = Stages()
    with torch.no_grad():
        out = torch.compile(model, backend="minference", options={"inner": "eager", "min_sparse_len": 0})(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    rows = recent_reports()[-1].rows
    assert len(rows) == 4 and all(r.decision == "sparse" for r in rows)


class WhereKeeps(torch.nn.Module):
    """Eager attention that keeps the causal scores with ``torch.where(keep, scores, -inf)``."""

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        return torch.softmax(torch.where(_keep(q, k), scores, float("-inf")), -1) @ v


@pytest.mark.parametrize("module", [MaskFirst, WhereKeeps])
def test_eager_attention_spelt_mask_first_or_with_where_is_found_causal_and_exact(module):
    """``mask + scores`` and ``where(keep, scores, -inf)`` had no report row (left dense unseen)."""
    q, k, v = _qkv(hkv=4)
    row = _only_row(inspect(module(), q, k, v))
    assert (row.decision, row.mask) == ("sparse", "causal"), row.reason
    out = torch.compile(module(), backend="minference", options={"inner": "eager", "min_sparse_len": 0})(q, k, v)
    torch.testing.assert_close(out, module()(q, k, v), rtol=1e-5, atol=1e-5)
