"""Speed against fidelity for one model and length: each setting's TTFT over HF eager's (``bench prefill`` JSON)
next to its perplexity ratios, sparse over dense (``eval`` JSON), as a markdown table and a PNG.

  python scripts/plot_tradeoff.py --length 131072 --out results/tradeoff.png \
      --run "guard 0.5=results/bench_prefill_..._guard0.5.json,results/eval_..._guard0.5.json" \
      --point "guard 0.8=1.71,0.977,1.004"      # a setting whose JSON is lost: speedup, Austen and code PPL ratios

A tooling script: the package never imports it; matplotlib is optional (no PNG without it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json


@dataclasses.dataclass
class Setting:
    label: str
    speedup: float
    """HF eager TTFT / this setting's, same run"""
    ppl_ratio: float
    code_ppl_ratio: float | None
    source: str


def from_runs(label: str, prefill_path: str, eval_path: str, length: int) -> Setting:
    with open(prefill_path) as f:
        prefill = json.load(f)
    with open(eval_path) as f:
        evaluation = json.load(f)
    speedup = prefill["speedups"][str(length)]["minference"]["eager"]
    ppl = next(r for r in evaluation["ppl"] if r["length"] == length)
    code = next((r for r in evaluation.get("ppl_code", []) if r["length"] == length), None)
    return Setting(label, speedup, ppl["sparse"] / ppl["dense"],
                   code["sparse"] / code["dense"] if code else None, f"{prefill_path}, {eval_path}")


def from_literal(spec: str) -> Setting:
    label, numbers = spec.split("=", 1)
    values = [float(x) for x in numbers.split(",")]
    if len(values) not in (2, 3):
        raise ValueError(f"--point {spec!r}: expected label=speedup,ppl_ratio[,code_ppl_ratio]")
    return Setting(label, values[0], values[1], values[2] if len(values) == 3 else None, "given on the command line")


def table(settings: list[Setting]) -> str:
    lines = ["| setting | TTFT × HF eager | PPL ratio (Austen) | PPL ratio (code) |", "| --- | --- | --- | --- |"]
    for s in sorted(settings, key=lambda s: s.speedup):
        code = "-" if s.code_ppl_ratio is None else f"{s.code_ppl_ratio:.4f}"
        lines.append(f"| {s.label} | {s.speedup:.2f}× | {s.ppl_ratio:.4f} | {code} |")
    return "\n".join(lines)


def plot(settings: list[Setting], length: int, title: str, out: str) -> bool:
    try:
        import matplotlib  # optional: without it the table alone
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # after use("Agg"), as matplotlib asks

    ordered = sorted(settings, key=lambda s: s.speedup)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([s.speedup for s in ordered], [s.ppl_ratio for s in ordered], "o-", label="Austen")
    coded = [s for s in ordered if s.code_ppl_ratio is not None]
    ax.plot([s.speedup for s in coded], [s.code_ppl_ratio for s in coded], "s--", label="Python stdlib code")
    for s in ordered:
        ax.annotate(s.label, (s.speedup, s.ppl_ratio), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.axhline(1.01, color="grey", lw=0.8, ls=":", label="+1 % target")
    ax.set_xlabel(f"TTFT speedup over HF eager at {length // 1024}K")
    ax.set_ylabel("perplexity ratio, sparse / dense")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--run", action="append", default=[], help="label=prefill.json,eval.json")
    parser.add_argument("--point", action="append", default=[], help="label=speedup,ppl_ratio[,code_ppl_ratio]")
    parser.add_argument("--title", default="")
    parser.add_argument("--out", default=None, help="PNG path")
    args = parser.parse_args(argv)
    settings = []
    for spec in args.run:
        label, paths = spec.split("=", 1)
        prefill_path, eval_path = paths.split(",")
        settings.append(from_runs(label, prefill_path, eval_path, args.length))
    settings += [from_literal(spec) for spec in args.point]
    print(table(settings))
    if args.out:
        print(f"wrote {args.out}" if plot(settings, args.length, args.title, args.out) else "no PNG: no matplotlib")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
