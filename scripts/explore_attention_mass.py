"""How concentrated a model's attention is: per layer and query head, the dense attention mass the best key set of
the default budgets' size (1000 columns + 6096 diagonals = 7,096 keys a row) holds, the share of the row that
90 % / 95 % of the mass needs, and the online index's recall and density. The measurement and what each number
means are in minference_fx.tools.attention_mass; this is its command line.

``--model llama-random`` is the issue's benchmark model (Llama-3-8B shape, HF's random init, random token ids);
``--model smollm2`` the real weights on Austen's prose (set up as scripts/gpu_smollm2.sh does).

usage: python3 scripts/explore_attention_mass.py [--model llama-random|smollm2] [--lengths 32k,128k]
       [--layers 2] [--rows 256]
"""
from __future__ import annotations

import argparse

from minference_fx.cli import parse_lengths
from minference_fx.tools.attention_mass import MODELS, measure


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="llama-random")
    parser.add_argument("--lengths", type=parse_lengths, default=[32768, 131072])
    parser.add_argument("--layers", type=int, default=2, help="llama-random only")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run at a short length (Triton interpreted)")
    args = parser.parse_args()
    for length in args.lengths:
        measure(args.model, length, layers=args.layers, rows=args.rows, device=args.device)


if __name__ == "__main__":
    main()
