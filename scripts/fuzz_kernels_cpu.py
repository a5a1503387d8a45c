#!/usr/bin/env python3
"""Differential fuzzing of the Triton kernels under the Triton interpreter (CPU) against the reference path; each
case draws its shapes, plan, masks and launch from its number, so it reruns alone (``--case N``, same ``--layer``,
``--profile`` and ``--dtype``).

* ``--layer index``: ``build_index_gpu`` and ``build_index_pair_gpu`` (the guard's escalated plan) against
  ``reference.build_index``, entry by entry and as key sets, in the tests' index format; the guard's mass
  (``mass_out``) against ``guard.captured_mass``. Where float64 scores nearly tie at a top-k cut the builders may
  pick either key: a case whose only differences are such heads' lists is a near tie, not a failure.
* ``--layer attend``: ``sparse_attention_triton`` against ``reference.sparse_attention_reference`` on the same index
  (the reference's, or the GPU builder's lists) under block sizes, pointer or TMA loads, forced-dense pairs
  (``here``, or ``skip`` + ``only`` into one output) and SKIP heads: the output, the LSE over the keys each row
  reads, rows reading no key exactly 0 (LSE -inf), SKIP heads' rows untouched.

``--profile edge`` (attend) puts query rows past the last key and negative ``q_offset`` first, half the heads
A-shape; ``long`` (index) takes 1000-2600 keys (several 1024-key chunks of the row statistics); a layer without the
profile runs ``default``. fp32 and fp16 only: the interpreter's bf16 ``tl.dot`` is wrong. Exit status 1 if a case
failed. ``--layer both`` runs each case number in both layers in turn.

    OMP_NUM_THREADS=1 python scripts/fuzz_kernels_cpu.py --layer both --profile default --seconds 240 --log fuzz.jsonl
    OMP_NUM_THREADS=1 python scripts/fuzz_kernels_cpu.py --layer attend --profile edge --case 10
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
import warnings
from pathlib import Path

# before triton is imported: it picks the interpreter at import, and no GPU may take the kernels instead
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

from minference_fx import dense  # noqa: E402
from minference_fx.kernels import guard  # noqa: E402
from minference_fx.kernels import reference as ref  # noqa: E402
from minference_fx.kernels.attend import SKIP_CODE, sparse_attention_triton  # noqa: E402
from minference_fx.kernels.index import build_index_gpu, build_index_pair_gpu, index_capacity  # noqa: E402
from minference_fx.plan import HeadPlan, LayerPlan, Pattern, escalated_plan  # noqa: E402

# the index tests' own format check and float64 scores, so the fuzzer holds the builder to the same contract
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from index_helpers import as_masks, brute_vs, check_format  # noqa: E402

# the interpreter computes masked-off lanes too; their garbage overflows harmlessly
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")

BLOCK = 64
VS, BS, DENSE, ASHAPE = Pattern.VERTICAL_SLASH, Pattern.BLOCK_SPARSE, Pattern.DENSE, Pattern.A_SHAPE
DTYPES = {"float32": torch.float32, "float16": torch.float16}
# the op's own launch (all defaults) three times in ten, the others once each
LAUNCHES = [dict(), dict(), dict(), dict(block_n=32), dict(block_n=128), dict(kv_desc=False), dict(block_m=32),
            dict(block_m=16), dict(block_m=16, block_n=128), dict(block_m=32, block_n=32)]
PROFILES = {"index": ("default", "long"), "attend": ("default", "edge")}
FAILED = ("MISMATCH", "EXCEPTION")  # the other statuses: ok, near-tie


# ---- drawing a case -------------------------------------------------------------------------------------------------

def rand_budget(r: random.Random, skv: int) -> int:
    """Below the forced minima, up to the keys, moderate, more than the keys, or at the minima's and tiles' edges."""
    c = r.random()
    return (r.randint(0, 5) if c < 0.15 else r.randint(0, max(1, skv)) if c < 0.55 else r.randint(20, 160) if c < 0.8
            else r.randint(skv, 3 * skv + 10) if c < 0.92
            else r.choice([1, 29, 30, 31, 49, 50, 51, 63, 64, 65, 99, 100, 101, 127, 128, 129]))


def rand_head(r: random.Random, skv: int, weights=(0.45, 0.3, 0.12, 0.13)) -> HeadPlan:
    pattern = r.choices([VS, BS, DENSE, ASHAPE], weights=weights)[0]
    if pattern is VS:
        return HeadPlan(VS, rand_budget(r, skv), rand_budget(r, skv))
    if pattern is BS:
        c = r.random()
        return HeadPlan(BS, r.randint(0, 3) if c < 0.4 else r.randint(0, 10) if c < 0.85 else r.randint(5, 40),
                        r.randint(0, 3))
    if pattern is DENSE:
        return HeadPlan(DENSE)
    return HeadPlan(ASHAPE, r.choice([0, 1, 4, 16, 63, 64, 65, 100, r.randint(0, 300)]),
                    r.choice([1, 2, 16, 63, 64, 65, 128, 129, r.randint(1, 400)]))


def rand_shapes(r: random.Random, max_s: int = 400):
    """(B, Hq, Hkv, Sq, Skv, q_offset, D): tile-edge lengths, short queries, and rows past the last key now and then
    (the op allows them without doc_ids)."""
    b, hkv = r.choice([1, 1, 2]), r.choice([1, 1, 2, 3])
    hq = hkv * r.choice([g for g in range(1, 7) if hkv * g <= 6])
    c = r.random()
    skv = (r.randint(1, 70) if c < 0.1 else r.randint(1, max_s) if c >= 0.25
           else r.choice([63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 320, 384]))
    c = r.random()
    sq = skv if c < 0.35 else r.randint(1, min(skv, 3)) if c < 0.5 else r.randint(1, skv)
    q_offset = skv - sq
    c = r.random()
    if c < 0.15:
        q_offset = r.randint(0, skv - sq)
    elif c < 0.22:
        q_offset = r.randint(0, skv)
    elif c < 0.27:
        sq, q_offset = r.randint(1, max_s), r.randint(0, 100)
    return b, hq, hkv, sq, skv, q_offset, r.choice([16, 32, 64])


def rand_key_mask(r: random.Random, b: int, skv: int):
    """(bool [B or 1, Skv] or None, its description): left padding, holes, fully masked rows, a broadcast row."""
    if r.random() < 0.55:
        return None, "none"
    key_mask, desc = torch.ones(b, skv, dtype=torch.bool), []
    for row in range(b):
        kind = r.random()
        if kind < 0.25:
            desc.append("full")
        elif kind < 0.9:
            pad = r.randint(0, skv)
            key_mask[row, :pad] = False
            desc.append(f"left{pad}")
            if kind >= 0.8 and skv > 2:
                h0 = r.randint(0, skv - 1)
                h1 = r.randint(h0, min(skv, h0 + 40))
                key_mask[row, h0:h1] = False
                desc[-1] += f"+hole{h0}:{h1}"
        else:
            key_mask[row] = False
            desc.append("allmasked")
    if b == 2 and r.random() < 0.15:
        return key_mask[:1], f"{desc[0]},bcast"
    return key_mask, ",".join(desc)


def draw_masks(r: random.Random, c: dict, p_window: float, p_doc: float, doc_dtypes) -> None:
    c["key_mask"], c["km_desc"] = rand_key_mask(r, c["b"], c["skv"])
    c["window"] = r.choice([1, 2, 63, 64, 65, r.randint(1, c["skv"] + 64)]) if r.random() < p_window else 0
    c["doc_ids"] = None
    # documents only where every query row has its key (the op's rule for doc_ids)
    if r.random() < p_doc and 0 <= c["q_offset"] and c["q_offset"] + c["sq"] <= c["skv"]:
        cuts = sorted(r.randint(0, c["skv"]) for _ in range(r.randint(1, 4) - 1))
        c["doc_ids"] = torch.zeros(c["b"], c["skv"], dtype=r.choice(doc_dtypes))
        for cut in cuts:
            c["doc_ids"][:, cut:] += 1


def index_case(n: int, profile: str) -> dict:
    if profile == "long":
        r = random.Random(7777 * n + 3)
        b, hkv = r.choice([1, 2]), r.choice([1, 2])
        hq, skv = hkv * r.choice([1, 2, 3]), r.randint(1000, 2600)
        sq, c = r.choice([r.randint(1, 64), r.randint(65, 200)]), r.random()
        q_offset = (skv - sq if c < 0.6 else r.randint(0, skv - sq) if c < 0.8
                    else r.randint(skv - sq, skv + 100) if c < 0.93 else r.randint(-80, 0))
        d = r.choice([16, 32, 64])
    else:
        r = random.Random(1000003 * n + 17)
        b, hq, hkv, sq, skv, q_offset, d = rand_shapes(r)
    c = dict(n=n, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, q_offset=q_offset, d=d,
             plan=LayerPlan(tuple(rand_head(r, skv) for _ in range(hq))))
    draw_masks(r, c, 0.2, 0.12, [torch.long])
    c.update(dtype=r.choice([torch.float32, torch.float32, torch.float16]),
             scale=r.choice([d ** -0.5, d ** -0.5, 0.25, 1.0, r.uniform(0.05, 1.5)]), structured=r.choice([0, 0, 1, 2]),
             esc=(r.randint(1, skv + 50), r.randint(1, skv + 50)) if r.random() < 0.5 else None,
             strided=r.random() < 0.15)
    return c


def attend_case(n: int, profile: str) -> dict:
    if profile == "edge":
        r = random.Random(104729 * n + 11)
        b, hkv = r.choice([1, 2]), r.choice([1, 2])
        hq, skv, sq, c = hkv * r.choice([1, 2, 3]), r.randint(1, 260), r.randint(1, 200), r.random()
        q_offset = (r.randint(max(0, skv - sq + 1), skv + 150) if c < 0.5  # some rows past the last key
                    else r.randint(0, max(0, skv - sq)) if c < 0.8 else r.randint(-70, 10))
        d = r.choice([16, 32])
        heads = tuple(HeadPlan(ASHAPE, r.choice([0, 1, 63, 64, 65, 128, 129, r.randint(0, 3 * skv + 70)]),
                               r.choice([1, 2, 63, 64, 65, r.randint(1, skv + 100)])) if r.random() < 0.5
                      else rand_head(r, skv, weights=(0.35, 0.35, 0.3, 0.0)) for _ in range(hq))
    else:
        r = random.Random(7919 * n + 5)
        b, hq, hkv, sq, skv, q_offset, d = rand_shapes(r, max_s=r.choice([130, 200, 300]))
        heads = tuple(rand_head(r, skv, weights=(0.3, 0.25, 0.2, 0.25)) for _ in range(hq))
    c = dict(n=n, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, q_offset=q_offset, plan=LayerPlan(heads))
    draw_masks(r, c, 0.25, 0.15, [torch.long, torch.int32])
    c["dtype"] = r.choice([torch.float32, torch.float16])
    c["d"] = r.choice([24, 40, 80, 128]) if d == 64 and r.random() < 0.2 else d  # head dims off a power of two
    c.update(scale=r.choice([c["d"] ** -0.5, 0.25, r.uniform(0.05, 1.2)]), launch=r.choice(LAUNCHES),
             mode=r.choices(["plain", "here", "split", "skiphead"], weights=(0.55, 0.15, 0.15, 0.15))[0])
    c["force"] = (torch.rand(b, hq, generator=torch.Generator().manual_seed(n)) < 0.5
                  if c["mode"] in ("here", "split") else None)
    c["skip_heads"] = (sorted(r.sample(range(hq), r.randint(1, hq - 1)))
                       if c["mode"] in ("skiphead", "split") and hq > 1 else [])
    c.update(lse=r.random() < 0.5, gpu_index=r.random() < 0.3, structured=r.choice([0, 0, 1, 2]),
             strided=r.random() < 0.15, only_launch=dict(block_m=r.choice([16, 32, 64, 128]),
                                                         block_n=r.choice([32, 64, 128])))
    return c


def params(c: dict) -> dict:
    """The case as JSON: a head as [pattern, budget_a, budget_b], the key mask by km_desc, doc_ids by dtype."""
    out = {key: list(value) if isinstance(value, tuple) else value for key, value in c.items() if key != "key_mask"}
    out.update(plan=[[h.pattern.value, h.budget_a, h.budget_b] for h in c["plan"].heads],
               doc_ids=None if c["doc_ids"] is None else str(c["doc_ids"].dtype).removeprefix("torch."),
               dtype=str(c["dtype"]).removeprefix("torch."))
    if c.get("force") is not None:
        out["force"] = c["force"].int().tolist()
    return out


def rand_qkv(seed: int, c: dict):
    """q, k, v of the case; ``structured`` 1 makes attention peaky, 2 adds a few heavy keys (sinks, verticals);
    ``strided`` gives them the [B, S, H, D] memory order."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c["b"], c["hq"], c["sq"], c["d"], generator=g)
    k = torch.randn(c["b"], c["hkv"], c["skv"], c["d"], generator=g)
    v = torch.randn(c["b"], c["hkv"], c["skv"], c["d"], generator=g)
    if c["structured"] == 1:
        q = q * 2.5
    elif c["structured"] == 2:
        k[:, :, torch.randint(0, max(1, c["skv"]), (3,), generator=g)] *= 3.0
    q, k, v = (x.to(c["dtype"]) for x in (q, k, v))
    if c["strided"]:
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q, k, v


