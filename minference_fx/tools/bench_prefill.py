"""``minference-fx bench prefill``: end-to-end time to first token of a Llama-3-8B-shaped model.

The model is ``transformers.LlamaForCausalLM`` with Llama-3-8B's shape (hidden 4096, 32 query
heads, 8 KV heads, MLP 14336, vocab 128256, RoPE theta 500000; plain RoPE, not Llama-3.1's
scaled variant) and random weights initialised on the device in bf16 — nothing is downloaded.
``--layers`` keeps fewer layers when memory requires; the JSON says how many ran.

Time to first token (TTFT) is one forward of the whole prompt with ``use_cache=False`` and
logits for the last position only (``logits_to_keep=1``), then the argmax. Variants:

* ``eager``: HF with ``attn_implementation="sdpa"``, SDPA backends in the priority cuDNN, flash,
  efficient, math (``eager-default`` keeps torch's own priority);
* ``inductor``: ``torch.compile(model)`` (Inductor, default mode);
* ``minference``: ``torch.compile(model, backend="minference")`` with default options;
* ``minference-noguard``: the same with ``guard_threshold=0``. Random weights give diffuse
  attention, so the default quality guard (a vertical-slash head keeping under half of the
  last rows' attention mass runs dense) fires on most heads: ``minference`` then measures the
  guarded fallback, ``minference-noguard`` the sparse path itself. Real weights are sparser;
  ``guard`` in each minference cell says how often the guard fired;
* ``minference-noroute``: the same with ``route_dense=False``: heads that run dense (near-dense index,
  guard) take the kernel's dense walk at every call instead of being routed to cuDNN from the call after
  (``minference_fx.routing``); ``routed_heads`` in each minference cell counts the routed ones;
* ``minference-ro`` (``--reduce-overhead``): ``options={"mode": "reduce-overhead"}`` (CUDA graphs);
  ``inductor-ro``: ``torch.compile(model, mode="reduce-overhead")``;
* ``inductor-noattn``: not a model but a bound. ``torch.compile(model)`` with every attention replaced by
  ``q + k + v`` (K and V broadcast over the query heads of their group): the projections stay live, the
  attention costs one fused elementwise pass. Its TTFT is what the rest of the model costs under Inductor,
  so ``eager / inductor-noattn`` is the most any attention kernel in a compiled model could gain at a length.
  Its next token means nothing.

For compiled variants the sequence dimension of ``input_ids`` is marked dynamic, so one graph
should serve every length. ``recompiles`` counts graphs Dynamo compiled after the first call
(``torch._dynamo.utils.counters["stats"]["unique_graphs"]``); compile time is the first call's
wall time at the first length minus the steady-state TTFT at that length.

Compile times are only comparable from a cold start: by default (``isolate=True``) every variant
runs in its own Python process with fresh, empty Inductor and Triton cache directories, after a
tiny warm-up compile that pays the process-wide one-time costs (imports, compile workers), so
no variant inherits another's compiled kernels. ``isolate=False`` runs in-process (tests, CPU).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import contextlib
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch import profiler
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import guard_stats, routing
from ..autotune import cache, dispatch
from ..backend import recent_reports
from ..defaults import DEFAULTS
from ..config import default_config, model_identity_from_hf
from ..kernels import guard
from ..dense import NEAR_DENSE_STATS
from ..plan import HeadPlan, LayerPlan, Pattern
from . import assets, bench, forward_kwarg, pick_device
from .evaluate import CHARS_PER_TOKEN_ROOM, text_window_ids

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02,
)
VARIANTS = ("eager", "eager-default", "inductor", "inductor-ro", "minference", "minference-noguard", "minference-noroute",
            "minference-ro", "inductor-noattn")
DEFAULT_VARIANTS = ("eager", "inductor", "minference", "minference-noguard")
# the SDPA order eager runs under on a GPU (torch's default on Hopper, set explicitly so eager never depends on it)
CUDNN_FIRST = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


# ---------------------------------------------------------------- model


def llama3_8b_config(layers: int = 32, max_len: int = 131072, **overrides):
    import transformers  # optional: the [transformers] extra

    fields = {**LLAMA3_8B, "num_hidden_layers": layers, "max_position_embeddings": max(8192, max_len), **overrides}
    return transformers.LlamaConfig(**fields)


def build_model(config, device, dtype: torch.dtype, seed: int = 0):
    """Random-weight model created directly on ``device`` in ``dtype`` (HF's normal init, std 0.02)."""
    import transformers  # optional: the [transformers] extra

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def _last_logits_kwarg(model) -> dict:
    # {} on an old transformers: every position's logits (large at long prompts)
    return forward_kwarg(model, ("logits_to_keep", "num_logits_to_keep"), 1)


def prompt_ids(length: int, vocab: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return torch.randint(0, vocab, (1, length), generator=g).to(device)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """What one timed forward holds: ``batch`` prompts of the cell's length, and the mask ``generate`` would pass.

    With ``pad_fraction`` F > 0 the rows are left-padded as a serving batch of unequal prompts is: row r of B
    keeps ``n - round(F * n * r / (B - 1))`` tokens (row 0 the whole length, the last row (1 - F) of it), and
    gets ``generate``'s position ids (counting from its first real token)."""
    batch: int = 1
    attention_mask: bool = False
    pad_fraction: float = 0.0

    def __post_init__(self):
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if not 0.0 <= self.pad_fraction < 1.0:
            raise ValueError(f"pad_fraction must be in [0, 1), got {self.pad_fraction}")
        if self.pad_fraction > 0 and self.batch < 2:
            raise ValueError("pad_fraction needs batch >= 2: the first row always keeps the whole length")

    @property
    def masked(self) -> bool:
        return self.attention_mask or self.pad_fraction > 0

    def kept(self, length: int) -> list[int]:
        """Real tokens of each row at prompt length ``length``."""
        if self.pad_fraction == 0:
            return [length] * self.batch
        return [max(1, length - round(self.pad_fraction * length * r / (self.batch - 1))) for r in range(self.batch)]

    def describe(self) -> Optional[str]:
        """The results' ``attention_mask`` entry (None: no mask passed)."""
        if self.pad_fraction > 0:
            return f"left padding: row r of {self.batch} keeps n - {self.pad_fraction:g} * n * r / {self.batch - 1} tokens"
        return "all ones (as generate passes)" if self.attention_mask else None

    def inputs(self, make_row: Callable[[int, int], torch.Tensor], length: int) -> dict:
        """Forward keyword arguments: ``make_row(length, row)`` gives a ``[1, length]`` prompt."""
        ids = torch.cat([make_row(length, r) for r in range(self.batch)])
        if not self.masked:
            return {"input_ids": ids}
        mask = torch.ones_like(ids)
        for r, keep in enumerate(self.kept(length)):
            mask[r, :length - keep] = 0
        if self.pad_fraction == 0:
            return {"input_ids": ids, "attention_mask": mask}
        # as generate does: a left-padded row's positions count from its first real token
        position_ids = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "position_ids": position_ids}


# Real weights (assets.REAL_MODELS): the only ones available offline. YaRN stretches RoPE by a power of two
# over the trained context (SmolLM2 8K, Qwen2.5-Coder 32K) so that the longest prompt fits. Quality past
# the trained context is not the point here (eval measures that); the attention of a trained model has the
# structure random weights lack.
SMOLLM2 = "smollm2"
MODELS = ("llama3-8b-random", *assets.REAL_MODELS)


def build_real(name: str, max_len: int, device, dtype: torch.dtype):
    """(model, tokenizer) of the named real model, YaRN-stretched to ``max_len`` tokens when it is past its context."""
    real = assets.REAL_MODELS[name]
    model, tokenizer = real.load(dtype=dtype, yarn_factor=real.yarn_factor(max_len))
    return model.to(device).eval(), tokenizer


def build_smollm2(max_len: int, device, dtype: torch.dtype):
    return build_real(SMOLLM2, max_len, device, dtype)


def _is_model_dir(name: str) -> bool:
    """Whether ``name`` names a local HF model directory (a config.json in it) rather than a built-in model."""
    return os.path.isfile(os.path.join(name, "config.json"))


def build_local(path: str, device, dtype: torch.dtype):
    """(model, tokenizer or None) of the HF model directory ``path``, with SDPA attention; its own tokenizer
    when the directory has one (the prompt is then prose), else None (random token ids)."""
    import transformers  # optional: the [transformers] extra

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    return model.to(device).eval(), tokenizer


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def text_prompt_ids(tokenizer, length: int, seed: int, device) -> torch.Tensor:
    """``length`` tokens of Austen's novels from a seed-chosen start: real prose, as a user's prompt."""
    text = assets.austen_text()
    start = (seed * 104_729) % max(1, len(text) - length * CHARS_PER_TOKEN_ROOM)
    return text_window_ids(tokenizer, text, start, length).to(device)


# ---------------------------------------------------------------- variants


@dataclasses.dataclass
class Variant:
    name: str
    description: str
    fn: Callable
    compiled: bool
    cuda_graphs: bool = False
    minference_options: Optional[dict] = None
    restore: Optional[Callable[[], None]] = None
    """undoes what building the variant changed on the model (its attention implementation)"""


NO_ATTENTION = "minference_fx_no_attention"


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """An HF attention function that does no attention: ``q + k + v`` per query head, [B, S, H, D] as HF's
    attention functions return. Keeps Q, K and V live so that no projection is dead code."""
    b, h, s, d = query.shape
    group = h // key.shape[1]
    out = query.view(b, key.shape[1], group, s, d) + (key + value)[:, :, None]
    return out.view(b, h, s, d).transpose(1, 2), None


def _without_attention(model) -> Callable[[], None]:
    """Switch ``model`` to :func:`_no_attention`; returns what switches it back."""
    from transformers import AttentionInterface  # optional: the [transformers] extra

    AttentionInterface.register(NO_ATTENTION, _no_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(NO_ATTENTION)
    return lambda: model.set_attn_implementation(before)


def make_variant(name: str, model, minference_options: Optional[dict] = None) -> Variant:
    extra = dict(minference_options or {})
    cuda = next(model.parameters()).is_cuda

    def minference(options: dict, description: str, cuda_graphs=False) -> Variant:
        kwargs = {"options": options} if options else {}
        return Variant(name, description, torch.compile(model, backend="minference", **kwargs), True, cuda_graphs, options)

    if name == "eager":
        priority = "SDPA priority " + ", ".join(b.name for b in CUDNN_FIRST) if cuda else "CPU SDPA"
        return Variant(name, f"HF sdpa, no compile; {priority}", model, False)
    if name == "eager-default":
        return Variant(name, "HF sdpa, no compile; torch's SDPA priority", model, False)
    if name == "inductor":
        return Variant(name, "torch.compile(model) (Inductor, default mode)", torch.compile(model), True)
    if name == "inductor-ro":
        return Variant(name, 'torch.compile(model, mode="reduce-overhead")', torch.compile(model, mode="reduce-overhead"),
                       True, True)
    if name == "inductor-noattn":
        restore = _without_attention(model)
        return Variant(name, "torch.compile(model) with every attention replaced by q + k + v (a bound, not a model)",
                       torch.compile(model), True, restore=restore)
    if name == "minference":
        return minference(extra, f'torch.compile(model, backend="minference"{", options=" + repr(extra) if extra else ""})')
    if name == "minference-noguard":
        opts = {**extra, "guard_threshold": 0.0}
        return minference(opts, f'torch.compile(model, backend="minference", options={opts!r})')
    if name == "minference-noroute":
        opts = {**extra, "route_dense": False}
        return minference(opts, f'torch.compile(model, backend="minference", options={opts!r})')
    if name == "minference-ro":
        opts = {**extra, "mode": "reduce-overhead"}
        return minference(opts, f'torch.compile(model, backend="minference", options={opts!r})', cuda_graphs=True)
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")


_DEFAULT_SEMANTIC = f"default: every head vertical-slash {DEFAULTS.budgets}"
PATTERNS = ("vertical_slash", "a_shape")
"""what ``pattern`` may give every head with ``budgets``: vertical-slash (columns, diagonals) or A-shape (sink keys,
local window). A-shape at the default budgets keeps as many keys a row as the default vertical-slash budgets, all in two
contiguous runs: on random weights, whose slashes scatter over the whole row, it is the speed the default budgets
would give if the attention had the structure of a trained model's."""


def _every_head(pattern: str, budgets) -> str:
    return f"every head {pattern.replace('_', '-')} {budgets}"


def _with_semantic_config(variant: Variant, model, budgets: Optional[tuple], config_path: Optional[str],
                          pattern: str = "vertical_slash") -> Variant:
    """``variant`` (a minference one) compiled with a semantic config: the JSON at ``config_path``, or every head
    ``pattern`` with ``budgets`` and this GPU's tuned crossover. Other variants as they are."""
    if not variant.name.startswith("minference"):
        return variant
    if config_path is not None:
        options, said = {**(variant.minference_options or {}), "config": config_path}, f"config {config_path}"
    else:
        semantic = default_config(model_identity_from_hf(model.config), pattern=pattern, budgets=tuple(budgets))
        options = {"min_sparse_len": -1, **(variant.minference_options or {}), "config": semantic}
        said = f"{_every_head(pattern, tuple(budgets))}, tuned crossover"
    # mode= cannot go beside options= in torch.compile; reduce-overhead travels in the options already
    compiled = torch.compile(model, backend="minference", options=options)
    return dataclasses.replace(variant, fn=compiled, minference_options=options,
                               description=f"{variant.description}; {said}")


# ---------------------------------------------------------------- results


@dataclasses.dataclass
class Cell:
    length: int
    variant: str
    status: str = "ok"
    """ok | oom | error: ... | skipped: ..."""
    ttft_ms: Optional[float] = None
    """median of the timed repetitions"""
    times_ms: list = dataclasses.field(default_factory=list)
    first_call_s: Optional[float] = None
    """wall time of the first call at this length (compile included at the first length)"""
    next_token: Optional[int] = None
    row_tokens: Optional[list] = None
    """with --batch N: every row's greedy next token (next_token is row 0's)"""
    finite: Optional[bool] = None
    peak_gib: Optional[float] = None
    path: Optional[str] = None
    """minference: the op's branch at this length from the crossover ("sparse" or "dense")"""
    launch: Optional[str] = None
    """minference on the sparse path: the kernel's launch config (BLOCK_M/BLOCK_N/warps/stages) and, when
    this length's bucket is not tuned, whose it is"""
    guard: Optional[dict] = None
    """minference with the guard on: head-calls the guard checked / forced dense in one extra forward"""
    routed_heads: Optional[int] = None
    """minference: heads sent to SDPA by the routing at the last timed forward, summed over its sites"""


@dataclasses.dataclass
class VariantSummary:
    variant: str
    description: str = ""
    compiled: bool = False
    compile_s: Optional[float] = None
    first_call_s: Optional[float] = None
    graphs_first_call: Optional[int] = None
    recompiles: Optional[int] = None
    graph_breaks: Optional[int] = None
    cudagraph_skips: Optional[int] = None
    attention_kernels: Optional[dict] = None
    """attention ops and kernels (name: calls) in one profiled forward at the first length: which ran"""
    minference: Optional[dict] = None
    error: Optional[str] = None


@dataclasses.dataclass
class PrefillResult:
    meta: dict
    cells: list
    variants: list

    def cell(self, length: int, variant: str) -> Optional[Cell]:
        return next((c for c in self.cells if c.length == length and c.variant == variant), None)

    def summary(self, variant: str) -> Optional[VariantSummary]:
        return next((v for v in self.variants if v.variant == variant), None)

    def speedup(self, length: int, variant: str, baseline: str) -> Optional[float]:
        mine, base = self.cell(length, variant), self.cell(length, baseline)
        if mine is None or base is None or mine.ttft_ms is None or base.ttft_ms is None:
            return None
        return base.ttft_ms / mine.ttft_ms

    def to_dict(self) -> dict:
        lengths = sorted({c.length for c in self.cells})
        speedups = {str(n): {v.variant: {b: self.speedup(n, v.variant, b) for b in ("eager", "inductor")}
                             for v in self.variants} for n in lengths}
        return {**self.meta, "variants": [dataclasses.asdict(v) for v in self.variants],
                "cells": [dataclasses.asdict(c) for c in self.cells], "speedups": speedups}

    def save(self, path) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)
        os.replace(tmp, path)

    @staticmethod
    def load(path) -> "PrefillResult":
        with open(path) as fh:
            data = json.load(fh)
        cells = [Cell(**c) for c in data.pop("cells")]
        variants = [VariantSummary(**v) for v in data.pop("variants")]
        data.pop("speedups", None)
        return PrefillResult(data, cells, variants)

    def table(self) -> str:
        def f(x, spec):
            return format(x, spec) if x is not None else "-".rjust(int(spec.rstrip("dfs").split(".")[0]))

        head = (f"{'length':>8}  {'variant':<19} {'TTFT ms':>10} {'x eager':>8} {'x induct':>8} {'compile s':>9} "
                f"{'recompiles':>10} {'1st call s':>10}  note")
        lines = [head]
        order = {v: i for i, v in enumerate(VARIANTS)}
        for c in sorted(self.cells, key=lambda c: (c.length, order.get(c.variant, 99))):
            s = self.summary(c.variant) or VariantSummary(c.variant)
            notes = [] if c.status == "ok" else [c.status]
            if c.path:
                notes.append(c.path)
            if c.launch:
                notes.append(c.launch)
            if c.guard and c.guard.get("heads_checked"):
                notes.append(f"guard dense {c.guard['heads_forced_dense']}/{c.guard['heads_checked']}")
            if c.routed_heads:
                notes.append(f"routed {c.routed_heads}")
            if c.guard and c.guard.get("heads_listed"):
                notes.append(f"near-dense {c.guard['heads_near_dense']}/{c.guard['heads_listed']}")
            if c.finite is False:
                notes.append("non-finite logits")
            lines.append(
                f"{c.length:>8}  {c.variant:<19} {f(c.ttft_ms, '10.1f')} {f(self.speedup(c.length, c.variant, 'eager'), '8.2f')} "
                f"{f(self.speedup(c.length, c.variant, 'inductor'), '8.2f')} {f(s.compile_s, '9.1f')} "
                f"{f(s.recompiles, '10d')} {f(c.first_call_s, '10.2f')}  {'; '.join(notes)}")
        lines.append("TTFT: median forward of the prompt + argmax; x = baseline TTFT / this TTFT; compile s = first call "
                     "at the first length - its TTFT; recompiles: graphs compiled after the first call")
        for v in sorted(self.variants, key=lambda v: order.get(v.variant, 99)):
            m = v.minference
            if m:
                lines.append(f"{v.variant}: {m['rewritten']}/{m['sites']} attention sites rewritten in {m['graphs']} graph(s); "
                             f"min_sparse_len {m['min_sparse_len']} (resolved {m['min_sparse_len_resolved']}); "
                             f"guard_threshold {m['guard_threshold']}; guard_escalation {m.get('guard_escalation') or 'none'}; "
                             f"semantic config: "
                             f"{self.meta.get('semantic_config', _DEFAULT_SEMANTIC)}")
            if v.attention_kernels:
                names = [f"{k[:70]} x{n}" for k, n in list(v.attention_kernels.items())[:4]]
                lines.append(f"{v.variant}: attention ran as " + ", ".join(names))
            if v.cudagraph_skips:
                lines.append(f"{v.variant}: CUDA graphs skipped {v.cudagraph_skips} time(s)")
            if v.error:
                lines.append(f"{v.variant}: {v.error}")
        return "\n".join(lines)


# ---------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:  # Dynamo/Inductor may wrap the OOM
        seen.add(id(exc))
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _counter(group: str, key: Optional[str] = None) -> int:
    values = counters.get(group, {})
    return int(values.get(key, 0)) if key else int(sum(values.values()))


def _sdpa_context(variant: str, device: torch.device):
    if variant != "eager" or device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(CUDNN_FIRST), set_priority=True)


