"""Autotuning on CPU: keys and buckets, the cache file (atomic, corrupt, foreign, concurrent), the tuner and the
crossover on fake timings, the CLI's --show, and the op's dispatch on a tuned crossover."""
import dataclasses
import hashlib
import inspect
import json
import logging
import multiprocessing

import pytest
import torch
from autotune_fakes import fake_tuning

import minference_fx.kernels.reference as reference
import minference_fx.dense as dense_module
from minference_fx.autotune import cache, dispatch, identity, space, tuner
from minference_fx.autotune.cache import CrossoverKey, Table, TuneEntry, TuneKey, seq_bucket
from minference_fx.autotune.identity import DeviceIdentity
from minference_fx.autotune.shapes import shape_from_hf_config
from minference_fx.config import ModelIdentity, default_config
from minference_fx.cost import WalkCost

OP = torch.ops.minference.sparse_attention.default
VS = ([2, 2, 2, 2], [1000] * 4, [6096] * 4)
LOGGER = "minference_fx.autotune"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh user cache directory, no shipped tables, and nothing remembered from other tests."""
    d = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV_DIR, str(d))
    monkeypatch.setattr(cache, "shipped_paths", lambda: [])
    monkeypatch.setattr(cache, "_missed", set())
    monkeypatch.setattr(cache, "_warned", set())
    cache.forget()
    yield d
    cache.forget()


def _key(i=0, **over):
    fields = dict(kernel="sparse_attention", source_hash="abc", gpu="NVIDIA H200", capability="9.0", triton="3.6.0",
                  dtype="bfloat16", head_dim=128, group=4, bucket=32768)
    fields.update(over)
    if i:
        fields["bucket"] = i
    return TuneKey(**fields)


def _xkey(**over):
    fields = dict(source_hash="abc", gpu="NVIDIA H200", capability="9.0", triton="3.6.0", dtype="bfloat16",
                  head_dim=128, group=4)
    fields.update(over)
    return CrossoverKey(**fields)


def _warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# --------------------------------------------------------------------------- keys, buckets, space


@pytest.mark.parametrize("length, bucket", [
    (0, 1), (1, 1), (1000, 1024), (8192, 8192), (12000, 16384), (16384, 16384), (40000, 32768),
    (46340, 32768), (46341, 65536), (131072, 131072), (1 << 20, 1 << 20), (1_000_000, 1 << 20),
])
def test_seq_bucket_is_the_nearest_power_of_two_in_log_scale(length, bucket):
    assert seq_bucket(length) == bucket


def test_every_key_field_separates_entries_and_survives_json():
    base = _key()
    variants = [base] + [_key(**{name: value}) for name, value in dict(
        kernel="other", source_hash="def", gpu="NVIDIA H100", capability="8.0", triton="3.5.0", dtype="float16",
        head_dim=64, group=8, bucket=65536).items()]
    assert len(set(variants)) == len(variants)
    table = Table({k: TuneEntry(64, 64, 4 + 4 * (i % 2), 1 + i % 4) for i, k in enumerate(variants)},
                  {_xkey(): 4096, _xkey(group=8): None})
    assert Table.from_json(table.to_json()) == table


def test_dispatch_keys_take_shape_dtype_and_bucket_from_the_tensors():
    q, k = torch.empty(1, 8, 40000, 64, dtype=torch.float16), torch.empty(1, 2, 40000, 64, dtype=torch.float16)
    key = dispatch.tune_key("sparse_attention", q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], q.shape[-2])
    assert (key.dtype, key.head_dim, key.group, key.bucket, key.gpu) == ("float16", 64, 4, 32768, "cpu")
    assert len(key.source_hash) == 16 and key.triton


def test_space_keeps_only_what_the_kernel_accepts_and_fits():
    kept = space.candidates("sparse_attention", 128, 2)
    # a query tile of the index or half of one; key steps of one or two index tiles
    t = reference.BLOCK
    assert {(c.BLOCK_M, c.BLOCK_N) for c in kept} == {(m, n) for m in (t // 2, t) for n in (t, 2 * t)}
    one_tile = {(c.num_warps, c.num_stages) for c in kept if (c.BLOCK_M, c.BLOCK_N) == (t, t)}
    assert one_tile == {(w, s) for w in (4, 8) for s in (1, 2, 3, 4)}
    # two tiles of K and V per stage: four stages of 128-wide d128 steps pass Hopper's shared memory
    assert max(c.num_stages for c in kept if (c.BLOCK_M, c.BLOCK_N) == (t, 2 * t)) == 3
    for config in space.SPACE["sparse_attention"]:
        for head_dim, dtype_bytes, limit in ((128, 2, space.SM90_SMEM_BYTES), (256, 2, space.SM90_SMEM_BYTES),
                                             (128, 4, space.SM90_SMEM_BYTES), (128, 2, 100 * 1024)):
            fits = space.smem_bytes(config, head_dim, dtype_bytes) <= limit
            if space.keep(config, head_dim, dtype_bytes, limit):
                assert fits
    # the shared-memory limit bites: deep pipelines of wide heads do not fit
    assert max(c.num_stages for c in space.candidates("sparse_attention", 256, 2)) < 4
    # the dense walk reads no list: its programs may own two query tiles, never half of one
    walk = space.candidates("dense_walk", 128, 2)
    assert {c.BLOCK_M for c in walk} == {t, 2 * t} and cache.DEFAULT_ENTRIES["dense_walk"] in walk
    assert len(space.candidates("sparse_attention", 128, 2, smem_limit=100 * 1024)) < len(kept)
    with pytest.raises(ValueError, match="head_dim=512"):
        space.candidates("sparse_attention", 512, 2)


# --------------------------------------------------------------------------- the cache file


def test_lookup_gives_the_default_and_logs_once_per_missing_key(cache_dir, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    assert cache.lookup(_key()) == cache.DEFAULT_ENTRY == TuneEntry(64, 64, 4, 2)
    assert cache.lookup(_key()) == cache.DEFAULT_ENTRY
    assert len(_warnings(caplog)) == 1
    cache.lookup(_key(bucket=65536))
    assert len(_warnings(caplog)) == 2
    assert cache.lookup_crossover(_xkey()) == cache.DEFAULT_MIN_SPARSE_LEN


def test_an_untuned_bucket_runs_the_nearest_tuned_bucket_of_its_shape_and_logs_once(cache_dir, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    at_8k, at_128k, other_shape = TuneEntry(32, 128, 4, 1), TuneEntry(64, 64, 4, 3), TuneEntry(16, 32, 2, 1)
    cache.write(configs={_key(bucket=8192): at_8k, _key(bucket=131072): at_128k,
                         _key(bucket=1 << 20, head_dim=64): other_shape, _key(bucket=1 << 20, kernel="other"): other_shape})
    assert cache.resolve(_key(bucket=131072)) == (at_128k, 131072)
    assert cache.resolve(_key(bucket=1 << 20)) == (at_128k, 131072)  # past the largest tuned length
    assert cache.resolve(_key(bucket=4096)) == (at_8k, 8192)
    assert cache.resolve(_key(bucket=16384)) == (at_8k, 8192)
    assert cache.resolve(_key(bucket=32768)) == (at_128k, 131072)  # 2 doublings from both: the larger
    assert cache.resolve(_key(bucket=32768, group=8)) == (cache.DEFAULT_ENTRY, None)  # no bucket of this shape
    assert cache.lookup(_key(bucket=1 << 20)) == at_128k
    assert cache.lookup(_key(bucket=1 << 20)) == at_128k
    assert cache.lookup(_key(bucket=131072)) == at_128k
    logged = [r.getMessage() for r in _warnings(caplog)]
    assert len(logged) == 1 and "tuned for the 131072-token bucket" in logged[0]


def test_a_triton_release_with_no_table_runs_the_newest_other_release_s_table_of_the_same_gpu_and_kernels(
        cache_dir, caplog):
    """Today's triton on an H200 reads the table tuned under 3.6 (launch configs, crossover, cost), the newest of the
    releases tuned, and says so once; a bucket its own release tuned wins over any other release's; another GPU's or
    another kernel hash's entries are never borrowed."""
    caplog.set_level(logging.WARNING, LOGGER)
    old, older, own = TuneEntry(64, 64, 4, 3), TuneEntry(32, 32, 2, 1), TuneEntry(64, 128, 8, 2)
    cost_36 = WalkCost(0.72, 0.05, 65536)
    cache.write(configs={_key(bucket=32768): old, _key(bucket=131072, triton="3.5.0"): older,
                         _key(bucket=8192, gpu="NVIDIA H100 80GB HBM3", triton="3.9.0"): own,
                         _key(bucket=8192, source_hash="stale", triton="3.6.0", head_dim=64): own},
                crossovers={_xkey(): 32768, _xkey(triton="3.5.0"): 65536})
    cache.write(costs={_xkey(): cost_36})
    today = dict(triton="3.9.0")
    assert cache.resolve(_key(bucket=32768, **today)) == (old, 32768)
    assert cache.resolve(_key(bucket=131072, **today)) == (old, 32768)  # 3.6's buckets, not 3.5's nearer one
    assert cache.lookup_crossover(_xkey(**today)) == 32768
    assert cache.lookup_cost(_xkey(**today)) == cost_36
    assert cache.resolve(_key(bucket=8192, gpu="NVIDIA H100 80GB HBM3", **today)) == (own, 8192)
    assert cache.resolve(_key(bucket=8192, head_dim=64, **today)) == (cache.DEFAULT_ENTRY, None)  # other kernels
    assert cache.lookup_crossover(_xkey(gpu="NVIDIA A100", **today)) == cache.DEFAULT_MIN_SPARSE_LEN
    cache.write(configs={_key(bucket=131072, **today): own})
    cache.forget()
    assert cache.resolve(_key(bucket=32768, **today)) == (own, 131072)  # its own release's bucket wins
    borrowed = [r.getMessage() for r in _warnings(caplog) if "under triton 3.6.0" in r.getMessage()]
    assert len(borrowed) == 2 and "launch config" in borrowed[0] and "crossover" in borrowed[1]


