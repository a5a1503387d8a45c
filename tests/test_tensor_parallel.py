"""The backend under HF tensor parallelism: 2 gloo ranks on the CPU, each holding half of a tiny model's heads.

Each rank must find its sites, rewrite them, read its first global query head from the sharded query projection
(``minference_fx.parallel``) and run that slice of a per-head config, so that the sharded model's logits equal the
single-process compiled model's; with ``head_offset=0`` given on every rank, rank 1 runs rank 0's plans and the
logits move, which shows the config's heads differ enough for a wrong offset to show.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minference_fx.backend import recent_reports
from tiny_models import per_head_config, reports_since, tiny_model

WORLD = 2
WORKER = Path(__file__).with_name("tp_worker.py")
FAMILY = "qwen2"  # q/k/v projections with biases (sharded too), the family of the GPU benchmark's model

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this torch build")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank wrote (``tp_worker.main``), rank by rank."""
    out = tmp_path_factory.mktemp("tp")
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out), FAMILY], env=env, cwd=WORKER.parent,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{log[-4000:]}"
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def single():
    """The same model and config in one process: dense logits and compiled logits of the long and short prompt."""
    from tp_worker import LONG, SHORT  # the worker's prompt lengths (tests/ is on the path, as for tiny_models)

    model = tiny_model(FAMILY)
    ids = torch.randint(0, 128, (1, LONG), generator=torch.Generator().manual_seed(0))
    short = ids[0, :SHORT].unsqueeze(0)  # as the worker's: a fresh [1, SHORT], no stride guard to fail
    before = list(recent_reports())
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend="minference", dynamic=True,
                                 options={"config": per_head_config(model), "inner": "aot_eager"})
        out = {"long": compiled(ids, use_cache=False).logits, "short": compiled(short, use_cache=False).logits,
               "dense_long": model(ids, use_cache=False).logits, "dense_short": model(short, use_cache=False).logits}
    out["reports"] = reports_since(before)
    out["heads"] = model.config.num_attention_heads
    return out


def test_each_rank_reads_its_heads_from_the_sharding_and_rewrites_its_sites(ranks, single):
    per_rank = single["heads"] // WORLD
    for rank, got in enumerate(ranks):
        assert got["derived"], f"rank {rank} published no report"
        for report in got["derived"]:
            assert report["decisions"] == ["sparse", "sparse"], report["table"]
            assert report["share"] == (rank, WORLD, rank * per_rank, per_rank), report["table"]
            assert report["head_offset"] == rank * per_rank
            assert f"tensor parallel: rank {rank} of {WORLD} holds query heads {rank * per_rank}.." in report["table"]
    # the ranks' plans are the single-process plan's halves: rank 0 runs the first heads of each layer
    assert ranks[0]["derived"][0]["plans"] != ranks[1]["derived"][0]["plans"]


def test_sharded_logits_equal_the_single_process_compiled_model(ranks, single):
    for got in ranks:
        torch.testing.assert_close(got["long"], single["long"])
        torch.testing.assert_close(got["short"], single["short"])


def test_on_a_short_prompt_the_config_reads_every_key_and_equals_dense(ranks, single):
    assert single["reports"] and all(r.rewritten == len(r.rows) == 2 for r in single["reports"])
    for got in ranks:
        torch.testing.assert_close(got["short"], single["dense_short"])
    # while on the long prompt the a-shape heads skip tiles (else a wrong offset could not show)
    gap = (single["long"] - single["dense_long"]).abs().max().item()
    assert gap > 1e-3, f"the config's sparse heads moved the long prompt's logits by only {gap}"


def test_an_explicit_head_offset_wins_and_a_wrong_one_shows(ranks, single):
    for rank, got in enumerate(ranks):
        assert got["given"]["head_offset"] == 0 and got["given"]["decisions"] == ["sparse", "sparse"], got["given"]["table"]
        assert got["given"]["share"][2] == rank * single["heads"] // WORLD  # still read, for the report
    assert "options['head_offset']" in ranks[1]["given"]["table"]
    gap = (ranks[1]["wrong"] - single["long"]).abs().max().item()
    assert gap > 1e-3, f"rank 1 running rank 0's plans moved the logits by only {gap}"


def test_shardings_whose_heads_cannot_be_read_stay_dense_with_the_reason(ranks):
    for rank, got in enumerate(ranks):
        neox = got["others"]["gpt_neox"]
        assert neox["decisions"] == ["dense", "dense"] and neox["share"] is None, neox["summary"]
        assert all("fused QKV" in reason for reason in neox["reasons"]), neox["summary"]


def test_a_gathered_projection_holds_every_head_and_reads_the_config_from_head_0(ranks):
    for rank, got in enumerate(ranks):
        phi3 = got["others"]["phi3"]
        assert phi3["decisions"] == ["sparse", "sparse"] and phi3["share"] == (0, 4), phi3["summary"]
        assert f"rank {rank} of {WORLD}; its sites hold all 4 query heads" in phi3["summary"]
