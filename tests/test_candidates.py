"""Candidate configs for GPU steps (minference_fx.tools.candidates): each edit changes what it says and nothing else."""
import json
from pathlib import Path

import pytest

from minference_fx.config import load_config
from minference_fx.tools import candidates

SHIPPED = Path(__file__).resolve().parent.parent / "configs" / "qwen2.5_coder_1.5b_instruct_32k_yarn.json"


@pytest.fixture
def shipped() -> dict:
    return json.loads(SHIPPED.read_text())


def test_min_columns_raises_only_vertical_slash_heads_below_it(shipped):
    out, change = candidates.min_columns(shipped, 2048)
    raised = 0
    for before_heads, after_heads in zip(shipped["layers"], out["layers"]):
        for before, after in zip(before_heads, after_heads):
            if before["pattern"] == "vertical_slash" and before["budgets"][0] < 2048:
                assert after["budgets"] == [2048, before["budgets"][1]]
                raised += 1
            else:
                assert after == before
    assert raised > 0 and change.startswith(f"{raised} ")
    assert out["provenance"]["notes"].endswith(f"Candidate: {change}.")
    assert shipped == json.loads(SHIPPED.read_text())  # the input is not edited in place


def test_dense_heads_and_layers(shipped):
    out, _ = candidates.dense_heads(shipped, [(3, 1), (0, 11)])
    assert out["layers"][3][1] == out["layers"][0][11] == candidates.dense_head()
    assert out["layers"][3][0] == shipped["layers"][3][0]
    with pytest.raises(ValueError, match=r"\(28, 0\)"):
        candidates.dense_heads(shipped, [(28, 0)])
    out, change = candidates.dense_layers(shipped, [2], min_sparse_len=32768)
    assert all(h == candidates.dense_head() for h in out["layers"][2]) and out["layers"][1] == shipped["layers"][1]
    assert out["defaults"]["min_sparse_len"] == 32768 and "32768" in change
    # a layer search that found only "all of them" names no layer
    assert candidates.found_layers({"found": [list(range(28))]}, 28) == []
    assert candidates.found_layers({"found": [[4, 5], [9]]}, 28) == [4, 5, 9]


def test_cli_writes_a_config_the_backend_loads(tmp_path, shipped):
    out = tmp_path / "c.json"
    candidates.main(["derived", str(SHIPPED), "--out", str(out), "--guard-threshold", "0.5", "--min-sparse-len",
                     "16384", "--scale", "2", "--budget-growth", "32768", "0.5"])
    written = json.loads(out.read_text())
    assert written["defaults"]["guard_threshold"] == 0.5 and written["defaults"]["budget_growth"] == [32768, 0.5]
    assert written["layers"][0][0]["budgets"] == [2 * b for b in shipped["layers"][0][0]["budgets"]]
    config = load_config(str(out))
    assert config.min_sparse_len == 16384
