import dataclasses
import json

import pytest

from minference_fx.config import (
    ConfigError,
    ConfigMismatchError,
    HeadEntry,
    ModelIdentity,
    Provenance,
    SemanticConfig,
    check_fits,
    default_config,
    import_minference_best_pattern,
    load_config,
    model_identity_from_hf,
)
from minference_fx.plan import HeadPlan, LayerPlan, Pattern, escalation_arguments, escalation_of

MODEL = ModelIdentity(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=16, name="toy", fingerprint="abc123")


def mixed_config() -> SemanticConfig:
    patterns = [
        HeadEntry(Pattern.VERTICAL_SLASH, (1000, 6096), 0.25),
        HeadEntry(Pattern.A_SHAPE, (128, 2048), 1.0),
        HeadEntry(Pattern.BLOCK_SPARSE, (100, 0), None),
        HeadEntry(Pattern.DENSE, (0, 0), 7.0),
    ]
    layers = [[patterns[(li + hi) % 4] for hi in range(4)] for li in range(3)]
    return SemanticConfig(
        model=MODEL,
        layers=layers,
        defaults={"min_sparse_len": 4096},
        provenance=Provenance(
            tool_version="test", calibration_data="toy text", lengths=[4096, 8192], seed=3, metric="recall", date="2025-01-01"
        ),
    )


def test_round_trip_equal_and_byte_identical(tmp_path):
    cfg = mixed_config()
    assert cfg.validate() == []
    first = tmp_path / "a.json"
    cfg.save(first)
    loaded = load_config(first)
    assert loaded == cfg
    assert loaded.layers[0][1].pattern is Pattern.A_SHAPE
    assert loaded.min_sparse_len == 4096
    assert loaded.guard_threshold == 0.8  # not in mixed_config's defaults: the default's
    second = tmp_path / "b.json"
    loaded.save(second)
    assert first.read_bytes() == second.read_bytes()
    # Loading from the parsed dict and from the object itself gives the same config.
    assert load_config(json.loads(first.read_text())) == cfg
    assert load_config(cfg) is cfg
    assert not list(tmp_path.glob(".*.tmp"))


def test_with_guard_threshold_copies_and_validates():
    cfg = default_config(MODEL)
    half = cfg.with_guard_threshold(0.5)
    assert half.guard_threshold == 0.5 and cfg.guard_threshold == 0.8 and half.layers == cfg.layers
    with pytest.raises(ConfigError, match=r"guard_threshold must be a number in \[0, 1\]"):
        cfg.with_guard_threshold(1.5)


@pytest.mark.parametrize("bad", [[1000], [0, 6096], [True, 6096], "1000,6096", [1000, 2**31], []])
def test_guard_escalation_default_is_two_budgets_or_null(bad):
    doc = mixed_config().to_dict()
    assert doc["defaults"]["guard_escalation"] is None and load_config(doc).guard_escalation == ()
    doc["defaults"]["guard_escalation"] = [1000, 6096]
    assert load_config(doc).guard_escalation == (1000, 6096)
    built = SemanticConfig(model=MODEL, layers=mixed_config().layers, defaults={"guard_escalation": (512, 2048)})
    assert built.validate() == [] and load_config(built.to_dict()) == built  # a tuple in memory, a list in JSON
    doc["defaults"]["guard_escalation"] = bad
    with pytest.raises(ConfigError, match=r"defaults.guard_escalation must be \[columns, diagonals\]"):
        load_config(doc)


@pytest.mark.parametrize("escalation, arguments", [((), (0, 0)), ((1000, 6096), (1000, 6096))])
def test_escalation_budgets_and_the_ops_arguments_round_trip(escalation, arguments):
    # the op takes (0, 0) for no escalation; the rewrite pass and bench kernels both pass it through this pair
    assert escalation_arguments(escalation) == arguments
    assert escalation_of(*arguments) == escalation


def test_defaults_filled():
    cfg = default_config(MODEL)
    assert cfg.defaults["min_sparse_len"] == -1  # this GPU's tuned crossover, as without a config
    assert cfg.defaults["guard_threshold"] == 0.8
    assert cfg.default_head == HeadEntry(Pattern.VERTICAL_SLASH, (1000, 6096), None)


