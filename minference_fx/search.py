"""Offline pattern search: pick each (layer, query head)'s pattern from real Q/K/V.

The model is compiled with the ``minference`` backend in search mode (see
:mod:`minference_fx.observe`), so every layer's attention is seen through the
same passes as a normal compile, for any model they understand.

Scoring (per observed call, every candidate, all heads at once)
    Dense attention probabilities are computed once, for a sample of query
    rows only: the last ``last_rows`` rows (where generation reads the prompt
    from, and where the eval measures recall) plus one random row from each of
    ``strata`` equal strata of the rest (stratified sampling, each row weighted
    by its stratum's size, so weighted sums estimate whole-sequence sums without
    bias). For a candidate, the reference builds its online index from the full
    Q/K (exactly what the op would do), and the index's key set restricts the
    sampled rows' dense probabilities: restricted softmax = dense probabilities
    renormalised over the kept keys, so no attention is recomputed per
    candidate. Per head we record

    * ``error``: relative L2 error of the attention output vs dense
      (sqrt of weighted squared error over weighted squared norm);
    * ``recall``: dense attention mass inside the index's key set, weighted mean
      over the sampled rows (whole-sequence estimate);
    * ``recall_last``: the same, mean over the last rows only (the eval's measure);
    * ``density``: physical density of the index over the whole prompt.

    A vertical-slash or block-sparse index the op would find near-dense (>= 90 % of the causal tiles) is
    scored as the op runs it: dense (error 0, density 1, the same as the dense candidate, which wins the tie).

Choice (global, see :func:`choose_heads`)
    1. A head may use a candidate only if its recall (the lower of the two
       estimates, mean over samples) is at least ``recall_min``; dense always may.
    2. Each head starts at its cheapest allowed candidate whose mean error is at
       most ``bound`` (else the most accurate allowed one, which may be dense).
    3. While the mean density over all heads exceeds ``target_density``, the
       head move to a cheaper allowed candidate with the smallest error increase
       per unit of density saved is made (a greedy multiple-choice knapsack);
       dense is given up first where it costs least accuracy.
    4. With ``spend_slack``, density left under the target is then spent the
       other way: the move to a dearer candidate with the largest error decrease
       per unit of density, while the mean stays within the target.

Candidates are scaled to the calibration length, a ladder of costs per family,
dense last.
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
from .call_masks import CallMasks
from .config import HeadEntry, Provenance, SemanticConfig, _tool_version, model_identity_from_hf
from .defaults import DEFAULTS
from .dense import near_dense_heads
from .kernels import guard, reference
from .plan import HeadPlan, LayerPlan, Pattern

METRIC = ("relative L2 error of the head's attention output vs dense and attention-mass recall of its index "
          "(mean over samples; estimated on the last query rows plus a stratified random sample of the others)")
METRICS = ("errors", "densities", "recall", "recall_last")

LAST_ROWS = 256
STRATA = 256


def candidates_for(length: int) -> list[HeadPlan]:
    """A ladder of costs per pattern family at one calibration length; dense last.

    Slash diagonals past the forced local band are what makes vertical-slash
    dear (each far diagonal touches one or two key tiles of every query tile),
    columns are cheap, so the ladder varies columns at the forced 100 diagonals
    and then adds diagonals. At 8K the cheapest of each family costs about
    5-6 % of the causal pairs. The ladder reaches about half the keys before
    dense: budgets are absolute, so a head that needs a quarter of a 32K row
    costs a sixteenth of a 128K one, where dense would cost it all (the 8K
    ladder stopped at an eighth, and left 51 of Qwen2.5-Coder's 336 heads dense).
    """
    n = length
    tiles = math.ceil(length / reference.BLOCK)
    vs = [(max(30, n // d), 100) for d in (128, 64, 32, 16, 8, 4)]
    vs += [(max(30, n // 8), max(100, n // d)) for d in (64, 48, 32, 16, 8, 4)] + [(max(30, n // 4), max(100, n // 4))]
    cands = [HeadPlan(Pattern.A_SHAPE, 64, max(128, n // d)) for d in (64, 32, 16, 8)]
    cands += [HeadPlan(Pattern.VERTICAL_SLASH, v, s) for v, s in dict.fromkeys(vs)]
    ks = (tiles // 32, tiles // 16, 3 * tiles // 32, tiles // 8, 3 * tiles // 16, tiles // 4, tiles // 3, tiles // 2)
    cands += [HeadPlan(Pattern.BLOCK_SPARSE, k) for k in dict.fromkeys(max(1, k) for k in ks)]
    return cands + [HeadPlan(Pattern.DENSE)]


def physical_density(index: reference.SparseIndex, sq: int, skv: int) -> torch.Tensor:
    """[Hq]: computed (i, j) pairs over causal pairs, tiles at BLOCK×BLOCK and columns at BLOCK rows."""
    b = reference.BLOCK
    work = index.block_count.double() * b * b + index.col_count.double() * b  # [B, Hq, M]
    causal = sq * (sq + 1) / 2 + sq * (skv - sq)
    return (work.sum(-1) / causal).mean(0).clamp(max=1.0)


# --------------------------------------------------------------------------- scoring


def sample_rows(sq: int, *, last_rows: int = LAST_ROWS, strata: int = STRATA,
                generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows, weights, n_last): the last ``last_rows`` rows (weight 1) and one random row per stratum of the rest.

    A stratum's row carries the stratum's size as its weight, so a weighted sum
    over the rows is an unbiased estimate of the sum over all rows. The last
    rows come last in ``rows``. When the sample would be as large as the
    sequence, every row is taken with weight 1.
    """
    n_last = min(last_rows, sq)
    rest = sq - n_last
    if rest <= strata:
        return torch.arange(sq), torch.ones(sq), n_last
    edges = torch.linspace(0, rest, strata + 1).round().long()
    size = edges[1:] - edges[:-1]
    pick = edges[:-1] + (torch.rand(strata, generator=generator) * size).long().clamp(max=size - 1)
    rows = torch.cat([pick, torch.arange(rest, sq)])
    weights = torch.cat([size.double(), torch.ones(n_last, dtype=torch.float64)])
    return rows, weights.float(), n_last


def _row_key_mask(index: reference.SparseIndex, rows: torch.Tensor, skv: int) -> torch.Tensor:
    """bool [B, Hq, R, Skv]: the keys the index lists for each of ``rows`` (any order, no base mask)."""
    return reference.listed_keys(index, skv, rows.to(index.block_start.device) // reference.BLOCK)


def score_layer(call: observe.AttentionCall, candidates: list[HeadPlan], *, last_rows: int = LAST_ROWS,
                strata: int = STRATA, generator: Optional[torch.Generator] = None) -> dict[str, torch.Tensor]:
    """Per metric (:data:`METRICS`) a ``[len(candidates), Hq]`` tensor for one observed attention call."""
    q, k, v = (t.detach().float() for t in (call.q, call.k, call.v))
    B, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    masks = CallMasks(call.key_mask, call.doc_ids, call.q_offset, call.window)
    rows, weights, n_last = sample_rows(sq, last_rows=last_rows, strata=strata, generator=generator)
    rows, weights = rows.to(q.device), weights.to(q.device)
    pos = reference.query_positions(sq, call.q_offset, None, q.device)[rows]
    base = reference.base_allowed(pos, skv, call.key_mask, call.doc_ids, call.window)  # [B|1, 1, R, Skv]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    prob = reference._masked_softmax(q[:, :, rows] @ kr.transpose(-1, -2) * call.scale, base.expand(B, hq, -1, -1))
    dense = prob @ vr  # [B, Hq, R, D]
    norm2 = (dense.pow(2).sum(-1) * weights).sum((0, 2)).clamp(min=1e-30)  # [Hq]
    w_total = weights.sum() * B

    out = {m: [] for m in METRICS}
    for cand in candidates:
        if cand.pattern is Pattern.DENSE:
            for m, value in zip(METRICS, (0.0, 1.0, 1.0, 1.0)):
                out[m].append(torch.full((hq,), value))
            continue
        plan = LayerPlan((cand,) * hq)
        index = reference.build_index(q, k, plan, scale=call.scale, **masks.kwargs())
        # the op runs a near-dense index dense (kernels.guard.near_dense): score what it computes
        near = near_dense_heads(index, plan, sq, skv, call.q_offset, masks.key_mask)
        if bool(near.any()):  # offline: a host check costs nothing here
            index = guard.densify(index, near, sq, skv, call.q_offset)
        kept = prob * (_row_key_mask(index, rows, skv) & base)
        mass = kept.sum(-1)  # [B, Hq, R]
        sparse = (kept @ vr) / torch.where(mass > 0, mass, torch.ones_like(mass))[..., None]
        err2 = ((sparse - dense).pow(2).sum(-1) * weights).sum((0, 2))
        out["errors"].append((err2 / norm2).sqrt().cpu())
        out["densities"].append(physical_density(index, sq, skv).float().cpu())
        out["recall"].append(((mass * weights).sum((0, 2)) / w_total).cpu())
        out["recall_last"].append(mass[:, :, -n_last:].mean((0, 2)).cpu())
    return {m: torch.stack(vals) for m, vals in out.items()}


# --------------------------------------------------------------------------- choice


@dataclasses.dataclass
class LayerScores:
    """Sums over samples for one layer: per metric ``[candidates, heads]``."""

    sums: dict[str, torch.Tensor]
    samples: int = 0

    @staticmethod
    def empty(n_candidates: int, n_heads: int) -> "LayerScores":
        return LayerScores({m: torch.zeros(n_candidates, n_heads, dtype=torch.float64) for m in METRICS})

    def add(self, scores: dict[str, torch.Tensor]) -> None:
        for m in METRICS:
            self.sums[m] += torch.as_tensor(scores[m], dtype=torch.float64)
        self.samples += 1

    def mean(self, metric: str) -> torch.Tensor:
        return self.sums[metric] / max(self.samples, 1)


@dataclasses.dataclass
class Choice:
    """The chosen candidate per (layer, head) and what the calibration measured for it."""

    picks: list[list[int]]
    error: list[list[float]]
    recall: list[list[float]]
    density: list[list[float]]

    @property
    def mean_density(self) -> float:
        flat = [d for layer in self.density for d in layer]
        return sum(flat) / len(flat)


def choose_heads(scores: list[LayerScores], candidates: list[HeadPlan], *, bound: float, recall_min: float = 0.0,
                 target_density: Optional[float] = None, spend_slack: bool = False, power: float = 1.0) -> Choice:
    """Pick one candidate per (layer, head); the rule is in the module docstring."""
    # plain nested lists [layer][candidate][head]: the greedy below indexes them thousands of times
    err = torch.stack([s.mean("errors") for s in scores]).tolist()
    dens = torch.stack([s.mean("densities") for s in scores]).tolist()
    rec = torch.minimum(torch.stack([s.mean("recall") for s in scores]),
                        torch.stack([s.mean("recall_last") for s in scores])).tolist()
    n_layers, n_cands, n_heads = len(err), len(candidates), len(err[0][0])
    is_dense = [cand.pattern is Pattern.DENSE for cand in candidates]
    allowed = [[[is_dense[c] or rec[l][c][h] >= recall_min for h in range(n_heads)] for c in range(n_cands)]
               for l in range(n_layers)]
    heads = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    picks = [[0] * n_heads for _ in range(n_layers)]
    for l, h in heads:
        opts = [c for c in range(n_cands) if allowed[l][c][h]]
        if not opts:  # no dense candidate and nothing meets the floor: the most accurate
            opts = list(range(n_cands))
        good = [c for c in opts if err[l][c][h] <= bound]
        # on a tie dense wins: a near-dense candidate runs dense anyway, after an index, below cuDNN's speed
        picks[l][h] = (min(good, key=lambda c: (dens[l][c][h], err[l][c][h], not is_dense[c])) if good
                       else min(opts, key=lambda c: (err[l][c][h], dens[l][c][h], not is_dense[c])))
    total = len(heads)
    mean = sum(dens[l][picks[l][h]][h] for l, h in heads) / total

    def move(score):
        """Apply the allowed (layer, head, candidate) move of lowest ``score`` (None: not a move); False if none."""
        nonlocal mean
        best = None
        for l, h in heads:
            c0 = picks[l][h]
            for c in range(n_cands):
                value = score(l, h, c0, c) if allowed[l][c][h] else None
                if value is not None and (best is None or value < best[0]):
                    best = (value, l, h, c)
        if best is None:
            return False
        _, l, h, c = best
        mean += (dens[l][c][h] - dens[l][picks[l][h]][h]) / total
        picks[l][h] = c
        return True

    def shrink(l, h, c0, c):  # error increase per density saved
        saved = dens[l][c0][h] - dens[l][c][h]
        return None if saved <= 0 else max(0.0, err[l][c][h] ** power - err[l][c0][h] ** power) / saved

    def spend(l, h, c0, c):  # minus the error decrease per density spent, within the target
        spent = dens[l][c][h] - dens[l][c0][h]
        gain = err[l][c0][h] ** power - err[l][c][h] ** power
        if gain <= 0 or mean + max(spent, 0.0) / total > target_density + 1e-6:
            return None
        return -(gain / spent if spent > 0 else math.inf)

    if target_density is not None:
        # float32 densities: a hair over is on target
        while mean > target_density + 1e-6 and move(shrink):
            pass
        while spend_slack and move(spend):
            pass

    def table(t):
        return [[round(t[l][picks[l][h]][h], 6) for h in range(n_heads)] for l in range(n_layers)]

    return Choice(picks, table(err), table(rec), table(dens))


def _entries(choice: Choice, candidates: list[HeadPlan]) -> list[list[HeadEntry]]:
    return [[HeadEntry(candidates[c].pattern, (candidates[c].budget_a, candidates[c].budget_b), choice.error[l][h])
             for h, c in enumerate(layer)] for l, layer in enumerate(choice.picks)]


# --------------------------------------------------------------------------- the search


def search(
    model,
    samples: list[torch.Tensor],
    *,
    data_name: str,
    seed: int = 0,
    bound: float = 0.05,
    recall_min: float = 0.9,
    target_density: Optional[float] = 0.24,
    spend_slack: bool = False,
    power: float = 1.0,
    last_rows: int = LAST_ROWS,
    strata: int = STRATA,
    state_path: Optional[str | os.PathLike] = None,
    progress: Callable[[str], None] = print,
    min_sparse_len: int = DEFAULTS.min_sparse_len,
    guard_defaults: Optional[dict] = None,
) -> SemanticConfig:
    """Search every (layer, head) pattern over ``samples`` (token id tensors [1, S]); returns the config.

    ``bound`` caps a head's mean relative output error, ``recall_min`` floors its
    attention-mass recall, ``target_density`` (None: no budget) caps the mean
    physical density over all heads at the longest calibration length (the rule
    is in the module docstring). The defaults aim at 25 % density with a margin:
    on SmolLM2 at 8K a config chosen at 0.25 on three calibration windows
    measured 0.257 on held-out text (the vertical-slash index follows the text). ``state_path`` makes the search resumable:
    scores are saved after every (sample, layer), and a rerun skips what is
    already there; the choice is redone from the saved scores. ``guard_defaults``
    (``guard_threshold``, ``guard_escalation``) go into the config's defaults as
    given: the search scores each head's own index, so they are the caller's choice.
    """
    if not samples:
        raise ValueError("search needs at least one calibration sample")
    identity = model_identity_from_hf(model.config)
    lengths = sorted({int(s.shape[-1]) for s in samples})
    candidates = candidates_for(max(lengths))
    state = _load_state(state_path, identity.fingerprint, candidates, (last_rows, strata, seed),
                        _inputs_digest(model, samples))
    per_layer: dict[int, LayerScores] = {}
    for key, rec in state["done"].items():
        layer = int(key.split(":")[1])
        per_layer.setdefault(layer, LayerScores.empty(len(candidates), identity.num_q_heads)).add(rec)

    for si, ids in enumerate(samples):
        def observer(call: observe.AttentionCall, si=si):
            key = f"{si}:{call.layer}"
            if key in state["done"]:
                return
            g = torch.Generator().manual_seed(seed * 1_000_003 + si * 1_009 + call.layer)
            scores = score_layer(call, candidates, last_rows=last_rows, strata=strata, generator=g)
            per_layer.setdefault(call.layer, LayerScores.empty(len(candidates), call.q.shape[1])).add(scores)
            state["done"][key] = {m: t.tolist() for m, t in scores.items()}
            _save_state(state_path, state)
            # each head's error at its cheapest candidate: how hard the layer is to make sparse
            cheapest = scores["densities"].argmin(0, keepdim=True)
            at_cheapest = scores["errors"].gather(0, cheapest).flatten()
            progress(f"sample {si + 1}/{len(samples)} layer {call.layer + 1}/{identity.num_layers} "
                     f"error at the cheapest candidate: mean {at_cheapest.mean():.3f}, worst {at_cheapest.max():.3f}")

        if all(f"{si}:{layer}" in state["done"] for layer in range(identity.num_layers)):
            continue
        observe.run_observed(model, ids.to(next(model.parameters()).device), observer)

    missing = [layer for layer in range(identity.num_layers) if layer not in per_layer]
    if missing:
        raise RuntimeError(f"search saw no attention for layers {missing}: inspect the model (minference-fx inspect) "
                           "to see which sites the passes leave dense and why")
    choice = choose_heads([per_layer[layer] for layer in range(identity.num_layers)], candidates, bound=bound,
                          recall_min=recall_min, target_density=target_density, spend_slack=spend_slack, power=power)
    layers = _entries(choice, candidates)
    counts: dict[str, int] = {}
    for layer in layers:
        for head in layer:
            counts[head.pattern.value] = counts.get(head.pattern.value, 0) + 1
    flat_rec = [r for layer in choice.recall for r in layer]
    flat_err = [e for layer in choice.error for e in layer]
    rule = (f"rule: cheapest candidate with error <= {bound} among those with recall >= {recall_min} (min of "
            f"sequence and last-rows estimates; dense always allowed)")
    if target_density is not None:
        rule += (f"; then, while the mean density over heads exceeds {target_density}, greedy moves to cheaper allowed "
                 f"candidates by least increase of error{'' if power == 1 else f'**{power:g}'} per density saved")
        if spend_slack:
            rule += "; then slack under the target spent by most error decrease per density"
    return SemanticConfig(
        model=identity,
        layers=layers,
        defaults={"min_sparse_len": min_sparse_len, **(guard_defaults or {})},
        provenance=Provenance(
            tool_version=_tool_version(), calibration_data=data_name, lengths=lengths, seed=seed,
            metric=f"{METRIC}; {rule}",
            date=datetime.date.today().isoformat(),
            notes=(f"{len(samples)} sample(s); rows per call: last {last_rows} + {strata} stratified; "
                   f"calibration mean density {choice.mean_density:.4f}, mean error {sum(flat_err) / len(flat_err):.4f}, "
                   f"mean recall {sum(flat_rec) / len(flat_rec):.4f}, worst recall {min(flat_rec):.4f}; "
                   f"picks {dict(sorted(counts.items()))}; "
                   f"candidates {[(c.pattern.value, c.budget_a, c.budget_b) for c in candidates]}"),
        ),
    )


def _inputs_digest(model, samples) -> str:
    """What the scores were computed on besides the weights' identity: every sample's ids, in order, and the rope
    scaling (which the model's fingerprint leaves out), so a rerun on other data, samples or YaRN starts afresh."""
    digest = hashlib.sha256()
    for ids in samples:
        digest.update(str(tuple(ids.shape)).encode())
        digest.update(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    config = model.config.to_dict()
    digest.update(json.dumps([config.get("rope_scaling"), config.get("rope_parameters")], sort_keys=True,
                             default=str).encode())
    return digest.hexdigest()


def _state_id(fingerprint: str, candidates, sampling, inputs: str) -> str:
    blob = json.dumps([fingerprint, [(c.pattern.value, c.budget_a, c.budget_b) for c in candidates], list(sampling),
                       list(METRICS), inputs])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _load_state(path, fingerprint, candidates, sampling, inputs: str) -> dict:
    state_id = _state_id(fingerprint, candidates, sampling, inputs)
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


CALIBRATION_SPAN = (0.10, 0.75)
"""Share of the text calibration windows come from: the eval reads perplexity and recall windows from the last
quarter and needle haystacks (seeds 0 and 1) from the first few percent."""


def text_samples(tokenizer, text: str, *, length: int, count: int, seed: int,
                 span: tuple[float, float] = CALIBRATION_SPAN) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens from the ``span`` share of ``text``, one per equal stratum, seeded."""
    lo, hi = int(len(text) * span[0]), int(len(text) * span[1])
    ids = tokenizer(text[lo:hi], return_tensors="pt").input_ids[0]
    if ids.numel() < length:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than the requested length {length}")
    g = torch.Generator().manual_seed(seed)
    room = ids.numel() - length + 1
    starts = [int(room * i / count) + int(torch.randint(0, max(1, room // count), (1,), generator=g))
              for i in range(count)]
    return [ids[s : s + length][None] for s in starts]
