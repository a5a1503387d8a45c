"""GPU checks (run through the device tool): bf16 kernel error, a shape fuzz, CUDA-graph capture of the op."""
import random

import pytest
import torch
import torch.nn.functional as F

from minference_fx import cost, routing
from minference_fx.autotune import dispatch
from minference_fx.call_masks import CallMasks
from minference_fx.dense import fused_sdpa
from minference_fx.kernels import reference
from minference_fx.kernels.attend import is_output_layout, rows_need_int64, sparse_attention_triton
from minference_fx.kernels.index import build_index_gpu
from minference_fx.plan import HeadPlan, LayerPlan, Pattern

from index_helpers import assert_lists_as_taken
from routing_helpers import calls_that_checked

pytestmark = pytest.mark.gpu
OP = torch.ops.minference.sparse_attention.default


# every pattern twice over 8 query heads, with the bench's default budgets
MIXED_8_HEADS = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096), HeadPlan(Pattern.A_SHAPE, 128, 2048),
                           HeadPlan(Pattern.BLOCK_SPARSE, 64), HeadPlan(Pattern.DENSE)) * 2)


def _bf16_math(q, k, v, index, plan, scale, rows_per_chunk=1024):
    """Masked attention with bf16 matmuls and fp32 softmax: the error budget a bf16 kernel is allowed."""
    B, Hq, sq, _ = q.shape
    group = Hq // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    pos = torch.arange(sq, device=q.device)
    for r0 in range(0, sq, rows_per_chunk):
        r1 = min(sq, r0 + rows_per_chunk)
        allowed = reference.index_to_mask(index, range(r0, r1), sq)[..., :r1] & (torch.arange(r1, device=q.device)[None] <= pos[r0:r1, None])
        s = (q[:, :, r0:r1] @ k_rep[:, :, :r1].transpose(-1, -2)).float() * scale
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        out[:, :, r0:r1] = (p.to(q.dtype) @ v_rep[:, :, :r1])
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(("seq", "launch"), [(4096, {}), (16384, {}), (65536, {}), (16384, dict(block_n=128)),
                                             (16384, dict(kv_desc=False)), (16384, dict(block_m=32))],
                         ids=["4096", "16384", "65536", "16384-bn128", "16384-pointer-loads", "16384-bm32"])
def test_bf16_kernel_error_within_twice_bf16_reference(seq, launch):
    from minference_fx.autotune.workload import structured_qkv

    q, k, v = structured_qkv(seq, num_q_heads=8, num_kv_heads=2, head_dim=128)
    plan = MIXED_8_HEADS
    scale = 128 ** -0.5
    index = reference.build_index(q, k, plan, scale=scale)
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, **launch)
    exact = reference.sparse_attention_reference(q.float(), k.float(), v.float(), plan, scale=scale, index=index, rows_per_chunk=1024)
    bf16 = _bf16_math(q, k, v, index, plan, scale)
    assert torch.isfinite(got).all()
    assert _rel(got, exact) <= 2 * _rel(bf16, exact) + 1e-4, (_rel(got, exact), _rel(bf16, exact))


@pytest.mark.parametrize("head_dim", [64, 80, 96, 256])
def test_bf16_head_dims_with_the_ops_launch_config(head_dim):
    """Head dims other than the benchmark's 128, launched as the op launches them (tuned or default config)."""
    from minference_fx.autotune.dispatch import launch_config
    from minference_fx.autotune.workload import structured_qkv

    q, k, v = structured_qkv(4096, num_q_heads=8, num_kv_heads=2, head_dim=head_dim)
    scale = head_dim ** -0.5
    index = reference.build_index(q, k, MIXED_8_HEADS, scale=scale)
    cfg = launch_config(q, k)
    got = sparse_attention_triton(q, k, v, index, *MIXED_8_HEADS.op_arguments(), scale=scale, **cfg.launch())
    exact = reference.sparse_attention_reference(q.float(), k.float(), v.float(), MIXED_8_HEADS, scale=scale, index=index,
                                                 rows_per_chunk=1024)
    bf16 = _bf16_math(q, k, v, index, MIXED_8_HEADS, scale)
    assert torch.isfinite(got).all()
    assert _rel(got, exact) <= 2 * _rel(bf16, exact) + 1e-4, (cfg, _rel(got, exact), _rel(bf16, exact))


@pytest.mark.parametrize("launch", [{}, dict(block_m=32, block_n=128)], ids=["default", "bm32-bn128"])
def test_bf16_lse_matches_fp32_logsumexp_over_the_index_keys(launch):
    """``return_lse`` on the GPU: the LSE of bf16 inputs against fp32 scores over exactly the index's keys."""
    from minference_fx.autotune.workload import structured_qkv

    seq = 16384
    q, k, v = structured_qkv(seq, num_q_heads=8, num_kv_heads=2, head_dim=128)
    plan = MIXED_8_HEADS
    scale = 128 ** -0.5
    index = reference.build_index(q, k, plan, scale=scale)
    out, lse = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, return_lse=True, **launch)
    assert torch.equal(out, sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, **launch))
    k_rep = k.float().repeat_interleave(4, 1)
    pos = torch.arange(seq, device=q.device)
    worst = 0.0
    for r0 in range(0, seq, 1024):
        r1 = r0 + 1024
        allowed = reference.index_to_mask(index, range(r0, r1), seq)[..., :r1] & (pos[:r1][None] <= pos[r0:r1, None])
        s = (q[:, :, r0:r1].float() @ k_rep[:, :, :r1].transpose(-1, -2)) * scale
        want = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
        worst = max(worst, (lse[:, :, r0:r1] - want).abs().max().item())
    assert lse.shape == (1, 8, seq) and torch.isfinite(lse).all()
    # bf16 products summed in fp32 against fp32 products: the log-sum moves by well under 1e-2
    assert worst < 1e-2, worst


