"""How concentrated a model's attention is: the share of dense attention mass that the best possible key set of
the default budgets' size holds, whatever index or kernel chooses it (``scripts/explore_attention_mass.py`` is
its command line).

For each layer and query head, over the last ``rows`` query rows of one prompt (dense attention, fp32),
:func:`measure` prints the mean over rows of:

- ``top-K mass``: the mass of the row's K heaviest keys, K = :data:`KEYS` (the default vertical-slash budgets,
  columns + diagonals, as keys a row). No sparse method that reads K keys a row can keep more.
- ``keys for 90 % / 95 %``: how many of the row's keys the heaviest-first set needs to hold that much mass, as a
  share of the row.
- ``index recall``: the mass inside what this project's online index (default budgets) lists for the row
  (tiles and columns, so it may read more than K keys), and that index's physical density.

On a model whose attention is sparse (trained weights: sinks, local windows, retrieval heads) the top-K mass is
near 1 and the 90 % set is a small share of the row; where it is low, every method that keeps dense attention's
output must read nearly every key, so no sparse kernel can beat dense there.
"""
from __future__ import annotations

import torch

from ..defaults import DEFAULTS
from ..observe import run_observed
from ..plan import HeadPlan, LayerPlan, Pattern
from .bench_prefill import build_model, build_smollm2, llama3_8b_config, prompt_ids, text_prompt_ids
from .evaluate import head_recall

COLUMNS, DIAGONALS = DEFAULTS.budgets
KEYS = COLUMNS + DIAGONALS
MODELS = ("llama-random", "smollm2")
"""``llama-random``: the issue's benchmark model (Llama-3-8B shape, HF's random init, random token ids);
``smollm2``: the real weights on Austen's prose (set up as scripts/gpu_smollm2.sh does)"""


def mass_profile(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int, keys: int) -> dict[str, torch.Tensor]:
    """Per query head ``[Hq]``: mean over the last ``rows`` rows of the top-``keys`` mass and of the share of the
    causal row the heaviest-first key set needs for 90 % and 95 % of the mass."""
    sq, skv = q.shape[2], k.shape[2]
    r0 = max(0, sq - rows)
    group = q.shape[1] // k.shape[1]
    out: dict[str, list[torch.Tensor]] = {"top": [], "need90": [], "need95": []}
    for h in range(q.shape[1]):  # one head at a time: [rows, S] fp32 is 128 MiB at 128K
        scores = q[0, h, r0:].float() @ k[0, h // group].float().T * scale
        pos = torch.arange(r0, sq, device=q.device)
        causal = torch.arange(skv, device=q.device)[None] <= pos[:, None] + (skv - sq)
        prob = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        mass = prob.sort(dim=-1, descending=True).values.cumsum(-1)
        row_len = causal.sum(-1)
        out["top"].append(mass[:, min(keys, skv) - 1].mean())
        for name, share in (("need90", 0.90), ("need95", 0.95)):
            need = (mass < share).sum(-1) + 1
            out[name].append((need.float() / row_len.float()).mean())
    return {name: torch.stack(values).cpu() for name, values in out.items()}


def default_plan(heads: int) -> LayerPlan:
    return LayerPlan(tuple(HeadPlan(Pattern.VERTICAL_SLASH, COLUMNS, DIAGONALS) for _ in range(heads)))


def measure(model_name: str, length: int, *, layers: int = 2, rows: int = 256, device="cuda") -> list:
    """Print each layer's profile and index recall of ``model_name`` (one of :data:`MODELS`) on a ``length``-token
    prompt, then their means; returns ``[(mass_profile, head_recall)]`` per layer (``layers``: llama-random only)."""
    device = torch.device(device)
    if model_name == "smollm2":
        model, tokenizer = build_smollm2(length, device, torch.bfloat16)
        ids = text_prompt_ids(tokenizer, length, 0, device)
    elif model_name == "llama-random":
        model = build_model(llama3_8b_config(layers, length), device, torch.bfloat16)
        ids = prompt_ids(length, model.config.vocab_size, 0, device)
    else:
        raise ValueError(f"unknown model {model_name!r}; known: {', '.join(MODELS)}")
    found = []

    def observe(call) -> None:
        profile = mass_profile(call.q, call.k, call.scale, rows, KEYS)
        recall = head_recall(call.q, call.k, default_plan(call.q.shape[1]), scale=call.scale, rows=rows)
        found.append((profile, recall))
        print(f"{model_name} {length:7d} layer {call.layer:2d}: top-{KEYS} mass {profile['top'].mean():.3f} "
              f"(heads {profile['top'].min():.3f}-{profile['top'].max():.3f}); keys for 90 % "
              f"{profile['need90'].mean():.3f} of the row, for 95 % {profile['need95'].mean():.3f}; index recall "
              f"{recall.recall.mean():.3f} at physical density {recall.density.mean():.3f}", flush=True)

    run_observed(model.model, ids, observe)  # the base model: no logits for every position

    def mean(values) -> float:  # over layers of the per-head means
        return sum(v.mean().item() for v in values) / len(found)

    print(f"== {model_name} at {length} ({len(found)} layers, last {rows} rows, mean over heads): "
          f"top-{KEYS} mass {mean(p['top'] for p, _ in found):.3f}; keys for 90 % "
          f"{mean(p['need90'] for p, _ in found):.3f} and for 95 % {mean(p['need95'] for p, _ in found):.3f} "
          f"of the row; index recall {mean(r.recall for _, r in found):.3f} at density "
          f"{mean(r.density for _, r in found):.3f}", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return found