def test_the_newest_release_is_borrowed_whichever_table_holds_it(cache_dir, tmp_path, monkeypatch):
    """A user cache tuned under an older release than the shipped table does not shadow the shipped table's newer
    crossover and cost: launch configs, crossover and cost all come from the newest release tuned."""
    shipped = tmp_path / "shipped.json"
    newer_cost, older_cost = WalkCost(0.72, 0.05, 65536), WalkCost(0.9, 0.2, 65536)
    shipped.write_text(Table({_key(): TuneEntry(64, 64, 4, 3)}, {_xkey(): 32768}, {_xkey(): newer_cost}).to_json())
    monkeypatch.setattr(cache, "shipped_paths", lambda: [shipped])
    cache.write(configs={_key(triton="3.4.0"): TuneEntry(32, 32, 2, 1)}, crossovers={_xkey(triton="3.4.0"): 131072},
                costs={_xkey(triton="3.4.0"): older_cost})
    today = dict(triton="3.9.0")
    assert cache.resolve(_key(**today)) == (TuneEntry(64, 64, 4, 3), 32768)
    assert cache.lookup_crossover(_xkey(**today)) == 32768
    assert cache.lookup_cost(_xkey(**today)) == newer_cost
    cache.write(crossovers={_xkey(): 16384})  # the user cache wins within the newest release
    cache.forget()
    assert cache.lookup_crossover(_xkey(**today)) == 16384