def warm_up_compiler(device: torch.device) -> None:
    """Pay Inductor's one-time process costs (imports, compile workers) outside any timed compile."""
    fn = torch.compile(lambda x: (x * 2).sin().sum(-1))
    fn(torch.randn(8, 16, device=device))
    torch._dynamo.reset()


# ---------------------------------------------------------------- one variant, in this process


def _minference_summary(reports, model, device, dtype, lengths, budgets: Optional[tuple] = None,
                        pattern: str = "vertical_slash") -> dict:
    rows = [r for rep in reports for r in rep.rows]
    option = reports[0].min_sparse_len if reports else None
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q = torch.empty(1, cfg.num_attention_heads, 1, head_dim, device=device, dtype=dtype)
    k = torch.empty(1, cfg.num_key_value_heads, 1, head_dim, device=device, dtype=dtype)
    # the plan every head runs (--budgets) sets the crossover of a device that has none tuned
    plan = LayerPlan((HeadPlan(Pattern(pattern), *budgets),)) if budgets else None
    resolved = dispatch.tuned_min_sparse_len(q, k, plan) if option is not None and option < 0 else option
    sparse_lengths = [n for n in lengths if resolved is not None and n >= resolved]
    return {
        "graphs": len(reports), "sites": len(rows), "rewritten": sum(r.decision == "sparse" for r in rows),
        "dense_reasons": dict(Counter(r.reason for r in rows if r.decision != "sparse")),
        "plans": dict(Counter(r.plan for r in rows if r.decision == "sparse")),
        "min_sparse_len": option, "min_sparse_len_resolved": resolved,
        "guard_threshold": reports[0].guard_threshold if reports else None,
        "guard_escalation": list(reports[0].guard_escalation) if reports else None,
        "budget_growth": list(reports[0].budget_growth) if reports else None,
        "path": {str(n): ("sparse" if n in sparse_lengths else "dense") for n in lengths},
        "launch": {str(n): _launch_config(q, k, n) for n in sparse_lengths} if device.type == "cuda" else {},
    }


