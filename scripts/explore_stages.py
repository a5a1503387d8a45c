"""GPU exploration (not a test): 2 against 3 pipeline stages for the 64-key sparse walk, 32K to 128K, both families.

usage: python scripts/explore_stages.py --out FILE.json [--write-cache]

Since 6cb727e the sparse walk reads each block's start a step ahead, so at 3 stages Triton copies K/V two steps ahead
(three buffers) where it copied one ahead before; at 2 stages nothing changed (scripts/explore_list_prefetch.py). The
shipped tables were re-keyed to that kernel with their launch configs carried, and the entries that had kept 2 stages
from tunes of the older walk were moved to 3 by hand on that A/B (BENCHMARKS section 6). For every shipped shape, this
takes this GPU's sparse-walk entries at 32K, 64K and 128K that walk a block a step (64-key steps) at 2 or 3 stages, and
times the entry at both stage counts on both input families at the bucket's length, choosing as the tuner does
(``tuner.tune``: the lowest sum of each family's time over its fastest). With ``--write-cache`` a choice that differs
from the table goes into the user cache, where every later process on this machine reads it first (``minference-fx
autotune --show``)."""
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


def block_step_buckets(measured_on) -> list[tuple[int, cache.TuneEntry]]:
    """(bucket, entry) of the tables' sparse-walk entries for ``measured_on`` at 32K-128K that walk a block a step
    at 2 or 3 stages."""
    found = []
    for bucket in (1 << p for p in range(15, 18)):
        entry, tuned_bucket = cache.resolve(TuneKey.of(KERNEL, measured_on, bucket))
        if tuned_bucket == bucket and entry.BLOCK_N == 64 and entry.num_stages in (2, 3):
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
        for bucket, shipped in block_step_buckets(measured_on):
            candidates = [dataclasses.replace(shipped, num_stages=n) for n in (2, 3)]
            result = tuner.tune(KERNEL, candidates, lambda c, w=workloads[0]: w.kernel(bucket, c)(),
                                also=[lambda c, w=w: w.kernel(bucket, c)() for w in workloads[1:]])
            ms = {w.family: {c.num_stages: result.timings_by_way[c][way] for c in candidates}
                  for way, w in enumerate(workloads)}
            row = dict(head_dim=head_dim, group=group, kv_heads=kv_heads, bucket=bucket, shipped=dataclasses.asdict(shipped),
                       ms=ms, chosen_stages=result.best.num_stages)
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
