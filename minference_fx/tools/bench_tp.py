"""Time to first token under tensor parallelism, one process a GPU, launched by torchrun:

    torchrun --nproc_per_node 2 -m minference_fx.tools.bench_tp --model qwen2.5-coder-1.5b --lengths 32k,128k \\
        --variants eager,minference --out tp.json [--single one_gpu.json]

Every rank loads the model with ``from_pretrained(..., tp_plan="auto")`` (the model's own TP plan: Qwen 2's q/k/v
colwise, o_proj rowwise; ``accelerate`` must be installed), YaRN-stretched to the longest prompt as ``bench prefill``
stretches it, and runs ``bench_prefill.run_variant`` in this process for each variant, in the same order on every
rank (the forwards all-reduce, so the ranks run in step). Every rank gets the same prompt (Austen's prose through
the model's tokenizer). A cell's TTFT is the slowest rank's median; ``recompiles`` are rank 0's (graphs compiled
after the first call), and each rank's share of the query heads is the minference report's.

``--single`` reads a ``minference-fx bench prefill`` JSON of the same model and lengths on one GPU, so the table
also gives the speed-up of TP over one GPU. ``scripts/bench_tp.sh`` runs both.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from ..backend import recent_reports
from ..cli import parse_lengths
from . import assets, bench_prefill

TP_VARIANTS = ("eager", "inductor", "minference", "minference-noguard")


def load_sharded(model_name: str, max_len: int, dtype: torch.dtype):
    """(model, tokenizer or None) of a named real model (``assets.REAL_MODELS``) or an HF directory, sharded by
    its TP plan over the default process group (initialised already)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # optional: the [transformers] extra

    real = assets.REAL_MODELS.get(model_name)
    if real and dist.get_rank() == 0:  # fetch and convert once, before the other ranks read the directory
        getattr(assets, real.directory)()
    dist.barrier()
    path = getattr(assets, real.directory)() if real else model_name
    config = AutoConfig.from_pretrained(path)
    factor = real.yarn_factor(max_len) if real else 1.0
    if factor > 1:  # static YaRN over the trained context, as assets._load_converted stretches it for one GPU
        original = config.max_position_embeddings
        config.rope_parameters = {"rope_type": "yarn", "factor": float(factor),
                                  "rope_theta": config.rope_parameters.get("rope_theta", 100000.0),
                                  "original_max_position_embeddings": original}
        config.max_position_embeddings = int(original * factor)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa",
                                                 tp_plan="auto")
    tokenizer = AutoTokenizer.from_pretrained(path) if bench_prefill._has_tokenizer(path) else None
    return model.eval(), tokenizer, factor


@dataclasses.dataclass
class TPCell:
    length: int
    variant: str
    ttft_ms: Optional[float]
    """the slowest rank's median (None: some rank's cell did not run)"""
    rank_ttft_ms: list
    status: list
    """each rank's cell status"""
    next_token: Optional[int] = None


def _share_lines(before: set) -> list:
    return sorted({r.tensor_parallel.describe() for r in recent_reports()
                   if id(r) not in before and r.tensor_parallel is not None})


def run(args) -> dict:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    lengths = parse_lengths(args.lengths)
    model, tokenizer, yarn = load_sharded(args.model, max(lengths), dtype)
    make_prompt = None
    if tokenizer is not None:
        make_prompt = lambda n, seed: bench_prefill.text_prompt_ids(tokenizer, n, seed, device)  # noqa: E731
    options = {"inner": args.inner} if args.inner else None
    bench_prefill.warm_up_compiler(device)
    result = {"command": " ".join(["torchrun", f"--nproc_per_node {world}", "-m minference_fx.tools.bench_tp",
                                   *sys.argv[1:]]),
              **bench_prefill.environment(device), "world": world, "model": args.model, "yarn_factor": yarn,
              "dtype": str(dtype).removeprefix("torch."), "lengths": lengths, "config": args.config,
              "minference_options": options or {}, "variants": {}, "cells": []}
    for name in args.variants.split(","):
        before = {id(r) for r in recent_reports()}
        cells, summary = bench_prefill.run_variant(model, name, lengths, reps=args.reps, seed=args.seed,
                                                   minference_options=options, make_prompt=make_prompt,
                                                   config_path=args.config, guard_probe=False)
        mine = {"cells": [dataclasses.asdict(c) for c in cells], "summary": dataclasses.asdict(summary),
                "shares": _share_lines(before)}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        result["variants"][name] = {**everyone[0]["summary"], "shares": [line for r in everyone for line in r["shares"]]}
        for i, n in enumerate(lengths):
            per_rank = [r["cells"][i] for r in everyone]
            times = [c["ttft_ms"] for c in per_rank]
            result["cells"].append(dataclasses.asdict(TPCell(
                n, name, None if None in times else max(times), times, [c["status"] for c in per_rank],
                per_rank[0]["next_token"])))
        if rank == 0 and args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=2)
    dist.destroy_process_group()
    return result


