"""GPU exploration (not a test): what the op's Triton kernels cost to JIT on a cold cache, and whether
that compile can overlap Python work in another thread (as Inductor's compile would be).

usage: python scripts/explore_compile.py [--child serial|overlap]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time


def busy(n: int) -> float:
    """Pure-Python work, like Dynamo/Inductor's: holds the GIL throughout."""
    t = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i * i % 7
    return time.perf_counter() - t


def first_call() -> tuple[float, float]:
    import torch

    import minference_fx  # noqa: F401  (registers the op)
    from minference_fx.plan import HeadPlan, LayerPlan, Pattern

    n = 4096
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    args = LayerPlan((HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096),) * 32).op_arguments()
    call = lambda: torch.ops.minference.sparse_attention(q, k, v, None, None, 128 ** -0.5, 0, 0, *args, 0, 0.5)  # noqa: E731
    times = []
    for _ in range(2):
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[0], times[1]


def child(mode: str) -> None:
    import torch

    torch.zeros(1, device="cuda")  # CUDA context outside the timings
    if mode == "serial":
        cold, warm = first_call()
        print(f"serial: first call {cold:.2f} s (Triton JIT of every kernel + launch), second {warm * 1e3:.1f} ms", flush=True)
        return
    alone = busy(30_000_000)
    box = {}

    def run():
        t = time.perf_counter()
        box["cold"], _ = first_call()
        box["done"] = time.perf_counter() - t

    th = threading.Thread(target=run)
    t0 = time.perf_counter()
    th.start()
    with_bg = busy(30_000_000)
    th.join()
    total = time.perf_counter() - t0
    print(f"overlap: python work alone {alone:.2f} s, with the compile in a thread {with_bg:.2f} s; "
          f"compile thread done after {box['done']:.2f} s; both finished after {total:.2f} s "
          f"(serial would be {alone + box['cold']:.2f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return
    for mode in ("serial", "overlap", "serial"):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp())  # cold Triton cache for each child
        subprocess.run([sys.executable, __file__, "--child", mode], env=env, check=False)


if __name__ == "__main__":
    main()