def test_the_user_cache_wins_for_the_nearest_bucket_too(cache_dir, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped.json"
    shipped.write_text(Table({_key(bucket=65536): TuneEntry(64, 64, 8, 3)}).to_json())
    monkeypatch.setattr(cache, "shipped_paths", lambda: [shipped])
    cache.write(configs={_key(bucket=65536): TuneEntry(64, 64, 4, 4)})
    assert cache.resolve(_key(bucket=1 << 18)) == (TuneEntry(64, 64, 4, 4), 65536)


def test_user_cache_is_read_before_the_shipped_tables(cache_dir, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped.json"
    shipped.write_text(Table({_key(): TuneEntry(64, 64, 8, 3), _key(bucket=65536): TuneEntry(64, 64, 8, 1)},
                             {_xkey(): 2048}).to_json())
    monkeypatch.setattr(cache, "shipped_paths", lambda: [shipped])
    cache.write(configs={_key(): TuneEntry(64, 64, 4, 4)})
    assert cache.lookup(_key()) == TuneEntry(64, 64, 4, 4)
    assert cache.lookup(_key(bucket=65536)) == TuneEntry(64, 64, 8, 1)
    assert cache.lookup_crossover(_xkey()) == 2048


def test_shipped_tables_are_valid():
    paths = cache.shipped_paths()
    assert any(p.name == "h200.json" for p in paths)
    for p in paths:
        Table.from_json(p.read_text())  # raises when foreign or corrupt


@pytest.mark.parametrize("name", ["h200.json", "h100.json"])
def test_a_shipped_table_was_tuned_on_these_kernels(name):
    """A kernel edit that can change speed voids the shipped tables: re-tune on that GPU (scripts/gpu_qwen.sh
    retune) and ship the new cache, or every lookup there falls back to the untuned defaults."""
    table = Table.from_json(next(p for p in cache.shipped_paths() if p.name == name).read_text())
    hashes = ({k.source_hash for k in table.configs} | {k.source_hash for k in table.crossovers}
              | {k.source_hash for k in table.costs})
    assert hashes == {identity.kernel_source_hash()}, f"autotune/{name} is stale: re-tune it for these kernels"


def test_each_gpu_reads_its_own_shipped_table(tmp_path, monkeypatch):
    """Both tables hold Qwen2.5-Coder's d128 / GQA-6 shape; the device name picks the row, and neither shadows the other."""
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "empty"))
    monkeypatch.setattr(cache, "_missed", set())
    monkeypatch.setattr(cache, "_warned", set())
    cache.forget()
    walk_rates = {}
    try:
        for name in ("h200.json", "h100.json"):
            table = Table.from_json(next(p for p in cache.shipped_paths() if p.name == name).read_text())
            key = next(k for k in table.crossovers if (k.head_dim, k.group) == (128, 6))
            assert cache.lookup_crossover(key) == table.crossovers[key]
            walk_rates[name] = cache.lookup_cost(key).walk_rate
            assert cache.lookup_crossover(dataclasses.replace(key, gpu="NVIDIA A100-SXM4-80GB"), untuned=-7) == -7
    finally:
        cache.forget()
    assert walk_rates["h200.json"] != walk_rates["h100.json"]


def test_each_shipped_table_holds_one_gpu():
    """A table is named for the GPU it was tuned on, so that a re-tune replaces it whole."""
    for path in cache.shipped_paths():
        table = Table.from_json(path.read_text())
        gpus = {k.gpu for k in table.configs} | {k.gpu for k in table.crossovers} | {k.gpu for k in table.costs}
        assert len(gpus) == 1, (path.name, gpus)


KERNEL_TEXT = '''"""Module docstring."""
import triton.language as tl

SKIP = -1
"""What SKIP means."""


def launch(x):  # a trailing comment
    """Docstring."""
    # a comment line

    y = x + 64
    if y > 0:
        raise ValueError(f"bad {y!r}")
    return y
'''


@pytest.mark.parametrize("edit", [
    ("# a comment line", "# another comment, longer"),
    ("# a trailing comment", "# edited"),
    ('"""Docstring."""', '"""Docstring,\n    now two lines."""'),
    ('"""What SKIP means."""', '"""SKIP, explained."""'),
    ("    y = x + 64\n", "\n    y = x + 64   \n\n"),
], ids=["comment", "trailing-comment", "docstring", "attribute-docstring", "blank-lines"])
def test_the_kernel_hash_ignores_comments_docstrings_and_blank_lines(edit):
    assert KERNEL_TEXT.count(edit[0]) == 1
    assert identity.code_of(KERNEL_TEXT.replace(*edit)) == identity.code_of(KERNEL_TEXT)


@pytest.mark.parametrize("edit", [
    ("x + 64", "x + 128"), ("    if y > 0:\n        raise", "    if y > 0:\n        pass\n    raise"),
    ('f"bad {y!r}"', 'f"bad {y}"'), ("SKIP = -1", "SKIP = -2"),
], ids=["constant", "indentation", "f-string", "assignment"])
def test_the_kernel_hash_follows_code_edits(edit):
    assert KERNEL_TEXT.count(edit[0]) == 1
    assert identity.code_of(KERNEL_TEXT.replace(*edit)) != identity.code_of(KERNEL_TEXT)


def test_the_kernel_hash_sees_the_kernels_code_not_their_comments():
    from importlib import resources

    text = resources.files("minference_fx.kernels").joinpath("attend.py").read_text(encoding="utf-8")
    comment = "# the rescaled accumulator goes into the MMA as its addend: no separate add of the product tile"
    code = "acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)"
    assert text.count(comment) == 1 and text.count(code) == 1
    assert identity.code_of(text.replace(comment, "# reworded")) == identity.code_of(text)
    assert "tl.dot(p.to(v.dtype), v, acc * alpha[:, None]" in identity.code_of(text)
    assert identity.code_of(text.replace(code, code.replace("acc * alpha", "alpha * acc"))) != identity.code_of(text)


def test_write_is_atomic(cache_dir, monkeypatch):
    path = cache.write(configs={_key(): TuneEntry(64, 64, 8, 3)})
    before = path.read_bytes()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        cache.write(configs={_key(bucket=65536): TuneEntry(64, 64, 4, 1)})
    assert path.read_bytes() == before
    assert sorted(p.name for p in cache_dir.iterdir()) == ["autotune.json", "autotune.json.lock"]


