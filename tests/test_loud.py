"""Issue 34, "failures are loud and short": a model that runs dense says so first (inspect, the CLI, the demo),
a config for another model is one line per kind of problem (not one per layer), and its fingerprint is
checked by torch.compile as load_config(model=) checks it."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from minference_fx import ConfigMismatchError, cli, inspect
from minference_fx.config import (
    Mismatch,
    ModelIdentity,
    _layer_ranges,
    check_fits,
    default_config,
    load_config,
    model_identity_from_hf,
    traced_model_identities,
)
from asset_helpers import fetch_or_skip


class Attn(torch.nn.Module):
    def __init__(self, causal: bool, heads: int = 2, dim: int = 16):
        super().__init__()
        self.causal, self.heads, self.dim = causal, heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], -1, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return out.transpose(1, 2).reshape(x.shape)


class Stack(torch.nn.Module):
    """``layers[i]``: one attention per layer, causal or bidirectional (which the backend leaves dense)."""

    def __init__(self, causal=(True, True)):
        super().__init__()
        self.layers = torch.nn.ModuleList(Attn(c) for c in causal)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class Stages(torch.nn.Module):
    """``stages[i].blocks[j]``: two list indices in every site's module path, so its config layer is not known."""

    def __init__(self):
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([Attn(True), Attn(True)])})
                                          for _ in range(3))

    def forward(self, x):
        for stage in self.stages:
            for block in stage["blocks"]:
                x = x + block(x)
        return x


X = torch.randn(1, 64, 32)


def _first_line(text: str) -> str:
    return text.splitlines()[0]


# -- inspect says first how much was rewritten ------------------------------------------------------------------


@pytest.mark.parametrize("causal,line", [
    ((True, True, True), "minference: 3 of 3 attention sites rewritten"),
    ((True, False, False), "minference: only 1 of 3 attention sites rewritten; the other 2 run dense"),
    ((False, False, False), "minference: 0 of 3 attention sites rewritten: the model runs dense"),
])
def test_inspect_says_first_how_many_sites_were_rewritten(causal, line):
    with torch.no_grad():  # with autograd on, a note under the line says the sites would stay dense
        result = inspect(Stack(causal), X, options={"inner": "eager"})
    assert result.rewritten == sum(causal)
    assert _first_line(str(result)) == _first_line(result.summary()) == line
    dense = len(causal) - sum(causal)
    if dense:  # the reason, with its count, under the summary line
        assert f"{dense} of 3: no mask and is_causal=False: bidirectional attention" in result.summary()
    else:
        assert result.summary() == line
    assert f"{sum(causal)}/3 attention sites rewritten" in str(result)  # each graph's own table keeps its count
    one = result.summary(one_line=True)
    assert "\n" not in one and one.startswith(line)


def test_a_model_without_attention_says_nothing_was_found():
    result = inspect(torch.nn.Linear(32, 32), X, options={"inner": "eager"})
    assert result.rewritten == 0
    assert _first_line(str(result)) == "minference: no attention site found: the model runs dense"


def test_the_summary_names_the_most_common_reasons_first_and_counts_the_rest():
    from minference_fx.report import SiteRow, summarize

    def row(i, decision, reason):
        return SiteRow(i, i, "", "sdpa", "", "causal", "-", decision, reason, "-")

    reasons = ["a"] * 5 + ["b"] * 3 + ["c"] * 2 + ["d", "e"]
    rows = [row(i, "dense", r) for i, r in enumerate(reasons)] + [row(99, "sparse", "rewritten")]
    text = summarize(rows)
    assert text.splitlines() == [
        "minference: only 1 of 13 attention sites rewritten; the other 12 run dense",
        "  5 of 13: a", "  3 of 13: b", "  2 of 13: c", "  2 more for 2 other reason(s): see the table"]


# -- the CLI exits 1 when nothing was rewritten -----------------------------------------------------------------


class _Config:
    vocab_size = 50


