"""The ``minference`` torch.compile backend.

``minference_backend`` is the target of the ``torch_dynamo_backends`` entry
point; it is a plain function on purpose (registering it again under the same
name would make torch raise "duplicate name: minference").
"""
from __future__ import annotations

import collections
import logging
import re
import warnings
from typing import Optional

import torch
import torch.fx as fx
from torch._logging import trace_structured

from . import parallel, passes, precompile, verify
from .autotune import dispatch
from .config import ConfigMismatchError, Mismatch, SemanticConfig, traced_model_identities
from .defaults import DEFAULTS
from .indexing import int64_for_dynamic_sizes
from .options import BackendOptions, Inner
from .plan import LayerPlan
from .report import Report

log = logging.getLogger("minference_fx")
try:  # lets TORCH_LOGS=+minference_fx turn this logger on
    torch._logging._internal.register_log("minference_fx", "minference_fx")
except Exception:  # a torch without the private registry still logs through logging
    pass

# Recent reports, newest last; inspect() and the CLI read them.
_REPORTS: collections.deque[Report] = collections.deque(maxlen=64)

_SPARSE_OP = torch.ops.minference.sparse_attention.default

_LAYER_PARAM = re.compile(r"layers_modules_(\d+)_")


def recent_reports() -> list[Report]:
    return list(_REPORTS)


def _head_count(site) -> tuple[int, int, int]:
    q = site.query.meta["example_value"]
    k = site.key.meta["example_value"]
    return q.shape[1], k.shape[1], q.shape[-1]


def _model_layer_count(gm: fx.GraphModule, sites) -> int:
    """Layers of the traced model, from its parameter names (placeholders) and the sites."""
    indices = [int(m.group(1)) for n in gm.graph.nodes if n.op == "placeholder" for m in [_LAYER_PARAM.search(n.name)] if m]
    indices += [s.layer for s in sites if s.layer is not None]
    return max(indices) + 1 if indices else 0


def _model_query_heads(gm: fx.GraphModule, config: Optional[SemanticConfig]) -> Optional[int]:
    """The query heads of the whole model the graph comes from: its transformers config's, else the semantic
    config's (made for the whole model); None when neither says, or the traced models disagree."""
    heads = {identity.num_q_heads for identity in traced_model_identities(gm)}
    if not heads and config is not None:
        heads = {config.model.num_q_heads}
    return heads.pop() if len(heads) == 1 else None


