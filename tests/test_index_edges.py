"""Edge cases of the GPU index builder's vertical-slash path (diagonal blocks walked 64 picks at a time, the
int8 cover map, the per-tile binary searches, the heads' first picks at mixed budgets) and of its guard mass,
against the CPU oracle ``reference.build_index`` and ``guard.captured_mass``.

Random q/k rarely select a given set of diagonals, so most cases plant one: with head dim 64, the r-th of the
last R = min(64, Sq) query rows (the only rows the vertical-slash estimate reads) is ``c * e_r``, and key j has
a 1 in coordinate r iff ``pos_r - j`` is a planted diagonal. Each estimate row then scores exactly c on the keys
of the planted diagonals and 0 elsewhere, so the slash score of a planted diagonal (one with a key) exceeds any
other's by a factor of at least about e^c / 64, and a slash budget of (forced diagonals + planted ones) selects
exactly them (checked before each comparison).
"""
from __future__ import annotations

import pytest
import torch

from minference_fx.kernels import guard
from minference_fx.kernels import index as index_mod
from minference_fx.kernels import reference as ref
from minference_fx.kernels.index import build_index_gpu, build_index_pair_gpu, vs_estimate
from minference_fx.plan import escalated_plan
from index_helpers import BLOCK, BS, DENSE, VS, as_masks, assert_no_near_tie, check_format, plan_of, rand_qk

HEAD_DIM = 64
PLANT_SCORE = 10.0  # e^10 = 22026: a planted diagonal's slash score dwarfs the 64 rows' share of any other
ALL = 4096  # a budget above every Skv here: every column / every diagonal is selected
FORCED_DIAGONALS = range(ref.VS_FORCED_DIAGONALS)


def planted_qk(sq, skv, diagonals_per_head, *, q_offset=0, batch=1, seed=0):
    """q ``[batch, H, sq, 64]``, k ``[batch, H, skv, 64]`` whose estimate rows attend exactly to the keys on the
    given diagonals. ``diagonals_per_head[h]`` is a set, or a list with one set per batch row."""
    heads = len(diagonals_per_head)
    q, k = rand_qk(batch, heads, heads, sq, skv, HEAD_DIM, seed=seed)
    k.zero_()
    rows = min(ref.VS_LAST_Q, sq)
    for h, diagonals in enumerate(diagonals_per_head):
        for b in range(batch):
            deltas = diagonals[b] if isinstance(diagonals, list) else diagonals
            deltas = torch.tensor(sorted(deltas), dtype=torch.long)
            for r in range(rows):
                row = sq - rows + r
                q[b, h, row] = 0
                q[b, h, row, r] = PLANT_SCORE
                keys = q_offset + row - deltas
                keys = keys[(keys >= 0) & (keys < skv)]
                k[b, h, keys, r] = 1.0
    return q, k


def selected_diagonals(q, k, plan, **kw):
    """[b][h]: the set of diagonals the reference's estimate selects for each vertical-slash head (the top of the
    slash scores with the forced ones first, as ``reference._vertical_slash`` ranks them)."""
    _, slash = vs_estimate(q, k, scale=1.0, **kw)
    skv = k.shape[2]
    slash = slash.clone()
    slash[..., : ref.VS_FORCED_DIAGONALS] = float("inf")
    out = []
    for b in range(q.shape[0]):
        per_head = {}
        for h, hp in enumerate(plan.heads):
            if hp.pattern is VS:
                n = min(max(hp.budget_b, ref.VS_MIN_DIAGONALS), skv)
                per_head[h] = set(ref._stable_topk(slash[b, h], n).tolist())
        out.append(per_head)
    return out


def assert_same_lists(got, want, heads):
    """Exact equality of the counts and of the listed entries (in order) of heads ``heads``, whatever each side's
    capacity."""
    assert torch.equal(got.block_count[:, heads], want.block_count[:, heads]), "block_count"
    assert torch.equal(got.col_count[:, heads], want.col_count[:, heads]), "col_count"
    B, _, M = want.block_count.shape
    for b in range(B):
        for h in heads:
            for m in range(M):
                n, c = int(want.block_count[b, h, m]), int(want.col_count[b, h, m])
                got_starts = got.block_start[b, h, m, :n].int().tolist()
                want_starts = want.block_start[b, h, m, :n].tolist()
                assert got_starts == want_starts, (
                    f"block_start (b={b}, h={h}, m={m}): got {got_starts}, want {want_starts}")
                got_cols, want_cols = got.col_index[b, h, m, :c].tolist(), want.col_index[b, h, m, :c].tolist()
                assert got_cols == want_cols, f"col_index (b={b}, h={h}, m={m}): got {got_cols}, want {want_cols}"


