"""Peers of ``bench kernels`` on the same inputs and the same keys: FlashInfer's block-sparse attention and
MInference's vertical-slash kernel as shipped (issue 36, part 4).

A benchmark kept outside the package: ``minference_fx`` never imports this folder, and neither peer is a
dependency of it. Each peer is imported inside its adapter; a peer whose package is missing is reported as
"not installed" in its row, not raised.

What each peer is given, from one :class:`~minference_fx.tools.bench.KernelCase`:

* **FlashInfer** (``flashinfer.sparse.VariableBlockSparseAttentionWrapper``: one block layout per kv head,
  q/k/v as ``[heads, seq, head_dim]``): a layout of 64 x 64 blocks per query head, the key tiles our index
  lists plus, for its leftover gathered columns, the whole blocks that hold them (a block layout cannot
  name single keys, so FlashInfer reads more keys than we do there; each row says how many more tiles).
  Our heads differ in sparsity and that wrapper shares a layout across the query heads of a kv head, so
  K/V are repeated to one kv head per query head. ``causal=True`` masks against the keys each block row
  gathers, aligned at their end, which is the causal mask only while every row lists its own diagonal block
  as its last: :func:`flashinfer_layout` checks that.
* **MInference** (``minference.ops.pit_sparse_flash_attention_v2.vertical_slash_sparse_attention``): the
  same vertical columns and slash diagonals our index was built from (:func:`selection_of`), as its
  ``v_idx`` (key positions) and ``s_idx`` (offsets below the diagonal, row - key: 0 is the diagonal). Its
  kernel reads K/V with the query's head index, so K/V are repeated to the query heads, and it fixes the
  softmax scale at ``head_dim ** -0.5``.
* **MInference's prefill, end to end** (peer ``minference-prefill``:
  ``minference.modules.minference_forward.minference_prefill_forward``, what its patched attention calls on a
  prompt): a head at a time, its own estimate from the last 64 queries, its top-k, its index conversion and
  the same kernel, every head vertical-slash at our plan's budgets. Its picks are its own, so its error is
  its own; this is the row to set against our index + kernel, which also estimate.

The conversions are plain torch, checked on CPU by ``tests/test_peers.py``; the runs need a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import sys
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minference_fx.autotune.dispatch import launch_config
from minference_fx.cli import parse_lengths
from minference_fx.defaults import DEFAULTS
from minference_fx.kernels.attend import sparse_attention_triton
from minference_fx.kernels.density import KeySelection, selection_of
from minference_fx.kernels.index import build_index_gpu
from minference_fx.kernels.reference import BLOCK, SparseIndex, covering_tiles, listed_slots
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools import bench

# each peer and the package it imports
PEER_PACKAGES = {"flashinfer": "flashinfer", "minference": "minference", "minference-prefill": "minference"}
PEERS = tuple(PEER_PACKAGES)
# extensions of MInference's KV-cache methods (KIVI's CUDA GEMV, LeanK's TileLang kernels, RetrievalAttention's
# faiss) that its modules import at import time; its prefill path calls none of them, and its setup builds none
MINFERENCE_UNUSED_EXTENSIONS = ("kivi_gemv", "tilelang", "tilelang.language", "papyfaiss")
NOT_INSTALLED = "not installed"
# MInference pads nothing: a -1 would be read as key -1. A key and an offset past every row are skipped by its
# index converter (csrc/vertical_slash_index.cu: columns at or after the last slash range are never emitted,
# offsets at or past a row block's end are passed over), so heads with fewer picks are padded with this.
MINFERENCE_FAR = 1 << 30
FLASHINFER_WORKSPACE_BYTES = 256 << 20
FLASHINFER_MAX_GATHERED = 2**30  # half the 32-bit limit: a margin for padding its planner may add


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- FlashInfer's layout


def block_mask_of(index: SparseIndex, skv: int) -> torch.Tensor:
    """bool ``[B, Hq, M, N]``: the aligned key blocks of 64 each query tile reads: those holding the index's blocks
    (``covering_tiles``) and its leftover columns."""
    n_blocks = _cdiv(skv, BLOCK)
    B, H, M = index.block_count.shape
    mask = torch.zeros(B, H, M, n_blocks + 1, dtype=torch.bool, device=index.block_count.device)
    listed = listed_slots(index.col_index, index.col_count)
    # unlisted entries go to a spare block that is dropped afterwards
    mask.scatter_(-1, torch.where(listed, index.col_index.long() // BLOCK, n_blocks), True)
    return mask[..., :n_blocks] | covering_tiles(index, skv)


@dataclasses.dataclass
class FlashInferLayout:
    """The arguments of ``VariableBlockSparseAttentionWrapper.plan`` for one batch row, one "kv head" per query
    head: ``block_mask_map`` bool ``[Hq, M, N]``, ``block_row_sz`` int32 ``[Hq, M]``, ``block_col_sz`` int32
    ``[Hq, N]``; ``extra_blocks``, the blocks beyond our index's own (those of leftover columns, and a diagonal
    block's second aligned tile): work FlashInfer does that our walk does not."""

    block_mask_map: torch.Tensor
    block_row_sz: torch.Tensor
    block_col_sz: torch.Tensor
    extra_blocks: int