class TokenStack(torch.nn.Module):
    """What ``minference-fx inspect`` calls: ``model(ids, use_cache=False)`` with ``model.config.vocab_size``."""

    def __init__(self, causal):
        super().__init__()
        self.config = _Config()
        self.embed = torch.nn.Embedding(50, 32)
        self.stack = Stack(causal)

    def forward(self, ids, use_cache=False):
        return self.stack(self.embed(ids))


@pytest.mark.parametrize("causal,rc", [((True, True), 0), ((True, False), 0), ((False, False), 1)])
def test_cli_inspect_exits_1_when_no_site_is_rewritten(monkeypatch, capsys, causal, rc):
    monkeypatch.setattr(cli, "build_model", lambda *a, **k: TokenStack(causal))
    assert cli.main(["inspect", "--seq", "64", "--diff"]) == rc
    out, err = capsys.readouterr()
    done = sum(causal)
    assert _first_line(out).startswith(f"minference: {'only ' if 0 < done < 2 else ''}{done} of 2 attention sites")
    if rc:
        assert "no diff: no attention site was rewritten" in out
        # and once more, last, on stderr, in one line
        assert err.strip().splitlines()[-1].startswith("minference: 0 of 2 attention sites rewritten: the model runs dense; ")
    else:
        assert "+++ graph after" in out and "sparse_attention" in out


def test_cli_inspect_of_an_hf_family_the_backend_leaves_dense_exits_1(capsys):
    # Gemma-2's logit soft-capping (tanh on the scores) is a form the sparse op cannot compute, on every stack
    assert cli.main(["inspect", "--model", "gemma2", "--attn", "eager", "--seq", "80"]) == 1
    out = capsys.readouterr().out
    assert _first_line(out) == "minference: 0 of 2 attention sites rewritten: the model runs dense"
    assert "2 of 2: attention scores pass through tanh" in out


# -- a config mismatch is a line per kind of problem ------------------------------------------------------------


@pytest.mark.parametrize("layers,text", [
    ([4], "layer 4"), ([0, 1, 2, 5, 7, 8], "layers 0-2, 5, 7-8"), (range(30), "layers 0-29"),
    ([0, 2, 4, 6, 8, 10, 12], "layers 0, 2, 4, 6, 8, ... (7 layers)"),
])
def test_layer_ranges(layers, text):
    assert _layer_ranges(layers) == text


def test_the_same_mismatch_at_every_layer_is_one_line_with_a_count():
    problems = [Mismatch("config is for 32 layers, the model has 30")]
    for layer in range(30):
        where = {"layer": layer, "site": "integrations/sdpa_attention.py:96"}
        problems += [Mismatch("9 query heads, config has 32", **where), Mismatch("head dim 64, config has 128", **where)]
    err = ConfigMismatchError(problems)
    assert str(err) == ("semantic config does not fit the model: 3 problems:\n"
                        "  - config is for 32 layers, the model has 30\n"
                        "  - layers 0-29 (30 sites): 9 query heads, config has 32\n"
                        "  - layers 0-29 (30 sites): head dim 64, config has 128")
    # every site's mismatch is still there to read, one string each
    assert len(err.problems) == 61 and err.problems[1] == "layer 0 (integrations/sdpa_attention.py:96): 9 query heads, config has 32"
    # a lone site keeps its full line, and strings (check_fits) still work
    assert str(ConfigMismatchError([Mismatch("head dim 64, config has 128", layer=3, site="x.py:1")])) == \
        "semantic config does not fit the model: layer 3 (x.py:1): head dim 64, config has 128"
    assert str(ConfigMismatchError("fingerprint a differs")) == "semantic config does not fit the model: fingerprint a differs"


def test_a_long_list_of_different_mismatches_is_cut():
    err = ConfigMismatchError([Mismatch(f"problem {i}", layer=i) for i in range(20)])
    lines = str(err).splitlines()
    assert lines[0].endswith("20 problems:") and lines[-1] == "  - ... and 15 more" and len(lines) == 7