def check_against_reference(q, k, plan, *, scale=1.0, **kw):
    """Build the GPU index with its guard mass and compare both with the reference (:func:`assert_as_reference`).
    Returns (gpu index, mass)."""
    mass = torch.full(q.shape[:2], -1.0)
    got = build_index_gpu(q, k, plan, scale=scale, mass_out=mass, **kw)
    assert_as_reference(got, mass, q, k, plan, scale=scale, **kw)
    return got, mass


def assert_as_reference(got, mass, q, k, plan, *, scale, mass_heads=None, **kw):
    """``got`` equals the reference index list by list (after the format and near-tie checks of
    tests/test_index.py), and ``mass`` equals ``guard.captured_mass`` on the reference index for the heads
    ``mass_heads`` (default: the vertical-slash and block-sparse ones), the others left at -1."""
    B, Hq, sq, _ = q.shape
    skv = k.shape[2]
    check_format(got, plan, sq, skv)
    assert_no_near_tie(q, k, plan, scale, **kw)
    want = ref.build_index(q, k, plan, scale=scale, **kw)
    checked = [h for h, hp in enumerate(plan.heads) if hp.pattern in (VS, BS)]
    unchecked = [h for h in range(Hq) if h not in checked]
    assert_same_lists(got, want, checked)
    # the lists' keys agree as sets too; dense and A-shape heads list nothing
    assert all(torch.equal(a[:, checked], b[:, checked]) for a, b in zip(as_masks(got, skv), as_masks(want, skv)))
    assert int(got.block_count[:, unchecked].abs().sum()) == 0 and int(got.col_count[:, unchecked].abs().sum()) == 0
    mass_heads = checked if mass_heads is None else mass_heads
    want_mass = guard.captured_mass(guard.vertical_scores(q, k, scale=scale, **kw), want, min(ref.VS_LAST_Q, sq))
    torch.testing.assert_close(mass[:, mass_heads], want_mass[:, mass_heads], rtol=1e-4, atol=1e-6)
    assert (mass[:, [h for h in range(Hq) if h not in mass_heads]] == -1).all()


def check_planted(sq, skv, diagonals_per_head, plan, *, q_offset=0, batch=1, key_mask=None, seed=0):
    """Plant the diagonals, confirm the estimate selects exactly forced + planted, then compare to the reference."""
    q, k = planted_qk(sq, skv, diagonals_per_head, q_offset=q_offset, batch=batch, seed=seed)
    kw = dict(q_offset=q_offset, key_mask=key_mask) if key_mask is not None else dict(q_offset=q_offset)
    selected = selected_diagonals(q, k, plan, **kw)
    for b in range(batch):
        for h, diagonals in enumerate(diagonals_per_head):
            if plan.heads[h].pattern is VS:
                deltas = diagonals[b] if isinstance(diagonals, list) else diagonals
                want = set(FORCED_DIAGONALS[:skv]) | {d for d in deltas if d < skv}
                assert selected[b][h] == want, f"planting failed for (b={b}, h={h})"
    return check_against_reference(q, k, plan, **kw)


def blocks_read_by_last_tile(diagonals, sq, skv, q_offset=0):
    """How many of ``reference.diagonal_blocks(diagonals)`` hold a key the last query tile can read."""
    lo = q_offset + (sq - 1) // BLOCK * BLOCK
    hi = min(q_offset + sq - 1, skv - 1)
    return sum(1 for x in ref.diagonal_blocks(diagonals) if lo - x + BLOCK - 1 >= 0 and lo - x <= hi)


def slash_budget(diagonals, skv):
    """The slash budget that keeps exactly the forced diagonals and ``diagonals``."""
    return len(set(FORCED_DIAGONALS[:skv]) | {d for d in diagonals if d < skv})


# --------------------------------------------------------------------------- every diagonal selected