def check_config_fits(config: SemanticConfig, gm: fx.GraphModule, sites, head_offset: Optional[int]) -> None:
    """Raise ConfigMismatchError naming every way the config does not fit this graph's sites that can be
    rewritten. A graph whose sites all stay dense uses no plan, so its layer count is not held against it: a
    graph break in the decoder stack (HF's sdpa with output_attentions=True, a hook) hands the backend graphs
    of a few layers that read the mask as an input. Layers numbered by call order (each layer compiled on its
    own) are still refused: they would all run layer 0's plan.

    The config's fingerprint (``model_identity_from_hf``: model type, vocabulary, hidden size and the shape)
    is checked against the transformers model the graph's parameters come from, looked up through Dynamo's
    traced frame (``config.traced_model_identities``); a config made for another model is refused as
    ``load_config(path, model=...)`` refuses it, in every graph with a site to rewrite (the fingerprint does not
    depend on which layers a graph holds; a graph without one, such as a vision tower's, takes nothing from the
    config), and it is accepted when any transformers model on the parameters' path matches
    (a config searched on a multimodal model's language model). Where no such model is found (a plain module
    or function, no transformers, a Dynamo whose frame API moved) the graph's layer count, head counts, GQA
    group and head dim below are all that can be compared, and are.

    Each problem is a ``Mismatch`` of its layer, so the message says one sentence per kind of problem with
    the layers it holds at, not one per layer."""
    model = config.model
    problems = []
    live = [s for s in sites if not s.blocker]
    if not live:  # no site takes the config here (a multimodal model's vision tower, traced as a frame of its own)
        return
    if model.fingerprint:
        traced = traced_model_identities(gm)
        if traced and model.fingerprint not in {t.fingerprint for t in traced}:
            this = traced[0]
            problems.append(Mismatch(
                f"config fingerprint {model.fingerprint} ({model.name or 'unnamed'}) differs from the model's "
                f"{this.fingerprint} ({this.name or 'unnamed'}, {this.num_layers} layers, {this.num_q_heads}/"
                f"{this.num_kv_heads} heads of {this.head_dim}): the config was made for another model"))
    layers = _model_layer_count(gm, sites)
    if live and layers and layers != model.num_layers:
        problems.append(Mismatch(f"config is for {model.num_layers} layers, the model has {layers}"))
    for site in live:
        if site.layer is None:
            continue
        if site.layer_from == passes.layers.AMBIGUOUS:
            path = passes.layers.module_path(site.node.meta.get("nn_module_stack"))
            problems.append(Mismatch("its module path has several list indices, so which config layer it is is "
                                     "not known", site=path or site.source or site.node.name))
            continue
        hq, hkv, dim = _head_count(site)
        where = {"layer": site.layer, "site": site.source or site.node.name}
        if head_offset is None and hq != model.num_q_heads:
            problems.append(Mismatch(f"{hq} query heads, config has {model.num_q_heads} (for one tensor-parallel "
                                     "rank's share of the heads, give options={'head_offset': its first head})", **where))
        elif head_offset is not None and head_offset + hq > model.num_q_heads:
            problems.append(Mismatch(f"query heads {head_offset}..{head_offset + hq - 1} exceed the config's "
                                     f"{model.num_q_heads}", **where))
        elif head_offset is not None and hkv and head_offset % (hq // hkv):
            problems.append(Mismatch(f"head_offset {head_offset} splits a GQA group of {hq // hkv} query heads: a "
                                     "rank holding whole kv heads starts at a multiple of it", **where))
        if hq // hkv != model.num_q_heads // model.num_kv_heads:
            problems.append(Mismatch(f"GQA group {hq // hkv}, config has {model.num_q_heads // model.num_kv_heads}", **where))
        if dim != model.head_dim:
            problems.append(Mismatch(f"head dim {dim}, config has {model.head_dim}", **where))
    if problems:
        raise ConfigMismatchError(problems)


def _inner_compile(inner: Inner, gm, example_inputs, mode, inductor_config, int64_indexing: bool = True):
    if inner == Inner.EAGER:
        return gm.forward
    if inner == Inner.AOT_EAGER:
        # here, not at the top: importing Dynamo's backend registry costs a second that `import minference_fx` and
        # the other inners do not pay (Dynamo has it loaded by the time a backend runs)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    # here, not at the top: importing Inductor costs seconds that `import minference_fx` and the eager inners do
    # not pay (options.py keeps it out of reading options too), and compile_fx is read at the call, where
    # tests/test_indexing.py replaces it
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {**list_mode_options(mode or "default"), **inductor_config}
    with int64_for_dynamic_sizes(int64_indexing):
        return compile_fx(gm, example_inputs, config_patches=patches or None)


def rewrite_graph(gm: fx.GraphModule, options: BackendOptions) -> Report:
    """Find, analyse and rewrite the attention sites of ``gm`` in place."""
    return _rewrite(gm, options)[0]


def _rewrite(gm: fx.GraphModule, options: BackendOptions) -> tuple[Report, list[verify.SiteCheck]]:
    """The report, and for each rewritten site what ``verify`` compares (node names before and after)."""
    code_before = gm.code
    sites = passes.analyse(gm)
    traced_names = [site.node.name for site in sites]
    unread = passes.stats(gm).unread  # analyse ran the unread stage on these sites
    config = options.config
    sites, share = parallel.read(gm, sites, derive=options.head_offset is None,
                                 model_heads=lambda: _model_query_heads(gm, config))
    head_offset = options.head_offset if options.head_offset is not None else share.first_head if share else None
    if share is not None and head_offset != share.first_head:  # the option wins; a mismatch is most likely a mistake
        log.warning("minference: head_offset=%d given, but the sharded weights say this rank's first query head is %d "
                    "(%s); using %d", head_offset, share.first_head, share.describe(), head_offset)
    if config is not None:
        check_config_fits(config, gm, sites, head_offset)
    min_len = _setting("min_sparse_len", options, config)

    plans: dict[int, LayerPlan] = {}
    index_of = {id(s.node): i for i, s in enumerate(sites)}

    def plan_for(site) -> LayerPlan:
        hq = _head_count(site)[0]
        if config is None:
            plan = LayerPlan((DEFAULTS.head,) * hq)
        else:
            plan = config.layer_plan(site.layer, head_offset or 0, hq)
        plans[index_of[id(site.node)]] = plan
        return plan

    guard = _setting("guard_threshold", options, config)
    escalation = _setting("guard_escalation", options, config)
    growth = _setting("budget_growth", options, config)
    sites = passes.apply(gm, sites, plan_for, min_len, options.observer, guard, options.route_dense, escalation, growth)
    report = Report.build(sites, plans, code_before, gm.code, min_len, guard, options.route_dense, tuple(unread),
                          share, head_offset or 0, escalation, growth)
    _publish(report)
    checks = [verify.SiteCheck(f"{i} (layer {site.layer}, {site.source or traced})", traced, site.node.name)
              for i, (site, traced) in enumerate(zip(sites, traced_names)) if not site.blocker]
    return report, checks


def _setting(name: str, options: BackendOptions, config):
    """Option ``name`` when given, else the config's value, else the default (``DEFAULTS``)."""
    value = getattr(options, name)
    if value is not None:
        return value
    return getattr(config if config is not None else DEFAULTS, name)


def _publish(report: Report) -> None:
    _REPORTS.append(report)
    needs_grad = sum(r.reason.startswith(passes.layout.NEEDS_GRAD) for r in report.rows)
    if needs_grad:
        # the report alone is easy to miss, and the model still runs (densely): say it where users look
        warnings.warn(f"minference: {needs_grad} attention site(s) traced with autograd on stay dense (the sparse "
                      "op is inference-only); run the prefill under torch.inference_mode() or torch.no_grad()",
                      stacklevel=2)
    log.info("minference: %d/%d attention sites rewritten\n%s", report.rewritten, len(report.rows), report.table())
    if report.rows and not report.rewritten and not any(r.reason.startswith(passes.layout.NEEDS_GRAD) for r in report.rows):
        # a model that silently runs dense is the failure users miss; one line, the report has the rest
        warnings.warn(report.summary(one_line=True), stacklevel=2)
    try:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "minference_fx_report", "encoding": "string"},
            payload_fn=lambda: report.table() + "\n\n" + report.diff(),
        )
    except Exception as exc:  # tlparse artifacts are a debugging aid; never fail a compile for them
        log.debug("trace_structured failed: %s", exc)


def minference_backend(gm: fx.GraphModule, example_inputs, *, mode=None, options=None):
    """torch.compile backend: rewrite causal attention to sparse, then hand over to ``options['inner']``."""
    opts = BackendOptions.from_user(options)
    if opts.autotune == "on-miss":
        dispatch.set_on_miss(True)
    traced = verify.snapshot(gm) if opts.verify else None
    report, checks = _rewrite(gm, opts)
    if opts.precompile and report.rewritten:
        precompile.start(n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SPARSE_OP)
    rewritten = verify.snapshot(gm) if opts.verify else None  # Inductor edits gm in place
    compiled = _inner_compile(opts.inner, gm, example_inputs, mode or opts.mode, opts.inductor_config, opts.int64_indexing)
    return verify.checked(compiled, traced, rewritten, checks) if opts.verify else compiled
