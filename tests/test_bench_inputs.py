"""The synthetic Q/K/V (``autotune.workload.structured_qkv``) have the structure they claim.

The kernel benchmark and the autotuner measure the sparse path on these inputs, so a regression
here (far diagonals scoring like near ones, sinks gone, non-determinism) would silently change
every density and speedup they report. Small shapes, CPU, fp32.
"""
from __future__ import annotations

import pytest
import torch

from minference_fx.autotune import workload
from minference_fx.kernels import reference as ref
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools import bench

S = 8192
HQ, HKV, D = 4, 2, 64


@pytest.fixture(scope="module")
def qkv():
    return workload.structured_qkv(S, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32, device="cpu", seed=3)


def _last_rows_softmax(q, k, rows=64):
    """[Hq, rows, S] causal softmax of the last ``rows`` queries of every head."""
    sq = q.shape[2]
    scale = q.shape[-1] ** -0.5
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q[0, :, sq - rows:] @ kk[0].transpose(-1, -2) * scale
    pos = torch.arange(sq)
    allowed = pos[None] <= pos[sq - rows:, None]
    return ref._masked_softmax(scores, allowed.expand_as(scores))


def _slash(p):
    """[Hq, S] diagonal sums of the last rows' probabilities (the vertical-slash estimate's slash scores)."""
    H, rows, sq = p.shape
    pos = torch.arange(sq)
    delta = (pos[sq - rows:, None] - pos[None]).clamp(min=0)
    out = torch.zeros(H, sq, dtype=torch.float64)
    return out.scatter_add_(1, delta.reshape(1, -1).expand(H, -1), p.double().reshape(H, -1))


def test_shapes_dtype_finite(qkv):
    q, k, v = qkv
    assert q.shape == (1, HQ, S, D) and k.shape == (1, HKV, S, D) and v.shape == (1, HKV, S, D)
    for t in qkv:
        assert t.dtype == torch.float32 and torch.isfinite(t).all()
    q, k, v = workload.structured_qkv(300, num_q_heads=2, num_kv_heads=1, head_dim=32, device="cpu")
    assert q.dtype == torch.bfloat16 and torch.isfinite(q.float()).all() and torch.isfinite(k.float()).all()


@pytest.mark.parametrize("family", sorted(workload.FAMILIES))
def test_deterministic_with_seed(family):
    kw = dict(num_q_heads=2, num_kv_heads=1, head_dim=32, dtype=torch.float32, device="cpu")
    a = workload.family_qkv(family, 1000, seed=5, **kw)
    b = workload.family_qkv(family, 1000, seed=5, **kw)
    c = workload.family_qkv(family, 1000, seed=6, **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])


def test_generation_in_chunks_keeps_the_structure(monkeypatch):
    # the position code and the repeat code are functions of the position: smaller chunks give
    # other noise draws but the same noise-free parts, so the same attention structure
    kw = dict(num_q_heads=2, num_kv_heads=1, head_dim=32, dtype=torch.float32, device="cpu", seed=7)
    q1, k1, _ = workload.structured_qkv(2048, **kw)
    monkeypatch.setattr(workload, "_GEN_CHUNK", 500)
    q2, k2, _ = workload.structured_qkv(2048, **kw)
    s1 = (q1[0, 0, -1] @ k1[0, 0].T) / 32 ** 0.5
    s2 = (q2[0, 0, -1] @ k2[0, 0].T) / 32 ** 0.5
    assert torch.corrcoef(torch.stack([s1, s2]))[0, 1] > 0.9


def test_logits_are_realistic(qkv):
    # neither one-hot nor flat: the top key of a row keeps well under all of the mass, and the
    # rows are far from uniform over the thousands of keys they see
    p = _last_rows_softmax(qkv[0], qkv[1])
    top1 = p.max(-1).values.mean().item()
    entropy = -(p.clamp_min(1e-30).log() * p).sum(-1).mean().item()
    assert 0.02 < top1 < 0.7, top1
    assert 1.0 < entropy < 0.8 * torch.log(torch.tensor(float(S))).item(), entropy