def mask_args(c: dict) -> dict:
    return dict(key_mask=c["key_mask"], doc_ids=c["doc_ids"], q_offset=c["q_offset"], window=c["window"])


# ---- the index layer ------------------------------------------------------------------------------------------------

def near_tie(values: torch.Tensor, k: int) -> bool:
    """Whether the k-th and (k+1)-th largest of float64 ``values`` (last dim) are close without being equal in any
    row: there the builders' float32 sums may order them either way (exact ties both break by index)."""
    if not 0 < k < values.shape[-1]:
        return False
    top = values.sort(dim=-1, descending=True).values
    a, b = top[..., k - 1], top[..., k]
    apart = (a > b) & (torch.isinf(a) | ((a - b) > 1e-4 * a.abs() + 1e-12))
    return bool((~((a == b) | apart)).any())


def near_ties(q, k, plan: LayerPlan, scores, *, key_mask=None, doc_ids=None, q_offset=0, window=0) -> dict:
    """{head: which cut} of the heads with a near tie at a top-k cut, under the reference's rules (forced sinks from
    the first kept key, the forced local band, forced and allowed block tiles); ``scores``: ``brute_vs``'s (vertical,
    slash) of q and k, which no plan changes."""
    B, sq, skv, group = q.shape[0], q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    vertical, slash = scores
    j = torch.arange(skv)
    first_key = ref.first_kept_keys(key_mask, "cpu")[:, None, None]
    vertical = torch.where((j >= first_key) & (j < first_key + ref.VS_FORCED_COLUMNS), float("inf"), vertical)
    slash = slash.masked_fill(j < ref.VS_FORCED_DIAGONALS, float("inf"))
    M, N = -(-sq // BLOCK), -(-skv // BLOCK)
    tile_lo, tile_hi = ref._tile_bounds(torch.arange(sq) + q_offset, M)
    ties = {}
    for h, hp in enumerate(plan.heads):
        if hp.pattern is VS:
            why = ("vertical" if near_tie(vertical[:, h], min(max(hp.budget_a, ref.VS_MIN_COLUMNS), skv)) else "") + (
                "slash" if near_tie(slash[:, h], min(max(hp.budget_b, ref.VS_MIN_DIAGONALS), skv)) else "")
            if why:
                ties[h] = why
        elif hp.pattern is BS:
            def pool(x, tiles):
                return torch.stack([x[:, t * BLOCK:(t + 1) * BLOCK].double().mean(1) for t in range(tiles)], 1)

            pq, pk = pool(q[:, h], M), pool(k[:, h // group], N)
            score, magnitude = pq @ pk.transpose(1, 2), pq.abs() @ pk.abs().transpose(1, 2)
            n = torch.arange(N)
            for row in range(B):
                first = int(first_key[min(row, first_key.shape[0] - 1), 0, 0])
                for m in range(M):
                    lo, hi = int(tile_lo[m]), int(tile_hi[m])
                    allowed = (n * BLOCK <= hi) & (torch.clamp(n * BLOCK + BLOCK - 1, max=skv - 1) >= first)
                    forced = allowed & ((n == first // BLOCK) | ((n >= lo // BLOCK) & (n <= hi // BLOCK)))
                    free = allowed & ~forced
                    want = max(min(hp.budget_a, int(allowed.sum())), int(forced.sum())) - int(forced.sum())
                    vals = score[row, m, free]
                    if 0 < want < vals.numel():
                        top = vals.sort(descending=True).values
                        gap = float(top[want - 1] - top[want])
                        if 0 != gap < 1e-5 * float(magnitude[row, m, free].max()) + 1e-9:
                            ties[h] = f"block b={row} m={m} gap={gap:.3g}"
    return ties


def compare_index(got, want, mass, plan: LayerPlan, vertical, sq: int, skv: int, what: str, mass_heads=None) -> list:
    """[(head or None, problem)]: ``got`` against ``want`` entry by entry and as key sets (the head named: a near tie
    there may excuse it), and ``mass`` (of the heads ``mass_heads``, default the listed ones; -1 elsewhere) against
    ``captured_mass`` of ``want`` where the lists agree (no tie excuses it then); ``vertical``: the guard's
    ``vertical_scores`` of the case."""
    problems, bad_heads = [], set()
    try:
        if got.block_start.shape[-1] == 0:  # check_format cannot take an empty capacity
            assert got.block_start.shape[-1] == index_capacity(plan, skv)[0] and not got.block_count.any()
        else:
            check_format(got, plan, sq, skv)
    except AssertionError as e:
        problems.append((None, f"{what}: format: {e}"))
    got_keys, got_cols = as_masks(got, skv)
    want_keys, want_cols = as_masks(want, skv)
    B, Hq, M = want.block_count.shape
    for h, hp in enumerate(plan.heads):
        if hp.pattern not in (VS, BS):
            if got.block_count[:, h].any() or got.col_count[:, h].any():
                problems.append((None, f"{what}: head {h} {hp} lists entries"))
            continue
        for row in range(B):
            for m in range(M):
                nb, nc = int(want.block_count[row, h, m]), int(want.col_count[row, h, m])
                got_blocks = got.block_start[row, h, m, :int(got.block_count[row, h, m])].int().tolist()
                lists_equal = (got_blocks == want.block_start[row, h, m, :nb].tolist()
                               and got.col_index[row, h, m, :int(got.col_count[row, h, m])].tolist()
                               == want.col_index[row, h, m, :nc].tolist())
                gk, wk, gc, wc = (x[row, h, m] for x in (got_keys, want_keys, got_cols, want_cols))
                sets_equal = torch.equal(gk, wk) and torch.equal(gc, wc)
                if not (lists_equal and sets_equal):
                    bad_heads.add(h)
                    only = [(x & ~y).nonzero().flatten().tolist()[:20]
                            for x, y in ((gc, wc), (wc, gc), (gk, wk), (wk, gk))]
                    problems.append((h, f"{what}: head {h} {hp} b={row} m={m}: lists_equal={lists_equal} sets_equal="
                                        f"{sets_equal}; got blocks {got_blocks} want "
                                        f"{want.block_start[row, h, m, :nb].tolist()}; columns only got {only[0]} only "
                                        f"want {only[1]}; keys only got {only[2]} only want {only[3]}"))
                    break
    checked = [h for h, hp in enumerate(plan.heads) if hp.pattern in (VS, BS)] if mass_heads is None else mass_heads
    want_mass = guard.captured_mass(vertical, want, min(ref.VS_LAST_Q, sq))
    for h in range(Hq):
        if h not in checked:
            if not (mass[:, h] == -1).all():
                problems.append((None, f"{what}: mass of unchecked head {h} written: {mass[:, h].tolist()}"))
        elif h not in bad_heads:  # a different index has a different mass
            g, w = mass[:, h], want_mass[:, h]
            if not (torch.isfinite(g).all() and torch.allclose(g, w, rtol=1e-4, atol=1e-6)):
                problems.append((None, f"{what}: mass head {h}: got {g.tolist()} want {w.tolist()}"))
    return problems


def run_index(c: dict) -> dict:
    q, k, _ = rand_qkv(c["n"], c)
    plan, scale, masks = c["plan"], c["scale"], mask_args(c)
    if c["n"] % 5 == 0:  # a row-strided mass_out: a view of a wider buffer
        mass = torch.full((q.shape[0], q.shape[1] + 3), -1.0)[:, 1:1 + q.shape[1]]
    else:
        mass = torch.full(q.shape[:2], -1.0)
    got = build_index_gpu(q, k, plan, scale=scale, mass_out=mass, **masks)
    # the guard's scores depend on q, k and the masks only: once for both plans
    vertical = guard.vertical_scores(q, k, scale=scale, **masks)
    sq, skv = q.shape[2], k.shape[2]
    problems = compare_index(got, ref.build_index(q, k, plan, scale=scale, **masks), mass, plan, vertical, sq, skv,
                             "single")
    escalated = escalated_plan(plan, c["esc"]) if c["esc"] is not None else None
    if escalated is not None:
        mass1, mass2 = torch.full(q.shape[:2], -1.0), torch.full(q.shape[:2], -1.0)
        first, second = build_index_pair_gpu(q, k, plan, escalated, scale=scale, mass_out=mass1,
                                             escalated_mass_out=mass2, **masks)
        for name in ("block_count", "block_start", "col_count", "col_index"):
            if not torch.equal(getattr(first.padded(), name), getattr(got.padded(), name)):
                problems.append((None, f"pair: first index's {name} differs from build_index_gpu's"))
        if not torch.equal(mass1, mass):
            problems.append((None, f"pair: mass_out differs from build_index_gpu's: {mass1.tolist()} vs "
                                   f"{mass.tolist()}"))
        # the escalated index lists only vertical-slash heads, the only ones the guard checks
        vs_heads = [h for h, hp in enumerate(plan.heads) if hp.pattern is VS]
        want_up = ref.build_index(q, k, escalated, scale=scale, **masks)
        problems += compare_index(second, want_up, mass2, escalated, vertical, sq, skv, "escalated",
                                  mass_heads=vs_heads)
    status, ties = "ok", {}
    if problems:  # only a disagreement needs the near ties that may excuse it (a passing case logs none)
        scores = brute_vs(q, k, scale, masks["key_mask"], masks["doc_ids"], masks["q_offset"], masks["window"])
        ties = near_ties(q, k, plan, scores, **masks)
        if escalated is not None:
            for h, why in near_ties(q, k, escalated, scores, **masks).items():
                ties.setdefault(h, "escalated " + why)
        status = "near-tie" if all(h is not None and h in ties for h, _ in problems) else "MISMATCH"
    return dict(status=status, problems=[p for _, p in problems], ties={str(h): w for h, w in ties.items()},
                pair=escalated is not None)


# ---- the attention layer --------------------------------------------------------------------------------------------

def run_attend(c: dict) -> dict:
    q, k, v = rand_qkv(c["n"] + 99, c)
    plan, scale, masks, mode = c["plan"], c["scale"], mask_args(c), c["mode"]
    B, Hq, sq, _ = q.shape
    skv = k.shape[2]
    ref_index = ref.build_index(q, k, plan, scale=scale, **masks)
    index = want_index = ref_index
    if c["gpu_index"]:
        index = build_index_gpu(q, k, plan, scale=scale, **masks)
        # the reference runs the GPU builder's lists of the listed heads (the kernel's index), its own for the others
        take = torch.tensor(dense.guarded_heads(plan)).expand(B, -1)
        want_index = dense.take_index(ref_index, index, take)
    want = ref.sparse_attention_reference(q, k, v, plan, scale=scale, index=want_index, **masks).float()
    base = ref.base_allowed(torch.arange(sq) + c["q_offset"], skv, c["key_mask"], c["doc_ids"], c["window"])
    reads = ref.index_to_mask(want_index, range(sq), skv) & base  # [B, Hq, Sq, Skv]
    force = c["force"] if c["force"] is not None else torch.zeros(B, Hq, dtype=torch.bool)
    skipped = torch.zeros(B, Hq, dtype=torch.bool)
    skipped[:, c["skip_heads"]] = True
    forced_dense = force & ~skipped
    if forced_dense.any():
        want_dense = ref.dense_attention_reference(q, k, v, scale=scale, **masks)
        want[forced_dense] = want_dense.float()[forced_dense]
        reads[forced_dense] = base.expand(B, Hq, -1, -1)[forced_dense]

    patterns, budget_a, budget_b = plan.op_arguments()
    patterns = [SKIP_CODE if h in c["skip_heads"] else p for h, p in enumerate(patterns)]
    sentinel = 7.0  # what SKIP heads' rows must still hold
    out = torch.full_like(q.contiguous(), sentinel)
    # split is the op's way: a launch that skips the forced pairs and one that runs only them, into one out
    launches = {"here": [("here", c["launch"])], "split": [("skip", c["launch"]), ("only", c["only_launch"])]}
    results = [sparse_attention_triton(q, k, v, index, patterns, budget_a, budget_b, out=out, return_lse=c["lse"],
                                       scale=scale, **masks, **launch,
                                       **(dict(force_dense=force, forced=forced) if forced else {}))
               for forced, launch in launches.get(mode, [(None, c["launch"])])]
    got = results[0][0] if c["lse"] else results[0]
    if got.data_ptr() != out.data_ptr():
        return dict(status="MISMATCH", problems=["the returned tensor is not out"])

    problems = []
    got = got.float()
    run = ~skipped
    if (got[skipped] != sentinel).any():
        problems.append("SKIP head rows were written")
    if torch.isnan(got[run]).any():
        problems.append("NaN in the output")
    empty = ~reads.any(-1) & run[:, :, None]  # [B, Hq, Sq]: rows that read no key
    if (got[empty] != 0).any():
        problems.append(f"rows that read no key are not exactly 0: {int((got[empty] != 0).any(-1).sum())} rows, "
                        f"max |x| {got[empty].abs().max().item():.3g}")
    # fp32: the fp32 reference itself is ~1e-5 off float64 on peaky rows; the bugs hunted here move outputs by 1e-1
    atol, rtol = (2e-5, 1e-5) if c["dtype"] == torch.float32 else (2e-3, 2e-3)
    diff = (got - want).abs()
    bad = (diff > atol + rtol * want.abs()) & run[:, :, None, None]
    if bad.any():
        first = bad.nonzero()[0].tolist()
        pairs = sorted({(int(x[0]), int(x[1])) for x in bad.nonzero()[:, :2]})
        problems.append(f"output mismatch: max diff {diff[run].max().item():.4g} (atol {atol}); bad (b, h) {pairs[:8]};"
                        f" first bad element {first} got {got[tuple(first)].item():.6g} want "
                        f"{want[tuple(first)].item():.6g}; bad rows {sorted({int(x[2]) for x in bad.nonzero()})[:20]}")
    if c["lse"]:
        lse = results[0][1].clone()
        if mode == "split":  # the only launch wrote the forced pairs' LSE
            lse[forced_dense] = results[1][1][forced_dense]
        scores = (q.float() @ k.float().repeat_interleave(Hq // k.shape[1], 1).transpose(-1, -2)) * scale
        want_lse = torch.logsumexp(scores.masked_fill(~reads, float("-inf")), -1)
        g, w = lse[run], want_lse[run]
        if torch.isnan(g).any():
            problems.append("NaN in the LSE")
        if not torch.equal(torch.isneginf(g), torch.isneginf(w)):
            problems.append("LSE -inf pattern differs")
        else:
            lse_diff = torch.where(torch.isneginf(w), 0.0, (g - w).abs())
            if (lse_diff > (1e-4 if c["dtype"] == torch.float32 else 2e-3)).any():
                problems.append(f"LSE mismatch: max diff {lse_diff.max().item():.4g}")
    return dict(status="MISMATCH" if problems else "ok", problems=problems, empty_rows=int(empty.sum()))


# ---- driving --------------------------------------------------------------------------------------------------------

LAYERS = {"index": (index_case, run_index), "attend": (attend_case, run_attend)}


def run_one(layer: str, n: int, profile: str, dtype) -> dict:
    """The record of case ``n``: its parameters, status (ok, near-tie, MISMATCH or EXCEPTION), problems, seconds."""
    draw, check = LAYERS[layer]
    profile = profile if profile in PROFILES[layer] else "default"
    c = draw(n, profile)
    if dtype is not None:  # after the draw, so the rest of the case stays what its number gives
        c["dtype"] = dtype
    start = time.time()
    try:
        record = check(c)
    except Exception as e:  # noqa: BLE001 - a crash is a finding, the run goes on
        record = dict(status="EXCEPTION", problems=[f"{type(e).__name__}: {e}", traceback.format_exc()[-1500:]])
    return dict(layer=layer, profile=profile, case=n, params=params(c), **record, secs=round(time.time() - start, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", choices=["index", "attend", "both"], default="both")
    ap.add_argument("--profile", choices=["default", "edge", "long"], default="default")
    ap.add_argument("--start", type=int, default=0, help="first case number")
    ap.add_argument("--count", type=int, default=10 ** 9, help="case numbers to run, each in every layer")
    ap.add_argument("--seconds", type=float, default=float("inf"), help="stop starting cases after this long")
    ap.add_argument("--case", type=int, default=None, help="rerun this case alone and print it")
    ap.add_argument("--dtype", default=None, help="float32 or float16 for every case (default: as drawn)")
    ap.add_argument("--log", default=None, help="append one JSON line a case to this file")
    args = ap.parse_args()
    if args.dtype is not None and args.dtype not in DTYPES:
        ap.error(f"--dtype {args.dtype}: float32 or float16 only (the interpreter's bf16 tl.dot is wrong)")
    dtype = DTYPES.get(args.dtype)
    layers = ["index", "attend"] if args.layer == "both" else [args.layer]

    if args.case is not None:
        failed = False
        for layer in layers:
            record = run_one(layer, args.case, args.profile, dtype)
            print(f"{layer} case " + " ".join(f"{key}={value}" for key, value in record["params"].items()))
            print(json.dumps({key: record[key] for key in record if key != "params"}, indent=1))
            failed |= record["status"] in FAILED
        sys.exit(int(failed))

    log = open(args.log, "a") if args.log else None
    records = {layer: [] for layer in layers}
    start = time.time()
    # the layers take turns, case by case, so both get covered whatever the time budget
    for n in range(args.start, args.start + args.count):
        if time.time() - start > args.seconds:
            break
        for layer in layers:
            record = run_one(layer, n, args.profile, dtype)
            records[layer].append(record)
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if record["status"] in FAILED:
                print(f"{layer} case {n}: {record['status']}: {record['problems'][0][:300]}", flush=True)
    for layer, rs in records.items():
        failed = [r["case"] for r in rs if r["status"] in FAILED]
        ties = sum(r["status"] == "near-tie" for r in rs)
        print(f"{layer} ({rs[0]['profile'] if rs else args.profile}): {len(rs)} cases, {len(rs) - len(failed)} ok"
              f"{f' ({ties} near ties)' if ties else ''}, {len(failed)} failed{f': {failed}' if failed else ''}")
    sys.exit(int(any(r["status"] in FAILED for rs in records.values() for r in rs)))


if __name__ == "__main__":
    main()
