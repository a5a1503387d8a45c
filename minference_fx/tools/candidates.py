"""Candidate configs for GPU experiments: a shipped semantic config with one change, written to a new file.

Each edit takes the config as its JSON dict, changes a copy and returns it with the change appended to its
provenance notes, so a candidate's file says what it is. The GPU step scripts (``scripts/gpu_qwen.sh``) call
this module instead of editing JSON inline:

    python -m minference_fx.tools.candidates min-columns CONFIG 1024 --out OUT
    python -m minference_fx.tools.candidates dense-heads CONFIG --probes P1.json P2.json --out OUT
    python -m minference_fx.tools.candidates dense-layers CONFIG --found FOUND.json [--min-sparse-len N] --out OUT
    python -m minference_fx.tools.candidates min-sparse-len CONFIG 4096 --out OUT
    python -m minference_fx.tools.candidates derived CONFIG --guard-threshold 0.8 --min-sparse-len 65536 \
        [--scale 1] [--budget-growth 32768 0.5] --out OUT
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from minference_fx.config import load_config


def dense_head() -> dict:
    return {"pattern": "dense", "budgets": [0, 0]}


def _noted(config: dict, change: str) -> dict:
    provenance = config.setdefault("provenance", {})
    provenance["notes"] = (provenance.get("notes", "") + f" Candidate: {change}.").strip()
    return config


def min_columns(config: dict, columns: int) -> tuple[dict, str]:
    """Every vertical-slash head keeps at least ``columns`` columns (budget growth still applies past its keys)."""
    out = copy.deepcopy(config)
    raised = 0
    for heads in out["layers"]:
        for head in heads:
            if head["pattern"] == "vertical_slash" and head["budgets"][0] < columns:
                head["budgets"][0] = columns
                raised += 1
    change = f"{raised} vertical-slash heads' columns raised to {columns}"
    return _noted(out, change), change


def dense_heads(config: dict, heads: list[tuple[int, int]]) -> tuple[dict, str]:
    """The given (layer, head) pairs run dense."""
    out = copy.deepcopy(config)
    for layer, head in heads:
        if not (0 <= layer < len(out["layers"]) and 0 <= head < len(out["layers"][layer])):
            raise ValueError(f"head ({layer}, {head}) is not in the config's {len(out['layers'])} layers")
        out["layers"][layer][head] = dense_head()
    change = f"heads {sorted(heads)} dense"
    return _noted(out, change), change


def dense_layers(config: dict, layers: list[int], min_sparse_len: int | None = None) -> tuple[dict, str]:
    """Every head of ``layers`` runs dense; with ``min_sparse_len``, prompts shorter than it run dense too."""
    out = copy.deepcopy(config)
    for layer in layers:
        out["layers"][layer] = [dense_head() for _ in out["layers"][layer]]
    change = f"layers {sorted(layers)} dense"
    if min_sparse_len is not None:
        change += ", " + _set_min_sparse_len(out, min_sparse_len)
    return _noted(out, change), change


def with_min_sparse_len(config: dict, min_sparse_len: int) -> tuple[dict, str]:
    out = copy.deepcopy(config)
    change = _set_min_sparse_len(out, min_sparse_len)
    return _noted(out, change), change


def _set_min_sparse_len(config: dict, min_sparse_len: int) -> str:
    config["defaults"]["min_sparse_len"] = min_sparse_len
    return f"sparse from {min_sparse_len} keys"


def derived(config: dict, *, guard_threshold: float, min_sparse_len: int, scale: float = 1.0,
            budget_growth: tuple[int, float] | None = None) -> tuple[dict, str]:
    """The config's defaults set to a guard threshold, a crossover and a budget growth (None: none), and every head's
    budgets times ``scale`` (a searched config turned into the candidates of BENCHMARKS.md section 2b)."""
    out = copy.deepcopy(config)
    out["defaults"].update(min_sparse_len=min_sparse_len, guard_threshold=guard_threshold,
                           budget_growth=list(budget_growth) if budget_growth else None)
    for heads in out["layers"]:
        for head in heads:
            head["budgets"] = [round(b * scale) for b in head.get("budgets", [])]
    change = (f"sparse from {min_sparse_len} keys, guard {guard_threshold}, budgets x{scale}, "
              f"growth {budget_growth or 'none'}")
    return _noted(out, change), change


def probe_link_heads(probes: list[dict]) -> list[tuple[int, int]]:
    """The (layer, head) pairs that ``scripts/explore_estimate_rows.py`` found carrying variable tracking's links."""
    return sorted({tuple(h) for probe in probes for h in probe["top_link_heads"]})


def found_layers(found: dict, n_layers: int) -> list[int]:
    """The layers ``scripts/explore_task_layers.py`` found losing the task; none when it only found all of them."""
    groups = found["found"]
    if groups == [list(range(n_layers))]:
        return []
    return sorted({layer for group in groups for layer in group})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    edits = parser.add_subparsers(dest="edit", required=True)

    def edit(name: str, help: str) -> argparse.ArgumentParser:
        p = edits.add_parser(name, help=help)
        p.add_argument("config")
        p.add_argument("--out", required=True)
        return p

    edit("min-columns", "every vertical-slash head keeps at least N columns").add_argument("columns", type=int)
    edit("dense-heads", "the link heads of explore_estimate_rows probes run dense").add_argument(
        "--probes", nargs="+", required=True)
    p = edit("dense-layers", "the layers explore_task_layers found run dense")
    p.add_argument("--found", required=True)
    p.add_argument("--min-sparse-len", type=int)
    edit("min-sparse-len", "prompts shorter than N keys run dense").add_argument("keys", type=int)
    p = edit("derived", "defaults and budgets of a searched config set for a candidate")
    p.add_argument("--guard-threshold", type=float, required=True)
    p.add_argument("--min-sparse-len", type=int, required=True)
    p.add_argument("--scale", type=float, default=1.0, help="every head's budgets times this")
    p.add_argument("--budget-growth", type=float, nargs=2, metavar=("KEYS", "EXPONENT"))
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    if args.edit == "min-columns":
        out, change = min_columns(config, args.columns)
    elif args.edit == "dense-heads":
        out, change = dense_heads(config, probe_link_heads([json.loads(Path(f).read_text()) for f in args.probes]))
    elif args.edit == "dense-layers":
        layers = found_layers(json.loads(Path(args.found).read_text()), len(config["layers"]))
        out, change = dense_layers(config, layers, args.min_sparse_len)
    elif args.edit == "min-sparse-len":
        out, change = with_min_sparse_len(config, args.keys)
    else:
        growth = (int(args.budget_growth[0]), args.budget_growth[1]) if args.budget_growth else None
        out, change = derived(config, guard_threshold=args.guard_threshold, min_sparse_len=args.min_sparse_len,
                              scale=args.scale, budget_growth=growth)
    Path(args.out).write_text(json.dumps(out))
    # the candidate must still be a config the backend takes; saved as the shipped configs are, so that shipping one
    # is a copy and its diff against the shipped file shows only the heads it changed
    load_config(args.out).save(args.out)
    print(f"{args.out}: {change}")


if __name__ == "__main__":
    main()