def test_corrupt_file_is_ignored_with_one_warning_then_rewritten(cache_dir, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    cache_dir.mkdir()
    path = cache_dir / cache.FILE_NAME
    path.write_text('{"schema": "minference-fx/autotune", "version": 1, "configs": [')
    assert cache.lookup(_key()) == cache.DEFAULT_ENTRY
    assert cache.lookup_crossover(_xkey()) == cache.DEFAULT_MIN_SPARSE_LEN
    assert "autotune.json" in cache.describe() and "empty" in cache.describe()
    corrupt = [r for r in _warnings(caplog) if "ignoring the autotune cache" in r.getMessage()]
    assert len(corrupt) == 1 and "not valid JSON" in corrupt[0].getMessage()
    cache.write(configs={_key(): TuneEntry(64, 64, 8, 2)})
    assert Table.from_json(path.read_text()).configs == {_key(): TuneEntry(64, 64, 8, 2)}
    assert cache.lookup(_key()) == TuneEntry(64, 64, 8, 2)
    assert len([r for r in _warnings(caplog) if "ignoring" in r.getMessage()]) == 1


@pytest.mark.parametrize("doc", [
    {"schema": "someone-else/tuning", "version": 1, "configs": [], "crossovers": []},
    {"schema": cache.SCHEMA, "version": cache.VERSION + 1, "configs": [], "crossovers": []},
    {"schema": cache.SCHEMA, "version": cache.VERSION, "configs": [{"key": {"kernel": "x"}, "entry": {}}], "crossovers": []},
    {"schema": cache.SCHEMA, "version": cache.VERSION, "configs": [], "crossovers": [{"key": {}, "min_sparse_len": True}]},
    ["a", "list"],
])
def test_foreign_file_is_ignored_then_rewritten(cache_dir, caplog, doc):
    caplog.set_level(logging.WARNING, LOGGER)
    cache_dir.mkdir()
    path = cache_dir / cache.FILE_NAME
    path.write_text(json.dumps(doc))
    assert cache.lookup(_key()) == cache.DEFAULT_ENTRY
    assert any("ignoring the autotune cache" in r.getMessage() for r in _warnings(caplog))
    cache.write(crossovers={_xkey(): 4096})
    assert Table.from_json(path.read_text()).crossovers == {_xkey(): 4096}


def _writer(path, worker, count):
    for i in range(count):
        cache.write(configs={_key(bucket=1 + worker * 1000 + i): TuneEntry(64, 64, 4, 1 + i % 4)}, path=path)
        cache.write(crossovers={_xkey(head_dim=1 + worker * 1000 + i): i}, path=path)


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / "shared" / cache.FILE_NAME
    count = 40
    # fork: the workers only touch the cache module, which holds no threads or CUDA state
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_writer, args=(path, w, count)) for w in range(2)]
    for p in workers:
        p.start()
    while any(p.is_alive() for p in workers):
        if path.exists():
            Table.from_json(path.read_text())  # a reader never sees half a file
    for p in workers:
        p.join()
        assert p.exitcode == 0
    table = Table.from_json(path.read_text())
    assert set(table.configs) == {_key(bucket=1 + w * 1000 + i) for w in range(2) for i in range(count)}
    assert set(table.crossovers) == {_xkey(head_dim=1 + w * 1000 + i) for w in range(2) for i in range(count)}
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"]


# --------------------------------------------------------------------------- tuner and crossover


def test_tune_picks_the_fastest_of_fake_timings_and_skips_failures():
    candidates = space.candidates("sparse_attention", 128, 2)
    fake_ms = {c: 1.0 + 0.1 * c.num_stages + (0.0 if c.num_warps == 8 else 0.05)
               + (0.0 if (c.BLOCK_M, c.BLOCK_N) == (64, 64) else 0.01) for c in candidates}
    fake_ms[TuneEntry(64, 64, 4, 4)] = 0.2  # fastest of all, but it fails to launch
    seen = []

    def run(config):
        if config == TuneEntry(64, 64, 4, 4):
            raise RuntimeError("out of resources: shared memory")
        return config

    result = tuner.tune("sparse_attention", candidates, run, timer=lambda fn: fake_ms[fn()], on_timed=seen.append)
    assert result.best == TuneEntry(64, 64, 8, 1) and result.best_ms == pytest.approx(1.1)
    assert set(result.failures) == {TuneEntry(64, 64, 4, 4)} and "out of resources" in result.failures[TuneEntry(64, 64, 4, 4)]
    assert seen == candidates
    with pytest.raises(RuntimeError, match="every candidate failed"):
        tuner.tune("sparse_attention", candidates[:2], lambda c: 1 / 0, timer=lambda fn: fn())


LENGTHS = [1024 * 2 ** p for p in range(7)]  # 1K .. 64K


def _curve(fn):
    return {n: fn(n) for n in LENGTHS}


def test_crossover_on_clean_curves():
    dense = _curve(lambda n: (n / 1024) ** 2)  # quadratic
    sparse = _curve(lambda n: 6 + n / 1024)  # index overhead + linear
    assert tuner.find_crossover(LENGTHS, dense, sparse) == 4096
    # the same given as callables
    assert tuner.find_crossover(LENGTHS, lambda n: (n / 1024) ** 2, lambda n: 6 + n / 1024) == 4096
    assert tuner.find_crossover(LENGTHS, dense, _curve(lambda n: 0.5)) == 1024  # sparse always faster
    assert tuner.find_crossover(LENGTHS, dense, _curve(lambda n: 1e9)) is None  # never
    # sparse 4% faster at 8K is inside the margin: dense keeps it
    close = {**sparse, 4096: 17.0, 8192: 64 / 1.04}
    assert tuner.find_crossover(LENGTHS, dense, close, margin=0.05) == 16384


def test_crossover_margin_keeps_dense_where_the_tuner_won_and_the_model_lost():
    # the H200 tuner's SmolLM2-shape timings (results/autotune_warmup_h200_2026-12-01_v14_smollm2_shape.txt):
    # sparse won 1.06x at 32K and the compiled model then ran 0.67x of HF eager there (v15), 1.56x at 64K (v16)
    dense = {16384: 0.717, 32768: 2.734, 65536: 10.817}
    sparse = {16384: 3.712, 32768: 2.591, 65536: 4.784}
    assert tuner.find_crossover(sorted(dense), dense, sparse, margin=tuner.CROSSOVER_MARGIN) == 65536
    # the Llama-3-8B shape's 1.59x win at 32K (v14) still crosses there
    dense, sparse = {16384: 3.595, 32768: 14.626, 65536: 57.206}, {16384: 4.021, 32768: 9.179, 65536: 19.818}
    assert tuner.find_crossover(sorted(dense), dense, sparse, margin=tuner.CROSSOVER_MARGIN) == 32768


def test_crossover_ignores_a_noisy_early_win():
    dense = _curve(lambda n: (n / 1024) ** 2)
    noisy = {**_curve(lambda n: 6 + n / 1024), 1024: 0.5, 8192: 70.0}  # wins by noise at 1K, loses at 8K
    # sparse is never slower at or above the answer
    got = tuner.find_crossover(LENGTHS, dense, noisy)
    assert got == 16384
    assert all(noisy[n] < dense[n] for n in LENGTHS if n >= got)


