"""``minference_fx.indexing``: Inductor's 32-bit test answers "no" for length-dependent sizes, only while inside."""
import importlib
import threading

import pytest
import sympy
import torch

from minference_fx import indexing
from minference_fx.options import BackendOptions


def _tests():
    return [getattr(importlib.import_module(m), indexing._NAME) for m in indexing._CALLERS]


def test_symbolic_sizes_are_wide_inside_and_inductors_test_is_back_outside():
    before = _tests()
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    with indexing.int64_for_dynamic_sizes() as patched:
        assert patched
        inside = _tests()
        assert all(t is not b for t, b in zip(inside, before))
        assert not any(t(14336 * s0) for t in inside) and not any(t(s0) for t in inside)
        assert torch.compiler.config.cache_key_tag == indexing.TAG  # Inductor's FX graph cache keys on it
    assert _tests() == before and torch.compiler.config.cache_key_tag == ""


def test_sizes_without_symbols_keep_inductors_answer():
    seen = []
    fits = indexing.wide_when_symbolic(lambda e: seen.append(e) or True)
    assert fits(sympy.Integer(4096)) and fits(7) and seen == [sympy.Integer(4096), 7]
    assert not fits(sympy.Symbol("s1") * 2) and len(seen) == 2  # a symbol: never asked, never guarded


def test_disabled_leaves_inductor_alone():
    before = _tests()
    with indexing.int64_for_dynamic_sizes(False) as patched:
        assert not patched and _tests() == before and torch.compiler.config.cache_key_tag == ""


def test_a_users_cache_key_tag_is_kept_beside_ours():
    with torch.compiler.config.patch(cache_key_tag="mine"):
        with indexing.int64_for_dynamic_sizes():
            assert torch.compiler.config.cache_key_tag == f"mine;{indexing.TAG}"
        assert torch.compiler.config.cache_key_tag == "mine"


def test_overlapping_compiles_restore_only_when_the_last_leaves():
    before = _tests()
    entered, leave = threading.Event(), threading.Event()

    def other_compile():
        with indexing.int64_for_dynamic_sizes():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_compile)
    thread.start()
    assert entered.wait(10)
    with indexing.int64_for_dynamic_sizes():
        pass
    assert all(t is not b for t, b in zip(_tests(), before))  # the other compile still holds it
    leave.set()
    thread.join(10)
    assert _tests() == before


def test_the_option_defaults_on_and_must_be_a_bool():
    assert BackendOptions.from_user(None).int64_indexing is True
    assert BackendOptions.from_user({"int64_indexing": False}).int64_indexing is False
    with pytest.raises(ValueError, match="int64_indexing='yes'"):
        BackendOptions.from_user({"int64_indexing": "yes"})


def test_the_backend_compiles_inside_the_context_unless_told_not_to(monkeypatch):
    import torch._inductor.compile_fx as inductor

    from minference_fx.backend import minference_backend

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(all(t is not b for t, b in zip(_tests(), before)))
        return gm.forward

    before = _tests()
    monkeypatch.setattr(inductor, "compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    for options in (None, {"int64_indexing": False}):
        minference_backend(gm, [torch.ones(3)], options=options)
    assert seen == [True, False] and _tests() == before
