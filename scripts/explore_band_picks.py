#!/usr/bin/env python3
"""Arithmetic and CPU attention, no kernel: vertical-slash heads that pick diagonal *blocks* by their mass instead of
single diagonals (issue 36, part 2: work proportional to the keys the index keeps).

Today a head ranks single diagonals by the estimate's slash scores, keeps the best S, and the index turns them into
diagonal blocks (``reference.diagonal_blocks``): a block at offset x of a query tile whose rows sit at ``lo ..
lo + 63`` holds keys ``lo - x .. lo - x + 63``. Where the picks scatter, each lone diagonal costs a whole 64 x 64
block of work for one picked key a row (``scripts/explore_layouts.py``). The walk computes every key of its blocks,
so the keys the attention reads are the blocks' keys, not only the picked diagonals.

A block at x holds diagonal ``x + j`` for ``64 - |j|`` of a tile's 64 rows (a tent over ``x - 63 .. x + 63``), so
its share of the estimate is the tent-weighted sum of the slash scores. Blocks 64 or more apart hold disjoint rows
of every diagonal, so a set of such blocks holds the sum of their tents. The rules, each ``RULE:N``:

* ``single:S``: today's index at S diagonals (and the given columns);
* ``aligned:S``: the same picks on aligned key tiles, as the index walked them before diagonal blocks (c533d13);
* ``prune:B``: today's blocks at the ``--budgets`` diagonals, cut to the forced band's (offsets 0, 64, 128) and the
  best by tent, B in all: a rule a GPU index could run after its block pass (a gather and a top-k a head);
* ``optimal:B``: the B blocks, 64 or more apart, of largest total tent (a dynamic program with a Lagrangian price
  per block; CPU only): the best any rule can do with this estimate and B blocks;
* ``pair:S`` / ``group:S``: today's index at S diagonals, but two consecutive query heads of a kv head (or its whole
  group) keep the same columns and diagonals, picked from their mean scores. Each head does the same work as with
  its own picks; a program could then walk one block list for both heads' rows (128 rows, K/V read once), the rate
  the 64-row sparse walk lacks (BENCHMARKS section 1). The question is the error at the same budgets.

For each rule it reports physical density (64 x 64 steps walked over causal tiles), logical density (keys kept
over causal keys: the picked diagonals and columns for ``single``, as ``kernels.density`` counts them, and the
blocks' keys and leftover columns for the block rules, since blocks are what they pick), and on sampled query tiles
(the last one and ``--tiles`` spread over the prompt) the dense attention mass inside the keys the rule reads and the
relative error of the attention output against dense (``|o - o_dense| / |o_dense|``, pooled over rows and heads).
Compare rules at equal physical density: that is the walk's time.

    python scripts/explore_band_picks.py --families structured,scattered --lengths 32k,128k \
        --rules single:6096,single:1524,prune:96,optimal:96 [--tiles 8] [--out FILE.json]
    python scripts/explore_band_picks.py --model qwen2.5-coder-1.5b --lengths 16k --budgets 125 762 \
        --rules single:762,single:190,prune:16,prune:24 --out FILE.json      # every layer, Austen prose, fp32
    python scripts/explore_band_picks.py --model qwen2.5-coder-1.5b --lengths 16k --configs A.json,B.json --out FILE.json
        # each config's plan at that length, on the heads vertical-slash in all of them (today's index)
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from minference_fx.autotune.workload import scattered_qkv, structured_qkv
from minference_fx.cli import parse_lengths
from minference_fx.config import SemanticConfig, load_config
from minference_fx.kernels.density import causal_pairs, key_selection, selection_pairs, vs_scores
from minference_fx.kernels.reference import BLOCK, VS_FORCED_DIAGONALS, diagonal_blocks
from minference_fx.observe import run_observed
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools.bench_prefill import build_real, text_prompt_ids

FAMILIES = {"structured": structured_qkv, "scattered": scattered_qkv}
RULES = ("single", "aligned", "prune", "optimal", "pair", "group")
SHARED = {"pair": 2, "group": None}
"""Rules whose heads share their picks: consecutive query heads of one kv head (2 of them, or the whole group)."""


def tent_scores(slash: np.ndarray) -> np.ndarray:
    """float64 ``[S]``: for each offset x, ``sum_j slash[x + j] * (64 - |j|) / 64`` over |j| < 64 (zero outside)."""
    padded = np.concatenate([np.zeros(BLOCK), slash.astype(np.float64), np.zeros(BLOCK)])
    c1 = np.concatenate([[0.0], np.cumsum(padded)])
    box = c1[BLOCK:] - c1[:-BLOCK]  # box[y] = padded[y .. y + 63]
    c2 = np.concatenate([[0.0], np.cumsum(box)])
    # tent at x (padded index x + 64) = sum of box[y] for y = x + 1 .. x + 64, over 64
    x = np.arange(len(slash))
    return (c2[x + BLOCK + 1] - c2[x + 1]) / BLOCK


def forced_blocks(skv: int) -> list[int]:
    """The blocks the index makes of the forced local diagonals 0 .. 99 (offsets 0, 64, 128)."""
    return diagonal_blocks(range(min(VS_FORCED_DIAGONALS, skv)))


def aligned_blocks(diagonals: list[int]) -> list[int]:
    """The aligned key tiles the index walked before diagonal blocks, as offsets: a diagonal d = 64a + b crosses key
    tiles m - a and, when b > 0, m - a - 1 of query tile m, which are the blocks at offsets 64a and 64(a + 1)."""
    tiles_back = {d // BLOCK for d in diagonals} | {d // BLOCK + 1 for d in diagonals if d % BLOCK}
    return sorted(BLOCK * t for t in tiles_back)


def pruned_blocks(single: list[int], tent: np.ndarray, n_blocks: int) -> list[int]:
    """``single``'s blocks (64 or more apart, so their tents add up) cut to the forced ones and the best by tent."""
    forced = set(forced_blocks(len(tent)))
    rest = sorted((x for x in single if x not in forced), key=lambda x: (-(tent[x] if x < len(tent) else 0.0), x))
    return sorted(forced | set(rest[: max(n_blocks - len(forced), 0)]))


