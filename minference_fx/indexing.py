"""Inductor's index width for sizes that grow with the prompt: int64 from the first compile.

Inductor indexes a Triton kernel with int32 when the sizes it sees at compile time fit, and guards on
that (``torch._inductor.codegen.simd.SIMDScheduling.can_use_32bit_indexing``). The guard is on the traced
sequence length, so the first prompt past ``2**31 / width`` elements recompiles the whole graph with
int64 indices: for Llama-3-8B (MLP width 14336) the guard is ``14336 * n <= 2**31 - 1``, broken from
149,797 tokens on (measured on an H200: one recompile at 256K, 20-30 s, for this backend and for Inductor
compiling the same model with its attention replaced; BENCHMARKS.md, section 4). Long prompts are what this backend is for, so a recompile there is the
common case, not the corner.

:func:`int64_for_dynamic_sizes` makes Inductor answer "does not fit" for every size with a free symbol
while it compiles one graph: those kernels index with int64 and nothing is guarded on the width. Sizes
without symbols keep Inductor's own answer. int64 indexing is always correct (Inductor says so where it
guards); it costs some integer arithmetic in the length-dependent kernels: +0.9-1.6 % time to first token
on the 8-layer Llama-3-8B shape at 32K-256K, within the spread between two runs (same results).

Inductor's FX graph cache does not see the patch, so while inside, ``torch.compiler.config.cache_key_tag``
(part of that cache's key) also names it: a graph compiled with int32 indices and its guard, by an earlier
minference-fx or with ``int64_indexing=False``, is never loaded in place of this one.
"""
from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Callable, Iterator

import torch

# the modules that call Inductor's 32-bit test by a name imported from torch._inductor.utils (torch 2.11)
_CALLERS = ("torch._inductor.codegen.simd", "torch._inductor.codegen.triton_utils")
_NAME = "expr_fits_within_32bit"


def wide_when_symbolic(fits: Callable) -> Callable:
    """``fits`` (Inductor's 32-bit test), answering False for an expression with free symbols."""

    def fits_unless_symbolic(expr) -> bool:
        if getattr(expr, "free_symbols", None):
            return False
        return fits(expr)

    return fits_unless_symbolic


_lock = threading.Lock()
_holders = 0  # compiles inside the context now (threads may compile at once); the last one out restores
_originals: list = []
_saved_tag: list = []
TAG = "minference_fx.indexing:int64-for-symbolic-sizes"


def _callers() -> list | None:
    modules = []
    for name in _CALLERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            return None
        if not callable(getattr(module, _NAME, None)):
            return None
        modules.append(module)
    return modules


@contextlib.contextmanager
def int64_for_dynamic_sizes(enabled: bool = True) -> Iterator[bool]:
    """While inside, Inductor indexes every kernel whose sizes depend on a symbol with int64. Yields whether
    it does (False when disabled, or when a torch version no longer has the callers this patches: the
    compile then runs with Inductor's own choice, which is correct, and may recompile past 2**31)."""
    global _holders
    modules = _callers() if enabled else None
    if modules is None:
        yield False
        return
    with _lock:
        if _holders == 0:
            _originals[:] = [getattr(m, _NAME) for m in modules]
            for module, fits in zip(modules, _originals):
                setattr(module, _NAME, wide_when_symbolic(fits))
            tag = torch.compiler.config.cache_key_tag
            _saved_tag[:] = [tag]
            torch.compiler.config.cache_key_tag = f"{tag};{TAG}" if tag else TAG
        _holders += 1
    try:
        yield True
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                for module, fits in zip(modules, _originals):
                    setattr(module, _NAME, fits)
                torch.compiler.config.cache_key_tag = _saved_tag[0]
