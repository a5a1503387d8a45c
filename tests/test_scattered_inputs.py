"""The second input family (``autotune.workload.scattered_qkv``) and ``bench kernels`` over both families.

The family exists so that the benchmark meets slashes that scatter: past a narrow band, the diagonals the
index keeps should be isolated ones spread over the length, costing more key tiles per kept key than on
``structured_qkv``. Small shapes, CPU, the reference index; fp16/fp32.
"""
from __future__ import annotations

import json

import pytest
import torch

from minference_fx import routing
from minference_fx.autotune import identity, workload
from minference_fx.kernels import attend
from minference_fx.kernels import density as den
from minference_fx.kernels import reference as ref
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools import bench

HQ, HKV, D = 4, 2, 64


def test_shapes_dtypes_gqa_and_names():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, k, v = workload.family_qkv("scattered", 700, num_q_heads=6, num_kv_heads=2, head_dim=48, dtype=dtype,
                                      device="cpu", seed=1)
        assert q.shape == (1, 6, 700, 48) and k.shape == v.shape == (1, 2, 700, 48)
        assert all(t.dtype == dtype and torch.isfinite(t.float()).all() for t in (q, k, v))
    q, _, _ = workload.scattered_qkv(130, batch=2, num_q_heads=2, num_kv_heads=2, head_dim=16, device="cpu")
    assert q.shape == (2, 2, 130, 16) and q.dtype == torch.bfloat16
    assert workload.FAMILIES["structured"] is workload.structured_qkv
    with pytest.raises(ValueError, match="unknown input family 'scatterd'"):
        workload.family_qkv("scatterd", 100, device="cpu")
    with pytest.raises(ValueError, match="head_dim must be at least 16"):
        workload.scattered_qkv(100, num_q_heads=2, num_kv_heads=1, head_dim=8, device="cpu")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        workload.scattered_qkv(100, num_q_heads=3, num_kv_heads=2, head_dim=16, device="cpu")


def test_chunks_change_the_noise_not_the_structure(monkeypatch):
    # the drift, repeat and period codes are functions of the position: smaller chunks redraw only the noise
    kw = dict(num_q_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32, device="cpu", seed=7)
    q1, k1, _ = workload.scattered_qkv(3000, **kw)
    monkeypatch.setattr(workload, "_GEN_CHUNK", 700)
    q2, k2, _ = workload.scattered_qkv(3000, **kw)
    s1, s2 = q1[0, 0, -1] @ k1[0, 0].T, q2[0, 0, -1] @ k2[0, 0].T
    assert not torch.equal(s1, s2)
    assert torch.corrcoef(torch.stack([s1, s2]))[0, 1] > 0.9


def _last_rows_softmax(q, k, rows=64):
    sq = q.shape[2]
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q[0, :, sq - rows:].float() @ kk[0].float().transpose(-1, -2) * q.shape[-1] ** -0.5
    pos = torch.arange(sq)
    return ref._masked_softmax(scores, (pos[None] <= pos[sq - rows:, None]).expand_as(scores))


def test_band_is_narrow_and_sinks_and_far_field_hold_mass():
    s = 8192
    q, k, _ = workload.scattered_qkv(s, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                                     device="cpu", seed=3)
    p = _last_rows_softmax(q, k)
    pos = torch.arange(s)
    delta = pos[s - 64:, None] - pos[None]
    # the band: diagonals 0..31 average far more than 64..127 (the drift decorrelates within ~60 tokens)
    near = (p * (delta < 32) * (delta >= 0)).sum(-1).mean(-1) / 32
    next_ = (p * (delta >= 64) * (delta < 128)).sum(-1).mean(-1) / 64
    assert (near > 5 * next_).all(), (near, next_)
    assert (p[..., :4].sum(-1).mean(-1) > 0.03).all()  # four sinks among thousands of keys
    # a noisy far field: past 512 tokens, away from sinks, rows are not empty
    far = (p * (delta >= 512) * (pos[None] >= 4)).sum(-1).mean(-1)
    assert (far > 0.005).all(), far


def _slash_spread(family, seed):
    """(isolated picked diagonals past the forced 100, physical / logical density) per head, reference index."""
    s = 8192
    q, k, _ = workload.family_qkv(family, s, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                                  device="cpu", seed=seed)
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 200, 1200),) * HQ)
    index = ref.build_index(q, k, plan, scale=D ** -0.5)
    picks = den.selection_of(q, k, plan, scale=D ** -0.5)
    density = den.index_density(index, plan, picks, sq=s)
    isolated = []
    for diags in picks.diagonals[0]:
        x = diags[diags >= ref.VS_FORCED_DIAGONALS]
        gap_before = x - torch.cat([torch.tensor([ref.VS_FORCED_DIAGONALS - 1]), x[:-1]])
        gap_after = torch.cat([x[1:], torch.tensor([s + 1])]) - x
        isolated.append(int(((gap_before > 1) & (gap_after > 1)).sum()))
    return torch.tensor(isolated, dtype=torch.float64), (density.physical / density.logical)[0]


def test_slashes_scatter_more_than_on_structured_inputs():
    # measured at this shape, seeds 0 and 1: isolated picks 24-247 (structured) vs 106-463 (scattered),
    # physical / logical 2.2-3.3 vs 4.2-5.9
    isolated_s, waste_s = _slash_spread("structured", 0)
    isolated_x, waste_x = _slash_spread("scattered", 0)
    assert isolated_x.mean() > 2 * isolated_s.mean(), (isolated_x, isolated_s)
    assert waste_x.min() > waste_s.max(), (waste_x, waste_s)


