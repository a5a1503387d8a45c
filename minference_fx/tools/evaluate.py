"""Model fidelity of the sparse backend against dense attention on a real model.

Six tasks, each comparing ``model`` (dense SDPA) with the same weights compiled
through ``backend="minference"`` (``min_sparse_len=0``, so every prefill runs the
sparse op whatever its length):

* ``ppl``    perplexity on prose from the text's last quarter (the search
             draws its calibration windows from 10-75 % of the text, see
             :data:`minference_fx.search.CALIBRATION_SPAN`, so these windows are
             unseen by it);
* ``ppl-code`` the same on code: Python's standard-library sources
             (:mod:`minference_fx.tools.stdlib_code`), which every machine has;
* ``niah``   needle in a haystack: a passkey sentence at a depth of the prose, a
             question at the end, greedy decoding; pass = the passkey appears;
* ``ruler``  RULER-style tasks beyond one needle (:mod:`minference_fx.tools.ruler`):
             multi-key and multi-value NIAH, variable tracking in the prose, and
             frequent-words extraction; score = the fraction of expected strings
             in the greedy answer; ``ruler-code``: the haystack tasks in code;
* ``recall`` index fidelity per (layer, head): the dense attention mass of the
             last query rows that the online index's key set captures, against the
             best possible key set of the same size (oracle top-k).

Q/K per layer come from the backend's own search mode (:mod:`minference_fx.observe`):
the model is compiled so that every attention site runs dense and hands its Q/K/V
to a Python callback. That sees exactly what the rewritten op would see (after
RoPE, before ``repeat_kv``), for any model the passes understand, with no
model-specific hooks.

Results are dataclasses; :class:`EvalResults` prints as tables and saves as JSON
(and a PNG when matplotlib is installed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from .. import configs, guard_stats, observe
from ..call_masks import CallMasks
from ..config import SemanticConfig, default_config, load_config, model_identity_from_hf
from ..dense import guard_mass, guarded_heads, near_dense_heads, weak_heads
from ..kernels import guard, reference
from ..kernels.index import build_index_gpu
from ..plan import LISTED_PATTERNS, LayerPlan, Pattern
from ..search import physical_density
from . import assets, cache_kwargs, pick_device, returned_cache, ruler, stdlib_code

NEEDLE = " The secret passcode for the vault is {passkey}. "
QUESTION = "\n\nQuestion: What is the secret passcode for the vault?\nAnswer: The secret passcode for the vault is"
HELD_OUT_FROM = 0.75  # perplexity windows come from the last quarter of the text


# --------------------------------------------------------------------------- compiling


def sparse_model(model, config: SemanticConfig, *, inner: str = "eager", guard_escalation: Optional[tuple] = None):
    """``model`` compiled with the minference backend, sparse at every length.

    ``inner="eager"`` runs the rewritten graph without Inductor: quality does not
    depend on the inner compiler, and it skips minutes of codegen on CPU.
    """
    torch._dynamo.reset()  # a fresh trace: the model may have been compiled with another config
    options = {"config": config, "inner": inner, "min_sparse_len": 0, "guard_escalation": guard_escalation}
    return torch.compile(model, backend="minference", options=options)


def shipped_config_for(model, longest: Optional[int] = None) -> Optional[Path]:
    """A config in ``minference_fx/configs`` whose model fingerprint matches ``model``, if any.

    When several match, the one calibrated at the shortest length that is at
    least ``longest`` wins (budgets are absolute, so a config searched at 8K is
    sparser and rougher at 16K); without such a one, the longest calibrated.
    """
    identity = model_identity_from_hf(model.config)
    found = []
    for path in sorted(Path(configs.__file__).parent.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("model", {}).get("fingerprint") == identity.fingerprint:
            found.append((max(doc.get("provenance", {}).get("lengths") or [0]), path))
    if not found:
        return None
    covering = [f for f in found if longest is None or f[0] >= longest]
    return min(covering)[1] if covering else max(found)[1]


def uniform_config(model, pattern: Pattern, budgets: tuple[int, int]) -> SemanticConfig:
    """Every head the same pattern, sparse from length 0 (a baseline, no search behind it)."""
    return default_config(model_identity_from_hf(model.config), pattern=pattern, budgets=budgets, min_sparse_len=0)


def resolve_config(model, path=None, *, longest: int = 8192) -> tuple[SemanticConfig, str]:
    """(config, description): ``path``, else the shipped searched config, else a scaled uniform one.

    The fallback is vertical-slash with budgets scaled to the longest length
    (the search's middle candidate), because the default (1000, 6096) covers
    almost every key below 8K and would measure nothing.
    """
    if path is None:
        path = shipped_config_for(model, longest)
    if path is not None:
        return load_config(path, model=model_identity_from_hf(model.config)), str(path)
    budgets = (max(30, longest // 32), max(50, longest // 16))
    return (uniform_config(model, Pattern.VERTICAL_SLASH, budgets),
            f"uniform vertical_slash{budgets} (no searched config found)")


# --------------------------------------------------------------------------- text


# ~4 characters per token in Austen; 6 leaves room and one tokenisation suffices
CHARS_PER_TOKEN_ROOM = 6


def text_window_ids(tokenizer, text: str, start: int, length: int) -> torch.Tensor:
    """``[1, length]`` token ids of ``text`` from character ``start`` on."""
    # contiguous: a sliced view has other strides, and Dynamo guards on strides (a needless recompile)
    window = text[start : start + length * CHARS_PER_TOKEN_ROOM]
    ids = tokenizer(window, return_tensors="pt").input_ids[:, :length].contiguous()
    if ids.shape[1] < length:
        raise ValueError(f"text window from character {start} gave {ids.shape[1]} tokens, fewer than {length}")
    return ids


def held_out_ids(tokenizer, text: str, length: int, *, seed: int = 0, calibrated: bool = True) -> torch.Tensor:
    """``[1, length]`` token ids of held-out prose (a window of the text's last quarter).

    The search calibrates on the first three quarters, so a searched (``calibrated``) config is only measured
    on the last. A config no search fitted to the text has nothing to hold out from: a length the last quarter
    cannot hold (past ~170K tokens of Austen) then takes the text's last characters, reaching back into the
    first three quarters (:func:`beyond_held_out` says when), or the whole text when even that is short of
    ``CHARS_PER_TOKEN_ROOM`` characters a token (Austen's 4.0M characters are 995K tokens: 960K fit)."""
    start = int(len(text) * HELD_OUT_FROM)
    span = len(text) - start
    need = length * CHARS_PER_TOKEN_ROOM
    if beyond_held_out(text, length):
        if calibrated:
            raise ValueError(f"the held-out quarter of the text has {span} characters; {length} tokens need about "
                             f"{need}; a searched config is only measured there")
        return text_window_ids(tokenizer, text, max(0, len(text) - need), length)
    return text_window_ids(tokenizer, text, start + random.Random(seed).randrange(0, span - need + 1), length)


def beyond_held_out(text: str, length: int) -> bool:
    """Whether :func:`held_out_ids` of an uncalibrated config reads more than the text's last quarter at ``length``."""
    return length * CHARS_PER_TOKEN_ROOM > len(text) - int(len(text) * HELD_OUT_FROM)


# --------------------------------------------------------------------------- perplexity


@dataclasses.dataclass
class PerplexityRow:
    length: int
    dense: float
    sparse: float
    rel_delta: float
    """(sparse - dense) / dense"""
    dense_s: float
    sparse_s: float
    scored: Optional[int] = None
    """next-token predictions scored: the last ones of the window (None: all of them)"""


def perplexity(model, ids: torch.Tensor, *, compiled=None, scored: Optional[int] = None) -> float:
    """Perplexity of ``ids`` [1, S] under ``compiled`` (when given) or ``model``, next-token NLL in fp32.

    ``scored``: only the last ``scored`` predictions count, and the model computes logits for those rows only
    (``logits_to_keep``): all 128K rows of a 151K-token vocabulary would be 80 GB in fp32.
    """
    run = compiled if compiled is not None else model
    n = ids.shape[1] - 1 if scored is None else min(scored, ids.shape[1] - 1)
    keep = {} if scored is None else {"logits_to_keep": n + 1}
    with torch.no_grad():
        logits = run(ids, use_cache=False, **keep).logits[0, -(n + 1) : -1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, -n:].to(logits.device))
    return math.exp(nll.item())


def _timed(fn: Callable):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


DenseMemo = dict
"""The dense side of eval's tasks by prompt (:func:`dense_once`), shared by the runs of several configs in one process."""


def dense_once(memo: Optional[DenseMemo], kind: str, ids: torch.Tensor, extra: tuple, compute: Callable):
    """``compute()`` for a prompt, once per ``memo``: configs compared in one process score against the same dense
    answers and perplexities, and pay for them once. Keyed by the prompt's token ids, so a config whose held-out
    window differs (calibrated or not) gets its own."""
    if memo is None:
        return compute()
    key = (kind, hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest(), tuple(ids.shape), extra)
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def compare_perplexity(model, compiled, ids: torch.Tensor, *, scored: Optional[int] = None,
                       dense_memo: Optional[DenseMemo] = None) -> PerplexityRow:
    dense, dense_s = dense_once(dense_memo, "ppl", ids, (scored,), lambda: _timed(lambda: perplexity(model, ids, scored=scored)))
    sparse, sparse_s = _timed(lambda: perplexity(model, ids, compiled=compiled, scored=scored))
    return PerplexityRow(ids.shape[1], dense, sparse, (sparse - dense) / dense, dense_s, sparse_s, scored)


def code_window_ids(tokenizer, code: str, length: int, *, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` token ids of the code corpus from a line start that ``seed`` picks (no search calibrates
    on code, so any window is held out)."""
    return torch.tensor([ruler.text_ids(tokenizer, code, length, random.Random(f"ppl-code:{seed}"))])


# --------------------------------------------------------------------------- needle in a haystack


@dataclasses.dataclass
class NiahCell:
    length: int
    depth: float
    seed: int
    passkey: str
    dense_pass: bool
    sparse_pass: bool
    dense_answer: str
    sparse_answer: str


def _passkey(length: int, depth: float, seed: int) -> str:
    return str(random.Random(f"{length}:{depth}:{seed}").randint(10000, 99999))


def _sentence_start(tokenizer, ids: list[int], at: int) -> int:
    """The nearest position at or before ``at`` that follows a sentence end (else ``at``)."""
    for i in range(at, max(0, at - 200), -1):
        if tokenizer.decode(ids[i - 1 : i]).rstrip().endswith((".", "!", "?")):
            return i
    return at


def haystack_prompt(tokenizer, text: str, length: int, needle: str, question: str, depth: float,
                    offset: int = 0) -> torch.Tensor:
    """``[1, length]`` ids: prose of ``text`` from character ``offset``, ``needle`` at ``depth`` (moved to a
    sentence start), then ``question``."""
    # no special tokens: a tokenizer that adds a BOS would put one before the needle and one before the question
    needle_ids = tokenizer(needle, add_special_tokens=False).input_ids
    question_ids = tokenizer(question, add_special_tokens=False).input_ids
    n_hay = length - len(needle_ids) - len(question_ids)
    hay = tokenizer(text[offset : offset + n_hay * CHARS_PER_TOKEN_ROOM]).input_ids[:n_hay]
    if len(hay) < n_hay:
        raise ValueError(f"text too short for a {length}-token haystack")
    at = _sentence_start(tokenizer, hay, int(depth * n_hay))
    return torch.tensor([hay[:at] + needle_ids + hay[at:] + question_ids])


def needle_prompt(tokenizer, text: str, length: int, depth: float, seed: int) -> tuple[torch.Tensor, str]:
    """(``[1, length]`` prompt ids, passkey): prose from the text's start, a needle at ``depth``, the question."""
    passkey = _passkey(length, depth, seed)
    needle = NEEDLE.format(passkey=passkey)
    n_hay = (length - len(tokenizer(needle, add_special_tokens=False).input_ids)
             - len(tokenizer(QUESTION, add_special_tokens=False).input_ids))
    # the haystack comes from the first three quarters (perplexity uses the rest); seeds move it along
    offset = (seed * 97_003) % max(1, int(len(text) * HELD_OUT_FROM) - n_hay * CHARS_PER_TOKEN_ROOM)
    return haystack_prompt(tokenizer, text, length, needle, QUESTION, depth, offset), passkey


def greedy_answer(model, ids: torch.Tensor, *, prefill=None, new_tokens: int = 7) -> list[int]:
    """Token ids of the greedy continuation of ``ids``: the prompt through ``prefill`` (e.g. the sparse model).

    Decode steps are dense in the backend's design too (one query row reads
    every cached key), so they run on the plain model with the prefill's cache.
    """
    run = prefill if prefill is not None else model
    with torch.no_grad():
        out = run(ids, use_cache=True)
    return decode_greedy(model, out, new_tokens)


def decode_greedy(model, out, new_tokens: int) -> list[int]:
    """Continue greedily from a prefill's output (its last logits and its KV cache) on ``model``."""
    tokens, cache = [], returned_cache(out)
    with torch.no_grad():
        for _ in range(new_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            out = model(token, **cache_kwargs(model, cache), use_cache=True)
            cache = returned_cache(out)
    return tokens


def needle_grid(model, tokenizer, lengths, depths, seeds, *, compiled=None, text: str | None = None,
                progress: Callable[[str], None] = print, dense_memo: Optional[DenseMemo] = None) -> list[NiahCell]:
    """NIAH cells for every (length, depth, seed), dense and (when ``compiled`` is given) sparse."""
    if text is None:
        text = assets.austen_text()
    cells = []
    device = next(model.parameters()).device
    for length in lengths:
        for depth in depths:
            for seed in seeds:
                ids, passkey = needle_prompt(tokenizer, text, length, depth, seed)
                ids = ids.to(device)
                dense = dense_once(dense_memo, "niah", ids, (), lambda: tokenizer.decode(greedy_answer(model, ids)))
                sparse = tokenizer.decode(greedy_answer(model, ids, prefill=compiled)) if compiled is not None else ""
                cell = NiahCell(length, depth, seed, passkey, passkey in dense, passkey in sparse, dense, sparse)
                cells.append(cell)
                progress(f"niah L={length} depth={depth} seed={seed}: dense {'pass' if cell.dense_pass else 'FAIL'} "
                         f"{dense!r}, sparse {'pass' if cell.sparse_pass else 'FAIL'} {sparse!r}")
    return cells


# --------------------------------------------------------------------------- RULER-style tasks


@dataclasses.dataclass
class RulerCell:
    length: int
    task: str
    haystack: str
    """what the needles hide in: "austen" (prose) or "code" (Python sources)"""
    depth: Optional[float]
    """where the first answer-carrying insert goes (None: the aggregation task, which has no inserts)"""
    seed: int
    answers: list[str]
    dense_score: float
    """fraction of ``answers`` in the dense model's greedy answer"""
    sparse_score: Optional[float]
    dense_answer: str
    sparse_answer: str


@dataclasses.dataclass
class RulerScore:
    """One (length, haystack, task): the mean scores over its depths and seeds, and the expected strings the
    sparse answers lost or gained against the dense ones on the same prompts."""

    length: int
    haystack: str
    task: str
    dense: float
    sparse: float
    cells: int
    strings: int = 0
    """expected strings over the cells that ran sparse"""
    lost: int = 0
    """strings the dense answer holds and the sparse one does not"""
    gained: int = 0
    """strings the sparse answer holds and the dense one does not"""


def sign_test(lost: int, gained: int) -> float:
    """Two-sided exact sign test of lost against gained strings: the chance of a split at least this uneven if
    sparse and dense were equally likely to hold each string they disagree on (1.0 when they never disagree)."""
    n = lost + gained
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)


def string_changes(cells) -> tuple[int, int, int]:
    """(strings, lost, gained) over the cells that ran sparse: see :class:`RulerScore`."""
    strings = lost = gained = 0
    for c in cells:
        if c.sparse_score is None:
            continue
        dense, sparse = ruler.found(c.dense_answer, c.answers), ruler.found(c.sparse_answer, c.answers)
        strings += len(c.answers)
        lost += sum(d and not s for d, s in zip(dense, sparse))
        gained += sum(s and not d for d, s in zip(dense, sparse))
    return strings, lost, gained


def stop_token_ids(model, tokenizer) -> set[int]:
    """Every end-of-sequence id the tokenizer or the model's generation config names (they can differ)."""
    found = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        found.update(value if isinstance(value, (list, tuple)) else () if value is None else (value,))
    return found


def _answer_text(tokenizer, tokens: list[int], stops: set[int]) -> str:
    """The decoded answer up to its first end-of-sequence token (what follows is not the answer)."""
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:cut])


def scored_answer(model, tokenizer, ids: torch.Tensor, answers: list[str], new_tokens: int, stops: set[int], *,
                  prefill=None) -> tuple[str, float]:
    """The greedy answer to a RULER-style prompt (through ``prefill`` when given, as :func:`greedy_answer`) cut at its
    first end-of-sequence token, and the fraction of ``answers`` it holds."""
    text = _answer_text(tokenizer, greedy_answer(model, ids, prefill=prefill, new_tokens=new_tokens), stops)
    return text, ruler.score(text, answers)


def ruler_grid(model, tokenizer, lengths, depths, seeds, *, haystack: str, haystack_name: str = "austen",
               tasks=tuple(ruler.TASKS), chat: bool = False, compiled=None,
               progress: Callable[[str], None] = print, dense_memo: Optional[DenseMemo] = None) -> list[RulerCell]:
    """RULER-style cells for every (length, task, depth, seed), dense and (when ``compiled`` is given) sparse on
    the same prompt. The aggregation task has no depth: it runs as many seeds instead (:func:`ruler.prompts_of`)."""
    device = next(model.parameters()).device
    stops = stop_token_ids(model, tokenizer)
    cells = []
    for length in lengths:
        for name in tasks:
            for depth, seed in ruler.prompts_of(name, depths, seeds):
                sample = ruler.generate(name, tokenizer, haystack, length, seed, depth=depth, chat=chat)
                ids = torch.tensor([sample.ids], device=device)
                dense, dense_score = dense_once(
                    dense_memo, "ruler", ids, (tuple(sample.answers), sample.new_tokens),
                    lambda: scored_answer(model, tokenizer, ids, sample.answers, sample.new_tokens, stops))
                sparse, sparse_score = ("", None) if compiled is None else scored_answer(
                    model, tokenizer, ids, sample.answers, sample.new_tokens, stops, prefill=compiled)
                cell = RulerCell(length, name, haystack_name, depth, seed, sample.answers, dense_score,
                                 sparse_score, dense, sparse)
                cells.append(cell)
                where = "" if depth is None else f" depth={depth}"
                progress(f"ruler {haystack_name} {name} L={length}{where} seed={seed}: dense {cell.dense_score:.2f} "
                         f"{dense!r}" + ("" if compiled is None else f", sparse {cell.sparse_score:.2f} {sparse!r}"))
    return cells


# --------------------------------------------------------------------------- index recall


@dataclasses.dataclass
class HeadRecall:
    length: int
    layer: int
    head: int
    pattern: str
    recall: float
    """mean over the rows of the dense attention mass inside the index's key set"""
    oracle: float
    """mean over the rows of the mass of the row's top-n keys, n = the index's key count for that row"""
    density: float
    """physical density of the head's index over the whole prompt (tiles and columns the kernel computes)"""
    guard_dense: bool = False
    """the op's run-time guard runs this head dense: its index is near-dense (>= 90 % of the causal tiles),
    or the quality guard finds its estimated captured mass under the threshold"""
    near_dense: Optional[bool] = None
    """the index alone sends the head dense (near-dense rule); None in results from before it was recorded"""
    guard_mass: Optional[float] = None
    """vertical-slash heads: the quality guard's captured-mass estimate (dense at any threshold above it)"""

    def dense_at(self, threshold: float) -> bool:
        """Whether the op would run this head dense with the quality guard at ``threshold``."""
        return bool(self.near_dense) or (self.guard_mass is not None and self.guard_mass < threshold)

    @property
    def recall_guarded(self) -> float:
        return 1.0 if self.guard_dense else self.recall

    @property
    def density_guarded(self) -> float:
        return 1.0 if self.guard_dense else self.density


class LayerRecall(NamedTuple):
    """One layer's heads, each ``[Hq]`` (see :func:`head_recall`)."""

    recall: torch.Tensor
    oracle: torch.Tensor
    density: torch.Tensor
    fires: torch.Tensor
    """bool: the op runs the head dense at the given guard threshold"""
    near_dense: torch.Tensor
    """bool: the index alone sends the head dense (at any threshold)"""
    guard_mass: torch.Tensor
    """fp32: the quality guard's captured-mass estimate (NaN for heads it does not check)"""


def _recall_index(q, k, plan: LayerPlan, scale: float) -> reference.SparseIndex:
    """The index whose recall is measured: the reference's, or on the GPU, for a plan of vertical-slash and
    block-sparse heads only, its GPU twin, which lists the same tiles and columns for those heads in memory
    linear in the length (the reference's masks are [Hq, S / 64, S]: 288 GiB at 512K tokens)."""
    if q.is_cuda and all(hp.pattern in LISTED_PATTERNS for hp in plan.heads):
        return build_index_gpu(q, k, plan, scale=scale)
    return reference.build_index(q, k, plan, scale=scale)


def head_recall(q, k, plan: LayerPlan, *, scale: float, rows: int, guard_threshold: float = 0.0) -> LayerRecall:
    """Recall, oracle, density and the run-time rules' view of one layer's q ``[1,Hq,S,D]`` and k ``[1,Hkv,S,D]``.

    Only the last ``rows`` query rows are scored (dense attention of every row
    would be S x S per head). Those rows include the vertical-slash estimate's
    own last 64 queries, so VS recall there is slightly optimistic.
    """
    q, k = q.float(), k.float()
    sq, skv = q.shape[2], k.shape[2]
    r0 = max(0, sq - rows)
    index = _recall_index(q, k, plan, scale)
    pos = torch.arange(r0, sq, device=q.device)
    base = reference.base_allowed(pos, skv)  # [1, 1, R, Skv]
    keys = reference.index_to_mask(index, range(r0, sq), skv) & base  # [1, Hq, R, Skv]
    group = q.shape[1] // k.shape[1]
    scores = q[:, :, r0:] @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    prob = reference._masked_softmax(scores, base.expand_as(scores))
    recall = (prob * keys).sum(-1)  # [1, Hq, R]
    n = keys.sum(-1)
    ranked = prob.sort(dim=-1, descending=True).values.cumsum(-1)
    oracle = ranked.gather(-1, (n - 1).clamp(min=0)[..., None])[..., 0] * (n > 0)
    # the op's run-time rules (dense.dense_rules) on this index, their inputs kept so any threshold can be read off
    near = near_dense_heads(index, plan, sq, skv, 0)[0].cpu()
    mass = guard_mass(q, k, index, scale, CallMasks()).cpu()
    fires = near | weak_heads(mass, plan, guard_threshold)[0] if guard_threshold > 0 else near
    checked = torch.tensor(guarded_heads(plan))
    return LayerRecall(recall.mean((0, 2)), oracle.mean((0, 2)), physical_density(index, sq, skv).float(), fires,
                       near, torch.where(checked, mass[0], float("nan")))


def index_recall(model, ids: torch.Tensor, config: SemanticConfig, *, rows: int = 256) -> list[HeadRecall]:
    """Per (layer, head) recall of the online index vs dense attention for the prompt ``ids``.

    Runs the model once in the backend's search mode (dense attention; every
    layer's Q/K handed to the callback below), so the Q/K are those of the dense
    model at every layer.
    """
    results: list[HeadRecall] = []
    length = ids.shape[1]

    def on_call(call: observe.AttentionCall):
        plan = config.plan_at(call.layer, 0, call.q.shape[1], call.k.shape[2])
        layer = head_recall(call.q, call.k, plan, scale=call.scale, rows=rows, guard_threshold=config.guard_threshold)
        for h, head in enumerate(plan.heads):
            mass = float(layer.guard_mass[h])
            results.append(HeadRecall(length, call.layer, h, head.pattern.value, float(layer.recall[h]),
                                      float(layer.oracle[h]), float(layer.density[h]), bool(layer.fires[h]),
                                      bool(layer.near_dense[h]), None if math.isnan(mass) else mass))

    observe.run_observed(model, ids, on_call)
    return sorted(results, key=lambda r: (r.layer, r.head))


@dataclasses.dataclass
class RecallSummary:
    """One length: the raw online index, then with the run-time guard's dense fallbacks applied (near-dense
    index, low captured mass)."""

    length: int
    mean: float
    worst: float
    worst_head: str
    oracle_mean: float
    density_mean: float
    guard_dense_heads: int
    guarded_mean: float
    guarded_worst: float
    guarded_density_mean: float

    @staticmethod
    def of(rows: list[HeadRecall]) -> "RecallSummary":
        worst = min(rows, key=lambda r: r.recall)
        n = len(rows)
        return RecallSummary(
            rows[0].length, sum(r.recall for r in rows) / n, worst.recall,
            f"layer {worst.layer} head {worst.head} ({worst.pattern})",
            sum(r.oracle for r in rows) / n, sum(r.density for r in rows) / n,
            sum(r.guard_dense for r in rows), sum(r.recall_guarded for r in rows) / n,
            min(r.recall_guarded for r in rows), sum(r.density_guarded for r in rows) / n)


GUARD_SWEEP = (0.5, 0.6, 0.7, 0.8, 0.9)
"""quality-guard thresholds the eval's recall table shows besides the config's"""


@dataclasses.dataclass
class GuardSweepRow:
    """One length and quality-guard threshold: what the recall would be with the op's run-time rules there."""

    length: int
    threshold: float
    dense_heads: int
    mean: float
    worst: float
    density_mean: float

    @staticmethod
    def of(rows: list[HeadRecall], threshold: float) -> "GuardSweepRow":
        dense = [r.dense_at(threshold) for r in rows]
        recall = [1.0 if d else r.recall for r, d in zip(rows, dense)]
        density = [1.0 if d else r.density for r, d in zip(rows, dense)]
        return GuardSweepRow(rows[0].length, threshold, sum(dense), sum(recall) / len(rows), min(recall),
                             sum(density) / len(rows))


def layer_density(heads: list[HeadRecall]) -> dict[int, float]:
    """Mean physical density per layer (over its heads)."""
    per: dict[int, list[float]] = {}
    for r in heads:
        per.setdefault(r.layer, []).append(r.density)
    return {layer: sum(v) / len(v) for layer, v in sorted(per.items())}


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class EvalResults:
    model: str
    config: str
    lengths: list[int]
    device: str
    ppl: list[PerplexityRow] = dataclasses.field(default_factory=list)
    niah: list[NiahCell] = dataclasses.field(default_factory=list)
    recall: list[HeadRecall] = dataclasses.field(default_factory=list)
    guard: dict = dataclasses.field(default_factory=dict)
    """quality-guard counters over the sparse runs (heads forced dense)"""
    notes: list[str] = dataclasses.field(default_factory=list)
    ppl_code: list[PerplexityRow] = dataclasses.field(default_factory=list)
    """perplexity on Python's standard-library sources"""
    ruler: list[RulerCell] = dataclasses.field(default_factory=list)
    code_corpus: dict = dataclasses.field(default_factory=dict)
    """which code ``ppl_code`` and the code haystack read (:meth:`stdlib_code.CodeCorpus.describe`)"""

    def recall_summaries(self) -> list[RecallSummary]:
        lengths = sorted({r.length for r in self.recall})
        return [RecallSummary.of([r for r in self.recall if r.length == n]) for n in lengths]

    def guard_sweep(self) -> list[GuardSweepRow]:
        """Per length, the recall at each threshold of :data:`GUARD_SWEEP` (empty for results without the
        guard's estimates)."""
        out = []
        for n in sorted({r.length for r in self.recall}):
            rows = [r for r in self.recall if r.length == n]
            if all(r.near_dense is not None for r in rows):
                out += [GuardSweepRow.of(rows, t) for t in GUARD_SWEEP]
        return out

    def ruler_scores(self) -> list[RulerScore]:
        """Mean scores per (length, haystack, task), in the order the cells were run."""
        groups: dict[tuple, list[RulerCell]] = {}
        for c in self.ruler:
            groups.setdefault((c.length, c.haystack, c.task), []).append(c)
        return [RulerScore(n, hay, name, sum(c.dense_score for c in cells) / len(cells),
                           sum(c.sparse_score or 0.0 for c in cells) / len(cells), len(cells), *string_changes(cells))
                for (n, hay, name), cells in groups.items()]

    def to_json(self) -> dict:
        doc = dataclasses.asdict(self)
        doc["recall_summary"] = [dataclasses.asdict(s) for s in self.recall_summaries()]
        doc["guard_sweep"] = [dataclasses.asdict(s) for s in self.guard_sweep()]
        doc["ruler_summary"] = [dataclasses.asdict(s) for s in self.ruler_scores()]
        return doc

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def from_json(doc: dict) -> "EvalResults":
        """The inverse of :meth:`to_json` (its derived summaries are recomputed, not read)."""
        fields = {f.name for f in dataclasses.fields(EvalResults)}
        rows = ("ppl", "niah", "recall", "ppl_code", "ruler")
        plain = {k: v for k, v in doc.items() if k in fields and k not in rows}
        return EvalResults(**plain, ppl=[PerplexityRow(**r) for r in doc.get("ppl", [])],
                           niah=[NiahCell(**c) for c in doc.get("niah", [])],
                           recall=[HeadRecall(**r) for r in doc.get("recall", [])],
                           ppl_code=[PerplexityRow(**r) for r in doc.get("ppl_code", [])],
                           ruler=[RulerCell(**c) for c in doc.get("ruler", [])])

    @staticmethod
    def load(path) -> "EvalResults":
        return EvalResults.from_json(json.loads(Path(path).read_text()))

    def table(self) -> str:
        out = [f"model {self.model} | config {self.config} | {self.device}"]
        if self.ppl:
            out.append(_ppl_table(self.ppl, "dense ppl", "sparse ppl"))
        if self.ppl_code:
            out.append(_ppl_table(self.ppl_code, "dense code ppl", "sparse code ppl"))
        if self.ruler or self.ppl_code:
            out.append(_quality_table(self))
        if self.niah:
            out.append(_niah_table(self.niah))
        if self.recall:
            out.append(_table(("length", "recall mean", "worst head", "", "oracle mean", "gap", "density",
                               "| guard: dense heads", "mean", "worst", "density"),
                              [(s.length, f"{s.mean:.4f}", f"{s.worst:.4f}", s.worst_head, f"{s.oracle_mean:.4f}",
                                f"{s.oracle_mean - s.mean:+.4f}", f"{s.density_mean:.3f}", s.guard_dense_heads,
                                f"{s.guarded_mean:.4f}", f"{s.guarded_worst:.4f}", f"{s.guarded_density_mean:.3f}")
                               for s in self.recall_summaries()]))
            sweep = self.guard_sweep()
            if sweep:
                out.append("if the quality guard's threshold were:\n" + _table(
                    ("length", "threshold", "dense heads", "recall mean", "worst", "density"),
                    [(s.length, f"{s.threshold:.2f}", s.dense_heads, f"{s.mean:.4f}", f"{s.worst:.4f}",
                      f"{s.density_mean:.3f}") for s in sweep]))
        if self.guard:
            out.append("quality guard: " + ", ".join(f"{k} {v}" for k, v in self.guard.items()))
        out += self.notes
        return "\n\n".join(out)


def _table(header, rows) -> str:
    lines = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def _ppl_table(rows: list[PerplexityRow], dense: str, sparse: str) -> str:
    """Perplexity rows; a "scored" column only when some rows scored fewer than all their predictions."""
    partial = any(r.scored is not None for r in rows)
    return _table(("length", dense, sparse, "delta", "dense s", "sparse s") + (("scored",) if partial else ()),
                  [(r.length, f"{r.dense:.4f}", f"{r.sparse:.4f}", f"{100 * r.rel_delta:+.3f}%", f"{r.dense_s:.1f}",
                    f"{r.sparse_s:.1f}") + ((r.scored or r.length - 1,) if partial else ()) for r in rows])


def _ruler_columns(results: EvalResults) -> list[tuple[str, str]]:
    """(haystack, task) pairs in the order they were run."""
    return list(dict.fromkeys((c.haystack, c.task) for c in results.ruler))


def _column_label(haystack: str, task: str) -> str:
    label = ruler.TASKS[task].label if task in ruler.TASKS else task
    return label if haystack == "austen" else f"{label} {haystack}"


def _quality_table(results: EvalResults) -> str:
    """One row per length: each RULER-style task's dense|sparse score (%), the worst sparse - dense difference,
    the expected strings lost and gained over every task with their sign test, and the sparse/dense perplexity ratios."""
    scores = {(s.length, s.haystack, s.task): s for s in results.ruler_scores()}
    columns = _ruler_columns(results)
    ppl = {r.length: r for r in results.ppl}
    code = {r.length: r for r in results.ppl_code}
    lengths = sorted({n for n, _, _ in scores} | set(ppl) | set(code))
    header = ["length"] + [_column_label(*col) for col in columns]
    header += (["worst diff", "strings lost/gained", "sign test p"] if columns else [])
    header += (["ppl ratio"] if ppl else []) + (["code ppl ratio"] if code else [])
    rows = []
    for n in lengths:
        here = [scores.get((n, *col)) for col in columns]
        row = [n] + [f"{100 * s.dense:.1f}|{100 * s.sparse:.1f}" if s else "-" for s in here]
        if columns:
            diffs = [100 * (s.sparse - s.dense) for s in here if s]
            lost, gained, strings = (sum(getattr(s, f) for s in here if s) for f in ("lost", "gained", "strings"))
            row.append(f"{min(diffs):+.1f}" if diffs else "-")
            row += [f"{lost}/{gained}/{strings}", f"{sign_test(lost, gained):.2f}"] if strings else ["-", "-"]
        row += ([f"{1 + ppl[n].rel_delta:.4f}" if n in ppl else "-"] if ppl else [])
        row += ([f"{1 + code[n].rel_delta:.4f}" if n in code else "-"] if code else [])
        rows.append(row)
    return (_table(header, rows) + "\nRULER-style scores: dense|sparse, % of the expected strings in the greedy "
            "answer (mean over depths and seeds); worst diff: sparse - dense in points; strings lost/gained: of "
            "the expected strings (the last number), those only the dense / only the sparse answer holds, every task; "
            "sign test p: the chance of a split at least that uneven if neither side were better; "
            "ppl ratio: sparse / dense")


def _niah_table(cells: list[NiahCell]) -> str:
    """Rows: length; columns: depth; cell: dense passes/seeds | sparse passes/seeds."""
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    rows = []
    for n in lengths:
        row = [n]
        for d in depths:
            here = [c for c in cells if c.length == n and c.depth == d]
            row.append(f"{sum(c.dense_pass for c in here)}|{sum(c.sparse_pass for c in here)} of {len(here)}")
        rows.append(row)
    dense_ok = [c for c in cells if c.dense_pass]
    kept = sum(c.sparse_pass for c in dense_ok)
    return (_table(["NIAH dense|sparse"] + [f"depth {d}" for d in depths], rows)
            + f"\nsparse passes {kept}/{len(dense_ok)} of the cells dense passes")


def save_png(results: EvalResults, path) -> Optional[str]:
    """NIAH grid (dense, sparse), recall per (layer, head) at the longest length, RULER-style scores and the
    perplexity ratios per length; None if no matplotlib or nothing to draw."""
    try:
        import matplotlib  # optional: the [eval] extra; without it no PNG

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = []
    if results.niah:
        panels += [("dense", "dense_pass"), ("sparse", "sparse_pass")]
    recall_len = max((r.length for r in results.recall), default=None)
    if recall_len is not None:
        panels += [("recall", None)]
    if results.ruler:
        panels += [("ruler", "lines")]
    if results.ppl or results.ppl_code:
        panels += [("ppl ratio", "lines")]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    lengths = sorted({c.length for c in results.niah})
    depths = sorted({c.depth for c in results.niah})
    for ax, (name, attr) in zip(axes[0], panels):
        if attr == "lines":
            (_draw_ruler if name == "ruler" else _draw_ppl_ratio)(ax, results)
            continue
        if attr is not None:
            grid = [[_pass_rate(results.niah, n, d, attr) for d in depths] for n in lengths]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(depths)), [str(d) for d in depths])
            ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
            ax.set_xlabel("needle depth"), ax.set_ylabel("prompt tokens"), ax.set_title(f"NIAH {name}")
        else:
            rows = [r for r in results.recall if r.length == recall_len]
            layers, heads = max(r.layer for r in rows) + 1, max(r.head for r in rows) + 1
            grid = [[float("nan")] * heads for _ in range(layers)]
            for r in rows:
                grid[r.layer][r.head] = r.recall
            im = ax.imshow(grid, vmin=min(0.8, min(r.recall for r in rows)), vmax=1, cmap="viridis", aspect="auto")
            ax.set_xlabel("query head"), ax.set_ylabel("layer"), ax.set_title(f"raw index recall at {recall_len}")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _length_axis(ax, lengths) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in sorted(lengths)])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens")


def _draw_ruler(ax, results: EvalResults) -> None:
    """Score per length for each (haystack, task): one colour per task, dense solid, sparse dashed."""
    scores = results.ruler_scores()
    for i, (hay, name) in enumerate(_ruler_columns(results)):
        mine = sorted((s for s in scores if (s.haystack, s.task) == (hay, name)), key=lambda s: s.length)
        x = [s.length for s in mine]
        ax.plot(x, [100 * s.dense for s in mine], "-o", color=f"C{i}", label=_column_label(hay, name))
        ax.plot(x, [100 * s.sparse for s in mine], "--x", color=f"C{i}")
    ax.plot([], [], "-", color="grey", label="dense"), ax.plot([], [], "--", color="grey", label="sparse")
    _length_axis(ax, {s.length for s in scores})
    ax.set_ylim(-5, 105), ax.set_ylabel("score (%)"), ax.set_title("RULER-style tasks")
    ax.legend(fontsize=7)


def _draw_ppl_ratio(ax, results: EvalResults) -> None:
    """Sparse / dense perplexity per length, prose and code, against the 1 % line."""
    for rows, label in ((results.ppl, "Austen"), (results.ppl_code, "Python stdlib")):
        if rows:
            rows = sorted(rows, key=lambda r: r.length)
            ax.plot([r.length for r in rows], [1 + r.rel_delta for r in rows], "-o", label=label)
    ax.axhline(1.0, color="grey", lw=0.8), ax.axhline(1.01, color="grey", lw=0.8, ls=":")
    _length_axis(ax, {r.length for r in results.ppl + results.ppl_code})
    ax.set_ylabel("sparse / dense perplexity"), ax.set_title("PPL ratio (dotted: +1 %)")
    ax.legend(fontsize=7)


def _pass_rate(cells, length, depth, attr) -> float:
    here = [getattr(c, attr) for c in cells if c.length == length and c.depth == depth]
    return sum(here) / len(here) if here else float("nan")


# --------------------------------------------------------------------------- the whole evaluation


def _guard_counts() -> dict:
    return dataclasses.asdict(guard_stats())


@contextlib.contextmanager
def _guard_counted():
    switch = guard.STATS_ON_GPU
    guard.STATS_ON_GPU = True
    try:
        yield
    finally:
        guard.STATS_ON_GPU = switch


EVAL_TASKS = ("ppl", "ppl-code", "niah", "ruler", "ruler-code", "recall")
SPARSE_RUN_TASKS = frozenset(EVAL_TASKS) - {"recall"}
"""the tasks that run the compiled sparse model (recall reads the index from a dense run)"""


def check_tasks(tasks, ruler_tasks) -> None:
    """A ValueError naming any unknown eval or RULER-style task: run it before a model loads (minutes at 128K)."""
    unknown = set(tasks) - set(EVAL_TASKS)
    if unknown:
        raise ValueError(f"unknown eval task(s) {sorted(unknown)}; known: {', '.join(EVAL_TASKS)}")
    for name in ruler_tasks:
        ruler.task(name)


def run_eval(model, tokenizer, text: str, *, lengths, tasks=("ppl", "niah", "recall"), config: SemanticConfig,
             config_name: str, model_name: str = "", depths=(0.1, 0.5, 0.9), seeds=(0,), inner: str = "eager",
             rows: int = 256, window_seed: int = 0, code: Optional[stdlib_code.CodeCorpus] = None,
             ruler_tasks=tuple(ruler.TASKS), chat: Optional[bool] = None, ppl_tokens: Optional[int] = None,
             progress: Callable[[str], None] = print, guard_escalation: Optional[tuple] = None,
             dense_memo: Optional[DenseMemo] = None) -> EvalResults:
    """Every requested task (of :data:`EVAL_TASKS`) at every length; progress lines as it goes.

    ``window_seed`` picks the held-out window of perplexity and recall; another seed checks that a
    result is not one window's luck. ``code``: the corpus of ``ppl-code`` and ``ruler-code`` (default: this
    Python's standard library). ``chat``: RULER-style prompts in the tokenizer's chat template (default: when
    it has one) or as a plain "Answer:" continuation. ``ppl_tokens``: score only the last this many
    predictions of each perplexity window (a large vocabulary's logits at 128K do not fit otherwise). ``dense_memo``:
    shared by the runs of several configs in one process, the dense side runs once for them all (:func:`dense_once`)."""
    device = str(next(model.parameters()).device)
    results = EvalResults(model_name, config_name, list(lengths), device)
    check_tasks(tasks, ruler_tasks)
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if code is None and ("ppl-code" in tasks or "ruler-code" in tasks):
        code = stdlib_code.stdlib_code()
    if code is not None:
        results.code_corpus = code.describe()
    # on the GPU the guard counts only when told to (a host sync per call): eval is no timing, so it counts
    with _guard_counted():
        guard_before = _guard_counts()
        calibrated = bool(config.provenance.calibration_data)
        if SPARSE_RUN_TASKS & set(tasks):
            compiled = sparse_model(model, config, inner=inner, guard_escalation=guard_escalation)
        for task_name, corpus, out in (("ppl", None, results.ppl), ("ppl-code", code, results.ppl_code)):
            if task_name not in tasks:
                continue
            for n in lengths:
                ids = (held_out_ids(tokenizer, text, n, seed=window_seed, calibrated=calibrated) if corpus is None
                       else code_window_ids(tokenizer, corpus.text, n, seed=window_seed)).to(device)
                row = compare_perplexity(model, compiled, ids, scored=ppl_tokens, dense_memo=dense_memo)
                out.append(row)
                progress(f"{task_name} L={n}: dense {row.dense:.4f} sparse {row.sparse:.4f} "
                         f"({100 * row.rel_delta:+.3f}%) [{row.dense_s:.0f} s / {row.sparse_s:.0f} s]")
        if "niah" in tasks:
            results.niah = needle_grid(model, tokenizer, lengths, depths, seeds, compiled=compiled, text=text,
                                       progress=progress, dense_memo=dense_memo)
        if "ruler" in tasks:
            results.ruler += ruler_grid(model, tokenizer, lengths, depths, seeds, haystack=text, haystack_name="austen",
                                        tasks=ruler_tasks, chat=chat, compiled=compiled, progress=progress,
                                        dense_memo=dense_memo)
        if "ruler-code" in tasks:  # the aggregation task reads no haystack: its code run would repeat the prose one
            in_code = [t for t in ruler_tasks if ruler.task(t).reads_haystack]
            results.ruler += ruler_grid(model, tokenizer, lengths, depths, seeds, haystack=code.text,
                                        haystack_name="code", tasks=in_code, chat=chat, compiled=compiled,
                                        progress=progress, dense_memo=dense_memo)
        if SPARSE_RUN_TASKS & set(tasks):  # the guard only runs in the sparse model's calls
            after = _guard_counts()
            results.guard = {k: after[k] - guard_before.get(k, 0) for k in after}
    if "recall" in tasks:
        for n in lengths:
            ids = held_out_ids(tokenizer, text, n, seed=window_seed, calibrated=calibrated).to(device)
            heads = index_recall(model, ids, config, rows=rows)
            results.recall += heads
            s = RecallSummary.of(heads)
            progress(f"recall L={n}: mean {s.mean:.4f} worst {s.worst:.4f} ({s.worst_head}) "
                     f"oracle {s.oracle_mean:.4f} density {s.density_mean:.3f}; with the guard "
                     f"({s.guard_dense_heads} heads dense) mean {s.guarded_mean:.4f} worst {s.guarded_worst:.4f}")
    results.notes += [
        f"sparse = torch.compile(backend='minference', inner={inner!r}, min_sparse_len=0); perplexity and recall "
        f"on windows of the text's last quarter (window seed {window_seed}) at the lengths it holds, needles in "
        "its first three quarters",
        f"recall: dense attention mass of the last {rows} query rows inside the online index's key set (these rows "
        "include the vertical-slash estimate's own last 64); oracle: the top-n keys of each row, n = the index's "
        "count; density: physical (tiles x 64 x 64 + columns x 64) / causal pairs, mean over heads (dense heads = 1)",
    ]
    escalation = config.guard_escalation if guard_escalation is None else guard_escalation
    if escalation and results.recall:
        results.notes.append(f"recall with the guard: heads it fires on are counted dense, though with its escalation "
                             f"to {tuple(escalation)} the sparse runs give them that index first")
    if results.ruler:
        results.notes.append(
            "ruler: RULER-style tasks (Hsieh et al. 2024) as minference_fx.tools.ruler writes them, "
            f"{'in the chat template' if chat else 'as plain Answer: prompts'}; the same prompt dense and sparse, "
            "greedy answers cut at the first end-of-sequence token; score = fraction of the expected strings found")
    if results.ppl_code:
        c = results.code_corpus
        results.notes.append(f"ppl-code: windows of Python {c['python']}'s standard-library sources ({c['files']} "
                             f"files, {c['chars']} characters, sha256 {c['sha256'][:12]}) from line starts picked by "
                             f"the window seed")
    beyond = [n for n in lengths if not calibrated and beyond_held_out(text, n) and ("ppl" in tasks or "recall" in tasks)]
    if beyond:
        results.notes.append(f"at {', '.join(map(str, beyond))} tokens the window is the text's last characters (the "
                             "whole text, from its start, when it is that short), longer than its last quarter "
                             "(the config was not calibrated on the text, so nothing is held out)")
    return results


def load_model(spec: str = "smollm2", *, longest: int = 8192, device: Optional[str] = None, dtype=None):
    """(model, tokenizer, name) for ``eval``: a named real model (:data:`assets.REAL_MODELS`, YaRN past its
    trained context) or an HF model directory."""
    dev = pick_device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if spec in assets.REAL_MODELS:
        real = assets.REAL_MODELS[spec]
        yarn = real.yarn_factor(longest)
        model, tok = real.load(dtype=dtype, yarn_factor=yarn)
        name = real.describe(yarn)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: the [transformers] extra

        if not Path(spec).is_dir():
            raise ValueError(f"--model {spec!r}: expected {' or '.join(map(repr, assets.REAL_MODELS))} or a local "
                             "model directory with a tokenizer")
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").eval()
        tok, name = AutoTokenizer.from_pretrained(spec), spec
    return model.to(dev), tok, name