def table(result: dict, single: Optional[dict] = None) -> str:
    """TTFT under TP per length and variant, the speed-up over HF eager under TP, and with ``single`` (a ``bench
    prefill`` JSON) the one-GPU TTFT and the speed-up of TP over it."""
    one = {}
    if single:
        one = {(c["length"], c["variant"]): c.get("ttft_ms") for c in single["cells"]}
    eager = {c["length"]: c["ttft_ms"] for c in result["cells"] if c["variant"] == "eager"}
    world = result["world"]
    lines = [f"{'length':>8}  {'variant':<19} {f'TP={world} ms':>10} {'x TP eager':>10} {'1 GPU ms':>10} "
             f"{'x 1 GPU':>8} {'recompiles':>10}  ranks' TTFT ms"]

    def f(x, spec):
        return format(x, spec) if x is not None else "-".rjust(int(spec.rstrip("df").split(".")[0] or 1))

    for c in sorted(result["cells"], key=lambda c: (c["length"], c["variant"])):
        base, alone = eager.get(c["length"]), one.get((c["length"], c["variant"]))
        summary = result["variants"].get(c["variant"], {})
        lines.append(
            f"{c['length']:>8}  {c['variant']:<19} {f(c['ttft_ms'], '10.1f')} "
            f"{f(base / c['ttft_ms'] if base and c['ttft_ms'] else None, '10.2f')} {f(alone, '10.1f')} "
            f"{f(alone / c['ttft_ms'] if alone and c['ttft_ms'] else None, '8.2f')} {f(summary.get('recompiles'), '10d')}  "
            + ", ".join(f(t, ".1f") if t is not None else s for t, s in zip(c["rank_ttft_ms"], c["status"])))
    for name, summary in result["variants"].items():
        m = summary.get("minference")
        if m:
            lines.append(f"{name} (rank 0): {m['rewritten']}/{m['sites']} sites rewritten in {m['graphs']} graph(s)")
        lines += [f"{name}: {line}" for line in summary.get("shares", [])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minference_fx.tools.bench_tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b",
                   help=f"{', '.join(assets.REAL_MODELS)}, or a local HF model directory")
    p.add_argument("--lengths", default="32k,128k")
    p.add_argument("--variants", default="eager,minference", help=f"comma list of {', '.join(TP_VARIANTS)}")
    p.add_argument("--config", default=None, help="semantic config JSON for the whole model (each rank reads its heads)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inner", default=None, choices=["inductor", "aot_eager", "eager"],
                   help="the minference variants' inner compiler (default inductor; aot_eager for a CPU smoke run)")
    p.add_argument("--device", default=None, help="cpu: gloo on the CPU (a smoke run); default: CUDA with NCCL")
    p.add_argument("--out", default=None, help="results JSON (written by rank 0)")
    p.add_argument("--single", default=None, help="a `minference-fx bench prefill` JSON of the same model on one GPU")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in TP_VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(TP_VARIANTS)}")
    if "RANK" not in os.environ:
        p.error("run it under torchrun (it reads RANK, WORLD_SIZE and LOCAL_RANK)")
    result = run(args)
    if int(os.environ["RANK"]) == 0:
        single = None
        if args.single and os.path.exists(args.single):
            with open(args.single) as fh:
                single = json.load(fh)
        print(table(result, single), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