def test_save_overwrites_and_refuses_invalid(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("old")
    cfg = mixed_config()
    cfg.save(path)
    assert load_config(path) == cfg
    bad = dataclasses.replace(cfg, schema_version=9)
    with pytest.raises(ConfigError):
        bad.save(path)
    assert load_config(path) == cfg  # the good file was left in place


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda c: setattr(c, "schema_version", 2), "schema_version"),
        (lambda c: c.layers.pop(), "config has 2 layers, model.num_layers is 3"),
        (lambda c: c.layers[1].pop(), "layer 1 has 3 heads"),
        (lambda c: c.layers[2].__setitem__(3, HeadEntry(Pattern.A_SHAPE, (-1, 10))), "layer 2 head 3: negative budget"),
        (lambda c: c.layers[1].__setitem__(0, HeadEntry(Pattern.A_SHAPE, (64, 0))),
         "layer 1 head 0: an A-shape head's local window must be >= 1"),
        (lambda c: c.layers[0].__setitem__(2, HeadEntry("diagonal_only", (1, 1))), "layer 0 head 2: unknown pattern 'diagonal_only'"),
        (lambda c: c.layers[0].__setitem__(0, HeadEntry(Pattern.VERTICAL_SLASH, (1, 2, 3))), "budgets must be two integers"),
        (lambda c: setattr(c, "model", dataclasses.replace(c.model, num_kv_heads=3)), "not a multiple of model.num_kv_heads"),
        (lambda c: c.defaults.__setitem__("min_sparse_len", -5), "defaults.min_sparse_len"),
        (lambda c: c.defaults.__setitem__("default_head", {"pattern": "nope", "budgets": [1, 2]}), "defaults.default_head"),
    ],
)
def test_validate_catches_each_problem(mutate, expected):
    cfg = mixed_config()
    mutate(cfg)
    problems = cfg.validate()
    assert any(expected in p for p in problems), problems


def test_load_of_invalid_file_lists_every_problem(tmp_path):
    doc = json.loads(mixed_config().to_json())
    doc["schema_version"] = 7
    doc["layers"][0][1]["budgets"] = [-3, 5]
    doc["layers"][1][2]["pattern"] = "sliding"
    doc["layers"][2].pop()
    doc["model"]["num_kv_heads"] = 3
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert len(err.problems) == 5, err.problems
    message = str(err)
    for fragment in ("schema_version", "layer 0 head 1: negative budget", "'sliding'", "layer 2 has 3 heads", "num_kv_heads"):
        assert fragment in message
    assert str(path) in message


def test_load_rejects_missing_and_misspelt_keys():
    doc = json.loads(mixed_config().to_json())
    doc["defualts"] = doc.pop("defaults")
    del doc["model"]["head_dim"]
    doc["layers"][0][0] = {"pattern": "dense"}
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    message = str(info.value)
    assert "'defualts'" in message
    assert "model.head_dim is missing" in message
    assert "layer 0 head 0: missing budgets" in message


def test_load_partial_layer_uses_default_head():
    doc = json.loads(default_config(MODEL, pattern=Pattern.A_SHAPE, budgets=(64, 1024)).to_json())
    doc["layers"][1] = {"2": {"pattern": "block_sparse", "budgets": [8, 0], "score": None}}
    cfg = load_config(doc)
    assert [e.pattern for e in cfg.layers[1]] == [Pattern.A_SHAPE, Pattern.A_SHAPE, Pattern.BLOCK_SPARSE, Pattern.A_SHAPE]
    assert cfg.layers[1][0].budgets == (64, 1024)


def test_load_refuses_best_pattern_file(tmp_path):
    path = tmp_path / "best_pattern.json"
    path.write_text(json.dumps([{"0": ["vertical_and_slash", 1000, 6096, 1]}]))
    with pytest.raises(ConfigError, match="import_minference_best_pattern"):
        load_config(path)


def test_load_bad_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)


def test_check_fits_names_mismatches():
    cfg = default_config(ModelIdentity(32, 8, 8, 128, fingerprint="aaaa"))
    with pytest.raises(ConfigMismatchError) as info:
        check_fits(cfg, ModelIdentity(2, 4, 2, 128, fingerprint="bbbb"))
    message = str(info.value)
    assert "config is for 32 layers, model has 2" in message
    assert "config has 8 query heads per layer, model has 4" in message
    assert "8 KV heads, model has 2" in message
    assert "fingerprint aaaa differs" in message
    assert "head dim" not in message
    assert isinstance(info.value, ConfigError) and len(info.value.problems) == 4