class FakeWorkload:
    """Thunks that say what they would run (on another family, their kind carries its ``tag``); the fake timer turns
    that into milliseconds."""

    identity = DeviceIdentity("Fake GPU", "9.0")
    smem_limit = space.SM90_SMEM_BYTES
    family = "structured"
    tag = ""

    def kernel(self, n, config):
        return lambda: ("kernel" + self.tag, n, config)

    def dense_walk(self, n, config):
        return lambda: ("walk" + self.tag, n, config)

    def sparse(self, n, config, dense_walk):
        return lambda: ("sparse" + self.tag, n, config, dense_walk)

    def dense(self, n):
        return lambda: ("dense" + self.tag, n)

    def index(self, n):
        return lambda: ("index", n)

    def kept_share(self, n):
        return 0.25


def fake_timer(fn):
    kind, n, *config = fn()
    if kind == "kernel":
        c = config[0]
        return n / 1024 * (1 + 0.1 * abs(c.num_stages - 3) + (0.0 if c.num_warps == 8 else 0.05)
                           + (0.0 if (c.BLOCK_M, c.BLOCK_N) == (64, 64) else 0.01))
    if kind == "walk":  # fastest: 128 rows, 4 warps, 3 stages (not the default's 2)
        c = config[0]
        return n / 512 * (1 + 0.1 * abs(c.num_stages - 3) + (0.0 if c.num_warps == 4 else 0.05)
                          + (0.0 if (c.BLOCK_M, c.BLOCK_N) == (128, 64) else 0.01))
    if kind == "index":
        return n / 1024 / 8
    return (n / 1024) ** 2 if kind == "dense" else 6 + n / 1024


def test_warm_up_with_fake_timings_writes_configs_and_crossover_and_leaves_the_semantic_config_alone(
        cache_dir, tmp_path, capsys):
    semantic = tmp_path / "heads.json"
    default_config(ModelIdentity(num_layers=2, num_q_heads=32, num_kv_heads=8, head_dim=128, name="llama-ish")).save(semantic)
    before = hashlib.sha256(semantic.read_bytes()).hexdigest()

    report = tuner.warm_up([8192, 32768], 128, 4, "bf16", progress=True, workload=FakeWorkload(), timer=fake_timer)

    assert hashlib.sha256(semantic.read_bytes()).hexdigest() == before
    assert report.crossover == 4096
    assert report.path == cache_dir / cache.FILE_NAME
    table = Table.from_json(report.path.read_text())
    sparse = {k: e for k, e in table.configs.items() if k.kernel == "sparse_attention"}
    walks = {k: e for k, e in table.configs.items() if k.kernel == "dense_walk"}
    assert {k.bucket for k in sparse} == {1024 * 2 ** p for p in range(6)}  # 1K .. 32K, the grid
    assert set(sparse.values()) == {TuneEntry(64, 64, 8, 3)}
    # the dense walk is tuned at the lengths asked for only
    assert {k.bucket for k in walks} == {8192, 32768} and set(walks.values()) == {TuneEntry(128, 64, 4, 3)}
    assert "dense walk @ 32768: 128, 64, 4, 3" in str(report) and "tuned gain 1.10x" in str(report)
    assert all(k.gpu == "Fake GPU" and k.dtype == "bfloat16" and k.group == 4 for k in table.configs)
    assert list(table.crossovers.values()) == [4096]
    # speed only: nothing semantic in the tuned cache
    text = report.path.read_text()
    assert "pattern" not in text and "budget" not in text
    assert "[" in capsys.readouterr().err  # the progress bar
    assert "crossover: sparse from 4096" in str(report)
    # a grid short of 64K measures no cost: it would replace the whole grid's with one of launch overhead
    assert table.costs == {} and report.cost is None


def test_a_tune_short_of_64k_that_never_saw_sparse_win_leaves_the_crossover_alone(cache_dir):
    """It stored "never sparse", which the user cache puts before the shipped table: after `autotune --lengths
    16k` the op ran dense at 128K too."""
    def sparse_wins_from_32k(fn):
        kind, n, *rest = fn()
        if kind == "dense":
            return 10.0 * (n / 32768) ** 2
        if kind == "sparse":
            return 10.0 * (n / 32768) / 1.6 if n >= 32768 else 20.0 * (n / 32768) ** 2
        return fake_timer(fn)

    report = tuner.warm_up([16384], 128, 4, "bf16", progress=False, workload=FakeWorkload(), timer=sparse_wins_from_32k)
    assert report.crossover is None  # what the grid to 16K saw, reported
    assert Table.from_json(report.path.read_text()).crossovers == {}  # and not written
    whole = tuner.warm_up([65536], 128, 4, "bf16", progress=False, workload=FakeWorkload(), timer=sparse_wins_from_32k)
    assert list(Table.from_json(whole.path.read_text()).crossovers.values()) == [32768] == [whole.crossover]


class ScatteredFake(FakeWorkload):
    """The second family: every thunk says so, and the fake timers make the structured family's winner slow there
    (and would move the dense walk's pick and the crossover, were those timed on it)."""

    family = "scattered"
    tag = "-scattered"


def timer_with_a_scattered_family(fn):
    """On the scattered family 8 warps (the structured winner) cost 40 % more, 4 warps with 3 stages the least; its
    dense walk prefers 2 warps and its sparse path never beats dense."""
    kind, n, *config = fn()
    if kind == "walk-scattered":
        return n / 512 * (1 + (0.0 if config[0].num_warps == 2 else 0.5))
    if kind == "sparse-scattered":
        return (n / 1024) ** 2 * 10
    if kind == "dense-scattered":
        return (n / 1024) ** 2
    if kind != "kernel-scattered":
        return fake_timer(fn)
    c = config[0]
    return n / 1024 * (1 + 0.1 * abs(c.num_stages - 3) + (0.4 if c.num_warps == 8 else 0.0)
                       + (0.0 if (c.BLOCK_M, c.BLOCK_N) == (64, 64) else 0.01))