# --------------------------------------------------------------------------- bench kernels


def test_families_option():
    assert bench.parse_families("structured,scattered") == ("structured", "scattered")
    assert bench.parse_families(" scattered ") == ("scattered",)
    assert bench.KERNEL_FAMILIES == ("structured", "scattered")
    for bad in ("structured,scatered", ""):
        with pytest.raises(ValueError, match="unknown input family"):
            bench.parse_families(bad)


def test_rows_of_both_families_on_cpu(tmp_path):
    # the benchmark's per-case work without the timing (which needs CUDA): inputs, reference index,
    # densities, then rows through the table and the JSON
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=32)
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 30, 200),) * 4)
    rows = []
    for family in bench.KERNEL_FAMILIES:
        case = bench.prepare_case(family, 1024, plan, shape=shape, device="cpu", dtype=torch.float16,
                                  build_index=ref.build_index)
        assert case.family == family and case.q.dtype == torch.float16
        fields = bench.density_fields(case.density)
        assert 0 < fields["logical_density"] < fields["physical_density"] <= 1
        assert len(fields["physical_by_head"]) == len(fields["logical_by_head"]) == 4
        rows.append(bench.KernelRow(family=family, seq=1024, index_ms=1.0, kernel_ms=2.0, total_ms=3.0,
                                    tflops_computed=1.0, cudnn_ms=6.0, op_ms=4.0, op_routed_heads=1, flash_ms=None,
                                    flex_ms=None, flex_mask_ms=None, launch_config={"BLOCK_M": 64}, **fields))
    table = bench.format_kernel_rows(rows)
    lines = table.splitlines()
    assert "family" in lines[0] and "ph/lo" in lines[0] and "phys%" in lines[0] and "log%" in lines[0]
    for row, line in zip(rows, lines[1:3]):
        assert line.split()[0] == row.family
        assert f"{100 * row.physical_density:.2f}" in line and f"{row.waste:.2f}" in line
        # cuDNN 6 ms, 2x our 3 ms; the op 4 ms, 1.5x, one head routed
        assert line.split()[-9:-4] == ["6.00", "2.00", "4.00", "1.50", "1"]
    out = tmp_path / "k.json"
    bench.write_json(out, rows, "test")
    doc = json.loads(out.read_text())
    saved = doc["rows"]
    assert [r["family"] for r in saved] == list(bench.KERNEL_FAMILIES)
    assert saved[1]["physical_by_head"] == rows[1].physical_by_head and saved[1]["launch_config"] == {"BLOCK_M": 64}
    # which kernel sources the numbers ran: the hash that keys the tuned tables
    assert doc["kernel_source_hash"] == identity.kernel_source_hash() and len(doc["kernel_source_hash"]) == 16


@pytest.mark.parametrize("every, cap, settle", [(2, 8, 7), (8, 64, 57), (8, 8, 1)])
def test_the_op_column_settles_until_an_all_routed_sites_checks_are_furthest_apart(every, cap, settle):
    """``bench kernels`` times the op over ``recheck_max`` calls after :func:`bench.settle_calls` (``bench.op_window``
    up to 128K): by then an all-routed site's checks are ``recheck_max`` apart, so the window holds exactly one (the
    steady state)."""
    router = routing.Router(recheck_every=every, recheck_max=cap)
    site, cpu, every_head = router.new_site(), torch.device("cpu"), torch.ones(1, 4, dtype=torch.bool)
    router.observe(site, every_head, 1000)  # call 0 builds the index and routes every head
    checks = [0]
    for call in range(1, settle + 3 * cap):
        if router.index_due(site, 1000, cpu):
            router.observe(site, every_head, 1000)
            checks.append(call)
    assert bench.settle_calls(router) == settle
    assert bench.op_window(router, 32768) == (settle, cap) and bench.op_window(router, 524288) == (3, every)
    window = [c for c in checks if settle <= c < settle + cap]
    assert len(window) == 1
    assert all(b - a == cap for a, b in zip(checks, checks[1:]) if a >= settle - 1)


def test_the_op_column_gets_qkv_in_the_layout_a_model_hands_the_op():
    """The op column's Q/K/V (``bench.op_arguments``, what ``_op_ms`` calls the op with) are token-major, as an HF
    model's attention hands them over and as the op's own output is laid out, so a call routed whole to fused SDPA
    (whose output takes q's layout) needs no copy, as in a model."""
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 64, 64),) * 3)
    args = bench.op_arguments(q, k, v, 0.5, plan, site=7)
    for given, passed in zip((q, k, v), args[:3]):
        assert torch.equal(passed, given)
        assert attend.is_output_layout(passed) and not attend.is_output_layout(given)
    assert args[-3:] == (7, 0, 0)  # the site, no escalation
    out = torch.ops.minference.sparse_attention.default(*args)  # the arguments are the op's, in its order
    assert out.shape == q.shape and attend.is_output_layout(out) and torch.isfinite(out).all()
    escalating = bench.op_arguments(q, k, v, 0.5, plan, site=7, escalation=(1000, 6096))
    assert escalating[-3:] == (7, 1000, 6096)
    assert torch.isfinite(torch.ops.minference.sparse_attention.default(*escalating)).all()