def test_check_fits_ignores_missing_fingerprint():
    cfg = default_config(ModelIdentity(2, 4, 2, 16))
    check_fits(cfg, ModelIdentity(2, 4, 2, 16, fingerprint="abc"))
    with pytest.raises(ConfigMismatchError, match="fingerprint"):
        check_fits(default_config(ModelIdentity(2, 4, 2, 16, fingerprint="x")), ModelIdentity(2, 4, 2, 16, fingerprint="y"))
    with pytest.raises(ConfigMismatchError):
        load_config(cfg.to_dict(), model=ModelIdentity(3, 4, 2, 16))


BEST_PATTERN = [
    {
        "0": ["vertical_and_slash", 1000, 6096, 336],
        "1": ["stream_llm", 100, 800, 0.5],
        "2": ["block_sparse", 30, 800, 0.9],
        "3": ["vertical_and_slash", 30, 800, 185169],
    },
    {
        "0": ["vertical_and_slash", 3500, 100, 0.7],
        "1": ["vertical_and_slash", 500, 700, 0.1],
        # head "2" missing: gets MInference's default head
        "3": ["stream_llm", 64, 4096, 1],
    },
    {
        "3": ["block_sparse", 1, 1, 0.3],
        "2": ["vertical_and_slash", 100, 800, 0.2],
        "1": ["stream_llm", 4, 1024, 0.4],
        "0": ["vertical_and_slash", 512, 2048, 0.6],
    },
]


@pytest.mark.parametrize("from_file", [False, True])
def test_import_minference_best_pattern(tmp_path, from_file):
    source = BEST_PATTERN
    if from_file:
        source = tmp_path / "best.json"
        source.write_text(json.dumps(BEST_PATTERN))
    cfg = import_minference_best_pattern(source, MODEL)
    assert cfg.validate() == []
    assert cfg.model == MODEL
    vs, a, bs = Pattern.VERTICAL_SLASH, Pattern.A_SHAPE, Pattern.BLOCK_SPARSE
    assert cfg.layers[0] == [
        HeadEntry(vs, (1000, 6096), 336.0),
        HeadEntry(a, (100, 800), 0.5),
        HeadEntry(bs, (100, 0), 0.9),
        HeadEntry(vs, (30, 800), 185169.0),
    ]
    assert cfg.layers[1][2] == HeadEntry(vs, (1000, 6096), None)
    assert cfg.layers[1][3] == HeadEntry(a, (64, 4096), 1.0)
    # Keys in any order land on their head index.
    assert [e.budgets for e in cfg.layers[2]] == [(512, 2048), (4, 1024), (100, 800), (100, 0)]
    assert "MInference" in cfg.provenance.notes
    assert cfg.layer_plan(0, 1, 2) == LayerPlan((HeadPlan(a, 100, 800), HeadPlan(bs, 100, 0)))
    # The imported config is an ordinary one from here on.
    assert load_config(json.loads(cfg.to_json())) == cfg


def test_import_reports_every_bad_entry():
    bad = [dict(layer) for layer in BEST_PATTERN[:2]]
    bad[0]["1"] = ["flash", 1, 2, 0.0]
    bad[0]["9"] = ["vertical_and_slash", 1, 2, 0.0]
    bad[1]["0"] = ["vertical_and_slash", 1000]
    with pytest.raises(ConfigError) as info:
        import_minference_best_pattern(bad, MODEL)
    problems = info.value.problems
    assert any("'flash'" in p for p in problems)
    assert any("'9'" in p for p in problems)
    assert any("layer 1 head 0" in p for p in problems)
    assert any("config has 2 layers, model.num_layers is 3" in p for p in problems)


def test_default_config_shape():
    model = ModelIdentity(5, 6, 3, 64)
    cfg = default_config(model, pattern=Pattern.A_SHAPE, budgets=(4, 512), min_sparse_len=1024)
    assert cfg.validate() == []
    assert len(cfg.layers) == 5
    assert all(len(layer) == 6 for layer in cfg.layers)
    assert {e for layer in cfg.layers for e in layer} == {HeadEntry(Pattern.A_SHAPE, (4, 512), None)}
    assert cfg.min_sparse_len == 1024
    assert cfg.default_head.pattern is Pattern.A_SHAPE
    plain = default_config(model)
    assert plain.layers[4][5] == HeadEntry(Pattern.VERTICAL_SLASH, (1000, 6096), None)
    assert plain.min_sparse_len == -1  # the tuned crossover, as the backend runs without a config