def test_the_walk_is_tuned_against_both_families_and_keeps_the_first_family_s_times():
    """Alone, the structured family picks 8 warps (5 % ahead of 4); with the scattered family, where 8 warps cost
    40 % more, the config near the best on both wins. ``best_ms`` and the timings stay the first family's."""
    candidates = [TuneEntry(64, 64, 8, 3), TuneEntry(64, 64, 4, 3), TuneEntry(64, 64, 4, 2)]
    structured, scattered = FakeWorkload(), ScatteredFake()
    alone = tuner.tune("sparse_attention", candidates, lambda c: structured.kernel(8192, c)(), timer_with_a_scattered_family)
    assert alone.best == TuneEntry(64, 64, 8, 3)
    both = tuner.tune("sparse_attention", candidates, lambda c: structured.kernel(8192, c)(), timer_with_a_scattered_family,
                      also=[lambda c: scattered.kernel(8192, c)()])
    assert both.best == TuneEntry(64, 64, 4, 3)
    assert both.timings == alone.timings and both.best_ms == alone.timings[TuneEntry(64, 64, 4, 3)] == pytest.approx(8 * 1.05)
    # every family's times stay on record, the first family's first
    assert {c: t[0] for c, t in both.timings_by_way.items()} == both.timings
    assert both.timings_by_way[TuneEntry(64, 64, 8, 3)][1] == pytest.approx(8 * 1.4)


def test_warm_up_chooses_launch_configs_against_every_family_and_the_crossover_from_the_first(cache_dir):
    """From the shortest length asked for up, grid lengths between the asked ones included; the grid's shorter
    lengths, the dense walk, the crossover and the cost come from the first family."""
    one = tuner.warm_up([8192, 32768], 128, 4, "bf16", progress=False, workload=FakeWorkload(), also=[],
                        timer=timer_with_a_scattered_family)
    both = tuner.warm_up([8192, 32768], 128, 4, "bf16", progress=False, workload=FakeWorkload(), also=[ScatteredFake()],
                         timer=timer_with_a_scattered_family)
    for length in (8192, 16384, 32768):  # 16K lies between the asked lengths: prompts there run its config
        assert one.results[length].best == TuneEntry(64, 64, 8, 3) and both.results[length].best == TuneEntry(64, 64, 4, 3)
    assert both.results[4096].best == TuneEntry(64, 64, 8, 3)  # under the shortest asked: the first family's
    assert both.dense_walk[8192].best == one.dense_walk[8192].best  # the dense walk on one family
    assert both.crossover == one.crossover
    assert "chosen against the input families structured, scattered; times on structured" in str(both)
    assert both.families == ("structured", "scattered") and one.families == ("structured",)


def test_a_family_that_cannot_build_the_head_dim_is_left_out_and_a_failure_is_reported(cache_dir, monkeypatch):
    """The scattered family needs a head dim of 16 (the kernels take 9 and up): a head dim of 12 times the first family
    alone instead of failing every candidate. A candidate that fails on one family is left out, and the report says
    so; a zero time divides nothing."""
    def fake_cuda_workload(head_dim, gqa, dtype, *, num_kv_heads=8, family="structured"):
        return ScatteredFake() if family == "scattered" else FakeWorkload()

    monkeypatch.setattr(tuner, "CudaWorkload", fake_cuda_workload)
    small = tuner.warm_up([2048], 12, 4, "bf16", progress=False, timer=timer_with_a_scattered_family)
    usual = tuner.warm_up([2048], 16, 4, "bf16", progress=False, timer=timer_with_a_scattered_family)
    assert small.families == ("structured",) and usual.families == ("structured", "scattered")

    def fails_on_scattered_with_8_warps(fn):
        kind, n, *config = fn()
        if kind == "kernel-scattered" and config[0].num_warps == 8:
            raise RuntimeError("out of resources")
        return fake_timer(fn)

    report = tuner.warm_up([2048], 16, 4, "bf16", progress=False, timer=fails_on_scattered_with_8_warps)
    assert report.results[2048].best.num_warps == 4 and "failed and were left out" in str(report)
    zero = tuner.tune("sparse_attention", [TuneEntry(64, 64, 8, 3), TuneEntry(64, 64, 4, 3)], lambda c: None,
                      lambda fn: 0.0, also=[lambda c: None])
    assert zero.best == TuneEntry(64, 64, 8, 3)


def test_an_on_miss_tune_inside_a_forward_times_the_first_family_alone(monkeypatch):
    asked = []
    monkeypatch.setattr(tuner, "warm_up", lambda *args, **kwargs: asked.append(kwargs.get("families")))
    monkeypatch.setattr(dispatch, "_tuned_here", set())
    dispatch._tune_now(torch.empty(1, 4, 8, 64), torch.empty(1, 2, 8, 64), 1024)
    assert asked == [tuner.TUNE_FAMILIES[:1]]


def test_cli_autotune_names_an_unknown_family(cache_dir):
    from minference_fx.cli import main

    with pytest.raises(SystemExit, match="--families: unknown input family"):
        main(["autotune", "--lengths", "8k", "--head-dim", "128", "--gqa", "4", "--families", "structured,bogus"])


def test_a_tune_up_to_64k_measures_the_cost_models_rates(cache_dir):
    report = tuner.warm_up([65536], 128, 4, "bf16", progress=False, workload=FakeWorkload(), timer=fake_timer)
    table = Table.from_json(report.path.read_text())
    # a quarter of the tiles walked in the tuned kernel's 64 ms against dense's 64 ** 2 for all of them, and the
    # index's 8 ms
    cost = table.costs[next(iter(table.crossovers))]
    assert cost == report.cost and cost.measured_at == 65536
    assert cost.walk_rate == pytest.approx(0.25 * 4096 / 64)
    assert cost.index_share == pytest.approx(8 / 4096)
    assert "the sparse walk runs 16.000x" in str(report)


def test_the_tunes_cost_times_the_walk_beside_the_dense_time_not_in_the_sweep(cache_dir):
    """The sweep's time of a config can sit far from a stand-alone one (11 % on an H100): the cost's walk time is
    taken after the dense time at the cost's length, with the tuned config."""
    timed = []

    def timer(fn):
        what = fn()[:2]
        timed.append(what)
        if what == ("kernel", 65536) and ("dense", 65536) in timed:
            return 32.0  # the walk alone, beside the dense time: half what the sweep saw
        return fake_timer(fn)

    report = tuner.warm_up([65536], 128, 4, "bf16", progress=False, workload=FakeWorkload(), timer=timer)
    assert timed[-3:] == [("sparse", 65536), ("kernel", 65536), ("index", 65536)]
    assert report.results[65536].best_ms == pytest.approx(64)  # the sweep's time, as before
    assert report.cost.walk_rate == pytest.approx(0.25 * 4096 / 32)


