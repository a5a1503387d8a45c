"""One rank of tests/test_tensor_parallel.py: a tiny HF model sharded over a gloo group, compiled with the backend.

Run as a script, one process per rank, with torchrun's variables set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT): ``python tests/tp_worker.py OUT_DIR FAMILY``. It writes ``OUT_DIR/rank<r>.pt``: the logits of a long
and a short prompt with the head offset read from the sharding, the long prompt's with an explicit (wrong on every
rank but 0) ``head_offset=0``, and what each compile's report said.

The model is sharded as ``from_pretrained(..., tp_plan="auto")`` shards it, by the same transformers calls
(``prepare_distribute_model`` then ``maybe_distribute_model``, on 5.17 to 5.25 alike), but from a model built
in memory: loading from a directory with a TP plan needs ``accelerate``, which the CI stacks do not install.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

from minference_fx import inspect
from minference_fx.backend import recent_reports
from tiny_models import per_head_config, tiny_model

LONG, SHORT = 256, 100  # 4 key tiles of 64: the a-shape heads skip some; 2 tiles: each of them reads every key


def shard(model, world: int):
    """``model`` under tensor parallelism over the default process group, its own TP plan (``tp_plan="auto"``)."""
    distributed, _, mesh = type(model).prepare_distribute_model(DistributedConfig(tp_size=world))
    return type(model).maybe_distribute_model(model, distributed, mesh)


def compiled_logits(model, config, ids, inner="aot_eager", **options):
    with torch.no_grad():
        # dynamic from the first call: one graph serves both prompt lengths (a second compile would double the time)
        compiled = torch.compile(model, backend="minference", dynamic=True, options={"config": config, "inner": inner, **options})
        return [compiled(x, use_cache=False).logits for x in ids]


def summary(report) -> dict:
    share = report.tensor_parallel
    return {"decisions": [row.decision for row in report.rows], "reasons": [row.reason for row in report.rows],
            "plans": [row.plan for row in report.rows], "head_offset": report.head_offset,
            "share": None if share is None else (share.rank, share.world, share.first_head, share.num_heads),
            "table": report.table()}


def main(out: Path, family: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(family)
    config = per_head_config(model)
    model = shard(model, world)
    ids = torch.randint(0, 128, (1, LONG), generator=torch.Generator().manual_seed(0))
    # the short prompt as a fresh [1, SHORT] (a slice keeps stride 256, which fails a stride guard: a recompile)
    long, short = compiled_logits(model, config, [ids, ids[0, :SHORT].unsqueeze(0)])
    derived = [summary(r) for r in recent_reports()]
    torch._dynamo.reset()
    (wrong,) = compiled_logits(model, config, [ids], inner="eager", head_offset=0)  # eager: only the logits matter
    given = summary(recent_reports()[-1])
    # other shardings: GPT-NeoX's fused query_key_value is colwise (whose heads a shard holds is not read: dense),
    # Phi-3's fused qkv_proj is gathered (every rank holds every head: sparse from head 0)
    others = {name: inspect(shard(tiny_model(name), world), ids[:, :64], use_cache=False) for name in ("gpt_neox", "phi3")}
    others = {name: {"summary": found.summary(), "share": found.tensor_parallel and (found.tensor_parallel.first_head,
                                                                                     found.tensor_parallel.num_heads),
                     "decisions": [row.decision for row in found.rows], "reasons": [row.reason for row in found.rows]}
              for name, found in others.items()}
    torch.save({"long": long, "short": short, "wrong": wrong, "derived": derived, "given": given, "others": others},
               out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