def _random_plan(rng, hq):
    heads = []
    for _ in range(hq):
        p = rng.choice(list(Pattern))
        if p is Pattern.A_SHAPE:
            heads.append(HeadPlan(p, rng.randint(0, 200), rng.randint(1, 400)))
        elif p is Pattern.VERTICAL_SLASH:
            heads.append(HeadPlan(p, rng.randint(0, 300), rng.randint(0, 300)))
        elif p is Pattern.BLOCK_SPARSE:
            heads.append(HeadPlan(p, rng.randint(1, 12)))
        else:
            heads.append(HeadPlan(p))
    return LayerPlan(tuple(heads))


def test_fuzz_op_against_reference_on_1000_shapes():
    rng = random.Random(0)
    worst = 0.0
    for case in range(1000):
        b, hkv, group = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4])
        d = rng.choice([64, 128])  # 80/96/256: test_bf16_head_dims_with_the_ops_launch_config; each is more compiles
        sq = rng.randint(1, 700)
        offset = rng.choice([0, 0, rng.randint(1, 300)])
        skv = sq + offset
        dtype = rng.choice([torch.float16, torch.bfloat16])
        window = rng.choice([0, 0, rng.randint(1, 500)])
        key_mask = None
        if b == 2 and rng.random() < 0.3:
            key_mask = torch.ones(b, skv, dtype=torch.bool, device="cuda")
            key_mask[1, : rng.randint(0, skv)] = False
        doc_ids = None
        if rng.random() < 0.25:  # packed documents; a table exactly as long as the keys, read at query positions too
            starts = torch.zeros(b, skv, dtype=torch.int32)
            for row in range(b):
                starts[row, rng.sample(range(1, skv), min(rng.randint(1, 4), skv - 1))] = 1
            doc_ids = starts.cumsum(1).to(torch.int32).cuda()
        masks = CallMasks(key_mask, doc_ids, offset, window)
        hq = hkv * group
        g = torch.Generator(device="cuda").manual_seed(case)
        q = torch.randn(b, hq, sq, d, device="cuda", generator=g).to(dtype)
        k = torch.randn(b, hkv, skv, d, device="cuda", generator=g).to(dtype)
        v = torch.randn(b, hkv, skv, d, device="cuda", generator=g).to(dtype)
        plan = _random_plan(rng, hq)
        scale = d ** -0.5

        index = build_index_gpu(q, k, plan, scale=scale, **masks.kwargs())
        # every launch config the tuner may pick: TMA copies (the default) for bf16; pointer loads or
        # two key tiles a step for fp16 (tied to the dtype: each pairing is one more set of compiles)
        launch = {} if dtype == torch.bfloat16 else rng.choice([dict(kv_desc=False), dict(block_n=128, num_stages=3),
                                                               dict(block_m=32)])
        out = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=scale, **masks.kwargs(), **launch)
        want = reference.sparse_attention_reference(q.float(), k.float(), v.float(), plan, scale=scale,
                                                    index=_full_index(index, q, k, plan, masks, scale), **masks.kwargs())
        assert torch.isfinite(out).all(), case
        err = (out.float() - want).abs().max().item()
        worst = max(worst, err)
        assert err < 3e-2, (case, b, hq, hkv, sq, skv, d, dtype, window, doc_ids is not None, launch, plan, err)
        if case % 100 == 99:
            print(f"fuzz: {case + 1} shapes, worst max-abs error so far {worst:.2e}", flush=True)
    print(f"fuzz: worst max-abs error {worst:.2e}")


def _full_index(gpu_index, q, k, plan, masks, scale):
    """The GPU index lists only VS/BS heads; take dense/A-shape heads' tiles from the reference."""
    ref = reference.build_index(q, k, plan, scale=scale, **masks.kwargs())
    implicit = torch.tensor([h.pattern in (Pattern.DENSE, Pattern.A_SHAPE) for h in plan.heads], device=q.device)
    t = max(ref.block_start.shape[-1], gpu_index.block_start.shape[-1])
    c = max(ref.col_index.shape[-1], gpu_index.col_index.shape[-1])
    pad = lambda x, n: torch.nn.functional.pad(x, (0, n - x.shape[-1]), value=-1)  # noqa: E731
    sel = implicit[None, :, None]
    return reference.SparseIndex(
        torch.where(sel, ref.block_count, gpu_index.block_count),
        torch.where(sel[..., None], pad(ref.block_start, t), pad(gpu_index.block_start, t)),
        torch.where(sel, ref.col_count, gpu_index.col_count),
        torch.where(sel[..., None], pad(ref.col_index, c), pad(gpu_index.col_index, c)),
    )


