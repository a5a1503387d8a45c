"""Launch configs that fit the GPU's shared memory (kernels.fit), and the op's dense path where none does."""
import logging

import pytest
import torch
import torch.nn.functional as F
from compiling import compiling
from triton.runtime.errors import OutOfResources

from minference_fx import op, routing, sparse_path
from minference_fx.call_masks import CallMasks
from minference_fx.kernels import fit
from minference_fx.plan import LayerPlan


@pytest.fixture(autouse=True)
def _fresh():
    fit.forget()
    yield
    fit.forget()


def _device(limit: int, need: dict):
    """A launch as a device with ``limit`` bytes a block makes it: configs ``need`` says need more fail."""
    tried = []

    def run(config):
        tried.append(config)
        if need[config] > limit:
            raise OutOfResources(need[config], limit, "shared memory")
        return config

    return run, tried


def test_the_first_config_that_fits_runs_and_later_launches_start_there():
    need = {"big": 300, "mid": 200, "small": 100}
    run, tried = _device(250, need)
    assert fit.launch("k", ("bf16", 128), ("big", "mid", "small"), run) == "mid"
    assert fit.launch("k", ("bf16", 128), ("big", "mid", "small"), run) == "mid"
    assert tried == ["big", "mid", "mid"]  # the config that failed is tried once a process
    # another specialisation learns for itself
    assert fit.launch("k", ("fp32", 128), ("big", "mid", "small"), run) == "mid"
    assert tried[3:] == ["big", "mid"]


def test_a_config_that_fits_at_once_is_never_replaced():
    run, tried = _device(1000, {"big": 300, "small": 100})
    assert fit.launch("k", (), ("big", "small"), run) == "big" and tried == ["big"]


def test_no_config_that_fits_names_the_kernel_and_the_numbers():
    run, _ = _device(50, {"big": 300, "small": 100})
    with pytest.raises(fit.DoesNotFit, match=r"index column sums: none of 2 launch configs fits .* 100 bytes, the device allows 50"):
        fit.launch("index column sums", (), ("big", "small"), run)


def test_the_attention_ladder_cuts_stages_then_rows_then_keys_and_keeps_the_warps():
    ladder = fit.attention_ladder(64, 64, 4, 2, rows=(16, 32, 64), keys=(32, 64, 128))
    assert ladder[:4] == ((64, 64, 4, 2), (64, 64, 4, 1), (32, 64, 4, 2), (32, 64, 4, 1))
    assert ladder[-1] == (16, 32, 4, 1) and len(ladder) == len(set(ladder)) == 12
    assert {warps for _, _, warps, _ in ladder} == {4}
    assert fit.attention_ladder(128, 128, 8, 3, rows=(16, 32, 64, 128), keys=(32, 64, 128))[:3] == (
        (128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 1))


def test_a_call_whose_kernels_fit_no_config_runs_dense_and_later_calls_plan_dense(monkeypatch, caplog):
    """The sparse path's first launch that fits nothing (DoesNotFit, before it queued anything) turns the call
    into dense attention, logged once, and later calls of that head dim and dtype plan the dense path."""
    monkeypatch.setattr(op, "_does_not_fit", set())

    def no_fit(*args, **kwargs):
        raise fit.DoesNotFit("index column sums", 1, OutOfResources(131072, 101376, "shared memory"))

    monkeypatch.setattr(sparse_path, "sparse_on_gpu", no_fit)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 96, 16, generator=g), torch.randn(1, 2, 96, 16, generator=g), torch.randn(1, 2, 96, 16, generator=g)
    plan = LayerPlan.from_op_arguments([2] * 4, [8] * 4, [8] * 4)
    call = op.CallPlan(op.CallPath.SPARSE_GPU, CallMasks(), 0.25, plan, 0)
    with caplog.at_level(logging.WARNING, logger="minference_fx"):
        out = op.run_call(call, q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True))
    assert "cannot run the sparse path at head_dim 16" in caplog.text and "131072 bytes" in caplog.text
    again = op.plan_call(q, k, CallMasks(), 0.25, plan, 0, router=routing.Router())
    assert again.path is op.CallPath.DENSE_BY_DEVICE
    # another head dim is not concerned
    assert op.plan_call(q[..., :8], k[..., :8], CallMasks(), 0.25, plan, 0, router=routing.Router()).path is op.CallPath.SPARSE_CPU