def test_a_timing_that_makes_no_cost_is_refused_before_anything_is_written(cache_dir):
    with pytest.raises(ValueError, match="cannot weigh"):
        tuner.measure_cost(FakeWorkload(), 65536, TuneEntry(), lambda fn: 0.0)
    with pytest.raises(ValueError, match="finite"):
        tuner.measure_cost(FakeWorkload(), 65536, TuneEntry(), lambda fn: float("nan") if fn()[0] == "index" else 1.0)


def test_costs_only_measures_the_rates_with_the_cached_launch_config(cache_dir):
    tuner.warm_up([8192], 128, 4, "bf16", progress=False, workload=FakeWorkload(), timer=fake_timer)
    table = Table.from_json((cache_dir / cache.FILE_NAME).read_text())
    assert not table.costs  # the premise: a short tune measures none
    timed = []

    def timer(fn):
        timed.append(fn()[:2])
        return fake_timer(fn)

    cost = tuner.measure_costs(128, 4, "bf16", length=8192, workload=FakeWorkload(), timer=timer)
    assert timed == [("dense", 8192), ("kernel", 8192), ("index", 8192)]
    assert cost.walk_rate == pytest.approx(0.25 * 64 / 8)  # at the tuned (64, 64, 8, 3) kernel's time
    assert Table.from_json((cache_dir / cache.FILE_NAME).read_text()).costs == {next(iter(table.crossovers)): cost}


def test_a_cost_table_round_trips_and_a_bad_cost_is_refused():
    key = _xkey()
    table = Table(costs={key: WalkCost(0.8, 0.02, 65536)})
    assert Table.from_json(table.to_json()) == table
    old = json.loads(table.to_json())
    del old["costs"]  # a table written before the cost model reads as one without costs
    assert Table.from_json(json.dumps(old)).costs == {}
    for bad in ({"walk_rate": 0, "index_share": 0.1, "measured_at": 1}, {"walk_rate": True, "index_share": 0.1,
                "measured_at": 1}, {"walk_rate": 0.8, "index_share": 0.1, "measured_at": 1.5},
                {"walk_rate": float("inf"), "index_share": 0.1, "measured_at": 1},
                {"walk_rate": 0.8, "index_share": float("nan"), "measured_at": 1},
                {"walk_rate": 0.8, "index_share": -0.1, "measured_at": 1},
                {"walk_rate": 10 ** 400, "index_share": 0.1, "measured_at": 1},
                {"walk_rate": 0.8, "index_share": 0.1, "measured_at": 10 ** 400}):
        doc = json.loads(table.to_json())
        doc["costs"][0]["cost"] = bad
        with pytest.raises(cache.ForeignFile, match="malformed"):
            Table.from_json(json.dumps(doc))
    # a JSON integer where a rate goes is read as the float it is
    doc = json.loads(table.to_json())
    doc["costs"][0]["cost"]["walk_rate"] = 1
    assert type(Table.from_json(json.dumps(doc)).costs[key].walk_rate) is float


def test_tuned_entries_reach_the_op_dispatch(cache_dir):
    tuner.warm_up([4096], 16, 2, torch.float32, progress=False, workload=FakeWorkload(), timer=fake_timer)
    table = Table.from_json((cache_dir / cache.FILE_NAME).read_text())
    # the fake GPU's entries are not this device's: the CPU dispatch must not pick them up
    q, k = torch.empty(1, 4, 4096, 16), torch.empty(1, 2, 4096, 16)
    assert dispatch.tuned_min_sparse_len(q, k) == dispatch.untuned_crossover()
    ident = DeviceIdentity("cpu", "none")
    entries = {dataclasses.replace(key, gpu=ident.gpu, capability=ident.capability): e for key, e in table.configs.items()}
    cache.write(configs=entries)
    assert dispatch.launch_config(q, k) == TuneEntry(64, 64, 8, 3)


def test_on_miss_tunes_a_missing_shape_once_then_reads_the_cache(cache_dir, monkeypatch):
    calls = []

    fake_tuning(monkeypatch, calls, crossover=2048)
    q, k = torch.empty(1, 4, 4096, 16), torch.empty(1, 2, 4096, 16)
    dispatch.set_on_miss(False)
    assert dispatch.launch_config(q, k) == cache.DEFAULT_ENTRY and not calls  # off: a forward never times
    cache.forget()
    dispatch.set_on_miss(True)
    try:
        assert dispatch.tuned_min_sparse_len(q, k) == 2048
        assert dispatch.launch_config(q, k) == TuneEntry(64, 64, 8, 3)
        assert dispatch.launch_config(q, k) == TuneEntry(64, 64, 8, 3)
    finally:
        dispatch.set_on_miss(False)
    assert calls == [(max(tuner.CROSSOVER_LENGTHS),), (4096,)]  # crossover over the whole grid, then this bucket