def _block_sizes(length: int, heads: int, device) -> torch.Tensor:
    sizes = torch.full((heads, _cdiv(length, BLOCK)), BLOCK, dtype=torch.int32, device=device)
    sizes[:, -1] = length - (sizes.shape[1] - 1) * BLOCK
    return sizes


def flashinfer_layout(index: SparseIndex, sq: int, skv: int | None = None, *, batch: int = 0) -> FlashInferLayout:
    """Our index as FlashInfer's variable block-sparse layout (row ``batch``: the wrapper has no batch).

    Raises ValueError where a query block does not read its own diagonal block or reads a block after it: with
    ``causal=True`` FlashInfer aligns the causal mask to the end of the keys a block row gathers, which is
    position-true only when that row's last block is its diagonal one.
    """
    skv = sq if skv is None else skv
    if skv != sq:
        raise ValueError(f"the causal alignment needs as many keys as queries, got {sq} queries and {skv} keys")
    mask = block_mask_of(index, skv)[batch]  # [H, M, N]
    H, M, N = mask.shape
    if M != _cdiv(sq, BLOCK):
        raise ValueError(f"index has {M} query tiles, {sq} rows make {_cdiv(sq, BLOCK)}")
    m = torch.arange(M, device=mask.device)
    last = torch.where(mask, torch.arange(N, device=mask.device), -1).amax(-1)  # [H, M]
    if not bool((last == m).all()):
        h, row = (last != m).nonzero()[0].tolist()
        raise ValueError(f"head {h} query block {row} ends at key block {int(last[h, row])}, not its diagonal block "
                         f"{row}: FlashInfer's causal mask would be misaligned there")
    tiles = index.block_count[batch].long().sum()
    return FlashInferLayout(mask, _block_sizes(sq, H, mask.device), _block_sizes(skv, H, mask.device),
                            int(mask.sum() - tiles))