def test_the_backend_says_a_head_mismatch_once_for_all_layers():
    model = Stack((True,) * 6)
    config = default_config(ModelIdentity(num_layers=6, num_q_heads=4, num_kv_heads=4, head_dim=16), min_sparse_len=0)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception) as err:
        torch.compile(model, backend="minference", options={"config": config, "inner": "eager"})(X)
    message = str(err.value)
    assert message.count("query heads, config has 4") == 1, message
    assert "layers 0-5 (6 sites): 2 query heads, config has 4" in message


def test_an_ambiguous_module_path_is_one_line_for_every_site():
    config = default_config(ModelIdentity(num_layers=2, num_q_heads=2, num_kv_heads=2, head_dim=16), min_sparse_len=0)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception) as err:
        torch.compile(Stages(), backend="minference", options={"config": config, "inner": "eager"})(X)
    message = str(err.value)
    assert message.count("several list indices") == 1, message
    assert "semantic config does not fit the model: 6 sites, e.g. L['self'].stages" in message \
        or "semantic config does not fit the model: 6 sites, e.g. L['args'][0].stages" in message, message
    mismatch = next(e for e in (err.value, err.value.__cause__, getattr(err.value, "inner_exception", None))
                    if isinstance(e, ConfigMismatchError))
    assert len(mismatch.problems) == 6


# -- the fingerprint: torch.compile refuses what load_config(model=) refuses ------------------------------------


def _hf_llama():
    from minference_fx.tools.tiny import tiny_model

    return tiny_model("llama")


def _compile_call(model, config, ids):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="minference", options={"config": config, "inner": "eager"})(ids)


def test_a_config_for_another_model_of_the_same_shape_is_refused_by_the_backend_too():
    model = _hf_llama()
    ident = model_identity_from_hf(model.config)
    # same layers, heads and head dim: only the fingerprint (model type, vocabulary, hidden size) tells them apart
    other = model_identity_from_hf(dict(model.config.to_dict(), vocab_size=model.config.vocab_size * 2))
    assert other.fingerprint != ident.fingerprint
    config = default_config(other, min_sparse_len=0)
    with pytest.raises(ConfigMismatchError, match="fingerprint"):
        load_config(config, model=ident)
    ids = torch.randint(0, 128, (1, 48))
    with pytest.raises(Exception, match=f"config fingerprint {other.fingerprint} .*differs from the model's {ident.fingerprint}"):
        _compile_call(model, config, ids)
    # the model's own config, and a config that records no fingerprint, are accepted
    _compile_call(model, default_config(ident, min_sparse_len=0), ids)
    _compile_call(model, default_config(dataclasses.replace(other, fingerprint=""), min_sparse_len=0), ids)


def test_the_fingerprint_is_read_through_a_wrapper_module():
    class Wrapper(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids, use_cache=False).logits

    model = _hf_llama()
    ident = model_identity_from_hf(model.config)
    seen = []

    def capture(gm, example_inputs):
        seen.append(traced_model_identities(gm))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Wrapper(model), backend=capture)(torch.randint(0, 128, (1, 16)))
    assert seen and seen[0] == [ident]
    wrong = default_config(dataclasses.replace(ident, fingerprint="0123456789abcdef"), min_sparse_len=0)
    with pytest.raises(Exception, match="fingerprint 0123456789abcdef"):
        _compile_call(Wrapper(model), wrong, torch.randint(0, 128, (1, 16)))


def test_without_a_transformers_model_the_shape_is_what_is_checked():
    """A plain module has no fingerprint to compare: its config is checked on layers, heads and head dim, and a
    fingerprint in the config is no reason to refuse it (nor to warn)."""
    import warnings

    config = default_config(ModelIdentity(2, 2, 2, 16, name="llama", fingerprint="0123456789abcdef"), min_sparse_len=0)
    assert traced_model_identities(torch.fx.symbolic_trace(torch.nn.Linear(2, 2))) == []  # outside Dynamo: none
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compile_call(Stack((True, True)), config, X)
    with pytest.raises(Exception, match="head dim 16, config has 32"):
        _compile_call(Stack((True, True)), default_config(ModelIdentity(2, 2, 2, 32, fingerprint="0123456789abcdef"),
                                                          min_sparse_len=0), X)


