"""Kernel launches on views whose element offsets pass 2**31, run in a child process (one for all of them).

Where int32 offsets wrap, the interpreter reads outside the buffer and dies of a segmentation fault; in the test's
own process that would end the whole run without a report. The cases live here, in a module the child can import
by name (the tests run under ``--import-mode=importlib``, whose test modules it cannot).
"""
import json
import multiprocessing
import traceback

import pytest
import torch

from minference_fx.kernels import reference
from minference_fx.kernels.attend import rows_need_int64, sparse_attention_triton
from minference_fx.plan import HeadPlan, LayerPlan, Pattern


def sparse_view(shape, strides, dtype=torch.float16):
    """A view whose last element lies past 2**31 elements, over a buffer that is mostly never touched (the OS commits
    only the pages the view's elements fill): offsets that int32 arithmetic wraps, on a CPU."""
    span = sum((n - 1) * st for n, st in zip(shape, strides)) + 1
    try:
        return torch.empty(span, dtype=dtype).as_strided(shape, strides)
    except RuntimeError as e:  # no room to reserve the address range
        pytest.skip(f"cannot reserve {span * 2 / 2**30:.1f} GiB of address space: {e}")


def packed_views_case(launch: dict, plan: LayerPlan) -> None:
    """Packed HF-style q, k, v views whose rows from 300 on lie past 2**31 elements: the launch equals the contiguous
    copies' bit for bit."""
    S, Hq, Hkv, D, row_stride = 310, 4, 2, 16, 7_158_288  # 300 x row_stride > 2**31
    packed = sparse_view((1, S, Hq + 2 * Hkv, D), ((S - 1) * row_stride + (Hq + 2 * Hkv) * D, row_stride, D, 1))
    packed.copy_(torch.randn(1, S, Hq + 2 * Hkv, D, generator=torch.Generator().manual_seed(0)))
    qkv = packed.transpose(1, 2)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    assert rows_need_int64(q) and rows_need_int64(k) and rows_need_int64(v)
    contiguous = [t.contiguous() for t in (q, k, v)]
    index = reference.build_index(*contiguous[:2], plan, scale=0.25)
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=0.25, **launch)
    want = sparse_attention_triton(*contiguous, index, *plan.op_arguments(), scale=0.25, **launch)
    assert torch.equal(got, want)


def head_dim_stride_case() -> None:
    """A q whose head-dim stride is 2**28 puts its columns past 2**31 elements."""
    S, D = 130, 16
    q = sparse_view((1, 1, S, D), (1, 1, 16, 2**28))
    g = torch.Generator().manual_seed(0)
    q.copy_(torch.randn(1, 1, S, D, generator=g))
    k, v = (torch.randn(1, 1, S, D, generator=g).half() for _ in range(2))
    assert rows_need_int64(q)
    plan = LayerPlan((HeadPlan(Pattern.DENSE),))
    index = reference.build_index(q.contiguous(), k, plan, scale=0.25)
    got = sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=0.25)
    assert torch.equal(got, sparse_attention_triton(q.contiguous(), k, v, index, *plan.op_arguments(), scale=0.25))


def _child_of_cases(cases: dict, log: str) -> None:
    """Each case in turn, a line in ``log`` when it starts and one with its outcome (flushed before the next)."""
    with open(log, "a") as out:
        def note(**line):
            out.write(json.dumps(line) + "\n")
            out.flush()

        for name, (case, args) in cases.items():
            note(name=name, status="started")
            try:
                case(*args)
            except pytest.skip.Exception as e:
                note(name=name, status="skip", detail=str(e))
            except BaseException:  # noqa: BLE001  (an assertion or any error: that case fails, the next ones run)
                note(name=name, status="fail", detail=traceback.format_exc()[-4000:])
            else:
                note(name=name, status="ok")


def run_cases_in_a_child(cases: dict, log) -> dict:
    """Every ``cases[name] = (case, args)`` in one fresh process, in turn: one start-up (seconds of imports) for all
    of them, where a child a case would pay one each. Returns name -> (status, detail), status "ok", "skip" or
    "fail". A case that kills the child (-11, a segmentation fault, for int32 offsets past 2**31) fails with the
    exit code, and so does every case after it (not run); the cases before it ran to their end, as in children of
    their own. A child that exits non-zero after its last case fails every case, as each case's own child would."""
    child = multiprocessing.get_context("spawn").Process(target=_child_of_cases, args=(cases, str(log)))
    child.start()
    child.join()
    lines = [json.loads(line) for line in open(log).read().splitlines()] if log.exists() else []
    results, running = {}, None
    for line in lines:
        if line["status"] == "started":
            running = line["name"]
        else:
            results[line["name"]], running = (line["status"], line.get("detail", "")), None
    if child.exitcode != 0:
        died = (f"the child ended with exit code {child.exitcode} (a negative code is the signal: -11, a segmentation "
                f"fault, is what int32 offsets past 2**31 give)")
        for name in cases:
            if name == running:
                results[name] = ("fail", f"{died} in this case")
            elif name not in results:
                results[name] = ("fail", f"{died} in case {running}; this case did not run")
            elif running is None and results[name][0] != "fail":  # died after the last case: every case's child
                results[name] = ("fail", f"{died} after its cases ran")
    return results


def outcome(result: tuple, name: str) -> None:
    """A test's end from its case's ``run_cases_in_a_child`` result: passes, skips or fails with the child's words."""
    status, detail = result
    if status == "skip":
        pytest.skip(f"the child process could not reserve the address space: {detail}")
    assert status == "ok", f"{name}: {detail}"
