"""The backend's options: one frozen dataclass, validated once, all problems at once."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum
from typing import Any, Optional

from .config import SemanticConfig, load_config
from .defaults import TUNED_CROSSOVER
from .plan import MAX_BUDGET, is_budget_growth, is_escalation

# the modes of torch._inductor.list_mode_options(), written out so that reading the options imports no Inductor
_INDUCTOR_MODES = ("default", "lite", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int to Python, never a length or an offset


class Inner(str, Enum):
    INDUCTOR = "inductor"
    AOT_EAGER = "aot_eager"  # no codegen: fast, for tests
    EAGER = "eager"


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    config: Optional[SemanticConfig] = None
    """semantic config; None: every head ``minference_fx.defaults.DEFAULTS.head`` (MInference's default vertical-slash
    budgets), sparse from the tuned crossover, the default guard: what ``default_config(model)`` gives"""
    inner: Inner = Inner.INDUCTOR
    min_sparse_len: Optional[int] = None
    """prompts shorter than this run dense SDPA; -1: this GPU's tuned crossover; None: the config's value,
    or the tuned crossover without a config"""
    head_offset: Optional[int] = None
    """global index of this rank's first query head (tensor parallelism); None: read from the sharded query
    projection under HF tensor parallelism (``minference_fx.parallel``), else the graph holds every head, so each
    layer's head count must equal the config's. Given, it wins over what the sharding says"""
    inductor_config: dict = dataclasses.field(default_factory=dict)
    """extra Inductor config patches"""
    mode: Optional[str] = None
    """Inductor mode ("reduce-overhead", "max-autotune", ...): torch.compile refuses mode= together with
    options=, so it can travel here instead"""

    observer: Optional[int] = None
    """search mode: token from ``observe.register``; sites become dense observed attention"""

    guard_threshold: Optional[float] = None
    """a vertical-slash or block-sparse head whose estimated captured mass falls below this runs dense (0 turns the
    guard off); None: the config's value"""

    guard_escalation: Optional[tuple] = None
    """(columns, diagonals), e.g. MInference's default budgets: a vertical-slash head the guard finds weak first takes
    an index at least that large (built beside its own, chosen on the device) and runs dense only if that still
    keeps under the threshold; (): a weak head runs dense at once; None: the config's value (none without one)"""

    budget_growth: Optional[tuple] = None
    """(keys, exponent): past ``keys`` keys, vertical-slash and block-sparse budgets grow as (prompt keys / keys) **
    exponent (``plan.grown_plan``), e.g. (32768, 0.5) for a config searched at 32K; (): they stay as the plan says;
    None: the config's value (none without one)"""

    autotune: str = "off"
    """"off": a shape missing from the autotune cache runs a safe default (logged once); "on-miss": it is
    tuned on the GPU at its first call, once per process, and stored. Process-wide once turned on."""

    precompile: bool = True
    """on a GPU, JIT the sparse kernels in a background thread while Inductor compiles the graph (the first
    call waits for it); False: the first sparse call compiles them"""

    route_dense: bool = True
    """send the heads that ran dense at a site's previous call (near-dense index, guard) to the device's
    SDPA at its next call instead of the kernel's dense walk (``minference_fx.routing``); False: the index
    of each call alone decides"""

    int64_indexing: bool = True
    """Inductor indexes the kernels whose sizes grow with the prompt with int64 from the first compile
    (``minference_fx.indexing``), so a prompt past 2**31 elements of an activation does not recompile the
    graph; False: Inductor's own choice (int32 while the first prompt's sizes fit, a recompile past them)"""

    verify: bool = False
    """self-check (``minference_fx.verify``): each graph's first call also runs the traced graph and the rewritten
    one on the op's exact dense path, eagerly, and raises naming the first site whose output differs"""

    _KNOWN = ("config", "inner", "min_sparse_len", "head_offset", "inductor_config", "mode", "observer", "guard_threshold",
              "guard_escalation", "budget_growth", "autotune", "precompile", "route_dense", "int64_indexing", "verify")
    AUTOTUNE_POLICIES = ("off", "on-miss")

    @classmethod
    def from_user(cls, options: Optional[dict[str, Any]]) -> "BackendOptions":
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"minference backend options must be a dict, got {type(options).__name__} {options!r}"
                             " (a semantic config goes in as options={'config': path})")
        options = dict(options or {})
        problems = [f"unknown option {key!r} (known: {', '.join(cls._KNOWN)})" for key in options if key not in cls._KNOWN]
        inner = options.get("inner", Inner.INDUCTOR)
        try:
            inner = Inner(inner)
        except ValueError:
            problems.append(f"inner={inner!r}; expected one of {[i.value for i in Inner]}")
        min_len = options.get("min_sparse_len")
        if min_len is not None and (not _is_int(min_len) or min_len < TUNED_CROSSOVER):
            problems.append(f"min_sparse_len={min_len!r}; expected an int >= 0, or {TUNED_CROSSOVER} for the tuned crossover")
        head_offset = options.get("head_offset")
        if head_offset is not None and (not _is_int(head_offset) or head_offset < 0):
            problems.append(f"head_offset={head_offset!r}; expected an int >= 0")
        guard = options.get("guard_threshold")
        if guard is not None and (isinstance(guard, bool) or not isinstance(guard, (int, float)) or not 0.0 <= guard <= 1.0):
            problems.append(f"guard_threshold={guard!r}; expected a number in [0, 1]")
        escalation = options.get("guard_escalation")
        if escalation is not None and not is_escalation(escalation):
            problems.append(f"guard_escalation={escalation!r}; expected (columns, diagonals), two ints in "
                            f"[1, {MAX_BUDGET}], () for none, or None for the config's")
        growth = options.get("budget_growth")
        if growth is not None and not is_budget_growth(growth):
            problems.append(f"budget_growth={growth!r}; expected (keys, exponent), an int in [1, {MAX_BUDGET}] and a "
                            "number in (0, 1], () for none, or None for the config's")
        if options.get("autotune", "off") not in cls.AUTOTUNE_POLICIES:
            problems.append(f"autotune={options['autotune']!r}; expected one of {list(cls.AUTOTUNE_POLICIES)}")
        for flag in ("precompile", "route_dense", "int64_indexing", "verify"):
            if not isinstance(options.get(flag, True), bool):
                problems.append(f"{flag}={options[flag]!r}; expected True or False")
        if options.get("mode") is not None and options["mode"] not in _INDUCTOR_MODES:
            problems.append(f"mode={options['mode']!r}; expected one of {list(_INDUCTOR_MODES)}")
        if not isinstance(options.get("inductor_config", {}), dict):
            problems.append("inductor_config must be a dict of Inductor config patches")
        if inner in (Inner.EAGER, Inner.AOT_EAGER):  # neither runs Inductor, so either would do nothing
            problems += [f"{name}={options[name]!r} is an Inductor setting, and inner={inner.value!r} runs no Inductor"
                         for name in ("mode", "inductor_config") if options.get(name)]
        observer = options.get("observer")
        if observer is not None and not _is_int(observer):
            problems.append(f"observer={observer!r}; expected a token from minference_fx.observe.register")
        if problems:
            raise ValueError("minference backend options: " + "; ".join(problems))
        config = options.get("config")
        return cls(
            config=None if config is None else load_config(config),
            inner=inner,
            min_sparse_len=min_len,
            head_offset=head_offset,
            inductor_config=dict(options.get("inductor_config", {})),
            mode=options.get("mode"),
            observer=options.get("observer"),
            guard_threshold=None if guard is None else float(guard),
            guard_escalation=None if escalation is None else tuple(int(x) for x in escalation),
            budget_growth=None if growth is None else tuple(growth),
            autotune=options.get("autotune", "off"),
            precompile=options.get("precompile", True),
            route_dense=options.get("route_dense", True),
            int64_indexing=options.get("int64_indexing", True),
            verify=options.get("verify", False),
        )