def test_autotune_option_is_validated():
    from minference_fx.options import BackendOptions

    assert BackendOptions.from_user({"autotune": "on-miss"}).autotune == "on-miss"
    with pytest.raises(ValueError, match="autotune='always'"):
        BackendOptions.from_user({"autotune": "always"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_warm_up_without_cuda_says_it_needs_a_gpu(cache_dir):
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        tuner.warm_up([8192], 128, 4, "bf16", progress=False)
    assert not cache_dir.exists()


# --------------------------------------------------------------------------- CLI


def test_cli_show_runs_on_cpu(cache_dir, capsys):
    from minference_fx.cli import main

    assert main(["autotune", "--show"]) == 0
    out = capsys.readouterr().out
    assert str(cache_dir / cache.FILE_NAME) in out and "empty" in out
    cache.write(configs={_key(): TuneEntry(64, 64, 8, 3)}, crossovers={_xkey(): None})
    assert main(["autotune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "num_warps=8 num_stages=3" in out and "NVIDIA H200" in out and "never" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cli_tuning_without_cuda_says_it_needs_a_gpu(cache_dir):
    from minference_fx.cli import main

    with pytest.raises(SystemExit, match="needs|CUDA GPU"):
        main(["autotune", "--lengths", "8k", "--head-dim", "128", "--gqa", "4", "--quiet"])


def test_model_config_gives_the_shape(tmp_path):
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = shape_from_hf_config(tmp_path)
    assert (shape.head_dim, shape.group, shape.num_kv_heads) == (128, 4, 8)
    (tmp_path / "qwen.json").write_text(json.dumps({**cfg, "head_dim": 64, "num_key_value_heads": 2}))
    assert shape_from_hf_config(tmp_path / "qwen.json").group == 16


# --------------------------------------------------------------------------- the op


def _qkv(sq):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, sq, 16, generator=g), torch.randn(1, 2, sq, 16, generator=g),
            torch.randn(1, 2, sq, 16, generator=g))


def _spy_paths(monkeypatch):
    ran = []
    dense, sparse = dense_module.dense_attention, reference.sparse_attention_reference
    monkeypatch.setattr(dense_module, "dense_attention", lambda *a, **kw: ran.append("dense") or dense(*a, **kw))
    monkeypatch.setattr(reference, "sparse_attention_reference", lambda *a, **kw: ran.append("sparse") or sparse(*a, **kw))
    return ran


def test_op_with_negative_min_sparse_len_dispatches_on_the_tuned_crossover(cache_dir, monkeypatch):
    ran = _spy_paths(monkeypatch)
    key = dispatch.crossover_key(torch.device("cpu"), torch.float32, 16, 2)
    cache.write(crossovers={key: 64})
    for sq in (32, 63, 64, 80):
        OP(*_qkv(sq), None, None, 0.25, 0, 0, *VS, -1)
    assert ran == ["dense", "dense", "sparse", "sparse"]
    # explicit values still win over the tuned one
    ran.clear()
    OP(*_qkv(80), None, None, 0.25, 0, 0, *VS, 8192)
    OP(*_qkv(32), None, None, 0.25, 0, 0, *VS, 0)
    assert ran == ["dense", "sparse"]
    # sparse never won when tuned: dense at every length
    cache.write(crossovers={key: None})
    ran.clear()
    OP(*_qkv(80), None, None, 0.25, 0, 0, *VS, -1)
    assert ran == ["dense"]


def test_op_without_a_tuned_crossover_uses_the_default_length(cache_dir, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    ran = _spy_paths(monkeypatch)
    OP(*_qkv(80), None, None, 0.25, 0, 0, *VS, -1)
    OP(*_qkv(96), None, None, 0.25, 0, 0, *VS, -1)
    assert ran == ["dense", "dense"]  # 80, 96 < 8192
    assert len([r for r in _warnings(caplog) if "crossover" in r.getMessage()]) == 1
    # the warning names the device and the shape in words, not as the key's dataclass repr
    message = next(r.getMessage() for r in _warnings(caplog) if "crossover" in r.getMessage())
    assert "CrossoverKey(" not in message and "cpu, triton " in message and "float32, head dim 16, GQA 2" in message


def test_untuned_lookups_warn_with_the_key_in_words(cache_dir, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    # a shape no other test looks up: each key warns once a process
    cache.lookup(_key(bucket=131072, kernel="dense_walk", head_dim=80))
    message = _warnings(caplog)[-1].getMessage()
    assert "TuneKey(" not in message
    assert ("dense_walk at the 131072-token bucket on NVIDIA H200 (compute capability 9.0), triton 3.6.0, bfloat16, "
            "head dim 80, GQA 4, kernel sources abc") in message
    # repr stays the dataclass's, for debugging
    assert repr(_xkey()).startswith("CrossoverKey(source_hash='abc'")


def test_untuned_crossover_follows_the_plans_budgets(cache_dir):
    """With no measured crossover, sparse starts where the widest sparse head reads at most an eighth of the
    prompt's keys per row (a power of two, never below the semantic default)."""
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern

    def plan(*heads):
        return LayerPlan(tuple(HeadPlan(*h) for h in heads))

    vs = (Pattern.VERTICAL_SLASH, 1000, 6096)
    assert dispatch.untuned_crossover() == dispatch.untuned_crossover(plan(vs)) == 65536  # 8 x 7096 = 56768
    assert dispatch.untuned_crossover(plan((Pattern.VERTICAL_SLASH, 250, 500))) == 8192  # 6000: the floor
    assert dispatch.untuned_crossover(plan((Pattern.VERTICAL_SLASH, 2048, 2048))) == 32768  # exactly 8 x 4096
    assert dispatch.untuned_crossover(plan((Pattern.VERTICAL_SLASH, 2048, 2049))) == 65536
    assert dispatch.untuned_crossover(plan((Pattern.BLOCK_SPARSE, 50, 0))) == 32768  # 50 tiles of 64 keys
    assert dispatch.untuned_crossover(plan((Pattern.A_SHAPE, 64, 512))) == 8192
    # the widest head decides; dense heads read every key but go to SDPA, so they do not count
    assert dispatch.untuned_crossover(plan((Pattern.DENSE,), vs, (Pattern.A_SHAPE, 64, 512))) == 65536
    assert dispatch.untuned_crossover(plan((Pattern.DENSE,))) == cache.DEFAULT_MIN_SPARSE_LEN
    q, k = torch.empty(1, 4, 64, 16), torch.empty(1, 2, 64, 16)
    assert dispatch.tuned_min_sparse_len(q, k, plan(*[(Pattern.VERTICAL_SLASH, 250, 500)] * 4)) == 8192
    assert dispatch.tuned_min_sparse_len(q, k, plan(*[vs] * 4)) == 65536
    # a measured crossover wins over the budgets
    cache.write(crossovers={dispatch.crossover_key(torch.device("cpu"), torch.float32, 16, 2): 2048})
    cache.forget()
    assert dispatch.tuned_min_sparse_len(q, k, plan(*[vs] * 4)) == 2048


def test_op_asks_for_the_crossover_of_its_own_plan(cache_dir, monkeypatch):
    asked = []
    monkeypatch.setattr(dispatch, "tuned_min_sparse_len", lambda q, k, plan=None: asked.append(plan) or 1 << 20)
    OP(*_qkv(80), None, None, 0.25, 0, 0, [2, 2, 0, 2], [250] * 4, [500] * 4, -1)
    (plan,) = asked
    assert [h.pattern.value for h in plan.heads] == ["vertical_slash", "vertical_slash", "dense", "vertical_slash"]
    assert dispatch.untuned_crossover(plan) == 8192


def test_launch_kwargs_carry_every_field_of_the_config():
    entry = TuneEntry(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3)
    assert entry.launch() == dict(block_m=32, block_n=128, num_warps=8, num_stages=3)
    assert len(entry.launch()) == len(dataclasses.fields(TuneEntry))
    from minference_fx.kernels.attend import sparse_attention_triton

    assert set(entry.launch()) <= set(inspect.signature(sparse_attention_triton).parameters)
