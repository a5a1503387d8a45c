"""``minference-fx demo``: SmolLM2 finds a needle in a long Austen prompt through the sparse backend.

``--model qwen2.5-coder-1.5b`` runs Qwen2.5-Coder-1.5B-Instruct instead (head dim 128; ten times the
parameters, so slow on a CPU). Everything below holds for either.

What it shows, in order: what the backend rewrote (the inspection table, under
its summary line), the answer of the dense and of the sparse model, the physical
density of each layer's sparse index, and dense vs sparse prefill time. Each long
step prints a line as it starts and its time as it ends. When the backend
rewrites no attention site it stops there, with a one-line reason and exit
status 1: a "sparse" run would be the dense model again.

The config is the shipped one searched for the model (``configs/``, matched by the
model's fingerprint), sparse from a quarter of the prompt so the short CPU prompt
runs the sparse path too; ``--config`` picks another. Without a shipped match it is
uniform vertical-slash with budgets scaled to the prompt (1/16 of its length each):
the backend's default (1000 columns, 6096 diagonals, dense below 8192) was set for
128K prompts and would read nearly every key, or not run sparse at all, here.

On a GPU the op runs the Triton kernels (Inductor compiles the rest). On CPU
it runs the pure-PyTorch reference, which computes masked dense attention, so
the CPU timings show the overhead of the index, not a speed-up.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import sys
import time
from typing import Callable, Optional

import torch

from .. import guard_stats, inspection
from ..backend import recent_reports
from ..config import SemanticConfig, default_config, load_config, model_identity_from_hf
from ..plan import Pattern
from ..report import summarize
from . import assets, evaluate, pick_device

# A made-up fact the model cannot know; at 2K the dense model retrieves it at depths 0.1, 0.5 and 0.9.
NEEDLE = " Mr. Knightley keeps the key of Donwell Abbey hidden inside a green teapot. "
QUESTION = ("\n\nQuestion: Where does Mr. Knightley keep the key of Donwell Abbey?\n"
            "Answer: Mr. Knightley keeps the key of Donwell Abbey hidden inside a")
EXPECTED = "green teapot"
DEPTH = 0.5
# " green teapot." is 3-4 tokens; a line break or a hyphen inside the answer takes a few more
ANSWER_TOKENS = 8

CPU_LENGTH = 2048  # ~1 min per sparse prefill on 2 CPU cores with the reference op
GPU_LENGTH = 8000  # inside SmolLM2's native 8K context (Qwen2.5-Coder's is 32K)


class NothingRewritten(RuntimeError):
    """The backend left every attention site dense: the "sparse" run would be the dense model again."""


@contextlib.contextmanager
def _step(progress: Callable[[str], None], name: str, detail: str = ""):
    """"name detail ..." as a long step starts and "name: 12.3 s" as it ends (nothing more if it fails)."""
    progress(f"{name} {detail} ..." if detail else f"{name} ...")
    start = time.perf_counter()
    yield
    progress(f"{name}: {time.perf_counter() - start:.1f} s")


def _words(text: str) -> str:
    # Austen's text wraps lines with hyphens, and the model imitates it ("tea-\npot"): join those first
    return " ".join(re.sub(r"-\s*\n\s*", "", text).split())


def found(expected: str, answer: str) -> bool:
    """``expected`` in ``answer`` up to whitespace and hyphenated line breaks (the model sometimes breaks
    the line mid-answer, as the novels' text does)."""
    return _words(expected) in _words(answer)


@dataclasses.dataclass
class LayerRow:
    layer: int
    density: float
    """mean over heads of the physical density (computed (i, j) pairs / causal pairs)"""
    recall: float
    """mean over heads of the dense attention mass the index keeps (last 64 rows)"""


@dataclasses.dataclass
class DemoResult:
    device: str
    dtype: str
    length: int
    config: str
    expected: str
    dense_answer: str
    sparse_answer: str
    dense_prefill_s: float
    sparse_prefill_s: float
    compile_s: float
    layers: list[LayerRow]
    guard: dict
    inspection: str
    rewrite_summary: str = ""
    """the inspection's summary line ("minference: 30 of 30 attention sites rewritten")"""

    @property
    def dense_pass(self) -> bool:
        return found(self.expected, self.dense_answer)

    @property
    def sparse_pass(self) -> bool:
        return found(self.expected, self.sparse_answer)

    def summary(self) -> str:
        density = sum(r.density for r in self.layers) / max(1, len(self.layers))
        lines = [self.rewrite_summary] if self.rewrite_summary else []
        lines += [
            f"answer (sparse): {self.sparse_answer.strip()!r}  -> {'found' if self.sparse_pass else 'MISSED'} {self.expected!r}",
            f"answer (dense):  {self.dense_answer.strip()!r}  -> {'found' if self.dense_pass else 'MISSED'} {self.expected!r}",
            f"prefill of {self.length} tokens on {self.device} ({self.dtype}): dense {self.dense_prefill_s:.2f} s, "
            f"sparse {self.sparse_prefill_s:.2f} s{self._speed_up()}; compile {self.compile_s:.1f} s",
            f"mean physical density {density:.3f} of the causal keys",
        ]
        if self.guard.get("heads_checked"):
            lines.append(f"quality guard: {self.guard['heads_forced_dense']} of {self.guard['heads_checked']} "
                         "checked head-calls (vertical-slash and block-sparse) ran dense (not counted in the density "
                         "above)")
        if self.device == "cpu":
            lines.append("note: on CPU the op is the pure-PyTorch reference (masked dense attention): the two times differ "
                         "by Inductor's code for the rest of the model and by one-off costs, not by sparsity; the "
                         "speed-up needs the Triton kernels on a GPU")
        return "\n".join(lines)

    def _speed_up(self) -> str:
        # a CPU ratio would read as the sparse speed-up, which the CPU's reference op cannot show
        return "" if self.device == "cpu" else f" (x{self.dense_prefill_s / self.sparse_prefill_s:.2f})"

    def layer_table(self) -> str:
        rows = [f"{'layer':>5}  {'density':>7}  {'recall':>6}"]
        rows += [f"{r.layer:>5}  {r.density:>7.3f}  {r.recall:>6.3f}" for r in self.layers]
        return "\n".join(rows)


def demo_config(model, length: int) -> SemanticConfig:
    """Uniform vertical-slash scaled to ``length``: 1/16 of it in columns and in diagonals."""
    budget = max(64, length // 16)
    return default_config(model_identity_from_hf(model.config), pattern=Pattern.VERTICAL_SLASH,
                          budgets=(budget, budget), min_sparse_len=max(1, length // 4))


def build_prompt(tokenizer, text: str, length: int, depth: float = DEPTH) -> torch.Tensor:
    """``[1, length]`` ids: Emma's opening chapters, the needle at ``depth`` (at a sentence start), the question."""
    return evaluate.haystack_prompt(tokenizer, text, length, NEEDLE, QUESTION, depth)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_prefill(run, ids, *, warm_up: bool = False) -> tuple[object, float]:
    """(output with KV cache, seconds) of one prefill, synchronised on the GPU.

    ``warm_up`` runs it once untimed first: on a GPU the first long call
    JIT-compiles the Triton kernels and picks cuDNN/flash plans.
    """
    if warm_up:
        with torch.no_grad():
            run(ids, use_cache=True)
    _sync(ids.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = run(ids, use_cache=True)
    _sync(ids.device)
    return out, time.perf_counter() - start


def _rewritten_since(before: list, what: str) -> None:
    """Raise NothingRewritten when the backend reports published after ``before`` rewrote no site."""
    new = [rep for rep in recent_reports() if not any(rep is old for old in before)]
    if new and not sum(rep.rewritten for rep in new):
        rows = [row for rep in new for row in rep.rows]
        raise NothingRewritten(f"{what}: {summarize(rows, tuple(n for rep in new for n in rep.unread), one_line=True)}")


def run_demo(length: Optional[int] = None, *, device: Optional[str] = None, config_path=None, inner: Optional[str] = None,
             progress: Callable[[str], None] = functools.partial(print, flush=True), model_name: str = "smollm2") -> DemoResult:
    """Each long step says when it starts and how long it took (through ``progress``). Raises NothingRewritten
    as soon as the inspection (or the compile) finds no site rewritten: there would be nothing sparse to show.
    ``model_name``: a name in :data:`assets.REAL_MODELS`.
    """
    if model_name not in assets.REAL_MODELS:
        raise ValueError(f"demo model {model_name!r}: expected one of {', '.join(assets.REAL_MODELS)}")
    real = assets.REAL_MODELS[model_name]
    dev = pick_device(device)
    on_gpu = dev.type == "cuda"
    length = length or (GPU_LENGTH if on_gpu else CPU_LENGTH)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    inner = inner or ("inductor" if on_gpu else "eager")
    yarn = real.yarn_factor(length)
    context = f"{real.trained_context // 1024}K"
    with _step(progress, "loading", f"{real.title} ({dtype}, {dev}{f', YaRN x{yarn:g} for >{context}' if yarn > 1 else ''}) "
               "and Jane Austen's novels"):
        model, tok = real.load(dtype=dtype, yarn_factor=yarn)
        model.to(dev)
        ids = build_prompt(tok, assets.austen_text(), length).to(dev)
    config_path = config_path or evaluate.shipped_config_for(model, longest=length)
    if config_path:
        config = load_config(config_path, model=model_identity_from_hf(model.config))
        config_name = str(config_path)
        if config.min_sparse_len < 0 or config.min_sparse_len > length // 4:  # -1: the GPU's tuned crossover
            # a searched config is often dense below 8K; the demo is about the sparse path
            config = dataclasses.replace(config, defaults={**config.defaults, "min_sparse_len": length // 4})
            config_name += f" (min_sparse_len lowered to {length // 4} for this prompt)"
    else:
        config = demo_config(model, length)
        head = config.default_head
        config_name = (f"uniform {head.pattern.value}{tuple(head.budgets)}, sparse from {config.min_sparse_len} "
                       f"tokens (scaled to the {length}-token prompt)")
    options = {"config": config, "inner": inner}

    progress(f"config: {config_name}\n")
    with _step(progress, "inspection", "(what the backend rewrites, traced on 128 tokens)"):
        with torch.no_grad():  # as the prefills below run (with autograd on, the report warns the sites stay dense)
            found = inspection.inspect(model, ids[:, :128], use_cache=False, options={**options, "inner": "eager"})
    table = str(found)
    progress(table + "\n")
    if not found.rewritten:  # before minutes of prefills that would compare the dense model with itself
        raise NothingRewritten(found.summary(one_line=True))

    with _step(progress, "dense prefill", f"of {length} tokens and its {ANSWER_TOKENS}-token answer"):
        evaluate.greedy_answer(model, ids[:, :64], new_tokens=1)  # warm-up: first-call allocations
        out, dense_s = timed_prefill(model, ids, warm_up=on_gpu)
        dense_answer = tok.decode(evaluate.decode_greedy(model, out, new_tokens=ANSWER_TOKENS))
        del out

    with _step(progress, "compile", f"with backend='minference' (inner={inner}; a 64-token call, dynamic length)"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="minference", options=options)
        # A short warm-up with a symbolic length compiles once for every length, so the timed prefill is no
        # recompile.
        warm = ids[:, :64].clone()
        torch._dynamo.mark_dynamic(warm, 1)
        reports = recent_reports()
        _, compile_s = timed_prefill(compiled, warm)
        _rewritten_since(reports, "the compiled model")
    with _step(progress, "sparse prefill", f"of {length} tokens and its {ANSWER_TOKENS}-token answer"):
        before = dataclasses.asdict(guard_stats())
        out, sparse_s = timed_prefill(compiled, ids, warm_up=on_gpu)
        after = dataclasses.asdict(guard_stats())
        sparse_answer = tok.decode(evaluate.decode_greedy(model, out, new_tokens=ANSWER_TOKENS))
        del out

    with _step(progress, "density", "per layer (from each layer's online index on the prompt's Q/K)"):
        heads = evaluate.index_recall(model, ids, config, rows=64)
    layers = []
    for layer, density in evaluate.layer_density(heads).items():
        rec = [h.recall for h in heads if h.layer == layer]
        layers.append(LayerRow(layer, density, sum(rec) / len(rec)))
    return DemoResult(str(dev), str(dtype).replace("torch.", ""), length, config_name, EXPECTED, dense_answer,
                      sparse_answer, dense_s, sparse_s, compile_s, layers,
                      {k: after[k] - before[k] for k in after}, table, found.summary().splitlines()[0])


def main(length=None, device=None, config_path=None, inner=None, model: str = "smollm2") -> int:
    try:
        result = run_demo(length, device=device, config_path=config_path, inner=inner, model_name=model)
    except NothingRewritten as e:  # one line, last: the reason there is no sparse run to show
        print(f"minference-fx demo: nothing to show, {e}", file=sys.stderr)
        return 1
    print("\n" + result.layer_table())
    print("\n" + result.summary())
    return 0 if result.sparse_pass or not result.dense_pass else 1