def _launch_config(q: torch.Tensor, k: torch.Tensor, length: int) -> str:
    """The sparse kernel's launch config at ``length`` as the op's lookup answers it, and whose it is."""
    key = dispatch.tune_key("sparse_attention", q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1], length)
    entry, bucket = cache.resolve(key)
    text = f"launch {entry.BLOCK_M}/{entry.BLOCK_N}/{entry.num_warps}/{entry.num_stages}"
    if bucket is None:
        return text + " (untuned default)"
    return text if bucket == key.bucket else text + f" (tuned at {bucket})"


def _guard_probe(step, device: torch.device) -> dict:
    """One extra, untimed forward with the guard's and the near-dense counters on (on GPU they need a host
    sync per call), every site building its index (an all-routed one skips it at most calls)."""
    before, switch = guard_stats(), guard.STATS_ON_GPU
    near_before = dataclasses.replace(NEAR_DENSE_STATS)
    guard.STATS_ON_GPU = True
    try:
        with routing.ROUTER.index_at_every_call():
            step()
        _sync(device)
    finally:
        guard.STATS_ON_GPU = switch
    after = guard_stats()
    return {"calls": after.calls - before.calls, "heads_checked": after.heads_checked - before.heads_checked,
            "heads_forced_dense": after.heads_forced_dense - before.heads_forced_dense,
            "heads_listed": NEAR_DENSE_STATS.heads_checked - near_before.heads_checked,
            "heads_near_dense": NEAR_DENSE_STATS.heads_forced_dense - near_before.heads_forced_dense}


