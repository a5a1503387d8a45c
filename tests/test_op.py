"""The op boundary: fake shapes, dense dispatch below the crossover, errors that name the problem."""
import pytest
import torch
import torch.nn.functional as F

import minference_fx.kernels.reference as reference
from minference_fx.op import dense_attention

OP = torch.ops.minference.sparse_attention.default
VS = ([2, 2, 2, 2], [1000] * 4, [6096] * 4)


def _qkv(sq=80, skv=80, b=1):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 4, sq, 16, generator=g), torch.randn(b, 2, skv, 16, generator=g), torch.randn(b, 2, skv, 16, generator=g)


def test_below_crossover_runs_dense_sdpa_not_the_reference(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the sparse path ran below min_sparse_len")

    monkeypatch.setattr(reference, "sparse_attention_reference", boom)
    q, k, v = _qkv()
    out = OP(q, k, v, None, None, 0.25, 0, 0, *VS, 8192)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True))


def test_decode_step_sees_every_cached_key():
    q, k, v = _qkv(sq=1, skv=50)
    out = OP(q, k, v, None, None, 0.25, 49, 0, *VS, 8192)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True))


def test_dense_path_equals_reference_with_padding_window_and_offset():
    q, k, v = _qkv(sq=40, skv=100, b=2)
    key_mask = torch.ones(2, 100, dtype=torch.bool)
    key_mask[1, :70] = False  # left padding that hides every key of some rows
    got = dense_attention(q, k, v, key_mask, None, 0.25, 60, 17)
    want = reference.dense_attention_reference(q, k, v, scale=0.25, key_mask=key_mask, q_offset=60, window=17)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fake_gives_contiguous_shape_of_q():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 80, 4, 16).transpose(1, 2)
        k = torch.empty(1, 2, 80, 16)
        out = OP(q, k, k, None, None, 0.25, 0, 0, *VS, 0)
    assert out.shape == (1, 4, 80, 16) and out.is_contiguous()


def test_bad_inputs_are_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head plan has 3 entries, q has 4 heads"):
        OP(q, k, v, None, None, 0.25, 0, 0, [2, 2, 2], [1] * 3, [1] * 3, 0)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of kv heads \(3\)"):
        OP(q, torch.randn(1, 3, 80, 16), torch.randn(1, 3, 80, 16), None, None, 0.25, 0, 0, *VS, 0)
    with pytest.raises(ValueError, match="key_mask must be a bool"):
        OP(q, k, v, torch.ones(1, 80), None, 0.25, 0, 0, *VS, 0)


def test_opcheck():
    q, k, v = _qkv(sq=70, skv=70)
    torch.library.opcheck(OP, (q, k, v, None, None, 0.25, 0, 0, *VS, 0), test_utils=("test_schema", "test_faketensor"))
