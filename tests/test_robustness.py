"""Robustness probes: a cache that exists but cannot be read or written, empty batches and prompts, the op under
autograd, and a bad budget named by its head."""
import errno
import logging
import os
import pathlib
import tempfile

import pytest
import torch
from autotune_fakes import fake_tuning
import torch.nn.functional as F

from minference_fx.autotune import cache, dispatch, tuner
from minference_fx.autotune.cache import CrossoverKey, Table, TuneEntry
from minference_fx.backend import recent_reports
from minference_fx.kernels.attend import is_output_layout
from minference_fx.plan import LayerPlan

OP = torch.ops.minference.sparse_attention.default
VS = ([2, 2, 2, 2], [30] * 4, [50] * 4)
LOGGER = "minference_fx.autotune"
SHIPPED_CROSSOVER = 4096


def _qkv(b=1, sq=80, skv=80, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 4, sq, 16, generator=g).to(dtype), torch.randn(b, 2, skv, 16, generator=g).to(dtype),
            torch.randn(b, 2, skv, 16, generator=g).to(dtype))


def _cpu_key() -> CrossoverKey:
    """The crossover key the op looks up for _qkv's fp32 inputs on this CPU."""
    return dispatch.crossover_key(torch.device("cpu"), torch.float32, 16, 2)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A user cache directory that does not exist yet, one shipped table holding this CPU's crossover, and nothing
    remembered from other tests."""
    shipped = tmp_path / "shipped.json"
    shipped.write_text(Table(crossovers={_cpu_key(): SHIPPED_CROSSOVER}).to_json())
    d = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV_DIR, str(d))
    monkeypatch.setattr(cache, "shipped_paths", lambda: [shipped])
    monkeypatch.setattr(cache, "_missed", set())
    monkeypatch.setattr(cache, "_warned", set())
    cache.forget()
    yield d
    cache.forget()


def _warnings(caplog, fragment):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and fragment in r.getMessage()]


def _break(case: str, d: pathlib.Path, monkeypatch) -> str:
    """Break the cache at ``d`` as ``case`` says; returns a fragment of the error the warning must carry."""
    path = d / cache.FILE_NAME
    if case == "cache dir is a file":
        d.write_text("not a directory")
        return "Not a directory"
    d.mkdir()
    if case == "autotune.json is a directory":
        path.mkdir()
        return "Is a directory"
    if case == "symlink loop":
        os.symlink(d / "loop_b", d / "loop_a")
        os.symlink(d / "loop_a", d / "loop_b")
        os.symlink(d / "loop_a", path)
        return "Too many levels of symbolic links"
    assert case == "unreadable file"  # root reads through chmod 000: the read is refused here instead
    path.write_text(Table(crossovers={_cpu_key(): 99}).to_json())
    read_text = pathlib.Path.read_text

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    return "Permission denied"


READ_CASES = ["cache dir is a file", "autotune.json is a directory", "symlink loop", "unreadable file"]


# --------------------------------------------------------------------------- 1. a cache that cannot be read


@pytest.mark.parametrize("case", READ_CASES)
def test_unreadable_cache_falls_back_to_the_shipped_tables_with_one_warning(cache_dir, monkeypatch, caplog, case):
    caplog.set_level(logging.WARNING, LOGGER)
    error = _break(case, cache_dir, monkeypatch)
    q, k, v = _qkv()
    for _ in range(3):  # each forward, and each forget() of the memo, reads the file again: still one warning
        assert dispatch.tuned_min_sparse_len(q, k) == SHIPPED_CROSSOVER
        out = OP(q, k, v, None, None, 0.25, 0, 0, *VS, -1)  # 80 < 4096: dense
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25,
                                                                       enable_gqa=True))
        assert cache.lookup(dispatch.tune_key("sparse_attention", q.device, q.dtype, 16, 2, 80)) == cache.DEFAULT_ENTRY
        cache.forget()
    (message,) = _warnings(caplog, "ignoring the autotune cache")
    assert str(cache_dir / cache.FILE_NAME) in message and error in message


@pytest.mark.parametrize("text", ["[" * 100_000, '{"version": ' + "9" * 5000 + "}"])
def test_json_that_python_refuses_is_a_corrupt_file_not_a_crash(cache_dir, caplog, text):
    """Nesting past the recursion limit (RecursionError) and an int past Python's digit limit (ValueError) are
    not JSONDecodeError: they escaped read_table."""
    caplog.set_level(logging.WARNING, LOGGER)
    cache_dir.mkdir()
    (cache_dir / cache.FILE_NAME).write_text(text)
    assert cache.lookup_crossover(_cpu_key()) == SHIPPED_CROSSOVER
    (message,) = _warnings(caplog, "ignoring the autotune cache")
    assert "not valid JSON" in message


@pytest.mark.parametrize("case", READ_CASES)
def test_cli_show_describes_an_unreadable_cache(cache_dir, monkeypatch, capsys, case):
    from minference_fx.cli import main

    error = _break(case, cache_dir, monkeypatch)
    assert main(["autotune", "--show"]) == 0
    out = capsys.readouterr().out
    user = next(line for line in out.splitlines() if line.startswith("user cache"))
    assert str(cache_dir / cache.FILE_NAME) in user and "empty (ignored: cannot read it" in user and error in user
    assert "crossover" in out and f"sparse from {SHIPPED_CROSSOVER}" in out  # the shipped table is still shown


# --------------------------------------------------------------------------- 1. a cache that cannot be written


@pytest.mark.parametrize("case", ["cache dir is a file", "autotune.json is a directory", "lock file is a directory",
                                  "cache dir is a symlink loop", "no new file in the directory"])
def test_writing_to_a_broken_cache_warns_once_and_stores_nothing(cache_dir, monkeypatch, caplog, case):
    caplog.set_level(logging.WARNING, LOGGER)
    if case == "cache dir is a symlink loop":
        os.symlink(cache_dir, cache_dir)
        error = "Too many levels of symbolic links"
    elif case == "lock file is a directory":
        cache_dir.mkdir()
        (cache_dir / (cache.FILE_NAME + ".lock")).mkdir()
        error = "Is a directory"
    elif case == "no new file in the directory":
        cache_dir.mkdir()

        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(cache_dir))

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
        error = "Permission denied"
    else:
        error = _break(case, cache_dir, monkeypatch)
    assert cache.unwritable() is not None and error in cache.unwritable()
    for length in (1024, 2048):
        assert cache.write(crossovers={_cpu_key(): length}) is None
    assert cache.lookup_crossover(_cpu_key()) == SHIPPED_CROSSOVER  # nothing stored
    (message,) = _warnings(caplog, "cannot write the autotune cache")
    assert str(cache_dir / cache.FILE_NAME) in message and error in message
    assert not list(cache_dir.parent.rglob("*.tmp"))  # no temporary file left behind


def test_a_symlink_loop_in_place_of_the_file_is_replaced_by_the_next_write(cache_dir, monkeypatch):
    _break("symlink loop", cache_dir, monkeypatch)
    assert cache.unwritable() is None
    path = cache.write(crossovers={_cpu_key(): 1024})
    assert path == cache_dir / cache.FILE_NAME and not path.is_symlink()
    assert cache.lookup_crossover(_cpu_key()) == 1024


def test_a_forward_that_tunes_on_a_miss_runs_when_the_cache_cannot_be_written(cache_dir, monkeypatch, caplog):
    """The on-miss tuner writes what it measured from inside a forward: a broken cache used to raise there."""
    caplog.set_level(logging.WARNING, LOGGER)
    monkeypatch.setattr(cache, "shipped_paths", lambda: [])  # a miss, so the forward tunes
    cache_dir.write_text("not a directory")
    calls = []

    fake_tuning(monkeypatch, calls, crossover=16)
    dispatch.set_on_miss(True)
    try:
        q, k, v = _qkv()
        out = OP(q, k, v, None, None, 0.25, 0, 0, *VS, -1)
    finally:
        dispatch.set_on_miss(False)
    assert calls, "the forward did not tune"
    # nothing stored: untuned, so dense at 80 tokens (the measured 16 would have run sparse)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, dense)
    assert len(_warnings(caplog, "cannot write the autotune cache")) == 1


def test_cli_tuning_refuses_an_unwritable_cache_before_timing(cache_dir, monkeypatch):
    from minference_fx.cli import main

    cache_dir.write_text("not a directory")
    monkeypatch.setattr(tuner, "warm_up", lambda *a, **kw: pytest.fail("tuned into a cache it cannot write"))
    with pytest.raises(SystemExit, match=r"cannot write the autotune cache .*autotune.json: .*MINFERENCE_FX_CACHE_DIR"):
        main(["autotune", "--lengths", "8k", "--head-dim", "128", "--gqa", "4", "--quiet"])


# --------------------------------------------------------------------------- 2. empty batches and prompts

PLANS = {"vertical_slash": VS, "a_shape": ([1] * 4, [4] * 4, [64] * 4), "block_sparse": ([3] * 4, [2] * 4, [0] * 4),
         "mixed": ([0, 1, 2, 3], [0, 4, 30, 2], [0, 64, 50, 0])}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("b, sq, skv, q_offset", [(0, 80, 80, 0), (0, 1, 80, 79), (0, 70, 200, 130), (1, 0, 80, 80),
                                                  (2, 0, 80, 0)])
def test_an_empty_batch_or_prompt_gives_an_empty_output_on_the_sparse_path(plan, b, sq, skv, q_offset):
    for dtype in (torch.float32, torch.float16):
        q, k, v = _qkv(b, sq, skv, dtype=dtype)
        for guard in (0.0, 0.9):  # the guard failed on no query rows
            for key_mask in (None, torch.ones(b, skv, dtype=torch.bool)):
                out = OP(q, k, v, key_mask, None, 0.25, q_offset, 0, *PLANS[plan], 0, guard)
                assert out.shape == q.shape and out.dtype == dtype and is_output_layout(out)
    with pytest.raises(ValueError, match="head 2 of the plan"):  # an empty call still checks its plan
        OP(q, k, v, None, None, 0.25, q_offset, 0, [2] * 4, [30, 30, -1, 30], [50] * 4, 0)


# --------------------------------------------------------------------------- 3. autograd


def test_the_op_with_inputs_that_require_grad_fails_at_the_call_and_says_why():
    q, k, v = _qkv()
    q.requires_grad_()
    v.requires_grad_()
    with pytest.raises(RuntimeError, match=r"inference-only .* q, v require grad .*torch.inference_mode\(\)"):
        OP(q, k, v, None, None, 0.25, 0, 0, *VS, 0)
    want = OP(q.detach(), k, v.detach(), None, None, 0.25, 0, 0, *VS, 0)
    with torch.no_grad():
        torch.testing.assert_close(OP(q, k, v, None, None, 0.25, 0, 0, *VS, 0), want, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(OP(q, k, v, None, None, 0.25, 0, 0, *VS, 0), want, rtol=0, atol=0)


def test_the_backend_still_leaves_a_site_traced_with_autograd_dense_and_backward_runs():
    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v = (t.requires_grad_() for t in _qkv())
    compiled = torch.compile(Causal(), backend="minference", options={"inner": "aot_eager", "min_sparse_len": 0})
    with pytest.warns(UserWarning, match="inference_mode"):
        compiled(q, k, v).sum().backward()
    (row,) = recent_reports()[-1].rows
    assert row.decision == "dense" and "require grad" in row.reason
    got = q.grad.clone()
    q.grad = None
    Causal()(q, k, v).sum().backward()
    torch.testing.assert_close(got, q.grad)
    with torch.no_grad():  # activations, not leaves that require grad: the site is rewritten
        compiled(q.detach(), k.detach(), v.detach())
    assert [r.decision for r in recent_reports()[-1].rows] == ["sparse"]


# --------------------------------------------------------------------------- 4. a bad budget names its head


def test_a_negative_budget_names_the_head_and_the_value():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"head 2 of the plan: budgets must be >= 0, got budget_a = -5 "):
        OP(q, k, v, None, None, 0.25, 0, 0, [2, 2, 2, 2], [30, 30, -5, 30], [50] * 4, 0)
    with pytest.raises(ValueError, match=r"head 3 of the plan: .*got budget_b = -1 \(budgets 4, -1\) for a_shape"):
        LayerPlan.from_op_arguments([1] * 4, [4] * 4, [64, 64, 64, -1])
    with pytest.raises(ValueError, match=r"head 1 of the plan: .*local window \(budget_b\) must be >= 1, got 0"):
        LayerPlan.from_op_arguments([2, 1], [30, 4], [50, 0])