@pytest.mark.parametrize("s", [1, 63, 64, 65, 127, 128, 129, 192, 193])
def test_every_diagonal_one_run(s):
    # slash budget >= Skv: the diagonals are exactly 0 .. s-1, one run of s (its last block at Skv when Skv is a
    # multiple of 64);
    # the second head also selects every column, all of them inside its blocks: no leftover column, full mass
    q, k = rand_qk(1, 2, 2, s, s, 16, seed=s)
    plan = plan_of((VS, 30, ALL), (VS, ALL, ALL))
    got, mass = check_against_reference(q, k, plan, scale=0.25)
    assert int(got.col_count[:, 1].sum()) == 0
    torch.testing.assert_close(mass, torch.ones_like(mass), rtol=0, atol=1e-5)
    # the last tile lists the blocks of diagonal_blocks(0 .. s-1) that reach a key
    assert int(got.block_count[0, 0, -1]) == blocks_read_by_last_tile(range(s), s, s)


@pytest.mark.parametrize("sq,skv,q_offset", [(64, 200, 136), (64, 600, 300), (1, 300, 299), (30, 90, 10),
                                             (100, 40, 0), (200, 130, 60)],
                         ids=["one-tile-at-end", "one-tile-mid", "one-row", "short-both", "rows-past-keys",
                              "rows-past-keys-offset"])
def test_every_diagonal_and_column_with_offsets(sq, skv, q_offset):
    # every diagonal and every column with rows not ending with the keys: blocks reach past the tile's keys on
    # both sides, columns beyond hi must be dropped
    q, k = rand_qk(1, 2, 2, sq, skv, 16, seed=sq + skv)
    check_against_reference(q, k, plan_of((VS, ALL, ALL), (VS, 45, 120)), scale=0.25, q_offset=q_offset)


# --------------------------------------------------------------------------- planted runs of diagonals


@pytest.mark.parametrize("start,length", [(100, 64), (100, 128), (129, 65), (192, 127), (193, 64), (193, 65),
                                          (193, 127), (193, 128), (250, 65)])
def test_planted_run(start, length):
    # one contiguous run of `length` diagonals: the walk consumes up to 64 picks a block, so 64/65/127/128 sit
    # on either side of a full vector step; start 100 continues the forced run 0..99, 129 and 192 extend its
    # last block (128), 193 just misses it
    sq = skv = 448
    run = set(range(start, start + length))
    plan = plan_of((VS, 30, slash_budget(run, skv)), (VS, ALL, slash_budget(run, skv)))
    got, _ = check_planted(sq, skv, [run, run], plan)
    assert int(got.block_count[0, 0, -1]) == blocks_read_by_last_tile(set(FORCED_DIAGONALS) | run, sq, skv)


@pytest.mark.parametrize("budget_b", [64, 65, 99, 100])
def test_forced_run_prefix_from_zero(budget_b):
    # budgets under 100 keep the lowest forced diagonals (their ties go to the lowest): a run 0 .. budget-1
    q, k = rand_qk(1, 2, 2, 300, 300, 16, seed=budget_b)
    got, _ = check_against_reference(q, k, plan_of((VS, 30, budget_b), (VS, ALL, budget_b)), scale=0.25)
    assert int(got.block_count[0, 0, -1]) == blocks_read_by_last_tile(range(budget_b), 300, 300)


@pytest.mark.parametrize("first", [65, 66, 127, 128, 129, 130, 200])
def test_run_to_the_last_key(first):
    # a run of `first` diagonals ending at Skv-1: the run's last block lies at Skv-1 (65), Skv+62 (66, the
    # largest offset the cover map holds), Skv+1 (127) or Skv (128 and more)
    sq = skv = 320
    run = set(range(skv - first, skv))
    plan = plan_of((VS, ALL, slash_budget(run, skv)), (VS, 30, slash_budget(run, skv)))
    check_planted(sq, skv, [run, run], plan)
    assert max(ref.diagonal_blocks(set(FORCED_DIAGONALS) | run)) >= skv - 1


@pytest.mark.parametrize("sq,skv,q_offset", [(1, 300, 299), (20, 400, 380), (64, 450, 300), (150, 500, 350)],
                         ids=["one-row", "short-tile", "one-tile-keys-past", "two-tiles-keys-past"])