def test_check_fits_still_counts_one_problem_per_field():
    with pytest.raises(ConfigMismatchError) as info:
        check_fits(default_config(ModelIdentity(32, 8, 8, 128, fingerprint="aaaa")), ModelIdentity(2, 4, 2, 128, fingerprint="bbbb"))
    assert len(info.value.problems) == 4 and str(info.value).count("\n") == 4


# -- the demo ---------------------------------------------------------------------------------------------------


def test_demo_steps_say_when_they_start_and_how_long_they_took():
    from minference_fx.tools import demo

    lines = []
    with demo._step(lines.append, "compile", "with backend='minference'"):
        pass
    with demo._step(lines.append, "density"):
        pass
    assert lines[0] == "compile with backend='minference' ..." and lines[2] == "density ..."
    assert all(line.startswith(("compile: ", "density: ")) and line.endswith(" s") for line in lines[1::2]), lines


def test_demo_main_exits_1_with_one_line_when_nothing_is_rewritten(monkeypatch, capsys):
    from minference_fx.tools import demo

    def dense(*a, **k):
        raise demo.NothingRewritten("minference: 0 of 30 attention sites rewritten: the model runs dense; 30 of 30: why")

    monkeypatch.setattr(demo, "run_demo", dense)
    assert demo.main(512, device="cpu") == 1
    err = capsys.readouterr().err.strip()
    assert err == "minference-fx demo: nothing to show, minference: 0 of 30 attention sites rewritten: the model runs dense; 30 of 30: why"


def test_demo_stops_after_the_inspection_when_nothing_is_rewritten(monkeypatch):
    """The real demo's first steps (SmolLM2 + Austen when they are cached): an inspection that finds nothing
    rewritten stops it before the minutes of prefills."""
    from minference_fx import inspection
    from minference_fx.tools import demo

    def dense_inspection(model, *args, **kwargs):
        return inspect(Stack((False, False)), X, options={"inner": "eager"})

    monkeypatch.setattr(inspection, "inspect", dense_inspection)
    monkeypatch.setattr(demo.evaluate, "greedy_answer", lambda *a, **k: pytest.fail("the demo went on to prefill"))
    lines = []

    def demo_stops():
        with pytest.raises(demo.NothingRewritten, match="^minference: 0 of 2 attention sites rewritten: the model runs dense; 2 of 2: "):
            demo.run_demo(256, device="cpu", progress=lines.append)

    fetch_or_skip(demo_stops)
    text = "\n".join(lines)
    assert "inspection (what the backend rewrites" in text and "minference: 0 of 2 attention sites rewritten" in text
    assert lines[0].startswith("loading SmolLM2") and lines[1].startswith("loading: ") and lines[1].endswith(" s")
    assert "inspection: " in text and "dense prefill" not in text


def test_inspect_of_something_not_callable_names_what_it_got():
    with pytest.raises(TypeError, match="minference_fx.inspect needs a callable model .*, got int"):
        inspect(42, X)


def test_inspect_with_autograd_on_says_the_sites_would_stay_dense():
    """inspect() traces under no_grad (a prefill's mode); called with autograd on, it says that a call made as
    it was would keep attention dense, rather than only reporting "sparse"."""
    import torch.nn.functional as F
    from minference_fx import inspect

    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    assert "stay dense" in inspect(Causal(), q, k, v).summary()
    with torch.no_grad():
        assert "stay dense" not in inspect(Causal(), q, k, v).summary()


def test_a_compiled_graph_with_no_site_rewritten_warns():
    import torch.nn.functional as F

    torch._dynamo.reset()
    with torch.no_grad(), pytest.warns(UserWarning, match="0 of 1 attention sites rewritten"):
        torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend="minference",
                      options={"inner": "eager"})(*(torch.randn(1, 2, 8, 4) for _ in range(3)))
