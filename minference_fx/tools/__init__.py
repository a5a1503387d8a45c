"""Tooling on top of the backend: benchmarks, the fidelity eval, the demo, the real assets they fetch, tiny
random-weight models and the attention-mass measurement.

The core (backend, options, passes, op, plan, config, kernels, autotune, search, inspection) never imports this
package (tests/test_layout.py); the CLI (``minference_fx.cli``), the scripts and the tests do.
"""
import inspect

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


def forward_kwarg(model, names: tuple, value) -> dict:
    """``{name: value}`` for the first of ``names`` that ``model``'s forward takes, else ``{}``: transformers renames
    forward arguments across releases. A torch.compile wrapper's forward takes (*args, **kwargs), so the wrapped
    model's is read."""
    params = inspect.signature(getattr(model, "_orig_mod", model).forward).parameters
    return next(({name: value} for name in names if name in params), {})


def cache_kwargs(model, cache) -> dict:
    """The forward keyword that hands ``model`` a KV cache: ``cache`` from transformers 5.25 on, ``past_key_values``
    before (5.25 still takes the old name, with a deprecation warning, until 5.40)."""
    return forward_kwarg(model, ("cache", "past_key_values"), cache) or {"past_key_values": cache}


def returned_cache(output):
    """The KV cache a transformers forward returned, under either name (``cache`` from 5.25 on)."""
    return output["cache"] if "cache" in output else output.past_key_values
