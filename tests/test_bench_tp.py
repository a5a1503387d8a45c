"""The TP benchmark's plumbing that runs without torchrun: its table and its refusal to run outside torchrun
(the run itself needs GPUs: scripts/bench_tp.sh)."""
import pytest

from minference_fx.tools import bench_tp


def _cell(length, variant, ttft, ranks):
    return {"length": length, "variant": variant, "ttft_ms": ttft, "rank_ttft_ms": ranks, "status": ["ok"] * len(ranks),
            "next_token": 7}


def test_the_table_gives_the_speed_ups_over_eager_under_tp_and_over_one_gpu():
    result = {"world": 2, "cells": [_cell(32768, "eager", 400.0, [390.0, 400.0]), _cell(32768, "minference", 200.0, [200.0, 180.0])],
              "variants": {"eager": {"recompiles": None}, "minference": {
                  "recompiles": 0, "minference": {"rewritten": 28, "sites": 28, "graphs": 1},
                  "shares": ["tensor parallel: rank 0 of 2 holds query heads 0..5 of 12 (...)"]}}}
    single = {"cells": [{"length": 32768, "variant": "minference", "ttft_ms": 300.0}]}
    text = bench_tp.table(result, single)
    row = next(line for line in text.splitlines() if "minference" in line and "32768" in line).split()
    assert row[:7] == ["32768", "minference", "200.0", "2.00", "300.0", "1.50", "0"], text
    assert "28/28 sites rewritten" in text and "holds query heads 0..5 of 12" in text


def test_outside_torchrun_it_says_how_to_run(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        bench_tp.main(["--lengths", "1k"])
    assert "torchrun" in capsys.readouterr().err