def test_kernel_compiles_once_across_prompt_lengths():
    """Lengths, offsets and the TMA descriptors' shapes are run-time values: new lengths reuse the binary."""
    from minference_fx.kernels.attend import _sparse_attn_fwd

    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 100, 200), HeadPlan(Pattern.DENSE)) * 2)
    compiled = lambda: len(_sparse_attn_fwd.device_caches[torch.cuda.current_device()][0])  # noqa: E731
    counts = []
    for seq in (1000, 1500, 2111, 3333, 4096):
        g = torch.Generator(device="cuda").manual_seed(seq)
        q = torch.randn(1, 4, seq, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, seq, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        index = reference.build_index(q, k, plan, scale=128 ** -0.5)
        sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=128 ** -0.5)
        counts.append(compiled())
    assert counts[1:] == counts[:1] * 4, counts


@pytest.mark.parametrize("guard_threshold", [0.0, 0.5])
def test_op_captures_in_a_cuda_graph_and_replays(guard_threshold):
    from minference_fx.autotune.workload import structured_qkv

    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 300, 500), HeadPlan(Pattern.A_SHAPE, 64, 512),
                      HeadPlan(Pattern.BLOCK_SPARSE, 8), HeadPlan(Pattern.DENSE)))
    args = (0.125, 0, 0, *plan.op_arguments(), 0, guard_threshold)
    q, k, v = structured_qkv(4096, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=1)
    static = [t.clone() for t in (q, k, v)]
    OP(*static, None, None, *args)  # warm-up: compiles kernels, builds plan tensors
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*static, None, None, *args)
    q2, k2, v2 = structured_qkv(4096, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=2)
    for dst, src in zip(static, (q2, k2, v2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, OP(q2, k2, v2, None, None, *args))


def test_the_guards_escalation_matches_the_cpu_op_lists_the_pairs_rows_and_captures():
    """The guard's escalation on the GPU writes the weak vertical-slash rows into the one index
    (index.build_index_escalated_gpu): it lists what dense.take_index of the two indexes lists, the op equals
    the CPU op (reference index, take_index) with some heads escalated, and the call captures in a CUDA graph."""
    from minference_fx import dense
    from minference_fx.autotune.workload import family_qkv
    from minference_fx.kernels.index import build_index_escalated_gpu, build_index_pair_gpu
    from minference_fx.plan import escalated_plan

    # narrow budgets on the scattered family: several heads miss mass, and the escalation rescues some
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 64, 128), HeadPlan(Pattern.VERTICAL_SLASH, 100, 200),
                      HeadPlan(Pattern.BLOCK_SPARSE, 4), HeadPlan(Pattern.VERTICAL_SLASH, 64, 256)))
    escalation = (512, 2048)
    q, k, v = family_qkv("scattered", 4096, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, seed=3)
    up = escalated_plan(plan, escalation)
    mass, mass_up = torch.ones(1, 4, device="cuda"), torch.zeros(1, 4, device="cuda")
    one, two = build_index_pair_gpu(q, k, plan, up, scale=0.125, mass_out=mass, escalated_mass_out=mass_up)
    # between the two weakest vertical-slash heads' masses (0.970 and 0.984 on the CPU): the weakest is taken
    weakest = mass[0, [0, 1, 3]].sort().values
    threshold = float(weakest[:2].mean())
    want = dense.take_index(one, two, mass < threshold)
    got, taken = build_index_escalated_gpu(q, k, plan, up, scale=0.125, take_below=threshold,
                                           mass_out=torch.ones(1, 4, device="cuda"),
                                           escalated_mass_out=torch.zeros(1, 4, device="cuda"))
    vs = torch.tensor([True, True, False, True], device="cuda")
    assert bool(taken[:, vs].any()), "the premise: some vertical-slash head is weak at these budgets"
    assert_lists_as_taken(got, want, vs)
    args = (None, None, 0.125, 0, 0, *plan.op_arguments(), 0, threshold, -1, *escalation)
    got_out = OP(q, k, v, *args)
    want_out = OP(q.cpu().float(), k.cpu().float(), v.cpu().float(), *args)
    assert _rel(got_out.float().cpu(), want_out) < 1e-2
    static = [t.clone() for t in (q, k, v)]
    OP(*static, *args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*static, *args)
    q2, k2, v2 = family_qkv("scattered", 4096, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                            seed=4)
    for dst, src in zip(static, (q2, k2, v2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, OP(q2, k2, v2, *args))


def test_the_dense_path_runs_cudnn_on_hopper_whatever_order_a_priority_block_left():
    """A sdpa_kernel(..., set_priority=True) block can leave SDPA's order flash first for the rest of a process
    (torch sets its cuDNN-first default lazily): the op's fused SDPA still runs cuDNN on Hopper, with the result
    SDPA gives under cuDNN alone, and a backend the user disabled stays disabled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minference_fx import dense
    from minference_fx.autotune.workload import structured_qkv

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuDNN is asked for on Hopper only")
    q, k, v = structured_qkv(4096, num_q_heads=12, num_kv_heads=2, head_dim=128, seed=1)

    def sdpa_ops(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn()
            torch.cuda.synchronize()
        return out, {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}

    flash_first = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                   SDPBackend.CUDNN_ATTENTION]
    op_path = lambda: dense.fused_sdpa(q, k, v, causal=True, scale=128 ** -0.5)  # noqa: E731
    with sdpa_kernel(flash_first, set_priority=True):
        got, ops = sdpa_ops(op_path)
    assert ops == {"aten::_scaled_dot_product_cudnn_attention"}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=128 ** -0.5, enable_gqa=True)
    assert torch.equal(got, want)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        _, ops = sdpa_ops(op_path)
    assert ops == {"aten::_scaled_dot_product_flash_attention"}


def test_padded_op_runs_dense_heads_in_the_kernel_matches_the_cpu_op_and_captures():
    """In a padded batch the plan's dense heads join the kernel's dense walk (SDPA would read a materialised
    mask): the GPU op equals the CPU op (the reference with the same run-time rules) on a left-padded batch,
    rows that see no key included, and the call captures in a CUDA graph."""
    from minference_fx.autotune.workload import structured_qkv

    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 300, 500), HeadPlan(Pattern.DENSE),
                      HeadPlan(Pattern.BLOCK_SPARSE, 8), HeadPlan(Pattern.DENSE)))
    q, k, v = structured_qkv(4096, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, seed=5)
    key_mask = torch.ones(2, 4096, dtype=torch.bool, device="cuda")
    key_mask[1, :700] = False
    args = (None, 0.125, 0, 0, *plan.op_arguments(), 0, 0.5)
    got = OP(q, k, v, key_mask, *args)
    want = OP(q.cpu().float(), k.cpu().float(), v.cpu().float(), key_mask.cpu(), *args)
    assert torch.isfinite(got).all() and not got[1, :, :700].any()
    assert _rel(got.cpu(), want) < 1e-2
    static = [t.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*static, key_mask, *args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, got)


def test_compiled_model_reduce_overhead_matches_eager():
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import covering_config, tiny_model

    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 256), device="cuda")
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="minference", options={"config": covering_config(model), "mode": "reduce-overhead"})
        for _ in range(3):
            sparse = compiled(ids, use_cache=False).logits
    assert _rel(sparse, dense) < 2e-2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_cache_chunks_with_a_lifted_scale_through_inductor_match_eager(attn):
    """On the GPU through Inductor: a left-padded Mistral batch prefilled in chunks through its sliding cache with
    ``dynamic=True`` (key offsets past 0, a SymFloat scale, the padding mask sliced from key 0's position in
    the graph) is rewritten and equals eager chunk by chunk."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import covering_config, sliding_cache_chunks, tiny_model

    model = tiny_model("mistral", attn).cuda().to(torch.float16)
    compiled = torch.compile(model, backend="minference", dynamic=True, options={"config": covering_config(model)})
    want, got, reports, valid = sliding_cache_chunks(model, compiled, 300, 150, ((0, 130), (130, 200), (200, 300)),
                                                     device="cuda")
    rows = [r for rep in reports for r in rep.rows]
    assert rows and all(r.decision == "sparse" for r in rows) and any("k_offset" in r.mask for r in rows), rows
    for w, g, real in zip(want, got, valid):
        assert _rel(g[real], w[real]) < 1e-2


def test_training_step_through_inductor_stays_dense_and_matches_eager_grads():
    """With autograd on, the sites stay dense (the op has no backward) and Inductor's forward + backward
    give eager's gradients; under inference_mode the same model is rewritten."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import covering_config, tiny_model
    from minference_fx.backend import recent_reports

    model = tiny_model("llama").cuda()
    ids = torch.randint(0, 128, (1, 256), device="cuda")
    model(ids, labels=ids).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="minference", options={"config": covering_config(model)})
    with pytest.warns(UserWarning, match="inference_mode"):
        compiled(ids, labels=ids).loss.backward()
    assert all(r.decision == "dense" for r in recent_reports()[-1].rows)
    for name, p in model.named_parameters():
        assert _rel(p.grad, want[name]) < 1e-3, name
    with torch.inference_mode():
        compiled(ids)
    assert all(r.decision == "sparse" for r in recent_reports()[-1].rows)


def test_eval_recall_on_the_gpu_index_equals_the_reference_index():
    """head_recall on CUDA measures the GPU twin of the index (memory linear in the length); it must read
    the same as on the reference's index, here on the CPU."""
    from minference_fx.tools import evaluate
    from minference_fx.autotune.workload import structured_qkv

    q, k, _ = structured_qkv(3000, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, seed=3)
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 100, 300), HeadPlan(Pattern.VERTICAL_SLASH, 30, 60),
                      HeadPlan(Pattern.BLOCK_SPARSE, 8), HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096)))
    on_gpu = evaluate.head_recall(q, k, plan, scale=0.125, rows=256, guard_threshold=0.8)
    on_cpu = evaluate.head_recall(q.cpu(), k.cpu(), plan, scale=0.125, rows=256, guard_threshold=0.8)
    for name in ("recall", "oracle", "density", "guard_mass"):
        torch.testing.assert_close(getattr(on_gpu, name).cpu().float(), getattr(on_cpu, name).float(),
                                   rtol=1e-4, atol=1e-4, equal_nan=True, msg=name)
    assert torch.equal(on_gpu.fires.cpu(), on_cpu.fires) and torch.equal(on_gpu.near_dense.cpu(), on_cpu.near_dense)
    assert bool(on_gpu.near_dense[3])  # (1000, 6096) keeps every tile at 3000 tokens: the rule is exercised


