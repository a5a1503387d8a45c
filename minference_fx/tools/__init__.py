"""Tooling on top of the backend: benchmarks, the fidelity eval, the demo, the real assets they fetch, tiny
random-weight models and the attention-mass measurement.

The core (backend, options, passes, op, plan, config, kernels, autotune, search, inspection) never imports this
package (tests/test_layout.py); the CLI (``minference_fx.cli``), the scripts and the tests do.
"""
import torch


def pick_device(device=None) -> torch.device:
    """``device`` when given, else CUDA when there is one, else the CPU: where every tool runs when not told."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r}: not a device torch knows (cpu, cuda, cuda:N)") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA GPU")
    return chosen
