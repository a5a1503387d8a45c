"""``options={"verify": True}``: the first call of each graph checks the rewrite against the traced model."""
import pytest
import torch
import torch.nn.functional as F

from minference_fx import verify
from minference_fx.backend import recent_reports
from minference_fx.passes import rewrite
from tiny_models import tiny_model


def _compiled(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="minference", dynamic=True,
                         options={"inner": "eager", "min_sparse_len": 0, "verify": True, **options})


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_verify_passes_a_correct_rewrite_and_the_logits_are_eager_ones(family, use_cache):
    model = tiny_model(family).eval()
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        got = _compiled(model)(ids, use_cache=use_cache).logits
        want = model(ids, use_cache=use_cache).logits
    # with nothing rewritten, verify would have nothing to check: both of the model's sites must be the op's
    assert recent_reports()[-1].rewritten == 2, recent_reports()[-1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_verify_catches_a_wrong_rewrite_and_names_the_site(monkeypatch):
    """A pass bug injected here (every site's queries read 5 positions further on than they are) is caught at
    the first call, naming the first site, instead of returning wrong logits."""
    monkeypatch.setattr(rewrite, "_q_offset_arg", lambda graph, info, keys: 5)
    model = tiny_model("llama").eval()
    with torch.no_grad(), pytest.raises(verify.VerifyError, match=r"attention site 0 \(layer 0, .*\) differs .* max abs error"):
        _compiled(model)(torch.randint(0, 128, (1, 40)), use_cache=False)


def test_verify_catches_a_wrong_rewrite_of_a_plain_module(monkeypatch):
    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    monkeypatch.setattr(rewrite, "_q_offset_arg", lambda graph, info, keys: -3)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    with pytest.raises(verify.VerifyError, match="attention site 0"):
        _compiled(Causal())(q, k, v)


def test_verify_checks_a_site_rewritten_by_an_earlier_pass_at_the_graph_outputs(monkeypatch):
    """The einsum pass writes its site before the rewrite, so only the graph's outputs can show it wrong; the
    output check compared the last checked site's attention output instead, never paired up and let it pass."""
    class EinsumThenSdpa(torch.nn.Module):
        def forward(self, q, k, v):
            n = q.shape[-2]
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            first = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)
            return (first + F.scaled_dot_product_attention(q, k, v, is_causal=True)).transpose(1, 2).flatten(2)

    real, calls = rewrite._q_offset_arg, []

    def first_site_reads_ahead(graph, info, keys):
        calls.append(info)
        return 5 if len(calls) == 1 else real(graph, info, keys)

    monkeypatch.setattr(rewrite, "_q_offset_arg", first_site_reads_ahead)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    with torch.no_grad(), pytest.raises(verify.VerifyError, match="graph output 0 differs"):
        _compiled(EinsumThenSdpa())(q, k, v)


def test_verify_leaves_an_input_the_graph_writes_as_the_caller_gave_it():
    """Both checked copies ran on the caller's tensors, so a counter (or a cache's length) advanced three times."""
    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, q, k, v):
            self.calls.add_(1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True) * self.calls

    model = Counted()
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    with torch.no_grad():
        out = _compiled(model)(q, k, v)
    assert model.calls.item() == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_verify_checks_only_the_first_call(monkeypatch):
    calls = []
    monkeypatch.setattr(verify, "check", lambda *args: calls.append(args))
    model = tiny_model("llama").eval()
    compiled = _compiled(model)
    with torch.no_grad():
        for n in (40, 40, 56):
            compiled(torch.randint(0, 128, (1, n)), use_cache=False)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype,error,caught", [(torch.float32, 1e-2, True), (torch.float32, 1e-6, False),
                                                 (torch.bfloat16, 1e-3, False), (torch.bfloat16, 0.5, True)])
def test_tolerance_follows_the_dtype(dtype, error, caught):
    want = torch.linspace(-1, 1, 64).to(dtype)
    got = (want.float() + error).to(dtype)
    assert bool(verify.mismatch(got, want)) == caught


def test_a_nan_the_traced_model_does_not_have_is_a_mismatch():
    want = torch.zeros(4)
    assert "NaN" in verify.mismatch(torch.tensor([0.0, float("nan"), 0.0, 0.0]), want)


def test_verify_option_must_be_a_bool():
    with pytest.raises(Exception, match="verify=.yes.; expected True or False"):  # Dynamo wraps backend errors
        torch.compile(lambda x: x + 1, backend="minference", options={"verify": "yes"})(torch.randn(2))