@pytest.mark.parametrize("batch", [1, 2])
def test_masked_dense_attention_past_the_limit_builds_no_pair_sized_mask(batch):
    """A padded dense call past MASKED_SDPA_MAX_PAIRS (what a prefill with generate's mask runs below the
    crossover and for routed heads) builds no [Sq, Skv] mask (256 MiB at 16K): a padded batch runs the dense
    walk, one prompt cuDNN then its row again in the walk. Either gives the result of the mask-building SDPA
    path, rows that see no key included."""
    from minference_fx import dense
    from minference_fx.autotune.dispatch import launch_config
    from minference_fx.autotune.workload import structured_qkv

    n = 16384
    q, k, v = (t.expand(batch, -1, -1, -1).contiguous()
               for t in structured_qkv(n, num_q_heads=8, num_kv_heads=2, head_dim=64, seed=4))
    key_mask = torch.ones(batch, n, dtype=torch.bool, device="cuda")
    key_mask[-1, :1000] = False  # left padding: rows 0-999 of the last prompt read nothing
    assert n * n > dense.MASKED_SDPA_MAX_PAIRS
    masks, walk = CallMasks(key_mask), launch_config(q, k, "dense_walk")
    dense.dense_attention(q, k, v, masks, 0.125, walk)  # compile outside the measured call
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = dense.dense_attention(q, k, v, masks, 0.125, walk)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < batch * n * n // 8  # the output is 16 MiB a row, a mask 256
    want = dense.masked_sdpa(q, k, v, masks, 0.125)
    assert torch.isfinite(got).all() and not got[-1, :, :1000].any()
    assert _rel(got, want) < 1e-2