def test_sinks_get_mass(qkv):
    p = _last_rows_softmax(qkv[0], qkv[1])
    sink_mass = p[..., :4].sum(-1).mean(-1)  # per head
    assert (sink_mass > 0.03).all(), sink_mass  # four keys out of thousands: 60 times their share and more


def test_top_slashes_are_near_the_main_diagonal():
    # The slash scores are a recency window: diagonals past three window widths score orders of
    # magnitude below near ones. (The previous inputs, RoPE's high frequencies on a vector shared
    # by all tokens, gave far diagonals a median of ~0.1 and a 99th percentile of 2-4 times the
    # near median, so the top slashes spread over every key tile.) Without hot columns, whose
    # 64-long runs of diagonals may land anywhere, the top 2000 past the forced 100 lie within two
    # window widths, but for the ~64 that the sinks make at the far end.
    s = 16384
    q, k, _ = workload.structured_qkv(s, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                                   device="cpu", seed=3, hot_columns=0)
    slash = _slash(_last_rows_softmax(q, k))
    width = int(workload._WINDOW_TOKENS)
    near = slash[:, 200:1000].median(-1).values
    far = slash[:, 3 * width:s - 128]
    assert (far.median(-1).values < 0.01 * near).all(), far.median(-1).values / near
    assert (far.quantile(0.99, dim=-1) < 0.3 * near).all(), far.quantile(0.99, dim=-1) / near
    top = slash[:, 100:].topk(2000, dim=-1).indices + 100
    assert ((top < 2 * width).float().mean(-1) > 0.9).all()


def test_one_head_per_group_has_a_strong_far_diagonal():
    # Along one diagonal, the first query head of the group scores ~9 logits above the diagonals
    # next to it (the repeat code); the other head does not. Mean logit per diagonal over the
    # last 64 rows, minus the median of its neighbourhood, so the smooth window cancels.
    q, k, _ = workload.structured_qkv(S, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32,
                                   device="cpu", seed=11, hot_columns=0)
    rows = 64
    logits = q[0, :, S - rows:] @ k[0, 0].T / 64 ** 0.5  # [2, rows, S]
    pos = torch.arange(S)
    delta = pos[S - rows:, None] - pos[None]
    ok = (delta >= 0).float()
    idx = delta.clamp(min=0).reshape(-1)
    sums = torch.zeros(2, S).index_add_(1, idx, (logits * ok).reshape(2, -1))
    mean = sums / torch.zeros(S).index_add_(0, idx, ok.reshape(-1)).clamp(min=1)
    local = mean[:, 64:S - 128].unfold(1, 65, 1).median(-1).values  # centred on 96 .. S-160
    spike = mean[:, 96:S - 160] - local
    assert spike[0].max() > 5.0 and spike[1].max() < 2.0, (spike.max(-1).values, spike.argmax(-1) + 96)


def test_vertical_slash_index_keeps_the_mass():
    # MInference's budgets scaled to this length keep most of the attention mass of every head,
    # and list well under all of the causal tiles
    s = 8192
    q, k, _ = workload.structured_qkv(s, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32,
                                   device="cpu", seed=13)
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 200, 1200),) * 2)
    index = ref.build_index(q, k, plan, scale=64 ** -0.5)
    physical, _ = bench._index_work(index, *plan.op_arguments(), s, s)
    assert physical / (2 * s * (s + 1) / 2) < 0.75  # 0.85 with the previous inputs
    rows = range(s - 64, s)  # the last query tile, whose rows made the estimate
    listed = ref.index_to_mask(index, rows, s)
    p = _last_rows_softmax(q, k)
    assert ((p * listed[0]).sum(-1).mean(-1) > 0.9).all()
