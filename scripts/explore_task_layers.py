"""Which layers of a semantic config lose a RULER-style task on a real model.

The 32K-searched Qwen2.5-Coder config loses variable tracking at 128K whatever the guard threshold
(BENCHMARKS.md section 2b), so the heads that drop the chains are not the ones the guard flags. This finds
them by layer: the task's prompts run dense once, then sparse with the config and with groups of its layers
made dense. A group whose dense layers give back the dense score is split in halves, down to single layers;
where neither half alone gives it back, the group is reported whole (the loss needs layers of both). A
probe is one compile (``inner="eager"``) and the task's prompts: about 2 * log2(layers) probes per layer found.

    python scripts/explore_task_layers.py CONFIG --model qwen2.5-coder-1.5b --length 128k \\
        [--tasks variable_tracking] [--haystacks austen,code] [--depths 0.1,0.5,0.9] [--seeds 0] [--out X.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Optional

import torch

from minference_fx.cli import parse_lengths
from minference_fx.config import HeadEntry, SemanticConfig, load_config
from minference_fx.plan import Pattern
from minference_fx.tools import assets, evaluate, ruler, stdlib_code


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: it holds a tensor
class Prompt:
    """One task prompt and what the dense model scored on it."""

    haystack: str
    task: str
    depth: Optional[float]
    """None for the aggregation task, which has no depth"""
    seed: int
    ids: torch.Tensor
    answers: list
    new_tokens: int
    dense_score: float


@dataclasses.dataclass
class Probe:
    """The sparse score with ``dense_layers`` made dense: the mean over the prompts, and each prompt's."""

    dense_layers: list
    score: float
    scores: list
    seconds: float


def with_dense_layers(config: SemanticConfig, layers) -> SemanticConfig:
    """``config`` with every head of ``layers`` dense (the op then runs those layers through cuDNN)."""
    dense = HeadEntry(Pattern.DENSE, (0, 0))
    chosen = set(layers)
    return dataclasses.replace(config, layers=[[dense] * len(heads) if i in chosen else list(heads)
                                               for i, heads in enumerate(config.layers)])


def task_prompts(model, tokenizer, haystacks: dict, tasks, length: int, depths, chat: bool,
                 seeds=(0,)) -> list[Prompt]:
    """Every (haystack, task, depth, seed) prompt at ``length``, with the dense model's score."""
    device = next(model.parameters()).device
    stops = evaluate.stop_token_ids(model, tokenizer)
    prompts = []
    for name, text in haystacks.items():
        for task in tasks:
            for depth, seed in ruler.prompts_of(task, depths, seeds):
                sample = ruler.generate(task, tokenizer, text, length, seed, depth=depth, chat=chat)
                ids = torch.tensor([sample.ids], device=device)
                _, score = evaluate.scored_answer(model, tokenizer, ids, sample.answers, sample.new_tokens, stops)
                prompts.append(Prompt(name, task, depth, seed, ids, sample.answers, sample.new_tokens, score))
    return prompts


def probe(model, tokenizer, config: SemanticConfig, prompts: list[Prompt], dense_layers) -> Probe:
    start = time.perf_counter()
    compiled = evaluate.sparse_model(model, with_dense_layers(config, dense_layers))
    stops = evaluate.stop_token_ids(model, tokenizer)
    scores = [evaluate.scored_answer(model, tokenizer, p.ids, p.answers, p.new_tokens, stops, prefill=compiled)[1]
              for p in prompts]
    return Probe(sorted(dense_layers), sum(scores) / len(scores), scores, time.perf_counter() - start)


def find_layers(restores, layers: list) -> list[list]:
    """The smallest groups of ``layers`` whose dense run ``restores`` the score, by halving a group that does."""
    if len(layers) == 1:
        return [layers]
    half = len(layers) // 2
    found = []
    for part in (layers[:half], layers[half:]):
        if restores(part):
            found += find_layers(restores, part)
    return found or [layers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--length", type=lambda s: parse_lengths(s)[0], default=131072)
    ap.add_argument("--tasks", default="variable_tracking")
    ap.add_argument("--haystacks", default="austen,code")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0", help="prompt seeds, e.g. 0,1,2 (the aggregation task has one prompt a seed)")
    ap.add_argument("--tolerance", type=float, default=0.0, help="a probe restores when it scores >= dense - this")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, tokenizer, name = evaluate.load_model(args.model, longest=args.length)
    config = load_config(args.config)
    texts = {"austen": lambda: assets.austen_text(), "code": lambda: stdlib_code.stdlib_code().text}
    haystacks = {h: texts[h]() for h in args.haystacks.split(",")}
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = task_prompts(model, tokenizer, haystacks, args.tasks.split(","), args.length,
                           [float(d) for d in args.depths.split(",")], chat, [int(x) for x in args.seeds.split(",")])
    dense = sum(p.dense_score for p in prompts) / len(prompts)
    probes = []

    def save(found) -> None:
        # after every probe too: a run its time limit ends keeps the probes it finished
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": name, "config": args.config, "length": args.length, "tasks": args.tasks,
                           "dense": dense, "dense_scores": [p.dense_score for p in prompts],
                           "prompts": [[p.haystack, p.task, p.depth, p.seed] for p in prompts],
                           "probes": [dataclasses.asdict(p) for p in probes], "found": found}, f, indent=1)

    def run(layers) -> Probe:
        result = probe(model, tokenizer, config, prompts, layers)
        probes.append(result)
        print(f"dense layers {result.dense_layers or 'none'}: sparse {result.score:.3f} (dense {dense:.3f}) "
              f"{result.scores} [{result.seconds:.0f} s]", flush=True)
        save(None)
        return result

    every = list(range(len(config.layers)))
    found = []
    if run([]).score < dense - args.tolerance:
        found = find_layers(lambda group: run(group).score >= dense - args.tolerance, every)
    print(f"{name}, {args.length} tokens, {args.tasks}: dense {dense:.3f}; layers whose dense run gives it back: "
          f"{found or 'none needed'}")
    save(found)


if __name__ == "__main__":
    main()