def test_float32_grouped_dense_attention_builds_no_score_matrix():
    """The float32 search's dense calls (12 query / 2 KV heads, as Qwen2.5-Coder) run on a kernel that builds no
    [Hq, Sq, Skv] score matrix: SDPA's math fallback for grouped float32 heads would take 3 GiB here, 48 GiB at 32K."""
    from minference_fx import dense

    n, group = 8192, 6
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 2 * group, n, 128, device="cuda", generator=gen)
    k, v = (torch.randn(1, 2, n, 128, device="cuda", generator=gen) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = dense.dense_attention(q, k, v, CallMasks(), 0.125)
    torch.cuda.synchronize()
    # the output and the repeated K and V take 144 MiB; the scores of one head alone 256 MiB, of all twelve 3 GiB
    assert torch.cuda.max_memory_allocated() - base < 4 * n * n
    rows = slice(n - 256, n)  # the last rows, against explicit float64 attention on every key
    s = (q[:, :, rows].double() @ k.repeat_interleave(group, 1).double().transpose(-1, -2)) * 0.125
    causal = torch.arange(n, device="cuda")[None] <= torch.arange(n - 256, n, device="cuda")[:, None]
    want = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v.repeat_interleave(group, 1).double()
    assert _rel(got[:, :, rows], want) < 5e-3  # TF32 would give about 1e-3; heads paired wrongly, order 1


def test_one_prompt_under_a_padding_mask_runs_sdpa_unmasked_and_decode_steps_keep_the_mask(monkeypatch):
    """generate's prefill of one prompt below the crossover, past the pair limit: SDPA never reads a mask,
    all-ones or left-padded, and the result is the mask-building path's; a decode step still passes its small
    mask to SDPA (a second launch per token would cost more)."""
    from minference_fx import dense
    from minference_fx.autotune.dispatch import launch_config
    from minference_fx.autotune.workload import structured_qkv

    n = 8192
    assert n * n > dense.MASKED_SDPA_MAX_PAIRS
    q, k, v = structured_qkv(n, num_q_heads=8, num_kv_heads=2, head_dim=64, seed=5)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        seen.append(attn_mask is not None)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    for pad in (0, 300):
        key_mask = torch.ones(1, n, dtype=torch.bool, device="cuda")
        key_mask[:, :pad] = False
        want = dense.masked_sdpa(q, k, v, CallMasks(key_mask), 0.125)
        walk = launch_config(q, k, "dense_walk")
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        got = dense.dense_attention(q, k, v, CallMasks(key_mask), 0.125, walk)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        assert seen == [False], (pad, seen)
        seen.clear()
        assert torch.isfinite(got).all() and not got[:, :, :pad].any()
        assert _rel(got, want) < 1e-2
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    dense.dense_attention(q[:, :, -1:], k, v, CallMasks(key_mask, q_offset=n - 1), 0.125)
    assert seen == [True]


@pytest.mark.parametrize("layout", ["token-major", "sequence-first"])
def test_one_padded_prompt_in_any_layout_runs_sdpa_then_the_walk_into_the_ops_layout(layout):
    """SDPA's output takes q's memory order; the dense walk that runs the padded row again writes into the op's
    token-major output: every q layout works there, and the op returns token-major."""
    from minference_fx import dense
    from minference_fx.autotune.dispatch import launch_config
    from minference_fx.autotune.workload import structured_qkv

    n = 8192
    order = (0, 2, 1, 3) if layout == "token-major" else (2, 0, 1, 3)
    inverse = tuple(order.index(d) for d in range(4))
    q, k, v = structured_qkv(n, num_q_heads=8, num_kv_heads=2, head_dim=64, seed=5)
    relaid = [t.permute(order).contiguous().permute(inverse) for t in (q, k, v)]  # same values, that memory order
    key_mask = torch.ones(1, n, dtype=torch.bool, device="cuda")
    key_mask[:, :300] = False
    want = dense.masked_sdpa(q, k, v, CallMasks(key_mask), 0.125)
    got = dense.dense_attention(*relaid, CallMasks(key_mask), 0.125, launch_config(q, k, "dense_walk"))
    assert torch.isfinite(got).all() and not got[:, :, :300].any() and _rel(got, want) < 1e-2
    out = OP(*relaid, key_mask, None, 0.125, 0, 0, [2] * 8, [1000] * 8, [6096] * 8, 10**7)
    assert is_output_layout(out) and _rel(out, want) < 1e-2


def test_near_dense_heads_run_dense_decided_at_replay_in_a_cuda_graph():
    """On diffuse Q/K (random-weight-like) VS(1000, 6096) keeps nearly every tile at 16K: the op runs those
    heads through the dense walk, so it matches cuDNN's dense attention. The choice is made on the device:
    a graph captured on structured inputs (sparse) replays diffuse ones dense, and structured ones again
    sparse, equal to the op called outside the graph."""
    from minference_fx.autotune.workload import structured_qkv
    from minference_fx.kernels import guard

    n, scale = 16384, 128 ** -0.5
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * 8)
    args = (scale, 0, 0, *plan.op_arguments(), 0, 0.0)
    g = torch.Generator(device="cuda").manual_seed(0)
    diffuse = [(1.28 * torch.randn(1, h, n, 128, device="cuda", generator=g)).bfloat16() for h in (8, 2, 2)]
    structured = structured_qkv(n, num_q_heads=8, num_kv_heads=2, head_dim=128, seed=1)
    for (q, k, _), promoted in ((diffuse, True), (structured, False)):
        index = build_index_gpu(q, k, plan, scale=scale)
        assert bool(guard.near_dense(index, n, n, 0).all()) is promoted
    q, k, v = diffuse
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    assert _rel(OP(q, k, v, None, None, *args), dense) < 1e-2

    static = [t.clone() for t in structured]
    OP(*static, None, None, *args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*static, None, None, *args)
    for inputs in (diffuse, structured):
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, OP(*inputs, None, None, *args))
        if inputs is diffuse:
            assert _rel(out, dense) < 1e-2


