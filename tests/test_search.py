"""The offline search on a tiny random model: a valid config with provenance that the backend loads."""
import json

import pytest
import torch

from minference_fx import ConfigMismatchError, load_config
from minference_fx.config import check_fits, model_identity_from_hf
from minference_fx.search import search
from tiny_models import tiny_model


def _samples(n=2, length=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, length), generator=g) for _ in range(n)]


def test_search_writes_a_valid_config_the_backend_loads(tmp_path):
    model = tiny_model("llama")
    lines = []
    config = search(model, _samples(), data_name="random ids", seed=0, bound=0.2, progress=lines.append,
                    state_path=tmp_path / "state.json", min_sparse_len=0)
    assert config.validate() == []
    assert config.provenance.lengths == [200] and config.provenance.seed == 0
    assert "relative L2 error" in config.provenance.metric and config.provenance.date
    assert config.model.fingerprint == model_identity_from_hf(model.config).fingerprint
    assert len(lines) == 4  # 2 samples x 2 layers
    assert all(h.score is not None and h.score <= 0.2 for layer in config.layers for h in layer)
    path = tmp_path / "searched.json"
    config.save(path)
    ids = torch.randint(0, 128, (1, 150))
    compiled = torch.compile(model, backend="minference", options={"config": str(path), "inner": "aot_eager"})
    with torch.no_grad():
        assert torch.isfinite(compiled(ids, use_cache=False).logits).all()


def test_search_resumes_from_its_state(tmp_path):
    model = tiny_model("llama")
    state = tmp_path / "state.json"
    first = search(model, _samples(), data_name="x", state_path=state, progress=lambda s: None)
    assert len(json.loads(state.read_text())["done"]) == 4
    calls = []
    again = search(model, _samples(), data_name="x", state_path=state, progress=calls.append)
    assert calls == []  # nothing recomputed
    assert again.layers == first.layers


def test_a_tight_bound_keeps_dense_and_a_loose_one_picks_the_cheapest():
    model = tiny_model("llama")
    tight = search(model, _samples(1), data_name="x", bound=0.0, progress=lambda s: None)
    loose = search(model, _samples(1), data_name="x", bound=10.0, progress=lambda s: None)
    assert all(h.pattern.value == "dense" or h.score == 0.0 for layer in tight.layers for h in layer)
    assert all(h.pattern.value != "dense" for layer in loose.layers for h in layer)


def test_config_searched_for_one_model_is_refused_for_another(tmp_path):
    config = search(tiny_model("llama"), _samples(1), data_name="x", progress=lambda s: None)
    other = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ConfigMismatchError, match="layers"):
        check_fits(load_config(config.to_dict()), model_identity_from_hf(other.config))