def test_lone_diagonals_with_gaps(sq, skv, q_offset):
    # diagonals at gaps of 1, 63, 64, 65 and 128 past each other and past the forced run: each gap either extends
    # the last block or starts a run; the planting reaches any set, also with fewer than 64 estimate rows
    diagonals = {150, 151, 214, 278, 343, 471, skv - 1} | {q_offset + sq - 1}
    diagonals = {d for d in diagonals if d <= q_offset + sq - 1}  # a diagonal past the last row has no key
    # (the second head keeps only the forced columns: the planted keys' column sums differ by a hair)
    plan = plan_of((VS, ALL, slash_budget(diagonals, skv)), (VS, 30, slash_budget(diagonals, skv)))
    check_planted(sq, skv, [diagonals, diagonals], plan, q_offset=q_offset)


@pytest.mark.parametrize("seed", range(4))
def test_random_diagonal_sets(seed):
    # random runs (1..139 diagonals) and gaps (1..129, around the 64 where extend-or-start flips), 3 query tiles
    g = torch.Generator().manual_seed(100 + seed)
    sq, skv = 192, 560
    diagonals, d = set(), 100 + int(torch.randint(0, 70, (1,), generator=g))
    while d < skv:
        run = int(torch.randint(1, 140, (1,), generator=g))
        diagonals |= set(range(d, min(d + run, skv)))
        d += run + int(torch.randint(1, 130, (1,), generator=g))
    plan = plan_of((VS, ALL, slash_budget(diagonals, skv)), (VS, 30, slash_budget(diagonals, skv)))
    check_planted(sq, skv, [diagonals, diagonals], plan, q_offset=skv - sq)


# --------------------------------------------------------------------------- heads and batch rows


@pytest.mark.parametrize("equal_budgets", [False, True])
def test_heads_with_their_own_diagonal_budgets(equal_budgets):
    # one top-k at the largest budget serves every head: with different budgets a head must drop the picks past
    # its own (the masking path of _first_picks_ascending); with equal ones there is no mask. A dense head
    # between them checks the head table.
    sq = skv = 384
    sets = [set(range(150, 160)), set(range(200, 330)), set(), {101, 230, 231, 300}]
    if equal_budgets:
        sets = [set(range(150, 170)), set(range(200, 220)), set(), {101, 230, 231, 300} | set(range(310, 326))]
    budgets = [slash_budget(s, skv) for s in sets]
    plan = plan_of((VS, ALL, budgets[0]), (VS, 30, budgets[1]), (DENSE,), (VS, 300, budgets[3]))
    assert (len({budgets[h] for h in (0, 1, 3)}) == 1) == equal_budgets
    check_planted(sq, skv, sets, plan)


def test_column_budgets_differ_and_exceed_the_keys():
    # column budgets below, at and above Skv in one plan (the columns' masking path), with planted diagonals
    sq, skv = 128, 200
    diagonals = {120, 121, 185}
    budget_b = slash_budget(diagonals, skv)
    plan = plan_of((VS, 30, budget_b), (VS, skv, budget_b), (VS, 10 * skv, budget_b), (VS, 77, budget_b))
    check_planted(sq, skv, [diagonals] * 4, plan, q_offset=skv - sq)


def test_batch_rows_with_left_padding_and_their_own_diagonals():
    # batch 2, the second row left-padded by 90 keys: each row has its own planted diagonals, and the padding
    # moves the forced columns of row 1 to start at key 90
    sq = skv = 384
    key_mask = torch.ones(2, skv, dtype=torch.bool)
    key_mask[1, :90] = False
    per_row = [{130, 131, 132, 260} | set(range(300, 361)), set(range(140, 205))]  # 65 diagonals each
    budget = slash_budget(per_row[0], skv)
    assert budget == slash_budget(per_row[1], skv)
    plan = plan_of((VS, ALL, budget), (VS, 30, budget))
    check_planted(sq, skv, [per_row, per_row], plan, batch=2, key_mask=key_mask)


# --------------------------------------------------------------------------- the guard's mass


@pytest.mark.parametrize("sq,skv,q_offset", [(5, 5, 0), (40, 100, 60), (100, 100, 0), (130, 300, 170),
                                             (256, 256, 0)],
                         ids=["five-rows", "short-offset", "short-last-tile", "offset-unaligned", "aligned"])
