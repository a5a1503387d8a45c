"""GPU exploration (not a test): 2 against 3 pipeline stages where the shipped table keeps 2 for the listed walk.

usage: python scripts/explore_stages.py --out FILE.json [--write-cache]

Since 6cb727e the sparse walk reads each block's start a step ahead, so at 3 stages Triton copies K/V two steps ahead
(three buffers) where it copied one ahead before; at 2 stages nothing changed (scripts/explore_list_prefetch.py). The
shipped tables were re-keyed to that kernel with their launch configs carried, and a few buckets kept 2 stages from
tunes of the older walk. For every shipped shape, this finds this GPU's sparse-walk entries with 64-key steps (one
block a step, the loop the read-ahead changed) and 2 stages from 8K up, and times each against the same config at 3
stages on both input families at the bucket's length, choosing as the tuner does (``tuner.tune``: the lowest sum of
each family's time over its fastest). With ``--write-cache`` the choices go into the user cache, where every later
process on this machine reads them first (``minference-fx autotune --show``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import datetime, timezone

import torch

from minference_fx.autotune import cache, tuner
from minference_fx.autotune.cache import TuneKey
from minference_fx.autotune.workload import CudaWorkload

# (head_dim, query heads per kv head, kv heads): Llama-3-8B's, SmolLM2's and Qwen2.5-Coder's, as `retune` tunes them
SHAPES = ((128, 4, 8), (64, 3, 3), (128, 6, 2))
KERNEL = "sparse_attention"


def two_stage_buckets(measured_on) -> list[tuple[int, cache.TuneEntry]]:
    """(bucket, entry) of the tables' sparse-walk entries for ``measured_on`` that walk a block a step at 2 stages."""
    found = []
    for bucket in (1 << p for p in range(13, 18)):  # 8K .. 128K
        entry, tuned_bucket = cache.resolve(TuneKey.of(KERNEL, measured_on, bucket))
        if tuned_bucket == bucket and entry.BLOCK_N == 64 and entry.num_stages == 2:
            found.append((bucket, entry))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--write-cache", action="store_true", help="write each choice into the user cache")
    args = parser.parse_args()
    rows = []
    for head_dim, group, kv_heads in SHAPES:
        workloads = [CudaWorkload(head_dim, group, torch.bfloat16, num_kv_heads=kv_heads, family=f)
                     for f in tuner.TUNE_FAMILIES]
        measured_on = tuner._measured_on(workloads[0], torch.bfloat16, head_dim, group)
        for bucket, shipped in two_stage_buckets(measured_on):
            candidates = [shipped, dataclasses.replace(shipped, num_stages=3)]
            result = tuner.tune(KERNEL, candidates, lambda c, w=workloads[0]: w.kernel(bucket, c)(),
                                also=[lambda c, w=w: w.kernel(bucket, c)() for w in workloads[1:]])
            # the other families' times, for the record (tune keeps the first family's)
            others = {w.family: {c.num_stages: tuner.do_bench(w.kernel(bucket, c)) for c in candidates}
                      for w in workloads[1:]}
            row = dict(head_dim=head_dim, group=group, kv_heads=kv_heads, bucket=bucket, shipped=dataclasses.asdict(shipped),
                       ms={workloads[0].family: {c.num_stages: result.timings[c] for c in candidates}, **others},
                       chosen_stages=result.best.num_stages)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.write_cache and result.best != shipped:
                cache.write(configs={TuneKey.of(KERNEL, measured_on, bucket): result.best})
    doc = dict(command="python scripts/explore_stages.py" + (" --write-cache" if args.write_cache else ""),
               date=datetime.now(timezone.utc).isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, kernel_hash=measured_on.source_hash, rows=rows)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
