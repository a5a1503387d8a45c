#!/usr/bin/env python3
"""Which query rows the vertical-slash estimate should read: recall of the picked keys for rows across the prompt and
for variable tracking's chain links, on real weights (issue 35: code VT loses strings at 128K). Arithmetic on the
dense model's attention, no kernel; runs on a CPU at a few thousand tokens.

The online index picks a head's columns and diagonals from the softmax of the last 64 query rows
(``reference.VS_LAST_Q``) and every row of the prompt reads them. Rows far from the end may attend elsewhere: in a
variable-tracking prompt, the assignment ``VAR b = VAR a`` is where the model can link b to a, and a's assignment
lies anywhere before it (at 128K, often tens of thousands of tokens back). For one variable-tracking prompt (``ruler.variable_tracking``, the code haystack of
``ruler-code``), every layer and query head, this measures the dense attention mass inside the picked keys (columns
and diagonals, no block rounding, so the index's blocks can only add) for:

* row sets: the last 64 rows (the question and answer prefix); 256 rows spread over the prompt; and the chain's
  links, each ``VAR b = VAR a`` insert's rows, of the mass they put on the previous link's insert (the retrieval
  a tracking model needs), reported for every head and for the heads that put the most mass there;
* estimates, each at the same budgets: ``last64`` (the index's); ``mixed64`` (the last 32 rows and 32 spread over
  the prompt: the same cost); ``mixed128`` (the last 64 and 64 spread: twice the estimate's rows); ``oracle`` (the
  scored rows' own mass: the best static picks for them, an upper bound); for each, the keys a spread row reads
  over its causal keys;
* and two indexes as the op builds them (``reference.build_index``, so with their blocks): ``vs_index``, the
  vertical-slash index at those budgets (``last64`` with the diagonals' blocks), and ``bs_index``, block-sparse at
  the same keys a row in 64-key blocks, which picks each query tile's blocks from its own pooled queries.

Budgets default to the share of a row that the default budgets (1000 columns + 6096 diagonals) keep at 128K, scaled
to the prompt's length, with the index's forced sinks and local band.

    python scripts/explore_estimate_rows.py --model qwen2.5-coder-1.5b --length 8k --out results/FILE.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from minference_fx.cli import parse_lengths
from minference_fx.defaults import DEFAULTS
from minference_fx.kernels.reference import BLOCK, VS_FORCED_COLUMNS, VS_FORCED_DIAGONALS, VS_LAST_Q, build_index, listed_keys
from minference_fx.observe import run_observed
from minference_fx.plan import HeadPlan, LayerPlan, Pattern
from minference_fx.tools import ruler, stdlib_code
from minference_fx.tools.bench_prefill import build_real

DEFAULT_COLUMNS, DEFAULT_DIAGONALS = DEFAULTS.budgets
DEFAULT_KEYS_AT_128K = DEFAULT_COLUMNS + DEFAULT_DIAGONALS
SPREAD_ROWS = 256
ESTIMATES = ("last64", "mixed64", "mixed128", "oracle", "vs_index", "bs_index")


def spread(lo: int, hi: int, n: int, phase: float) -> torch.Tensor:
    """``n`` rows evenly spread over ``lo .. hi - 1``, shifted by ``phase`` of a step (distinct sets for distinct
    phases)."""
    step = (hi - lo) / n
    return (lo + (torch.arange(n, dtype=torch.float64) + phase) * step).long().clamp(max=hi - 1).unique()


def probabilities(q_h: torch.Tensor, k_g: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of query rows ``rows`` of one head over every key, fp32 ``[len(rows), S]``."""
    scores = q_h[rows].float() @ k_g.float().T * scale
    keys = torch.arange(k_g.shape[0])
    return scores.masked_fill(keys[None, :] > rows[:, None], float("-inf")).softmax(-1)


def picks(prob: torch.Tensor, rows: torch.Tensor, columns: int, diagonals: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column mask ``[S]``, diagonal mask ``[S]``): the top columns and diagonals of the rows' summed mass, with the
    index's forced sinks and local band first."""
    s = prob.shape[-1]
    vertical = prob.sum(0)
    vertical[:VS_FORCED_COLUMNS] = float("inf")
    offset = (rows[:, None] - torch.arange(s)[None, :]).clamp(min=0)  # masked keys carry 0 mass: any offset will do
    slash = torch.zeros(s).scatter_add_(0, offset.reshape(-1), prob.reshape(-1))
    slash[:VS_FORCED_DIAGONALS] = float("inf")
    col = torch.zeros(s, dtype=torch.bool)
    col[vertical.topk(min(columns, s)).indices] = True
    diag = torch.zeros(s, dtype=torch.bool)
    diag[slash.topk(min(diagonals, s)).indices] = True
    return col, diag


