"""What ptxas makes of the attention kernel for a GPU target, without the GPU.

A kernel edit that looks free can tip ptxas into serialising the wgmma pipeline (its advisory C7515) or into
more registers: two scalar ops on the A-shape sinks did that once, and the sparse walk ran 14% slower at 128K
on the H200 (``git show 6fb579a:results/autotune_warmup_h200_2026-12-01_v13.txt``). Triton compiles to PTX on any machine and
ships ptxas, so this check costs seconds of CPU instead of a GPU session: a stand-in driver names the target,
the kernel is compiled as the op would launch it, and the launch, which needs a GPU, is not made.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime import driver

from minference_fx.defaults import DEFAULTS
from minference_fx.plan import LayerPlan

from . import attend
from .reference import SparseIndex

HOPPER = ("cuda", 90, 32)


@dataclasses.dataclass(frozen=True)
class Codegen:
    """ptxas's account of one compiled variant."""

    registers: int
    spill_bytes: int
    wgmma_serialized: bool
    """ptxas advisory C7515: the wgmma pipeline waits on ordinary instructions (a real slowdown)"""


class _TargetOnlyDriver:
    """Enough of a Triton driver to compile for ``target``; launching raises."""

    def __init__(self, target):
        self.target = GPUTarget(*target)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _ptxas(arch: int) -> Path:
    """The ptxas Triton itself picks for ``arch``: the PTX it writes targets that ptxas's ISA version.
    Triton 3.9 assembles sm_90 with its bundled CUDA 13 ``ptxas-blackwell`` (PTX 9.x), which the plain
    CUDA 12.9 ``ptxas`` rejects (exit 255); 3.6-3.8 use the plain one below sm_100."""
    return Path(get_ptxas(arch).path)


def sparse_walk_ptx(head_dim: int, block_m: int, block_n: int, num_warps: int, num_stages: int, *,
                    key_mask: bool = False, dense_walk: bool = False, target=HOPPER, **launch) -> str:
    """The PTX of the attention kernel (bf16, vertical-slash heads) as the op would launch it for ``target``.

    ``dense_walk``: the launch of forced-dense heads only (``forced="only"``, 128-row programs allowed);
    ``launch``: further arguments to :func:`attend.sparse_attention_triton`. Needs ``TRITON_INTERPRET`` unset or 0
    when Triton was imported (the interpreter compiles nothing)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("kernel codegen needs TRITON_INTERPRET=0: the interpreter compiles nothing")
    b, hq, hkv, s = 1, 8, 2, 1024
    q = torch.zeros(b, hq, s, head_dim, dtype=torch.bfloat16)
    k, v = (torch.zeros(b, hkv, s, head_dim, dtype=torch.bfloat16) for _ in range(2))
    m = s // 64
    # int32 starts: the index of a prompt past 32K keys, where the walk's speed matters
    index = SparseIndex(torch.zeros(b, hq, m, dtype=torch.int32), torch.zeros(b, hq, m, 16, dtype=torch.int32),
                        torch.zeros(b, hq, m, dtype=torch.int32), torch.zeros(b, hq, m, 16, dtype=torch.int32))
    plan = LayerPlan((DEFAULTS.head,) * hq)
    if dense_walk:
        launch = {**launch, "force_dense": torch.ones(b, hq, dtype=torch.bool), "forced": "only"}
    kernel = attend._sparse_attn_fwd
    before = set(id(x) for cache in kernel.device_caches.values() for x in cache[0].values())
    previous = driver._active  # reset_active() would build the default driver, which needs a GPU
    driver.set_active(_TargetOnlyDriver(target))
    try:
        attend.sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=head_dim ** -0.5,
                                       key_mask=torch.ones(b, s, dtype=torch.bool) if key_mask else None,
                                       num_warps=num_warps, num_stages=num_stages, block_m=block_m, block_n=block_n,
                                       **launch)
    except AttributeError as e:  # the launch: the stand-in driver has no launcher, and nothing is meant to run
        if "launcher" not in str(e):
            raise
    finally:
        driver._active = previous
    compiled = [x for cache in kernel.device_caches.values() for x in cache[0].values() if id(x) not in before]
    if len(compiled) != 1:
        raise RuntimeError(f"expected one new compiled variant, found {len(compiled)}")
    return compiled[0].asm["ptx"]


def ptx_instructions(ptx: str) -> str:
    """``ptx`` without its debug information (line records, file names, the labels of inlined scopes, the DWARF
    sections): moving kernel code between lines or into a ``@triton.jit`` helper changes only those."""
    ptx = ptx.split(".section\t.debug", 1)[0]
    return "\n".join(line for line in ptx.splitlines()
                     if not re.match(r"\s*\.(loc|file)\b", line) and not re.fullmatch(r"\$L__tmp\d+:", line))


def ptxas_report(ptx_text: str, target=HOPPER) -> Codegen:
    """ptxas's account of the PTX ``ptx_text`` assembled for ``target``."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(ptx_text)
        arch = f"sm_{target[1]}a" if target[1] == 90 else f"sm_{target[1]}"
        report = subprocess.run([str(_ptxas(target[1])), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return Codegen(registers, spills, "C7515" in report)


def sparse_walk_codegen(head_dim: int, block_m: int, block_n: int, num_warps: int, num_stages: int, *,
                        key_mask: bool = False, target=HOPPER, **launch) -> Codegen:
    """ptxas's report on :func:`sparse_walk_ptx`'s kernel."""
    return ptxas_report(sparse_walk_ptx(head_dim, block_m, block_n, num_warps, num_stages, key_mask=key_mask,
                                        target=target, **launch), target)