def test_layer_plan_with_head_offset():
    cfg = mixed_config()
    plan = cfg.layer_plan(1, 2, 2)
    # layer 1 head h holds patterns[(1 + h) % 4]: heads 2, 3 -> dense, vertical-slash
    assert plan == LayerPlan((HeadPlan(Pattern.DENSE, 0, 0), HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096)))
    assert plan.op_arguments() == ([0, 2], [0, 1000], [0, 6096])
    assert len(cfg.layer_plan(0, 0, 4).heads) == 4
    for args in [(3, 0, 4), (-1, 0, 4), (0, 2, 3), (0, -1, 2)]:
        with pytest.raises(ConfigError) as info:
            cfg.layer_plan(*args)
        assert isinstance(info.value, IndexError)


def test_model_identity_from_hf():
    transformers = pytest.importorskip("transformers")
    kwargs = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    ident = model_identity_from_hf(transformers.LlamaConfig(**kwargs))
    assert (ident.num_layers, ident.num_q_heads, ident.num_kv_heads, ident.head_dim) == (2, 4, 2, 16)
    assert ident.name == "llama"
    assert ident.fingerprint and len(ident.fingerprint) == 16
    assert model_identity_from_hf(transformers.LlamaConfig(**kwargs)).fingerprint == ident.fingerprint
    deeper = model_identity_from_hf(transformers.LlamaConfig(**dict(kwargs, num_hidden_layers=3)))
    assert deeper.num_layers == 3
    assert deeper.fingerprint != ident.fingerprint
    # Without num_key_value_heads every query head has its own KV head.
    mha = model_identity_from_hf({"model_type": "toy", "num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 256})
    assert (mha.num_kv_heads, mha.head_dim) == (8, 32)
    check_fits(default_config(ident), ident)
    with pytest.raises(ConfigMismatchError, match="fingerprint"):
        check_fits(default_config(ident), dataclasses.replace(deeper, num_layers=2))


# A config or options that say something other than what would run: each was once accepted silently.
def test_a_typo_in_the_defaults_is_named_not_ignored():
    doc = default_config(MODEL).to_dict()
    doc["defaults"]["min_sparse_length"] = 0  # min_sparse_len misspelt: the default would stand
    doc["defaults"]["default_head"]["budget"] = [1, 2]
    with pytest.raises(ConfigError) as err:
        load_config(doc)
    assert "min_sparse_length" in str(err.value) and "budget" in str(err.value)


def test_one_head_given_twice_is_named(tmp_path):
    doc = default_config(MODEL).to_dict()
    doc["layers"][0] = {"2": {"pattern": "dense", "budgets": [0, 0]}, " 2": {"pattern": "a_shape", "budgets": [4, 64]}}
    with pytest.raises(ConfigError, match="head 2 is given twice"):
        load_config(doc)
    path = tmp_path / "twice.json"  # the same key twice in one JSON object: json.loads keeps the last
    path.write_text(json.dumps(default_config(MODEL).to_dict()).replace('"layers": [', '"layers": [], "layers": [', 1))
    with pytest.raises(ConfigError, match="appears twice"):
        load_config(path)


@pytest.mark.parametrize("budgets", [[4, 2**31 + 1], [2**31 - 1, 64]])
def test_a_budget_past_int32_is_refused(budgets):
    # the first would wrap negative in the kernels' tables; the second fitted them, then wrapped when the kernel
    # rounded the A-shape sinks up to whole tiles (the GPU output was off by 1.9, with no error)
    doc = default_config(MODEL).to_dict()
    doc["layers"][0][0] = {"pattern": "a_shape", "budgets": budgets}
    with pytest.raises(ConfigError, match="int32"):
        load_config(doc)


def test_best_pattern_heads_left_out_get_the_default_and_are_named(caplog):
    with caplog.at_level("WARNING", logger="minference_fx.config"):
        cfg = import_minference_best_pattern(BEST_PATTERN, MODEL)
    assert cfg.layers[1][2] == HeadEntry(Pattern.VERTICAL_SLASH, (1000, 6096), None)
    assert "layer 1 lists no entry for query heads [2]" in caplog.text