def test_heads_dense_at_a_sites_previous_call_are_routed_to_sdpa_without_a_sync(monkeypatch):
    """Diffuse Q/K at 16K make every VS head near-dense: after that call (and the copy it queued has landed)
    the site routes all 8 heads, so its next calls run cuDNN on the whole layer even for structured inputs,
    whose own index is sparse. The first of them skips the index (every head routed), the second checks it
    (``recheck_every`` 2 here), so the call after that routes only the heads it found near-dense. A CUDA
    graph captured on a routed site reads and queues nothing while capturing and replays the routed path."""
    from minference_fx.autotune.workload import structured_qkv
    from minference_fx.kernels import guard

    n, scale = 16384, 128 ** -0.5
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    diffuse = [(1.28 * torch.randn(1, h, n, 128, device="cuda", generator=g)).bfloat16() for h in (8, 2, 2)]
    structured = structured_qkv(n, num_q_heads=8, num_kv_heads=2, head_dim=128, seed=1)
    monkeypatch.setattr(routing.ROUTER, "recheck_every", 2)
    monkeypatch.setattr(dispatch, "walk_cost", lambda q, k: cost.UNTUNED_COST)  # the near-dense rule alone
    site = routing.new_site()
    args = (scale, 0, 0, *plan.op_arguments(), 0, 0.0)
    OP(*diffuse, None, None, *args, site)
    torch.cuda.synchronize()
    assert routing.ROUTER.routed_heads(site, 8, diffuse[0].device) == tuple(range(8))
    q, k, v = structured
    near = guard.near_dense(build_index_gpu(q, k, plan, scale=scale), n, n, 0)[0].tolist()
    assert not all(near)
    dense = fused_sdpa(q, k, v, causal=True, scale=scale)  # the call routed heads run: cuDNN on Hopper
    unrouted = OP(q, k, v, None, None, *args)
    assert not torch.equal(unrouted, dense)  # structured inputs alone run (partly) sparse
    routed = OP(q, k, v, None, None, *args, site)
    assert torch.equal(routed, dense)  # the whole layer went to the same SDPA call
    torch.cuda.synchronize()
    assert routing.ROUTER.routed_heads(site, 8, q.device) == tuple(range(8))  # that call skipped the index
    assert torch.equal(OP(q, k, v, None, None, *args, site), dense)  # this one checks it, still routed
    torch.cuda.synchronize()
    assert routing.ROUTER.routed_heads(site, 8, q.device) == tuple(h for h in range(8) if near[h])
    torch.testing.assert_close(OP(q, k, v, None, None, *args, site), OP(q, k, v, None, None, *args))

    OP(*diffuse, None, None, *args, site)
    torch.cuda.synchronize()
    assert routing.ROUTER.routed_heads(site, 8, q.device) == tuple(range(8))  # read before the capture, which reads nothing
    static = [t.clone() for t in structured]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*static, None, None, *args, site)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dense)
    assert routing.ROUTER.routed_heads(site, 8, q.device) == tuple(range(8))  # the capture observed nothing