def test_guard_mass_equals_captured_mass(sq, skv, q_offset):
    # the last tile's mass from the device kernel against guard.captured_mass on the reference index, with
    # fewer than 64 estimate rows, a short last tile, blocks before key 0, columns and block-sparse heads
    q, k = rand_qk(2, 4, 2, sq, skv, 16, seed=sq * 7 + skv)
    key_mask = torch.ones(2, skv, dtype=torch.bool)
    key_mask[1, : skv // 5] = False
    plan = plan_of((VS, 40, 60), (BS, 2), (VS, 100, 20), (DENSE,))
    _, mass = check_against_reference(q, k, plan, scale=0.25, q_offset=q_offset, key_mask=key_mask)
    assert ((mass[:, [0, 1, 2]] > 0) & (mass[:, [0, 1, 2]] <= 1 + 1e-5)).all()


def test_guard_mass_reads_column_sums_of_any_stride():
    # the kernel reads the column sums through their strides: a key-major layout (key stride B * heads) gives
    # the same masses as the contiguous one
    q, k = rand_qk(2, 4, 2, 200, 200, 16, seed=11)
    plan = plan_of((VS, 40, 60), (VS, 100, 20), (VS, 30, 30), (VS, 64, 64))
    index = build_index_gpu(q, k, plan, scale=0.25)
    vertical = guard.vertical_scores(q, k, scale=0.25).to(torch.float32)
    key_major = vertical.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert key_major.stride(-1) != 1
    heads = torch.arange(4, dtype=torch.int32)
    masses = torch.full((2, 2, 4), -1.0)
    index_mod._last_tile_mass(vertical, heads, index, masses[0], 200)
    index_mod._last_tile_mass(key_major, heads, index, masses[1], 200)
    assert (masses[0] > 0).all()
    torch.testing.assert_close(masses[1], masses[0], rtol=0, atol=0)


def test_index_pair_against_the_reference():
    # the guard's escalation builds two indexes from one top-k at the larger budgets: the plan's heads share one
    # budget (no mask, but a top-k wider than it), the escalated plan keeps every diagonal and column; a
    # block-sparse head makes the vertical-slash rows of the estimate a strided slice. Both indexes and both
    # masses against the reference.
    sq = skv = 320
    key_mask = torch.ones(2, skv, dtype=torch.bool)
    key_mask[1, :40] = False
    sets = [set(range(150, 170)), set(), {101, 230, 231, 232} | set(range(240, 256))]
    plan = plan_of((VS, 30, 120), (BS, 2), (VS, 30, 120))
    q, k = planted_qk(sq, skv, sets, batch=2)
    q[:, 1:2], k[:, 1:2] = rand_qk(2, 1, 1, sq, skv, HEAD_DIM, seed=5)
    up = escalated_plan(plan, (ALL, ALL))
    mass, mass_up = torch.full((2, 3), -1.0), torch.full((2, 3), -1.0)
    got, got_up = build_index_pair_gpu(q, k, plan, up, scale=1.0, key_mask=key_mask, mass_out=mass,
                                       escalated_mass_out=mass_up)
    selected = selected_diagonals(q, k, plan, key_mask=key_mask)
    assert all(selected[b][h] == set(FORCED_DIAGONALS) | sets[h] for b in range(2) for h in (0, 2))
    assert_as_reference(got, mass, q, k, plan, scale=1.0, key_mask=key_mask)
    assert_as_reference(got_up, mass_up, q, k, up, scale=1.0, key_mask=key_mask, mass_heads=[0, 2])
    torch.testing.assert_close(mass_up[:, [0, 2]], torch.ones(2, 2), rtol=0, atol=1e-5)  # every key listed


@pytest.mark.parametrize("q_offset, sq, skv", [(-200, 64, 256), (-129, 64, 64), (-300, 130, 512)])
def test_block_sparse_rows_that_all_sit_before_key_0_pick_nothing(q_offset, sq, skv):
    """A score chunk whose every query row lies 65 or more positions before key 0 had no key tile to score and
    raised (a negative slice width); the reference lists nothing for such rows."""
    q, k = rand_qk(1, 2, 1, sq, skv, 16)
    check_against_reference(q, k, plan_of((BS, 2), (VS, 30, 50)), scale=0.25, q_offset=q_offset)
