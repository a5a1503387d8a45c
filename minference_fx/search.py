"""Offline pattern search: pick each (layer, query head)'s pattern from real Q/K/V.

The model is compiled with the ``minference`` backend in search mode (see
:mod:`minference_fx.observe`), so every layer's attention is seen through the
same passes as a normal compile, for any model they understand. For each call,
every candidate pattern runs through the reference on that layer's Q/K/V; per
head we record the relative L2 error of the attention output against dense and
the physical density (share of causal (i, j) pairs the kernel would compute).
Per head the cheapest candidate whose mean error over the samples meets the
bound wins; if none does, the most accurate one.

Candidates are scaled to the calibration length so that each family offers a
few costs (MInference matched kernel FLOPs to one target; a ladder of costs lets
the bound decide instead).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from . import observe
from .config import HeadEntry, Provenance, SemanticConfig, _tool_version, model_identity_from_hf
from .kernels import reference
from .plan import HeadPlan, LayerPlan, Pattern

METRIC = "relative L2 error of the head's attention output vs dense (mean over samples)"


def candidates_for(length: int) -> list[HeadPlan]:
    """A ladder of costs per pattern family at one calibration length; dense last."""
    tiles = math.ceil(length / reference.BLOCK)
    return [
        HeadPlan(Pattern.A_SHAPE, 64, max(128, length // 16)),
        HeadPlan(Pattern.A_SHAPE, 128, max(256, length // 8)),
        HeadPlan(Pattern.VERTICAL_SLASH, max(30, length // 64), max(50, length // 32)),
        HeadPlan(Pattern.VERTICAL_SLASH, max(30, length // 32), max(50, length // 16)),
        HeadPlan(Pattern.VERTICAL_SLASH, max(30, length // 16), max(50, length // 64)),
        HeadPlan(Pattern.BLOCK_SPARSE, max(1, tiles // 8)),
        HeadPlan(Pattern.BLOCK_SPARSE, max(1, tiles // 4)),
        HeadPlan(Pattern.DENSE),
    ]


def physical_density(index: reference.SparseIndex, sq: int, skv: int) -> torch.Tensor:
    """[Hq]: computed (i, j) pairs over causal pairs, tiles at BLOCK×BLOCK and columns at BLOCK rows."""
    b = reference.BLOCK
    work = index.tile_count.double() * b * b + index.col_count.double() * b  # [B, Hq, M]
    causal = sq * (sq + 1) / 2 + sq * (skv - sq)
    return (work.sum(-1) / causal).mean(0).clamp(max=1.0)


@dataclasses.dataclass
class LayerScores:
    """Sums over samples for one layer: errors and densities [candidates, heads]."""

    errors: list[list[float]]
    densities: list[list[float]]
    samples: int = 0

    def add(self, errors: torch.Tensor, densities: torch.Tensor) -> None:
        for c in range(errors.shape[0]):
            for h in range(errors.shape[1]):
                self.errors[c][h] += float(errors[c, h])
                self.densities[c][h] += float(densities[c, h])
        self.samples += 1


def score_layer(call: observe.AttentionCall, candidates: list[HeadPlan]) -> tuple[torch.Tensor, torch.Tensor]:
    """(errors, densities), each [len(candidates), Hq], for one observed attention call."""
    q, k, v = (t.detach().float() for t in (call.q, call.k, call.v))
    hq, sq, skv = q.shape[1], q.shape[2], k.shape[2]
    masks = dict(key_mask=call.key_mask, doc_ids=call.doc_ids, q_offset=call.q_offset, window=call.window)
    dense = reference.dense_attention_reference(q, k, v, scale=call.scale, **masks)
    norm = dense.pow(2).sum(dim=(0, 2, 3)).sqrt().clamp(min=1e-12)
    errors, densities = [], []
    for cand in candidates:
        if cand.pattern is Pattern.DENSE:
            errors.append(torch.zeros(hq))
            densities.append(torch.ones(hq))
            continue
        plan = LayerPlan((cand,) * hq)
        index = reference.build_index(q, k, plan, scale=call.scale, **masks)
        out = reference.sparse_attention_reference(q, k, v, plan, scale=call.scale, index=index, **masks)
        errors.append(((out - dense).pow(2).sum(dim=(0, 2, 3)).sqrt() / norm).cpu())
        densities.append(physical_density(index, sq, skv).float().cpu())
    return torch.stack(errors), torch.stack(densities)


def choose(scores: LayerScores, candidates: list[HeadPlan], bound: float) -> list[HeadEntry]:
    heads = []
    n = max(scores.samples, 1)
    for h in range(len(scores.errors[0])):
        options = [(scores.densities[c][h] / n, scores.errors[c][h] / n, c) for c in range(len(candidates))]
        good = [o for o in options if o[1] <= bound]
        density, error, c = min(good) if good else min(options, key=lambda o: (o[1], o[0]))
        cand = candidates[c]
        heads.append(HeadEntry(cand.pattern, (cand.budget_a, cand.budget_b), round(error, 6)))
    return heads


def search(
    model,
    samples: list[torch.Tensor],
    *,
    data_name: str,
    seed: int = 0,
    bound: float = 0.05,
    state_path: Optional[str | os.PathLike] = None,
    progress: Callable[[str], None] = print,
    min_sparse_len: int = 8192,
) -> SemanticConfig:
    """Search every (layer, head) pattern over ``samples`` (token id tensors [1, S]); returns the config.

    ``state_path`` makes the search resumable: scores are saved after every
    (sample, layer), and a rerun skips what is already there.
    """
    if not samples:
        raise ValueError("search needs at least one calibration sample")
    identity = model_identity_from_hf(model.config)
    lengths = sorted({int(s.shape[-1]) for s in samples})
    candidates = candidates_for(max(lengths))
    state = _load_state(state_path, identity.fingerprint, candidates)
    per_layer: dict[int, LayerScores] = {}
    for key, rec in state["done"].items():
        layer = int(key.split(":")[1])
        scores = per_layer.setdefault(layer, _empty(len(candidates), identity.num_q_heads))
        scores.add(torch.tensor(rec["errors"]), torch.tensor(rec["densities"]))

    for si, ids in enumerate(samples):
        def observer(call: observe.AttentionCall, si=si):
            key = f"{si}:{call.layer}"
            if key in state["done"]:
                return
            errors, densities = score_layer(call, candidates)
            per_layer.setdefault(call.layer, _empty(len(candidates), errors.shape[1])).add(errors, densities)
            state["done"][key] = {"errors": errors.tolist(), "densities": densities.tolist()}
            _save_state(state_path, state)
            progress(f"sample {si + 1}/{len(samples)} layer {call.layer + 1}/{identity.num_layers} "
                     f"best error at min density {min(errors[:-1].min(0).values.tolist(), default=0):.3f}")

        if all(f"{si}:{layer}" in state["done"] for layer in range(identity.num_layers)):
            continue
        observe.run_observed(model, ids, observer)

    missing = [layer for layer in range(identity.num_layers) if layer not in per_layer]
    if missing:
        raise RuntimeError(f"search saw no attention for layers {missing}: inspect the model (minference-fx inspect) "
                           "to see which sites the passes leave dense and why")
    layers = [choose(per_layer[layer], candidates, bound) for layer in range(identity.num_layers)]
    return SemanticConfig(
        model=identity,
        layers=layers,
        defaults={"min_sparse_len": min_sparse_len},
        provenance=Provenance(
            tool_version=_tool_version(), calibration_data=data_name, lengths=lengths, seed=seed,
            metric=f"{METRIC}; bound {bound}",
            date=datetime.date.today().isoformat(),
            notes=f"{len(samples)} sample(s); candidates {[(c.pattern.value, c.budget_a, c.budget_b) for c in candidates]}",
        ),
    )


def _empty(n_candidates: int, n_heads: int) -> LayerScores:
    return LayerScores([[0.0] * n_heads for _ in range(n_candidates)], [[0.0] * n_heads for _ in range(n_candidates)])


def _state_id(fingerprint: str, candidates) -> str:
    blob = json.dumps([fingerprint, [(c.pattern.value, c.budget_a, c.budget_b) for c in candidates]])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _load_state(path, fingerprint, candidates) -> dict:
    state_id = _state_id(fingerprint, candidates)
    if path is not None and Path(path).exists():
        state = json.loads(Path(path).read_text())
        if state.get("id") == state_id:
            return state
    return {"id": state_id, "done": {}}


def _save_state(path, state) -> None:
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def text_samples(tokenizer, text: str, *, length: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens from ``text``, at seeded random offsets."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < length:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than the requested length {length}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length + 1, (count,), generator=g).tolist()
    return [ids[s : s + length][None] for s in starts]
