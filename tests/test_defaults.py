"""One source for every default (minference_fx.defaults): no config and ``default_config(model)`` run the same."""
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from minference_fx import search
from minference_fx.backend import recent_reports
from minference_fx.config import DEFAULT_DEFAULTS, default_config, load_config, model_identity_from_hf
from minference_fx.defaults import DEFAULTS, TUNED_CROSSOVER, Defaults
from minference_fx.options import BackendOptions
from minference_fx.plan import HeadPlan, Pattern
from tiny_models import reports_since

ROOT = Path(__file__).resolve().parents[1]
# the package's source folders (pyproject.toml's package-dir)
PACKAGE_DIRS = ("minference_fx", "passes", "autotune", "configs")
# files that still write the default budgets themselves, to be switched to minference_fx.defaults; remove a file
# from here once it reads DEFAULTS (the test then keeps it from writing them again)
PENDING = {
    "minference_fx/tools/demo.py",  # prose
    "minference_fx/tools/evaluate.py",  # prose
}


def _without_site_ids(code: str) -> str:
    """The rewritten graph's code less each op call's last argument, its process-unique routing site id."""
    return "\n".join(re.sub(r", \d+\)(?=;|$)", ", <site>)", line) if "sparse_attention.default(" in line else line
                     for line in code.splitlines())


def _compile_reports(model, ids, options):
    torch._dynamo.reset()
    before = recent_reports()
    with torch.no_grad():
        out = torch.compile(model, backend="minference", options={"inner": "eager", **options})(ids).logits
    return out, reports_since(before)


def test_no_config_and_default_config_compile_the_same():
    pytest.importorskip("transformers")
    from tiny_models import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    plain_out, plain = _compile_reports(model, ids, {})
    config = default_config(model_identity_from_hf(model.config))
    configured_out, configured = _compile_reports(model, ids, {"config": config})

    assert plain and len(plain) == len(configured)
    for a, b in zip(plain, configured):
        assert a.rewritten == len(a.rows) > 0
        assert a.rows == b.rows  # the plans, decisions and reasons, site by site
        assert (a.min_sparse_len, a.guard_threshold) == (b.min_sparse_len, b.guard_threshold) \
            == (DEFAULTS.min_sparse_len, DEFAULTS.guard_threshold) == (TUNED_CROSSOVER, 0.8)
        # the op's constant arguments: patterns, budgets, min_sparse_len, guard threshold
        assert "<site>)" in _without_site_ids(a.code_after)
        assert _without_site_ids(a.code_after) == _without_site_ids(b.code_after)
        head = DEFAULTS.head
        assert {r.plan for r in a.rows} == {f"4x{head.pattern.value}({head.budget_a},{head.budget_b})"}
    assert torch.equal(plain_out, configured_out)


def test_an_explicit_min_sparse_len_still_wins():
    ident = model_identity_from_hf({"model_type": "toy", "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "hidden_size": 64})
    assert default_config(ident).min_sparse_len == TUNED_CROSSOVER
    for n in (0, 1024, 8192):
        assert default_config(ident, min_sparse_len=n).min_sparse_len == n
    # the tuned crossover is a valid config value and survives the file
    cfg = default_config(ident)
    assert cfg.validate() == [] and load_config(json.loads(cfg.to_json())).min_sparse_len == TUNED_CROSSOVER
    # a file that leaves the defaults out gets DEFAULTS too
    doc = cfg.to_dict()
    doc["defaults"] = {}
    loaded = load_config(doc)
    assert (loaded.min_sparse_len, loaded.guard_threshold) == (DEFAULTS.min_sparse_len, DEFAULTS.guard_threshold)
    assert loaded.default_head.plan() == DEFAULTS.head
    # below -1 is still refused, in a config and in the options
    assert any("defaults.min_sparse_len" in p for p in default_config(ident, min_sparse_len=-2).validate())
    with pytest.raises(ValueError, match="min_sparse_len=-2"):
        BackendOptions.from_user({"min_sparse_len": -2})


def test_every_default_reads_defaults():
    assert isinstance(DEFAULTS, Defaults) and DEFAULTS.head == HeadPlan(Pattern.VERTICAL_SLASH, *DEFAULTS.budgets)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.guard_threshold = 0.5
    assert DEFAULT_DEFAULTS == {
        "min_sparse_len": DEFAULTS.min_sparse_len, "guard_threshold": DEFAULTS.guard_threshold,
        "guard_escalation": list(DEFAULTS.guard_escalation) or None,
        "budget_growth": list(DEFAULTS.budget_growth) or None,
        "default_head": {"pattern": DEFAULTS.head.pattern.value, "budgets": list(DEFAULTS.budgets)},
    }
    params = inspect.signature(default_config).parameters
    assert (params["pattern"].default, params["budgets"].default, params["min_sparse_len"].default) == \
        (DEFAULTS.head.pattern, DEFAULTS.budgets, DEFAULTS.min_sparse_len)
    assert inspect.signature(search.search).parameters["min_sparse_len"].default == DEFAULTS.min_sparse_len


def test_the_defaults_module_is_the_only_place_the_default_budgets_are_written():
    writers = set()
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "minference_fx/defaults.py" and "6096" in path.read_text(encoding="utf-8"):
                writers.add(rel)
    assert writers <= PENDING, f"write minference_fx.defaults.DEFAULTS instead of the budgets in {sorted(writers - PENDING)}"
    assert "6096" in (ROOT / "minference_fx" / "defaults.py").read_text(encoding="utf-8")