def tile_steps(index: SparseIndex) -> int:
    """64 x 64 steps our kernel walks over ``index``: its listed tiles and its leftover columns 64 at a time."""
    return int(index.block_count.long().sum() + ((index.col_count.long() + BLOCK - 1) // BLOCK).sum())


# --------------------------------------------------------------------------- MInference's indices


def minference_indices(selection: KeySelection) -> tuple[torch.Tensor, torch.Tensor]:
    """(``v_idx``, ``s_idx``) int32 ``[B, Hq, C]`` / ``[B, Hq, S]`` for ``vertical_slash_sparse_attention``.

    MInference's convention (``minference/modules/minference_forward.py``, ``vertical_and_slash_kernel``:
    ``slash = (q_len - 1) - topk(diagonal sums).indices``, the last diagonal sum being the main diagonal) is
    the :class:`KeySelection`'s: columns are key positions and slashes are ``row - key``. It sorts both itself;
    the -1 padding of heads with fewer picks becomes :data:`MINFERENCE_FAR`, which it skips.
    """
    def convert(picks):
        return torch.where(picks >= 0, picks, MINFERENCE_FAR).to(torch.int32).contiguous()

    return convert(selection.columns), convert(selection.diagonals)


# --------------------------------------------------------------------------- accuracy


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over the whole tensor, in fp32, one (batch, head) slice at a time."""
    if out.shape != ref.shape:
        raise ValueError(f"output {list(out.shape)} and reference {list(ref.shape)} differ in shape")
    diff = norm = 0.0
    for a, b in zip(out.reshape(-1, *out.shape[-2:]), ref.reshape(-1, *ref.shape[-2:])):
        a, b = a.float(), b.float()
        diff += float((a - b).square().sum())
        norm += float(b.square().sum())
    return (diff / norm) ** 0.5 if norm else float(diff > 0)


# --------------------------------------------------------------------------- runs (GPU)


def peer_status(name: str) -> str | None:
    """None when peer ``name``'s package can be imported, else why it cannot run."""
    return None if importlib.util.find_spec(PEER_PACKAGES[name]) is not None else NOT_INSTALLED


def flashinfer_head_chunks(layout: FlashInferLayout) -> list[range]:
    """The query heads planned together, in order: as many as keep the keys one plan gathers (64 per listed block)
    under :data:`FLASHINFER_MAX_GATHERED`. Its planner counts them in 32 bits: 32 heads of the scattered family at
    128K gathered 2,707,467,712 and failed (``AssertionError: -1587499584 != 2707467712``, H200, 2026-12-03)."""
    gathered = (layout.block_mask_map.sum((-1, -2)).long() * BLOCK).tolist()  # per head
    chunks, start, total = [], 0, 0
    for h, keys in enumerate(gathered):
        if keys > FLASHINFER_MAX_GATHERED:
            raise ValueError(f"head {h} alone gathers {keys} keys, past FlashInfer's 32-bit count")
        if total + keys > FLASHINFER_MAX_GATHERED:
            chunks.append(range(start, h))
            start, total = h, 0
        total += keys
    return chunks + [range(start, len(gathered))]


def run_flashinfer(case, *, reps: float):
    """(plan ms, run ms, output ``[1, Hq, S, D]``, blocks read only for columns) of FlashInfer on ``case``; heads
    too many for one plan are planned and run in chunks (:func:`flashinfer_head_chunks`), their times summed."""
    # an optional peer: only a benchmark machine has it, and it JIT-compiles its kernels there on first use
    from flashinfer.sparse import VariableBlockSparseAttentionWrapper

    q, k, v = case.q, case.k, case.v
    if q.shape[0] != 1:
        raise ValueError("the FlashInfer wrapper takes one sequence; the benchmark runs batch 1")
    Hq, sq, D = q.shape[1:]
    group = Hq // k.shape[1]
    layout = flashinfer_layout(case.index, sq)
    k_rep, v_rep = (x[0].repeat_interleave(group, 0).contiguous() for x in (k, v))  # one "kv head" per query head
    q_hnd = q[0].contiguous()
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    plan_ms = run_ms = 0.0
    outs = []
    for heads in flashinfer_head_chunks(layout):
        part = slice(heads.start, heads.stop)
        wrapper = VariableBlockSparseAttentionWrapper(workspace)  # one at a time: they share the workspace

        def plan(wrapper=wrapper, part=part, n=len(heads)):
            wrapper.plan(layout.block_mask_map[part], layout.block_row_sz[part], layout.block_col_sz[part], n, n, D,
                         causal=True, sm_scale=case.scale, q_data_type=q.dtype)

        plan_ms += bench._ms(plan, reps)
        plan()
        args = (q_hnd[part].contiguous(), k_rep[part].contiguous(), v_rep[part].contiguous())
        run_ms += bench._ms(lambda wrapper=wrapper, args=args: wrapper.run(*args), reps)
        outs.append(wrapper.run(*args))
    return plan_ms, run_ms, torch.cat(outs)[None], layout.extra_blocks


def minference_kernel():
    """MInference's ``vertical_slash_sparse_attention``, from a source checkout installed on the benchmark machine
    (its CUDA index converter is built there).

    The package's ``__init__`` also imports its model patches, written against transformers 4.x; where that fails,
    the kernel module is loaded under a bare package entry that runs no ``__init__``: the kernel and its CUDA
    converter are the same code either way.
    """
    name = "minference.ops.pit_sparse_flash_attention_v2"
    try:
        return importlib.import_module(name).vertical_slash_sparse_attention
    except Exception as exc:  # the patches' import, not the kernel's, is what fails under transformers 5
        reason = f"{type(exc).__name__}: {exc}"
    for loaded in [m for m in sys.modules if m == "minference" or m.startswith("minference.")]:
        del sys.modules[loaded]
    spec = importlib.util.find_spec("minference")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"minference is not installed ({reason})")
    sys.modules["minference"] = importlib.util.module_from_spec(spec)  # its __init__ never runs
    print(f"minference: package __init__ failed ({reason[:160]}); loaded its kernel module alone", flush=True)
    return importlib.import_module(name).vertical_slash_sparse_attention


def minference_qkv(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``case``'s Q, and K/V repeated to the query heads (MInference reads K/V by the query head's index); refused
    unless the case's scale is ``head_dim ** -0.5``, which MInference fixes."""
    q, k, v = case.q, case.k, case.v
    D = q.shape[-1]
    if abs(case.scale - D ** -0.5) > 1e-12:
        raise ValueError(f"MInference fixes the softmax scale at head_dim ** -0.5, the case uses {case.scale}")
    group = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def run_minference(case, selection: KeySelection, *, reps: float):
    """(ms, output ``[1, Hq, S, D]``) of MInference's vertical-slash attention on ``case``'s picks."""
    vertical_slash_sparse_attention = minference_kernel()
    q, k_rep, v_rep = minference_qkv(case)
    v_idx, s_idx = minference_indices(selection)

    def call():
        return vertical_slash_sparse_attention(q, k_rep, v_rep, v_idx, s_idx)

    return bench._ms(call, reps), call()


def stub_missing_modules(names) -> list[str]:
    """Put an empty module in ``sys.modules`` for each of ``names`` that cannot be imported; return those stubbed."""
    stubbed = []
    for name in names:
        if name in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a dotted name under a stub, which is no package
            found = False
        if not found:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = module
            stubbed.append(name)
    return stubbed


@contextlib.contextmanager
def package_checks_as_bools():
    """transformers 5's ``_is_package_available`` returns ``(available, version)``, a tuple and so always true;
    MInference tests it as a bool at import (``if _is_package_available("vllm"): ... import vllm``). Within this
    block it answers the bool alone."""
    from transformers.utils import import_utils

    original = import_utils._is_package_available

    def as_bool(name, *args, **kwargs):
        found = original(name, *args, **kwargs)
        return found[0] if isinstance(found, tuple) else found

    import_utils._is_package_available = as_bool
    try:
        yield
    finally:
        import_utils._is_package_available = original


def minference_prefill():
    """MInference's ``minference_prefill_forward``, its module imported as :func:`minference_kernel` imports the
    kernel's, with :data:`MINFERENCE_UNUSED_EXTENSIONS` stubbed where missing and its package checks as bools."""
    minference_kernel()  # the package, or its bare entry where its __init__ fails
    stubbed = stub_missing_modules(MINFERENCE_UNUSED_EXTENSIONS)
    if stubbed:
        print(f"minference: stubbed {', '.join(stubbed)} (not called on its prefill path)", flush=True)
    with package_checks_as_bools():
        return importlib.import_module("minference.modules.minference_forward").minference_prefill_forward


def minference_prefill_kwargs(plan: LayerPlan) -> dict:
    """``prefill_kwargs`` of ``minference_prefill_forward`` for one layer whose every head is vertical-slash at
    ``plan``'s budgets: its search config's ``best_pattern`` entry per head, (type, vertical, slash, score)."""
    heads = {}
    for h, hp in enumerate(plan.heads):
        if hp.pattern is not Pattern.VERTICAL_SLASH:
            raise ValueError(f"head {h} is {hp.pattern.value}; MInference's prefill runs vertical-slash heads here")
        heads[str(h)] = ("vertical_and_slash", hp.budget_a, hp.budget_b, 1)
    return {"attn_forward_config": {"best_pattern": [heads]}, "layer_idx": 0, "num_hidden_layers": 1}


def run_minference_prefill(case, plan: LayerPlan, *, reps: float):
    """(ms, output ``[1, Hq, S, D]``) of MInference's prefill attention on ``case``: its own estimate and picks."""
    prefill_forward = minference_prefill()
    q, k_rep, v_rep = minference_qkv(case)
    kwargs = minference_prefill_kwargs(plan)

    def call():
        return prefill_forward(q, k_rep, v_rep, kwargs)

    return bench._ms(call, reps), call()


@dataclasses.dataclass
class PeerRow:
    """One (family, length): ours and each peer's time in ms, its relative error against dense attention (cuDNN,
    or FlashAttention where cuDNN fails) on the same inputs, and why a peer has no number."""

    family: str
    seq: int
    index_ms: float
    kernel_ms: float
    total_ms: float
    ours_error: float
    dense_ms: float
    dense_backend: str
    flashinfer_plan_ms: float | None = None
    flashinfer_ms: float | None = None
    flashinfer_error: float | None = None
    flashinfer_extra_blocks: int | None = None
    """64 x 64 blocks FlashInfer reads only because a leftover column lies in them (our index gathers columns)"""
    our_tile_steps: int | None = None
    """64 x 64 steps our kernel walks (listed tiles, column groups of 64), for comparison"""
    minference_ms: float | None = None
    minference_error: float | None = None
    minference_prefill_ms: float | None = None
    """MInference's prefill end to end: its estimate, picks, conversion and kernel, a head at a time"""
    minference_prefill_error: float | None = None
    notes: dict = dataclasses.field(default_factory=dict)
    """peer -> why it has no number ("not installed", or the error it raised)"""


def _dense(q, k, v, scale):
    """(backend name, ms function, output) of causal dense attention, cuDNN first."""
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True, scale=scale)
        try:
            return name, fn, fn()
        except RuntimeError as exc:
            print(f"dense {name}: {exc}"[:300])
    raise RuntimeError("neither cuDNN nor FlashAttention ran the dense reference")