def test_heads_the_cost_model_finds_slower_walked_are_routed_and_a_capture_replays_them(monkeypatch):
    """With a walk rate at the structured heads' median share of their causal tiles (16K), the heads that keep
    at least that share route at the next call and equal cuDNN there, the others
    keep their index; a CUDA graph of that call replays the same. The layer is cheaper mixed (a free index), so
    it is not routed whole."""
    from minference_fx.cost import WalkCost
    from minference_fx.autotune.workload import structured_qkv
    from minference_fx.kernels import guard

    n, scale = 16384, 128 ** -0.5
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * 8)
    q, k, v = structured_qkv(n, num_q_heads=8, num_kv_heads=2, head_dim=128, seed=1)
    share = guard.kept_share(build_index_gpu(q, k, plan, scale=scale), n, n, 0)[0].tolist()
    rate = sorted(share)[4]  # as if the walk ran at this share of cuDNN's rate per tile: about half the heads cost more
    costly = tuple(h for h in range(8) if share[h] >= rate)
    assert costly and len(costly) < 8 and all(s < guard.NEAR_DENSE_SHARE for s in share)  # the premise
    monkeypatch.setattr(dispatch, "walk_cost", lambda q, k: WalkCost(rate, 0.0, 0))
    site = routing.new_site()
    args = (scale, 0, 0, *plan.op_arguments(), 0, 0.0)
    unrouted = OP(q, k, v, None, None, *args)
    OP(q, k, v, None, None, *args, site)
    torch.cuda.synchronize()
    assert routing.ROUTER.routed_heads(site, 8, q.device) == costly
    dense = fused_sdpa(q, k, v, causal=True, scale=scale)  # the call routed heads run: cuDNN on Hopper
    routed = OP(q, k, v, None, None, *args, site)
    cheap = [h for h in range(8) if h not in costly]
    torch.testing.assert_close(routed[:, list(costly)], dense[:, list(costly)])
    torch.testing.assert_close(routed[:, cheap], unrouted[:, cheap])
    torch.cuda.synchronize()
    torch.testing.assert_close(_replayed(q, k, v, None, None, *args, site), routed)


def test_an_all_routed_site_backs_off_its_index_checks_as_the_host_reads_each_decision(monkeypatch):
    """Diffuse Q/K at 16K make every VS head near-dense, so each check routes all 8 heads again: read by the host
    once its copy has landed, each such decision doubles the calls to the next check (2, 4, then the cap 4)."""
    monkeypatch.setattr(routing.ROUTER, "recheck_every", 2)
    monkeypatch.setattr(routing.ROUTER, "recheck_max", 4)
    monkeypatch.setattr(dispatch, "walk_cost", lambda q, k: cost.UNTUNED_COST)  # the near-dense rule alone
    n, scale = 16384, 128 ** -0.5
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    diffuse = [(1.28 * torch.randn(1, h, n, 128, device="cuda", generator=g)).bfloat16() for h in (8, 2, 2)]
    site = routing.new_site()

    def run():
        OP(*diffuse, None, None, scale, 0, 0, *plan.op_arguments(), 0, 0.0, site)
        torch.cuda.synchronize()  # the host reads each decision once its copy has landed

    assert calls_that_checked(run, site) == [0, 2, 6, 10]
    assert routing.ROUTER.routed_heads(site, 8, diffuse[0].device) == tuple(range(8))