def kept(col: torch.Tensor, diag: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[len(rows), S]``: whether each row reads each key under the picks."""
    s = col.shape[0]
    offset = rows[:, None] - torch.arange(s)[None, :]
    return col[None, :] | (diag[offset.clamp(0, s - 1)] & (offset >= 0))


def insert_spans(sample: ruler.RulerSample, tokenizer) -> list[tuple[int, int]]:
    """The token span of each answer-carrying insert (the chain's assignments, in order)."""
    spans = []
    for at in sample.answer_positions:
        end = at
        while end < len(sample.ids) and "." not in tokenizer.decode(sample.ids[at:end + 1]):
            end += 1
        spans.append((at, end + 1))
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--length", type=lambda s: parse_lengths(s)[0], default=8192)
    parser.add_argument("--keys", type=int, default=None,
                        help="keys a row (columns + diagonals); default: the default budgets' share at 128K")
    parser.add_argument("--columns", type=int, default=None,
                        help="columns a row, with --diagonals: budgets of their own instead of --keys' default split")
    parser.add_argument("--diagonals", type=int, default=None, help="diagonals a row, with --columns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=float, default=0.2)
    parser.add_argument("--top-heads", type=int, default=8, help="link heads reported apart: the most link mass")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    length = args.length
    keys = args.keys or max(VS_FORCED_COLUMNS + VS_FORCED_DIAGONALS,
                            round(DEFAULT_KEYS_AT_128K * length / 131072))
    columns = max(VS_FORCED_COLUMNS, round(keys * DEFAULT_COLUMNS / DEFAULT_KEYS_AT_128K))
    diagonals = keys - columns
    if (args.columns is None) != (args.diagonals is None):
        parser.error("--columns and --diagonals go together")
    if args.columns is not None:
        columns, diagonals = args.columns, args.diagonals
        keys = columns + diagonals
    model, tokenizer = build_real(args.model, length, torch.device("cpu"), torch.float32)
    haystack = stdlib_code.stdlib_code().text
    # as `eval` asks an instruct model: in its chat template
    sample = ruler.variable_tracking(tokenizer, haystack, length, args.seed, depth=args.depth,
                                     chat=bool(getattr(tokenizer, "chat_template", None)))
    ids = torch.tensor([sample.ids])
    s = ids.shape[1]
    spans = insert_spans(sample, tokenizer)
    last = torch.arange(s - VS_LAST_Q, s)
    scored = {"last64": last, "spread": spread(VS_LAST_Q, s - VS_LAST_Q, SPREAD_ROWS, 0.5)}
    # each estimate: its rows spread over the prompt, then how many of the last rows
    estimate_parts = {"last64": (torch.zeros(0, dtype=torch.long), VS_LAST_Q),
                      "mixed64": (spread(VS_LAST_Q, s - VS_LAST_Q, 32, 0.0), 32),
                      "mixed128": (spread(VS_LAST_Q, s - VS_LAST_Q, 64, 0.0), VS_LAST_Q)}
    estimate_rows = {name: torch.cat([rows, last[len(last) - n_last:]])
                     for name, (rows, n_last) in estimate_parts.items()}
    links = [(torch.arange(*spans[i]), spans[i - 1]) for i in range(1, len(spans))]
    print(f"{args.model}, variable tracking at {s} tokens (seed {args.seed}, depth {args.depth}): inserts at "
          f"{[a for a, _ in spans]}; budgets {columns} columns + {diagonals} diagonals = {keys} keys a row "
          f"({keys / (s / 2):.3f} of the mean causal row)", flush=True)
    layers = []
    t0 = time.time()

    def observe(call) -> None:
        q, k = call.q[0], call.k[0]
        group = q.shape[0] // k.shape[0]
        indexes = {}
        for name, head in (("vs_index", HeadPlan(Pattern.VERTICAL_SLASH, columns, diagonals)),
                           ("bs_index", HeadPlan(Pattern.BLOCK_SPARSE, max(1, round(keys / BLOCK))))):
            index = build_index(call.q.float(), call.k.float(), LayerPlan((head,) * q.shape[0]), scale=call.scale)
            indexes[name] = listed_keys(index, s)[0]  # [Hq, query tiles, S]
        per_head = []
        for h in range(q.shape[0]):
            k_g = k[h // group]
            prob = {name: probabilities(q[h], k_g, rows, call.scale) for name, rows in scored.items()}
            link_prob = [probabilities(q[h], k_g, rows, call.scale) for rows, _ in links]
            span_mass = [p[:, a:b].sum(-1) for p, (_, (a, b)) in zip(link_prob, links)]  # [link rows] each
            link_mass = [m.mean().item() for m in span_mass]
            # a row's softmax is its own: the estimates' last rows are the scored last rows, and the oracle's are
            # every scored row, so their probabilities are reused rather than computed again
            estimate_prob = {name: torch.cat([probabilities(q[h], k_g, rows, call.scale),
                                              prob["last64"][VS_LAST_Q - n:]])
                             for name, (rows, n) in estimate_parts.items()}
            sets = {name: picks(estimate_prob[name], rows, columns, diagonals) for name, rows in estimate_rows.items()}
            oracle_rows = torch.cat([scored["spread"], last, *(rows for rows, _ in links)])
            sets["oracle"] = picks(torch.cat([prob["spread"], prob["last64"], *link_prob]), oracle_rows, columns,
                                   diagonals)
            row = {"link_mass": sum(link_mass) / max(len(link_mass), 1)}
            readers = {est: (lambda rows, col=col, diag=diag: kept(col, diag, rows)) for est, (col, diag) in sets.items()}
            readers.update({est: (lambda rows, tiles=tiles[h]: tiles[rows // BLOCK] & (torch.arange(s) <= rows[:, None]))
                            for est, tiles in indexes.items()})
            for est, reads in readers.items():
                read = {name: reads(rows) for name, rows in scored.items()}
                for name in scored:
                    row[f"{est}/{name}"] = (prob[name] * read[name]).sum(-1).mean().item()
                row[f"{est}/density"] = (read["spread"].sum(-1) / (scored["spread"] + 1)).mean().item()
                inside = []
                for p, m, (rows, (a, b)) in zip(link_prob, span_mass, links):
                    got = (p * reads(rows))[:, a:b].sum(-1)
                    inside.append((got.sum() / m.sum().clamp(min=1e-30)).item())
                row[f"{est}/links"] = sum(inside) / max(len(inside), 1)
            per_head.append(row)
        layers.append(per_head)
        mean = lambda key: sum(r[key] for r in per_head) / len(per_head)  # noqa: E731
        print(f"layer {call.layer:2d} ({time.time() - t0:5.0f} s): link mass {mean('link_mass'):.3f}; " + "; ".join(
            f"{est} " + " ".join(f"{mean(f'{est}/{name}'):.3f}" for name in ("last64", "spread", "links"))
            for est in ESTIMATES), flush=True)

    run_observed(model.model, ids, observe)
    heads = [(layer, h, row) for layer, per_head in enumerate(layers) for h, row in enumerate(per_head)]
    top = sorted(heads, key=lambda x: -x[2]["link_mass"])[: args.top_heads]
    summary = {}
    for group_name, group in (("all heads", heads), (f"top {args.top_heads} link heads", top)):
        summary[group_name] = {f"{est}/{name}": sum(r[f"{est}/{name}"] for _, _, r in group) / len(group)
                               for est in ESTIMATES for name in ("last64", "spread", "links", "density")}
        summary[group_name]["link_mass"] = sum(r["link_mass"] for _, _, r in group) / len(group)
    print("\nrecall of the picked keys (mean over heads); columns: last 64 rows, 256 spread rows, chain links; then the "
          "keys read over the causal keys on the spread rows")
    for group_name, values in summary.items():
        print(f"{group_name} (link mass {values['link_mass']:.3f})")
        for est in ESTIMATES:
            print(f"  {est:<9}" + "".join(f"{values[f'{est}/{name}']:8.3f}"
                                          for name in ("last64", "spread", "links", "density")))
    print("top link heads (layer, head, link mass):", [(layer, h, round(r["link_mass"], 3)) for layer, h, r in top])
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "length": s, "seed": args.seed, "depth": args.depth, "columns": columns,
                   "diagonals": diagonals, "insert_positions": [a for a, _ in spans], "summary": summary,
                   "top_link_heads": [[layer, h] for layer, h, _ in top], "layers": layers}, f, indent=1)


if __name__ == "__main__":
    main()