def _best_spaced(weight: np.ndarray, first: int) -> tuple[float, list[int]]:
    """Offsets >= ``first``, 64 or more apart, of largest total ``weight`` (only positive weights are worth
    taking): ``f[i] = max(f[i - 1], f[i - 64] + weight[i])``, 64 offsets at a time (those need only the previous 64)."""
    n = len(weight) - first
    if n <= 0:
        return 0.0, []
    w = np.concatenate([weight[first:], np.full(-n % BLOCK, -np.inf)]).reshape(-1, BLOCK)
    f = np.empty_like(w)
    prev, last = np.zeros(BLOCK), 0.0
    for c in range(w.shape[0]):
        f[c] = np.maximum.accumulate(np.concatenate([[last], prev + w[c]]))[1:]
        prev, last = f[c], f[c, -1]
    f = f.reshape(-1)
    taken, i = [], n - 1
    while i >= 0:
        if f[i] > (f[i - 1] if i > 0 else 0.0):
            taken.append(first + i)
            i -= BLOCK
        else:
            i -= 1
    return float(f[n - 1]), taken[::-1]


def optimal_blocks(tent: np.ndarray, n_blocks: int) -> list[int]:
    """At most ``n_blocks`` blocks (the forced ones included), 64 or more apart, of largest total tent: the
    Lagrangian of the spacing DP, with the price per block found by bisection (an upper bound for any rule that
    places blocks by this estimate)."""
    forced = forced_blocks(len(tent))
    extra = n_blocks - len(forced)
    if extra <= 0:
        return forced
    first = forced[-1] + BLOCK
    lo, hi = 0.0, float(tent.max()) + 1.0
    best = _best_spaced(tent - hi, first)[1]
    for _ in range(40):
        price = (lo + hi) / 2
        taken = _best_spaced(tent - price, first)[1]
        if len(taken) > extra:
            lo = price
        else:
            hi, best = price, taken
    return forced + best


