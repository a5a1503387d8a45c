"""What ptxas makes of the attention kernel for a GPU target, without the GPU.

A kernel edit that looks free can tip ptxas into serialising the wgmma pipeline (its advisory C7515) or into
more registers: two scalar ops on the A-shape sinks did that once, and the sparse walk ran 14% slower at 128K
on the H200 (``git show 6fb579a:results/autotune_warmup_h200_2026-12-01_v13.txt``). Triton compiles to PTX on any machine and
ships ptxas, so this check costs seconds of CPU instead of a GPU session: a stand-in driver names the target,
the kernel is compiled as the op would launch it, and the launch runs nothing (:func:`simulated_gpu`, which
also makes Triton's own shared-memory check against the target's limit, or any other).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import compiler as triton_compiler
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from minference_fx.defaults import DEFAULTS
from minference_fx.plan import LayerPlan

from . import attend, guard, index
from .reference import SparseIndex

HOPPER = ("cuda", 90, 32)


@dataclasses.dataclass(frozen=True)
class Codegen:
    """ptxas's account of one compiled variant."""

    registers: int
    spill_bytes: int
    wgmma_serialized: bool
    """ptxas advisory C7515: the wgmma pipeline waits on ordinary instructions (a real slowdown)"""


# Shared memory one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), by compute capability.
SHARED_MEMORY_OPTIN = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


class _NoUtils:
    """The device queries Triton makes at a kernel's first launch, answered for a device that is not there."""

    def __init__(self, shared_memory: int):
        self.shared_memory = shared_memory

    def get_device_properties(self, device):
        return {"max_shared_mem": self.shared_memory}

    def load_binary(self, name, kernel, shared, device):  # (module, function, registers, spills, max threads)
        return None, None, 0, 0, 1024


class _SimulatedGpuDriver:
    """Enough of a Triton driver to compile for ``target`` and make Triton's own first-launch checks against
    ``shared_memory`` bytes a block, as a device of that target would; a launch that passes them runs nothing."""

    def __init__(self, target, shared_memory: int):
        self.target = GPUTarget(*target)
        self.utils = _NoUtils(shared_memory)
        self.compiled: list = []
        """(kernel name, shared memory bytes) of every kernel compiled while active, in order"""

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

    def launcher_cls(self, src, metadata):
        self.compiled.append((src.fn.__name__, metadata.shared))
        return lambda *args, **kwargs: None

    def variants(self) -> dict:
        """{kernel name: each variant compiled so far in this simulation, as Triton's compiled kernel (``asm``,
        ``metadata``)}"""
        return {k.fn.__name__: [c for cache in k.device_caches.values() for c in cache[0].values()]
                for k in _our_kernels()}

    def ptx(self) -> dict:
        """{kernel name: the PTX of each variant compiled so far in this simulation}"""
        return {name: [c.asm["ptx"] for c in compiled] for name, compiled in self.variants().items()}


def _our_kernels() -> list:
    return [x for module in (attend, index, guard) for x in vars(module).values() if isinstance(x, JITFunction)]


@contextlib.contextmanager
def simulated_gpu(capability: int, shared_memory: Optional[int] = None):
    """While active, the op's Triton kernels compile for compute capability ``capability`` (e.g. 80) and are
    checked against its shared memory (:data:`SHARED_MEMORY_OPTIN` unless given) as a real launch would be;
    nothing runs, so outputs stay as allocated. Yields the driver, whose ``compiled`` lists what compiled.
    The host code picks the variants that target's GPU would get (TMA copies from sm_90, bf16 dots in the
    index's estimate), not the interpreter's. Kernels compiled for another target are set aside meanwhile (Triton
    keys them by device only). Needs ``TRITON_INTERPRET`` unset or 0, and CPU tensors."""
    if triton.knobs.runtime.interpret:
        raise RuntimeError("a simulated GPU needs TRITON_INTERPRET=0: the interpreter compiles nothing")
    limit = SHARED_MEMORY_OPTIN[capability] if shared_memory is None else shared_memory
    sim = _SimulatedGpuDriver(("cuda", capability, 32), limit)
    kernels = _our_kernels()
    saved = [k.device_caches for k in kernels]
    previous = driver._active  # reset_active() would build the default driver, which needs a GPU
    for k in kernels:
        k.device_caches = collections.defaultdict(k.create_binder)
    # Triton remembers a device's limit per process: forget it on the way in and out
    forget_limit = getattr(triton_compiler.max_shared_mem, "cache_clear", lambda: None)
    driver.set_active(sim)
    forget_limit()
    try:
        yield sim
    finally:
        driver._active = previous
        forget_limit()
        for k, caches in zip(kernels, saved):
            k.device_caches = caches


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
    return sparse_walk_asm(head_dim, block_m, block_n, num_warps, num_stages, key_mask=key_mask,
                           dense_walk=dense_walk, target=target, **launch)["ptx"]


def sparse_walk_asm(head_dim: int, block_m: int, block_n: int, num_warps: int, num_stages: int, *,
                    key_mask: bool = False, dense_walk: bool = False, target=HOPPER, **launch) -> dict:
    """Every stage Triton compiled :func:`sparse_walk_ptx`'s kernel through, by name (``ttgir``, ``ptx``, ...)."""
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
    # no shared-memory limit: the config asked for is compiled, never stepped down
    with simulated_gpu(target[1], shared_memory=1 << 40) as gpu:
        attend.sparse_attention_triton(q, k, v, index, *plan.op_arguments(), scale=head_dim ** -0.5,
                                       key_mask=torch.ones(b, s, dtype=torch.bool) if key_mask else None,
                                       num_warps=num_warps, num_stages=num_stages, block_m=block_m, block_n=block_n,
                                       **launch)
        compiled = gpu.variants()[attend._sparse_attn_fwd.fn.__name__]
    if len(compiled) != 1:
        raise RuntimeError(f"expected one compiled variant, found {len(compiled)}")
    return compiled[0].asm


def first_loop_kv_depth(ttgir: str) -> int:
    """How many K/V blocks the first key loop of a compiled walk (its TTGIR) keeps in shared memory: the depth of the
    multi-buffered allocations made before that loop. Triton's pipeliner copies K/V depth - 1 steps
    ahead; a load the loop must make before it can address K/V (a listed block start read in the step itself) takes a
    stage of its own and leaves one buffer fewer at the same ``num_stages``."""
    before_loop = ttgir.split("scf.for", 1)[0]
    depths = {int(d) for d in re.findall(r"= ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", before_loop)}
    if len(depths) != 1:
        raise ValueError(f"expected the K/V buffers of one depth before the first loop, found depths {sorted(depths)}")
    return depths.pop()


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