_ATTENTION_NAME = re.compile(r"attention|attn|flash|fmha|cudnn|sdpa|sparse|vertical|slash", re.IGNORECASE)


def _attention_kernels(step, device: torch.device, top: int = 12) -> dict:
    """Names and call counts of the attention ops and GPU kernels in one untimed, profiled forward."""
    activities = [profiler.ProfilerActivity.CPU] + ([profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiler.profile(activities=activities) as prof:
        step()
        _sync(device)
    found = {}
    for event in prof.key_averages():
        if _ATTENTION_NAME.search(event.key):
            found[event.key[:160]] = found.get(event.key[:160], 0) + int(event.count)
    return dict(sorted(found.items(), key=lambda kv: -kv[1])[:top])


def run_variant(model, name: str, lengths, *, reps: int = 3, warmup: int = 1, seed: int = 0,
                minference_options: Optional[dict] = None, guard_probe: bool = True, profile: bool = True,
                on_cell: Optional[Callable[[Cell], None]] = None,
                make_prompt: Optional[Callable[[int, int], torch.Tensor]] = None,
                budgets: Optional[tuple] = None, config_path: Optional[str] = None,
                prompts: PromptBatch = PromptBatch(), pattern: str = "vertical_slash") -> tuple[list, VariantSummary]:
    torch._dynamo.reset()
    routing.ROUTER.reset()  # one variant's routing decisions never reach the next (in-process runs)
    reports_before = {id(r) for r in recent_reports()}
    variant = make_variant(name, model, minference_options)
    try:
        return _run(variant, model, name, lengths, reps=reps, warmup=warmup, seed=seed, guard_probe=guard_probe,
                    profile=profile, on_cell=on_cell, make_prompt=make_prompt, budgets=budgets,
                    config_path=config_path, prompts=prompts, pattern=pattern, reports_before=reports_before)
    finally:
        if variant.restore:  # in-process runs: the next variant gets the model as it was
            variant.restore()


def _run(variant: Variant, model, name: str, lengths, *, reps, warmup, seed, guard_probe, profile, on_cell,
         make_prompt, budgets, config_path, prompts, pattern, reports_before) -> tuple[list, VariantSummary]:
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.config.vocab_size
    last = _last_logits_kwarg(model)
    if budgets is not None or config_path is not None:
        variant = _with_semantic_config(variant, model, budgets, config_path, pattern)
    summary = VariantSummary(name, variant.description, variant.compiled)
    graphs0, breaks0 = _counter("stats", "unique_graphs"), _counter("graph_break")
    skips0 = _counter("inductor", "cudagraph_skips")
    graphs_after_first = None
    oom_at = None
    cells = []
    for i, n in enumerate(lengths):
        cell = Cell(n, name)
        cells.append(cell)
        if oom_at is not None and n >= oom_at:
            cell.status = f"oom (skipped: out of memory at {oom_at})"
            if on_cell:
                on_cell(cell)
            continue
        # every row its own prompt (seed + row), as a batch of users' prompts is
        inputs = prompts.inputs(lambda n, row: make_prompt(n, seed + row) if make_prompt
                                else prompt_ids(n, vocab, seed + row, device), n)
        if variant.compiled:
            for t in inputs.values():
                torch._dynamo.mark_dynamic(t, 1)

        def step(inputs=inputs):
            if variant.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            logits = variant.fn(**inputs, use_cache=False, **last).logits[:, -1]  # left padding: every row's last is real
            return logits.argmax(-1), torch.isfinite(logits).all()

        try:
            with torch.inference_mode(), _sdpa_context(name, device):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                start = time.perf_counter()
                tokens, finite = step()
                _sync(device)
                cell.first_call_s = time.perf_counter() - start
                cell.next_token, cell.finite = int(tokens[0]), bool(finite)
                if prompts.batch > 1:
                    cell.row_tokens = tokens.tolist()
                if graphs_after_first is None:
                    graphs_after_first = _counter("stats", "unique_graphs")
                for _ in range(max(0, warmup - 1) + variant.cuda_graphs):  # CUDA graphs: warm-up, then record
                    step()
                cell.times_ms = [_time_ms(step, device) for _ in range(max(1, reps))]
                cell.ttft_ms = statistics.median(cell.times_ms)
                if name.startswith("minference"):
                    cell.routed_heads = routing.ROUTER.routed_count()
                if device.type == "cuda":
                    cell.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
                if (guard_probe and name.startswith("minference") and not variant.cuda_graphs
                        and (variant.minference_options or {}).get("guard_threshold", 1.0) > 0):
                    cell.guard = _guard_probe(step, device)
                if i == 0 and profile and not variant.cuda_graphs:
                    summary.attention_kernels = _attention_kernels(step, device)
        except Exception as exc:  # a cell that cannot run is reported, not fatal
            if _is_oom(exc):
                cell.status, oom_at = "oom", n if oom_at is None else min(oom_at, n)
            else:
                cell.status = f"error: {type(exc).__name__}: {exc}"[:500]
            cell.times_ms, cell.ttft_ms = [], None
            print(f"{name} at {n}: {cell.status[:300]}", flush=True)
        _free(device)
        if cell.status == "ok":
            print(f"{name:>19} {n:>8}: TTFT {cell.ttft_ms:.1f} ms, first call {cell.first_call_s:.2f} s", flush=True)
        if i == 0 and cell.ttft_ms is not None and variant.compiled:
            summary.first_call_s = cell.first_call_s
            summary.compile_s = max(0.0, cell.first_call_s - cell.ttft_ms / 1e3)
        if on_cell:
            on_cell(cell)
    if variant.compiled:
        graphs_end = _counter("stats", "unique_graphs")
        first = graphs_after_first if graphs_after_first is not None else graphs_end
        summary.graphs_first_call = first - graphs0
        summary.recompiles = graphs_end - first
        summary.graph_breaks = _counter("graph_break") - breaks0
        summary.cudagraph_skips = _counter("inductor", "cudagraph_skips") - skips0
    if name.startswith("minference"):
        reports = [r for r in recent_reports() if id(r) not in reports_before]
        summary.minference = _minference_summary(reports, model, device, dtype, lengths, budgets, pattern)
        for cell in cells:
            cell.path = summary.minference["path"].get(str(cell.length))
            cell.launch = summary.minference["launch"].get(str(cell.length))
    del variant
    torch._dynamo.reset()
    _free(device)
    return cells, summary


def _time_ms(step, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


# ---------------------------------------------------------------- the benchmark


def environment(device: torch.device) -> dict:
    import transformers  # optional: the [transformers] extra

    env = {**bench.environment(), "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    else:
        env["gpu"] = "none (cpu)"
    return env


def bench_prefill(lengths, *, layers: int = 32, variants=DEFAULT_VARIANTS, reduce_overhead: bool = False,
                  device=None, dtype: Optional[torch.dtype] = None, reps: int = 3, warmup: int = 1, seed: int = 0,
                  config_overrides: Optional[dict] = None, minference_options: Optional[dict] = None,
                  isolate: bool = True, cold_caches: bool = True, guard_probe: bool = True,
                  out=None, append: bool = False, command: Optional[str] = None,
                  model_name: str = "llama3-8b-random", budgets: Optional[tuple] = None,
                  config_path: Optional[str] = None, attention_mask: bool = False, batch: int = 1,
                  pad_fraction: float = 0.0, pattern: str = "vertical_slash") -> PrefillResult:
    """Time to first token of every variant at every length; a table via ``.table()``, JSON via ``out``.

    ``out`` is rewritten after every finished variant (every cell in-process), so a run cut
    short keeps what it measured. With ``append``, the variants already in ``out`` (same model
    shape and dtype) are kept and the ones run now replace theirs: a run too long for one job
    can be split by variant. ``config_overrides`` change the Llama-3-8B shape (tests use a tiny one).
    ``model_name="smollm2"`` or ``"qwen2.5-coder-1.5b"`` (:data:`assets.REAL_MODELS`) runs that model's real
    weights (all layers, YaRN to the longest length) on Austen's prose instead; ``layers`` and
    ``config_overrides`` do not apply.
    The minference variants run MInference's default budgets unless ``budgets`` (columns, diagonals: every
    head vertical-slash with those, this GPU's tuned crossover; ``pattern="a_shape"``: every head A-shape with
    ``budgets`` as (sink, window), see :data:`PATTERNS`) or ``config_path`` (a semantic config JSON) says.
    ``attention_mask``: every forward also gets an all-ones ``attention_mask``, as ``generate`` passes one.
    ``batch`` prompts of each length in one forward; ``pad_fraction`` > 0 left-pads them to unequal lengths
    (:class:`PromptBatch`), with the mask and position ids ``generate`` would pass. TTFT is the whole batch's.
    """
    prompts = PromptBatch(batch, attention_mask, pad_fraction)
    if budgets is not None and config_path is not None:
        raise ValueError("give budgets or a semantic config, not both")
    if budgets is not None and (len(budgets) != 2 or min(budgets) < 1):
        raise ValueError(f"budgets must be two positive ints (columns, diagonals), got {budgets!r}")
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    if pattern != "vertical_slash" and budgets is None:
        raise ValueError(f"pattern {pattern!r} needs budgets: the default ones are vertical-slash budgets")
    if config_path is not None:
        config_path = os.path.abspath(config_path)  # the variants' processes may run elsewhere
        if not os.path.isfile(config_path):
            raise ValueError(f"semantic config {config_path} does not exist")
    local = model_name not in MODELS and _is_model_dir(model_name)
    if model_name not in MODELS and not local:
        raise ValueError(f"unknown model {model_name!r}; known: {', '.join(MODELS)}, or a local HF model "
                         "directory (with its config.json)")
    if local:
        model_name = os.path.abspath(model_name)  # the variants' processes may run elsewhere
    real = assets.REAL_MODELS.get(model_name)
    device = pick_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    variants = list(dict.fromkeys([*variants, *(["minference-ro"] if reduce_overhead else [])]))
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    lengths = [int(n) for n in lengths]
    config = llama3_8b_config(layers, max(lengths), **(config_overrides or {}))
    meta = {
        "command": command or "bench_prefill(...)",
        **({} if isolate else environment(device)),  # isolated: the variants' processes report it (no CUDA here)
        "model": "LlamaForCausalLM, Llama-3-8B shape, random weights (std 0.02)" if not config_overrides
        else f"LlamaForCausalLM, random weights, overrides {config_overrides}",
        "device": str(device), "layers": layers, "layers_note": None if layers >= 32 else f"{layers} of Llama-3-8B's 32 layers",
        "config": {k: getattr(config, k, None)
                   for k in (*LLAMA3_8B, "rope_parameters", "num_hidden_layers", "max_position_embeddings")},
        "model_name": model_name,
        "dtype": str(dtype).removeprefix("torch."), "lengths": lengths, "variants_requested": variants,
        "reps": reps, "warmup": warmup, "seed": seed, "isolated_processes": isolate, "cold_caches": cold_caches and isolate,
        "minference_options": minference_options or {},
        "semantic_config": config_path or (_every_head(pattern, list(budgets)) if budgets else _DEFAULT_SEMANTIC),
        "use_cache": False, "logits": "last position only",
        "attention_mask": prompts.describe(), "batch": batch,
        "eager_sdpa_priority": [b.name for b in CUDNN_FIRST] if device.type == "cuda" else "cpu default",
        "memory_estimate_gib": None if config_overrides or real else memory_estimate_gib(layers, max(lengths), batch),
    }
    if real:
        meta.update(model=f"{real.title}, real weights, all {real.layers} layers",
                    layers=real.layers, layers_note=None, config={"yarn_factor": real.yarn_factor(max(lengths))},
                    prompt="Austen's novels (real prose), tokenized")
    if local:
        meta.update(_local_meta(model_name, max(lengths)), memory_estimate_gib=None)
    result = PrefillResult(meta, [], [])
    if append and out and os.path.exists(out):
        _take_earlier(result, PrefillResult.load(out), variants)

    def save():
        if out:
            result.save(out)

    if isolate:
        for name in variants:
            part = _run_child(name, dict(
                lengths=lengths, layers=layers, device=str(device), dtype=str(dtype).removeprefix("torch."), reps=reps,
                warmup=warmup, seed=seed, config_overrides=config_overrides, minference_options=minference_options,
                guard_probe=guard_probe, model_name=model_name, budgets=budgets, config_path=config_path,
                attention_mask=attention_mask, batch=batch, pad_fraction=pad_fraction, pattern=pattern),
                cold_caches, out)
            result.cells += part.cells
            result.variants += part.variants
            for key, value in part.meta.items():  # environment, model size: the same in every process
                meta.setdefault(key, value)
            save()
        return result

    if any(_needs_compile(v) for v in variants):
        warm_up_compiler(device)
    start = time.perf_counter()
    make_prompt = None
    if real:
        model, tokenizer = build_real(model_name, max(lengths), device, dtype)
        make_prompt = lambda n, row_seed: text_prompt_ids(tokenizer, n, row_seed, device)  # noqa: E731
    elif local:
        model, tokenizer = build_local(model_name, device, dtype)
        if tokenizer is not None:
            make_prompt = lambda n, row_seed: text_prompt_ids(tokenizer, n, row_seed, device)  # noqa: E731
    else:
        model = build_model(config, device, dtype, seed)
    meta["model_build_s"] = time.perf_counter() - start
    meta["parameters"] = sum(p.numel() for p in model.parameters())
    for name in variants:
        summary = VariantSummary(name)
        result.variants.append(summary)

        def on_cell(cell):
            result.cells.append(cell)
            save()

        try:
            _, done = run_variant(model, name, lengths, reps=reps, warmup=warmup, seed=seed,
                                  minference_options=minference_options, guard_probe=guard_probe, on_cell=on_cell,
                                  make_prompt=make_prompt, budgets=budgets, config_path=config_path,
                                  prompts=prompts, pattern=pattern)
            result.variants[result.variants.index(summary)] = done
        except Exception as exc:  # e.g. a compile that fails outright
            summary.error = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name}: {summary.error}", flush=True)
            torch._dynamo.reset()
        save()
    del model
    _free(device)
    return result


def _local_meta(path: str, longest: int) -> dict:
    """What the results say about a local model directory: its shape from config.json, and whether its
    tokenizer gives the prompt."""
    import transformers  # optional: the [transformers] extra

    config = transformers.AutoConfig.from_pretrained(path)
    text = getattr(config, "get_text_config", lambda: config)()
    layers = getattr(text, "num_hidden_layers", None)
    max_pos = getattr(text, "max_position_embeddings", None)
    return dict(
        model=f"{path} ({type(config).__name__}), its own weights, all {layers} layers",
        layers=layers, layers_note=None,
        config={k: getattr(text, k, None) for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                   "hidden_size", "max_position_embeddings")},
        prompt="Austen's novels through the model's tokenizer" if _has_tokenizer(path) else "random token ids (no tokenizer)",
        **({"length_note": f"prompts up to {longest} tokens, past max_position_embeddings {max_pos}"}
           if max_pos and longest > max_pos else {}),
    )


def _take_earlier(result: PrefillResult, earlier: PrefillResult, variants) -> None:
    """Keep ``earlier``'s variants that are not run now; refuse results of another model or dtype."""
    same = ("layers", "config", "dtype", "device", "semantic_config", "attention_mask", "batch")

    def canon(meta):
        # files from before semantic_config and batch were recorded ran the default budgets on one prompt
        defaults = {"semantic_config": _DEFAULT_SEMANTIC, "batch": 1}
        return json.dumps({k: meta.get(k, defaults.get(k)) for k in same},
                          sort_keys=True, default=str)

    if canon(json.loads(json.dumps(result.meta, default=str))) != canon(earlier.meta):
        raise ValueError(f"--append: the results already in the file are for another {'/'.join(same)}; "
                         "use another --out")
    result.meta["earlier_commands"] = [*earlier.meta.get("earlier_commands", []), earlier.meta.get("command")]
    result.cells += [c for c in earlier.cells if c.variant not in variants]
    result.variants += [v for v in earlier.variants if v.variant not in variants]


def _needs_compile(name: str) -> bool:
    return not name.startswith("eager")


def _run_child(name: str, spec: dict, cold_caches: bool, out) -> PrefillResult:
    """One variant in a fresh Python process (fresh, empty compile caches when ``cold_caches``)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-prefill-{name}-") as tmp:
        # beside --out, so that a job killed mid-variant still leaves that variant's finished cells
        spec_path, part_path = os.path.join(tmp, "spec.json"), f"{out}.{name}.part.json" if out else os.path.join(tmp, "r.json")
        if os.path.exists(part_path):  # an earlier job's, killed mid-variant: this child's cells must not be its
            os.remove(part_path)
            print(f"--- {name}: removed {part_path}, an earlier run's unfinished cells", flush=True)
        with open(spec_path, "w") as fh:
            json.dump({**spec, "variants": [name], "out": part_path}, fh)
        env = dict(os.environ)
        if cold_caches:
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
            env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
        print(f"--- {name}: own process" + (", empty Inductor/Triton caches" if cold_caches else ""), flush=True)
        rc = subprocess.run([sys.executable, "-m", "minference_fx.tools.bench_prefill", spec_path], env=env).returncode
        if os.path.exists(part_path):
            part = PrefillResult.load(part_path)
            os.remove(part_path)
        else:
            part = PrefillResult({}, [], [VariantSummary(name)])
        done = {c.length for c in part.cells}
        for n in spec["lengths"]:
            if n not in done:
                part.cells.append(Cell(n, name, status=f"error: the variant's process exited with {rc} before this length"))
        if rc != 0:
            for v in part.variants:
                v.error = v.error or f"the variant's process exited with {rc}"
        if not part.variants:
            part.variants = [VariantSummary(name, error=f"the variant's process exited with {rc}")]
        return part


def _child_main(spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    bench_prefill(spec["lengths"], layers=spec["layers"], variants=spec["variants"], device=spec["device"],
                  dtype=getattr(torch, spec["dtype"]), reps=spec["reps"], warmup=spec["warmup"], seed=spec["seed"],
                  config_overrides=spec["config_overrides"], minference_options=spec["minference_options"],
                  guard_probe=spec["guard_probe"], isolate=False, out=spec["out"],
                  model_name=spec.get("model_name", "llama3-8b-random"), budgets=spec.get("budgets"),
                  config_path=spec.get("config_path"), attention_mask=spec.get("attention_mask", False),
                  batch=spec.get("batch", 1), pad_fraction=spec.get("pad_fraction", 0.0),
                  pattern=spec.get("pattern", "vertical_slash"))
    return 0


def memory_estimate_gib(layers: int, length: int, batch: int = 1) -> dict:
    """Rough bf16 sizes: weights, and the largest per-layer activations of ``batch`` prompts of ``length``."""
    cfg = LLAMA3_8B
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] / cfg["num_attention_heads"]
    per_layer = int((2 + 2 * kv) * h * h) + 3 * h * cfg["intermediate_size"]
    weights = 2 * (layers * per_layer + 2 * cfg["vocab_size"] * cfg["hidden_size"])
    tokens = batch * length
    return {"weights": weights / 2**30, "hidden": 2 * cfg["hidden_size"] * tokens / 2**30,
            "mlp_intermediate": 2 * cfg["intermediate_size"] * tokens / 2**30,
            "hf_compiled_mask_bool": batch * length * length / 2**30}


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].endswith(".json"):
        sys.exit("usage: python -m minference_fx.tools.bench_prefill SPEC.json (internal; use `minference-fx bench prefill`)")
    sys.exit(_child_main(sys.argv[1]))