def mean_over_sets(scores: torch.Tensor, size: int) -> torch.Tensor:
    """``scores`` ``[B, H, S]`` with each set of ``size`` consecutive heads given the set's mean."""
    if size == 1:
        return scores
    B, H, S = scores.shape
    return scores.reshape(B, H // size, size, S).mean(2, keepdim=True).expand(B, H // size, size, S).reshape(B, H, S)


def tile_bounds(sq: int) -> tuple[np.ndarray, np.ndarray]:
    lo = np.arange(0, sq, BLOCK)
    return lo, np.minimum(lo + BLOCK - 1, sq - 1)


def head_work(blocks: list[int], columns: np.ndarray, sq: int) -> tuple[int, int, np.ndarray]:
    """(tile steps walked, keys in blocks and leftover columns, block offsets as an array) over every query tile."""
    lo, hi = tile_bounds(sq)
    x = np.asarray(blocks, dtype=np.int64)
    listed = (x[None, :] <= lo[:, None] + BLOCK - 1)  # a block that holds a key >= 0
    n_blocks = listed.sum(1)
    # leftover columns: causal, and in none of the tile's blocks (c in block x iff lo - c <= x <= lo - c + 63)
    cols = np.sort(columns[columns >= 0])
    first = np.searchsorted(x, lo[:, None] - cols[None, :])
    inside = (first < len(x)) & (x[np.minimum(first, len(x) - 1)] <= lo[:, None] - cols[None, :] + BLOCK - 1)
    causal_col = cols[None, :] <= hi[:, None]
    leftover = (causal_col & ~inside).sum(1)
    steps = int(n_blocks.sum() + np.ceil(leftover / BLOCK).sum())
    starts = torch.as_tensor(lo[:, None] - x[None, :])
    block_keys = causal_pairs(torch.as_tensor(lo)[:, None], torch.as_tensor(hi)[:, None], starts.clamp(min=0),
                              starts + BLOCK, sq).numpy()
    col_keys = np.where(causal_col & ~inside, np.minimum(hi[:, None], sq - 1) - np.maximum(cols[None, :], lo[:, None]) + 1, 0)
    keys = int(block_keys.sum() + np.clip(col_keys, 0, None).sum())
    return steps, keys, x


def read_mask(blocks: np.ndarray, columns: np.ndarray, tile_lo: int, rows: int, skv: int) -> torch.Tensor:
    """bool ``[rows, skv]``: the keys a query tile at ``tile_lo`` reads (blocks and columns, causal)."""
    keys = torch.zeros(skv + 1, dtype=torch.int32)
    starts = torch.as_tensor(tile_lo - blocks)
    ok = starts + BLOCK - 1 >= 0
    keys.index_add_(0, starts[ok].clamp(min=0), torch.ones(int(ok.sum()), dtype=torch.int32))
    keys.index_add_(0, (starts[ok] + BLOCK).clamp(max=skv), -torch.ones(int(ok.sum()), dtype=torch.int32))
    reads = keys.cumsum(0)[:skv] > 0
    cols = torch.as_tensor(columns[columns >= 0])
    reads[cols] = True
    i = tile_lo + torch.arange(rows)[:, None]
    return reads[None, :] & (torch.arange(skv)[None, :] <= i)


def sampled_tiles(sq: int, n: int) -> list[int]:
    m = math.ceil(sq / BLOCK)
    picks = {m - 1} | {int(t) for t in np.linspace(m // 8, m - 2, n)}
    return sorted(picks)


def parse_rules(text: str) -> list[tuple[str, int]]:
    rules = []
    for item in text.split(","):
        name, _, budget = item.partition(":")
        if name not in RULES or not budget.isdigit():
            raise SystemExit(f"--rules: {item!r} is not RULE:N with RULE one of {', '.join(RULES)}")
        rules.append((name, int(budget)))
    return rules


class Tally:
    """Per rule: tile steps walked, keys kept, and over the sampled rows the dense mass read and the squared error."""

    def __init__(self, labels: list[str]):
        self.rules = {label: {"steps": 0, "keys": 0.0, "causal_tiles": 0, "causal_keys": 0, "mass": 0.0,
                              "err2": 0.0, "rows": 0} for label in labels}
        self.ref2 = 0.0

    def add_causal(self, label: str, n_heads: int, sq: int) -> None:
        """Count ``n_heads`` heads' causal tiles and keys of an ``sq``-row call, the denominators of the densities."""
        _, hi = tile_bounds(sq)
        self.rules[label]["causal_tiles"] += n_heads * int((hi // BLOCK + 1).sum())
        self.rules[label]["causal_keys"] += n_heads * sq * (sq + 1) // 2

    def summary(self) -> dict:
        return {label: {"physical": a["steps"] / a["causal_tiles"], "logical": a["keys"] / a["causal_keys"],
                        "mass": a["mass"] / a["rows"], "rel_err": math.sqrt(a["err2"] / self.ref2)}
                for label, a in self.rules.items()}


def measure_call(q, k, v, scale: float, *, columns: int, diagonals: int, rules: list[tuple[str, int]], tiles: list[int],
                 tally: Tally) -> None:
    """Add one attention call (q ``[1, Hq, S, D]``, k and v ``[1, Hkv, S, D]``, causal) to ``tally``."""
    Hq, Hkv, sq = q.shape[1], k.shape[1], q.shape[2]
    group = Hq // Hkv
    vertical, slash = vs_scores(q, k, scale=scale)

    def picks_at(n_diags: int, share: int = 1):
        """Every head's picks at ``n_diags`` diagonals, each set of ``share`` consecutive heads ranking by its mean."""
        plan = LayerPlan(tuple(HeadPlan(Pattern.VERTICAL_SLASH, columns, n_diags) for _ in range(Hq)))
        return key_selection(mean_over_sets(vertical, share), mean_over_sets(slash, share), plan)

    singles = {n: picks_at(n) for n in {diagonals} | {b for r, b in rules if r in ("single", "aligned")}}
    base = singles[diagonals]
    shared = {}
    for rule, budget in rules:
        if rule in SHARED:
            size = SHARED[rule] or group
            if group % size:
                raise SystemExit(f"rule {rule}: {group} query heads a kv head do not split into sets of {size}")
            shared[(rule, budget)] = picks_at(budget, size)
    labels = [f"{r}:{b}" for r, b in rules]
    for label, (rule, budget) in zip(labels, rules):
        tally.add_causal(label, Hq, sq)
        if rule in ("single", "aligned"):  # the pattern's keys, as kernels.density counts them
            tally.rules[label]["keys"] += float(selection_pairs(singles[budget], sq, sq, 0).sum())
        elif rule in SHARED:
            tally.rules[label]["keys"] += float(selection_pairs(shared[(rule, budget)], sq, sq, 0).sum())
    for h in range(Hq):
        cols = base.columns[0, h].numpy()
        tent = tent_scores(slash[0, h].numpy())
        single_blocks = {n: diagonal_blocks([d for d in p.diagonals[0, h].tolist() if d >= 0])
                         for n, p in singles.items()}
        reads = {}
        for label, (rule, budget) in zip(labels, rules):
            head_cols = cols
            if rule == "single":
                blocks = single_blocks[budget]
            elif rule in SHARED:
                picked = shared[(rule, budget)]
                blocks = diagonal_blocks([d for d in picked.diagonals[0, h].tolist() if d >= 0])
                head_cols = picked.columns[0, h].numpy()
            elif rule == "aligned":
                blocks = aligned_blocks([d for d in singles[budget].diagonals[0, h].tolist() if d >= 0])
            elif rule == "prune":
                blocks = pruned_blocks(single_blocks[diagonals], tent, budget)
            else:
                blocks = optimal_blocks(tent, budget)
            steps, keys, x = head_work(blocks, head_cols, sq)
            reads[label] = (x, head_cols)
            tally.rules[label]["steps"] += steps
            if rule not in ("single", "aligned") and rule not in SHARED:
                tally.rules[label]["keys"] += keys
        tally_reads(q[0, h], k[0, h // group], v[0, h // group], scale, reads, tiles, tally)


def tally_reads(q_h, k_g, v_g, scale: float, reads: dict, tiles: list[int], tally: Tally) -> None:
    """Add to ``tally`` the dense mass inside, and the output error of, each rule's keys (``reads[label]`` = (block
    offsets, columns)) on the sampled query tiles of one head."""
    sq = q_h.shape[0]
    kh, vh = k_g.float(), v_g.float()
    for t in tiles:
        lo = t * BLOCK
        rows = min(BLOCK, sq - lo)
        s = (q_h[lo: lo + rows].float() @ kh.T) * scale
        causal = torch.arange(sq)[None, :] <= (lo + torch.arange(rows))[:, None]
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        dense = p @ vh
        tally.ref2 += float((dense ** 2).sum())
        for label, (x, cols) in reads.items():
            m = read_mask(x, cols, lo, rows, sq)
            tally.rules[label]["mass"] += float((p * m).sum())
            ps = torch.softmax(s.masked_fill(~m, float("-inf")), -1)
            tally.rules[label]["err2"] += float(((ps @ vh - dense) ** 2).sum())
            tally.rules[label]["rows"] += rows


def measure_configs_call(q, k, v, scale: float, *, plans: dict[str, LayerPlan], tiles: list[int],
                         tally: Tally) -> int:
    """Add one attention call to ``tally`` for each semantic config's plan of the layer (``plans[label]``), over the
    heads that are vertical-slash in every plan (today's index: single diagonals). Returns how many heads that is."""
    Hq, Hkv, sq = q.shape[1], k.shape[1], q.shape[2]
    group = Hq // Hkv
    heads = [h for h in range(Hq) if all(p.heads[h].pattern is Pattern.VERTICAL_SLASH for p in plans.values())]
    if not heads:
        return 0
    vertical, slash = vs_scores(q, k, scale=scale)
    picks = {label: key_selection(vertical, slash, plan) for label, plan in plans.items()}
    for label, pick in picks.items():
        tally.add_causal(label, len(heads), sq)
        tally.rules[label]["keys"] += float(selection_pairs(pick, sq, sq, 0)[0, heads].sum())
    for h in heads:
        reads = {}
        for label, pick in picks.items():
            cols = pick.columns[0, h].numpy()
            steps, _, x = head_work(diagonal_blocks([d for d in pick.diagonals[0, h].tolist() if d >= 0]), cols, sq)
            reads[label] = (x, cols)
            tally.rules[label]["steps"] += steps
        tally_reads(q[0, h], k[0, h // group], v[0, h // group], scale, reads, tiles, tally)
    return len(heads)


def measure_family(family: str, sq: int, *, columns: int, diagonals: int, rules: list[tuple[str, int]], n_tiles: int,
                   seed: int) -> dict:
    started = time.time()
    q, k, v = FAMILIES[family](sq, device="cpu", dtype=torch.float32, seed=seed)
    tiles = sampled_tiles(sq, n_tiles)
    tally = Tally([f"{r}:{b}" for r, b in rules])
    measure_call(q, k, v, q.shape[3] ** -0.5, columns=columns, diagonals=diagonals, rules=rules, tiles=tiles,
                 tally=tally)
    return {"family": family, "length": sq, "columns": columns, "diagonals": diagonals, "seed": seed,
            "sampled_tiles": tiles, "heads": q.shape[1], "rules": tally.summary(),
            "seconds": round(time.time() - started, 1)}


def measure_model(name: str, sq: int, *, columns: int, diagonals: int, rules: list[tuple[str, int]], n_tiles: int,
                  seed: int, configs: dict[str, SemanticConfig] | None = None) -> dict:
    """Every layer of a real model on ``sq`` tokens of Austen's prose (fp32 on the CPU), pooled over its heads: the
    rules at uniform budgets, or with ``configs`` each config's plan at that length (its vertical-slash heads)."""
    started = time.time()
    model, tokenizer = build_real(name, sq, torch.device("cpu"), torch.float32)
    ids = text_prompt_ids(tokenizer, sq, seed, "cpu")
    tiles = sampled_tiles(ids.shape[1], n_tiles)
    tally = Tally(list(configs) if configs else [f"{r}:{b}" for r, b in rules])
    per_layer = []

    def observe(call) -> None:
        layer = Tally(list(tally.rules))
        if configs:
            n_heads = call.q.shape[1]
            plans = {label: c.plan_at(call.layer, 0, n_heads, call.k.shape[2]) for label, c in configs.items()}
            if not measure_configs_call(call.q, call.k, call.v, call.scale, plans=plans, tiles=tiles, tally=layer):
                return
        else:
            measure_call(call.q, call.k, call.v, call.scale, columns=columns, diagonals=diagonals, rules=rules,
                         tiles=tiles, tally=layer)
        for label, acc in layer.rules.items():
            for key, value in acc.items():
                tally.rules[label][key] += value
        tally.ref2 += layer.ref2
        per_layer.append(layer.summary())
        print(f"layer {call.layer:2d} ({time.time() - started:5.0f} s): " + "; ".join(
            f"{label} {m['physical']:.3f}/{m['rel_err']:.4f}" for label, m in per_layer[-1].items()), flush=True)

    run_observed(model.model, ids, observe)
    config_notes = {label: str(c.provenance.notes)[-200:] for label, c in (configs or {}).items()}
    return {"model": name, "length": ids.shape[1], "columns": columns, "diagonals": diagonals, "seed": seed,
            "configs": config_notes, "text": "austen", "sampled_tiles": tiles, "rules": tally.summary(),
            "layers": per_layer, "seconds": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="structured,scattered")
    parser.add_argument("--model", help="a real model (e.g. qwen2.5-coder-1.5b) on Austen's prose instead of --families")
    parser.add_argument("--configs", help="with --model: semantic config files, comma-separated, compared on their "
                        "vertical-slash heads instead of --rules")
    parser.add_argument("--lengths", default="32k")
    parser.add_argument("--budgets", type=int, nargs=2, default=(1000, 6096), metavar=("COLUMNS", "DIAGONALS"))
    parser.add_argument("--rules", default="single:6096,prune:96,optimal:96",
                        help="RULE:N, comma-separated: single:DIAGONALS, aligned:DIAGONALS, prune:BLOCKS, optimal:BLOCKS, "
                        "pair:DIAGONALS, group:DIAGONALS")
    parser.add_argument("--tiles", type=int, default=8, help="query tiles sampled besides the last one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    rules = parse_rules(args.rules)
    results = []
    print("| family | length | rule | physical | logical | physical / logical | mass read | rel. err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    budgets = dict(columns=args.budgets[0], diagonals=args.budgets[1], rules=rules, n_tiles=args.tiles,
                   seed=args.seed)
    if args.configs:
        if not args.model:
            parser.error("--configs needs --model")
        budgets["configs"] = {Path(f).stem: load_config(f) for f in args.configs.split(",")}
    cases = ([(args.model, sq) for sq in parse_lengths(args.lengths)] if args.model else
             [(family, sq) for family in args.families.split(",") for sq in parse_lengths(args.lengths)])
    for family, sq in cases:
        r = (measure_model if args.model else measure_family)(family, sq, **budgets)
        results.append(r)
        for label, m in r["rules"].items():
            print(f"| {family} | {sq // 1024}K | {label} | {m['physical']:.1%} | {m['logical']:.1%} | "
                  f"{m['physical'] / m['logical']:.2f} | {m['mass']:.4f} | {m['rel_err']:.4f} |", flush=True)
        if args.out:  # after each case, so a long run keeps what it has
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