@pytest.mark.parametrize("recheck_every", [1, 8], ids=["index checked", "index skipped"])
def test_routed_heads_under_a_padding_mask_run_sdpa_then_the_padded_row_masked_and_capture(monkeypatch, recheck_every):
    """generate's mask on the GPU, one prompt: after diffuse Q/K at 16K (every VS head near-dense) the site
    routes all 8 heads. Under an all-ones mask its next call is cuDNN's causal result exactly; on a left-padded
    row it runs cuDNN without the mask, then the row again in the masked dense walk, and equals masked dense
    attention (rows that see no key 0); a CUDA graph of that call replays it. So whether the call builds the
    index (``sparse_on_gpu``) or skips it (``dense.every_head_routed``)."""
    from minference_fx.autotune.workload import structured_qkv

    monkeypatch.setattr(routing.ROUTER, "recheck_every", recheck_every)
    monkeypatch.setattr(routing.ROUTER, "recheck_max", recheck_every)  # no back-off: "checked" checks every call

    n, pad, scale = 16384, 3000, 128 ** -0.5
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    diffuse = [(1.28 * torch.randn(1, h, n, 128, device="cuda", generator=g)).bfloat16() for h in (8, 2, 2)]
    ones = torch.ones(1, n, dtype=torch.bool, device="cuda")
    key_mask = ones.clone()
    key_mask[0, :pad] = False
    site = routing.new_site()
    args = (scale, 0, 0, *plan.op_arguments(), 0, 0.0)

    def route_all():  # the structured calls may un-route heads: diffuse Q/K route all 8 again
        OP(*diffuse, ones, None, *args, site)
        torch.cuda.synchronize()
        assert routing.ROUTER.routed_heads(site, 8, ones.device) == tuple(range(8))  # read now: a capture reads nothing

    q, k, v = structured_qkv(n, num_q_heads=8, num_kv_heads=2, head_dim=128, seed=1)
    route_all()
    unmasked = fused_sdpa(q, k, v, causal=True, scale=scale)  # the call routed heads run: cuDNN on Hopper
    assert torch.equal(OP(q, k, v, ones, None, *args, site), unmasked)  # the whole layer in one cuDNN call

    allowed = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None, None] & key_mask[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    want[:, :, :pad] = 0
    del allowed
    route_all()
    routed = OP(q, k, v, key_mask, None, *args, site)
    assert torch.isfinite(routed).all() and not routed[:, :, :pad].any()
    assert _rel(routed, want) < 1e-2

    route_all()
    torch.testing.assert_close(_replayed(q, k, v, key_mask, None, *args, site), routed)


def _replayed(q, k, v, *rest):
    """The op's output from a CUDA graph captured on copies of ``q``, ``k``, ``v`` (the other arguments ``rest``),
    replayed once."""
    static = [t.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*static, *rest)
    graph.replay()
    torch.cuda.synchronize()
    return out


class _EinsumBlock(torch.nn.Module):
    """Research-code attention on [B, S, H*D] activations: einsum products, a triu mask, the output viewed back
    with ``.view`` (which the op's contiguous output broke before the rewrite copied it into the traced order)."""

    def __init__(self, width=512, heads=4):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(width, 3 * width, bias=False)

    def forward(self, x):
        b, n, width = x.shape
        q, k, v = (t.view(b, n, self.heads, -1) for t in self.qkv(x).chunk(3, dim=-1))
        s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = torch.einsum("bhij,bjhd->bhid", s.softmax(dim=-1), v)
        sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return out.transpose(1, 2).reshape(b, n, width), sdpa.transpose(1, 2).view(b, n, width)


def test_einsum_attention_and_a_view_of_the_sdpa_output_through_inductor_match_eager():
    """On the GPU through Inductor (bf16, 4K tokens, the sparse path forced): both spellings are rewritten, the
    ``view`` of SDPA's transposed output compiles and runs, and both equal eager within bf16 error."""
    from minference_fx.backend import recent_reports

    torch.manual_seed(0)
    model = _EinsumBlock().cuda().to(torch.bfloat16)
    x = torch.randn(1, 4096, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend="minference", options={"min_sparse_len": 0})(x)
    rows = recent_reports()[-1].rows
    assert [r.decision for r in rows] == ["sparse", "sparse"], rows
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-2


def test_a_strided_view_past_2_31_row_elements_reads_what_a_contiguous_copy_reads():
    """HF hands the op [B, S, H, D].transpose(1, 2) views: with 32 heads of 128 a row's offset passes 2**31 elements
    past 524,288 tokens, where int32 row arithmetic read wrong rows. The kernel then addresses rows in int64 (no copy);
    on q, k and v alike (MHA, so K/V's rows pass it too) it must write what the contiguous copies' int32 launch writes."""
    S, H, D = 2**19 + 4096, 32, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 64, 128), HeadPlan(Pattern.A_SHAPE, 64, 256)) * (H // 2))
    index = build_index_gpu(q, k, plan, scale=D ** -0.5)
    assert rows_need_int64(q) and rows_need_int64(k)
    wide = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=D ** -0.5)
    q, k, v = (t.contiguous() for t in (q, k, v))
    assert not rows_need_int64(q, k, v)
    narrow = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=D ** -0.5)
    assert torch.isfinite(wide).all() and torch.equal(wide, narrow)


@pytest.mark.parametrize("int64_indexing", [True, False])
def test_a_prompt_past_2_31_activation_elements_recompiles_only_without_int64_indexing(int64_indexing):
    """Inductor indexes with int32 while the first prompt's sizes fit and guards on it; an MLP 2**20 wide passes
    2**31 elements between 1024 and 2304 tokens. With int64_indexing the longer prompt reuses the graph (and
    matches eager); without it, Inductor's guard recompiles."""
    from torch._dynamo.utils import counters

    from minference_fx.tools import bench_prefill as bp

    cfg = bp.llama3_8b_config(layers=1, max_len=4096, hidden_size=64, intermediate_size=2 ** 20, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128)
    model = bp.build_model(cfg, "cuda", torch.bfloat16)
    compiled = torch.compile(model, backend="minference", options={"int64_indexing": int64_indexing})
    graphs = []
    with torch.inference_mode():
        for seq in (1024, 2304):
            ids = bp.prompt_ids(seq, 128, 0, "cuda")
            torch._dynamo.mark_dynamic(ids, 1)
            got = compiled(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            graphs.append(counters["stats"]["unique_graphs"])
        dense = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
    assert 2304 * 2 ** 20 > 2 ** 31 - 1 >= 1024 * 2 ** 20
    assert graphs[1] - graphs[0] == (0 if int64_indexing else 1), graphs
    assert torch.isfinite(got).all() and _rel(got, dense) < 2e-2


@pytest.mark.parametrize("family", ["gpt2_upcast", "gpt_neox_japanese"])
def test_attention_on_merged_heads_through_inductor_matches_eager(family):
    """``baddbmm`` on [B·H, S, D] views, rewritten by the bmm pass, in bf16 on the GPU through Inductor: GPT-2's
    scores are upcast to fp32 and read below the casts, so the op gets bf16 q and k (a site given fp32 q and bf16
    v stays dense); both equal eager within bf16 error. GPT-2's positions stop at 1024."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import covering_config, tiny_model
    from minference_fx.backend import recent_reports

    model = tiny_model(family, "eager").cuda().to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 1024), device="cuda")
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="minference", options={"config": covering_config(model)})
        sparse = compiled(ids, use_cache=False).logits
    rows = recent_reports()[-1].rows
    assert [r.decision for r in rows] == ["sparse", "sparse"], rows
    assert _rel(sparse, dense) < 2e-2