_SIMULATED = r'''
import json, sys, torch
from minference_fx.autotune.cache import DEFAULT_ENTRIES
from minference_fx.call_masks import CallMasks
from minference_fx.kernels import attend, fit, reference
from minference_fx.kernels.codegen import simulated_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.sparse_path import sparse_on_gpu

plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 30, 60), HeadPlan(Pattern.DENSE, 0, 0)) * 2)
q = torch.zeros(1, 4, 256, 64, dtype=torch.bfloat16)
k, v = (torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16) for _ in range(2))
report = {}
for limit in (16500, 16000):
    fit.forget()
    with simulated_gpu(80, limit) as gpu:
        try:
            sparse_on_gpu(q, k, v, plan, 0.125, CallMasks(), 0.8, DEFAULT_ENTRIES["sparse_attention"],
                          DEFAULT_ENTRIES["dense_walk"])
            failed = None
        except fit.DoesNotFit as exc:
            failed = str(exc)
        index = reference.build_index(q.float(), k.float(), plan, scale=0.125)
        attend.sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=0.125, num_stages=3)
        fusion = sorted({(name, compiled.metadata.enable_fp_fusion) for name, variants in gpu.variants().items()
                         for compiled in variants})
    report[limit] = {"compiled": gpu.compiled, "failed": failed, "fp_fusion": fusion}
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def simulated_small_gpu():
    """The op's kernels compiled for sm_80 on the CPU under 16,500 and 16,000 bytes a block, in a subprocess
    whose Triton defaults to no fused multiply-adds (Triton 3.10's default): what compiled, what failed."""
    import json

    return json.loads(compiling(_SIMULATED, TRITON_DEFAULT_FP_FUSION="0").strip().splitlines()[-1])


def test_a_simulated_gpu_with_less_shared_memory_gets_smaller_configs_or_a_named_kernel_that_fits_none(simulated_small_gpu):
    """Compiled for sm_80 on the CPU with Triton's own first-launch check (``codegen.simulated_gpu``) against a
    small limit, as a 99 KB card meets the configs tuned on Hopper at d256: at d64 in bf16 the index's row
    statistics need 41,984, 25,600 and 24,576 bytes in 128-key steps with 3, 2 and 1 stages, then 25,088, 16,896 and
    16,384 in 64-key steps; the column sums 16,384 in any config. Under 16,500 bytes the path steps down to 64-key
    steps and one stage and runs; under 16,000 the row statistics fit no config and the error names them and the
    numbers. A 3-stage attention launch (24,832 bytes) steps down to 2
    stages (16,384)."""
    roomy, tight = simulated_small_gpu["16500"], simulated_small_gpu["16000"]
    stats = [shared for name, shared in roomy["compiled"] if name == "_vs_row_stats_kernel"]
    assert len(stats) == 6 and min(stats[:-1]) > 16500 >= stats[-1], stats
    assert roomy["failed"] is None
    walks = [shared for name, shared in roomy["compiled"] if name == "_sparse_attn_fwd"]
    assert walks[-2] > 16500 >= walks[-1], walks  # the direct 3-stage launch, then the 2-stage one that ran
    assert tight["failed"].startswith("index row statistics: none of 6 launch configs fits"), tight
    assert "the smallest needs 16384 bytes, the device allows 16000" in tight["failed"], tight


def test_every_kernel_compiles_with_fused_multiply_adds_whatever_tritons_default(simulated_small_gpu):
    """Triton 3.10 stops fusing multiply-adds by default (3.9 warns of it at each compile); the kernels were tuned
    and tested fused, and every launch pins it (``fit.COMPILE_OPTIONS``), so a Triton set to the new default
    still compiles each of them fused."""
    fusion = simulated_small_gpu["16500"]["fp_fusion"]
    names = {name for name, _ in fusion}
    assert {"_sparse_attn_fwd", "_vs_row_stats_kernel", "_vs_colsum_kernel", "_rank_keys_kernel"} <= names, names
    assert all(fused for _, fused in fusion), fusion


_WALK_PTX = r'''
from minference_fx.kernels.codegen import sparse_walk_ptx
print(*("cp.async.bulk.tensor" in sparse_walk_ptx(64, 64, 64, 4, 2, target=("cuda", cap, 32)) for cap in (90, 80)))
'''


def test_a_simulated_gpu_compiles_the_variant_that_gpu_runs():
    """The stand-in driver must compile what the GPU would, or the shared memory and PTX it reports are another
    kernel's: on a simulated Hopper the 64-key walk copies K/V by TMA, as an H100 does; on an A100 it cannot."""
    out = compiling(_WALK_PTX)
    assert out.split() == ["True", "False"], out