def bench_peers(lengths, families=None, budgets=None, peers=PEERS) -> list[PeerRow]:
    """Ours (index + kernel), dense, FlashInfer and MInference on ``bench kernels``' inputs, one row a case."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; known: {', '.join(PEERS)}")
    families = bench.parse_families(",".join(families or bench.KERNEL_FAMILIES))
    budgets = tuple(budgets or DEFAULTS.budgets)
    shape = bench.LLAMA3_8B
    plan = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, *budgets),) * shape["num_q_heads"])
    patterns, budget_a, budget_b = plan.op_arguments()
    rows = []
    for family in families:
        for seq in lengths:
            case = bench.prepare_case(family, seq, plan, shape=shape)
            q, k, v, scale, index = case.q, case.k, case.v, case.scale, case.index
            reps = 5 if seq <= 131072 else 1
            launch = launch_config(q, k).launch()

            def kernel(index=index):
                return sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, scale=scale, **launch)

            index_ms = bench._ms(lambda: build_index_gpu(q, k, plan, scale=scale), reps)
            kernel_ms = bench._ms(kernel, reps)
            total_ms = bench._ms(lambda: kernel(build_index_gpu(q, k, plan, scale=scale)), reps)
            dense_name, dense_fn, ref = _dense(q, k, v, scale)
            row = PeerRow(family, seq, index_ms, kernel_ms, total_ms, relative_error(kernel(), ref),
                          bench._ms(dense_fn, 3 if seq <= 131072 else 1), dense_name, our_tile_steps=tile_steps(index))
            del dense_fn  # its repeated K/V are not needed while the peers run
            for peer in peers:
                status = peer_status(peer)
                if status:
                    row.notes[peer] = status
                    continue
                try:
                    if peer == "flashinfer":
                        row.flashinfer_plan_ms, row.flashinfer_ms, out, row.flashinfer_extra_blocks = run_flashinfer(
                            case, reps=reps)
                        row.flashinfer_error = relative_error(out, ref)
                    elif peer == "minference-prefill":
                        row.minference_prefill_ms, out = run_minference_prefill(case, plan, reps=reps)
                        row.minference_prefill_error = relative_error(out, ref)
                    else:
                        selection = selection_of(q, k, plan, scale=scale)
                        row.minference_ms, out = run_minference(case, selection, reps=reps)
                        row.minference_error = relative_error(out, ref)
                    del out
                except Exception as exc:  # a peer that cannot run is reported in its row, not fatal
                    row.notes[peer] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.empty_cache()
            print(format_peer_rows([row]).splitlines()[1], flush=True)
            rows.append(row)
            del q, k, v, index, case, ref
            torch.cuda.empty_cache()
    return rows


def format_peer_rows(rows) -> str:
    """One table: ours, dense, FlashInfer, MInference, each with its relative error and ours / peer."""
    def f(x, spec):
        return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)

    def ratio(ours, peer):
        return None if peer is None else ours / peer

    head = (f"{'family':>10} {'seq':>7} {'index':>7} {'kernel':>7} {'total':>7} {'err':>7} {'dense':>8} {'o/d':>5} "
            f"{'FI plan':>8} {'FI':>8} {'err':>7} {'o/FI':>5} {'+til%':>5} {'MInf':>8} {'err':>7} {'o/MI':>5} "
            f"{'MI pre':>8} {'err':>7} {'o/MIp':>5}")
    lines = [head]
    for r in rows:
        blocks = r.flashinfer_extra_blocks
        extra = None if blocks is None else 100 * blocks / max(r.our_tile_steps or 0, 1)
        lines.append(
            f"{r.family:>10} {r.seq:>7} {r.index_ms:>7.2f} {r.kernel_ms:>7.2f} {r.total_ms:>7.2f} {r.ours_error:>7.4f} "
            f"{r.dense_ms:>8.2f} {ratio(r.total_ms, r.dense_ms):>5.2f} "
            f"{f(r.flashinfer_plan_ms, '8.2f')} {f(r.flashinfer_ms, '8.2f')} {f(r.flashinfer_error, '7.4f')} "
            f"{f(ratio(r.kernel_ms, r.flashinfer_ms), '5.2f')} {f(extra, '5.1f')} "
            f"{f(r.minference_ms, '8.2f')} {f(r.minference_error, '7.4f')} "
            f"{f(ratio(r.kernel_ms, r.minference_ms), '5.2f')} "
            f"{f(r.minference_prefill_ms, '8.2f')} {f(r.minference_prefill_error, '7.4f')} "
            f"{f(ratio(r.total_ms, r.minference_prefill_ms), '5.2f')}")
        lines.extend(f"{'':>10} {r.seq:>7} {peer}: {why}" for peer, why in r.notes.items())
    lines.append("times in ms; err = ||out - dense|| / ||dense|| on the same inputs (dense: cuDNN, else flash); "
                 "o/d = our index+kernel / dense, o/FI and o/MI = our kernel / the peer's run (below 1: ours faster); "
                 "FI plan = FlashInfer's planning, not in o/FI; MInf includes its block conversion of the same picks; "
                 "+til% = aligned blocks FlashInfer reads beyond our index's listed tiles (for leftover columns, which our "
                 "walk gathers 64 a step, and diagonal blocks' second tiles), over our tile steps; MI pre = MInference's "
                 "prefill with its own estimate and picks, a head at a time, and o/MIp = our index+kernel / it")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="32k,128k", help="comma list, e.g. 32k,128k")
    parser.add_argument("--families", default=",".join(bench.KERNEL_FAMILIES), help="comma list of input families")
    parser.add_argument("--budgets", default=None, help="vertical,slash budgets of every head, e.g. 1000,6096")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ", ".join(PEERS))
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.peers needs a CUDA GPU")
    budgets = tuple(int(x) for x in args.budgets.split(",")) if args.budgets else None
    rows = bench_peers(parse_lengths(args.lengths), args.families.split(","), budgets,
                       tuple(p.strip() for p in args.peers.split(",") if p.strip()))
    print(format_peer_rows(rows))
    if args.out:
        command = "python -m benchmarks.peers " + " ".join(sys.argv[1:] if argv is None else argv)
        bench.write_json(args.out, rows, command)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
