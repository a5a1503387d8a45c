"""Scripts run in a child process that compiles Triton kernels for real: the suite runs Triton's interpreter, which
compiles nothing, and whether it interprets is read when Triton is imported."""
import os
import subprocess
import sys


def compiling(script: str, *args: str, **env: str) -> str:
    """stdout of ``script`` (given ``args``) in a subprocess with ``TRITON_INTERPRET=0``, no GPU and ``env``."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "", **env}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
