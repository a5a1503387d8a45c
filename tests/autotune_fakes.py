"""A stand-in for the GPU tuner, for tests of what happens around tuning on a CPU."""
import torch

from minference_fx.autotune import cache, dispatch, tuner
from minference_fx.autotune.cache import TuneEntry


def fake_tuning(monkeypatch, calls: list, crossover: int) -> None:
    """Make ``tuner.warm_up`` write one launch config and ``crossover`` as the real one writes after timing (the same
    ``cache.write``), record the lengths it was asked for in ``calls``, and let the dispatcher tune on the CPU."""

    def fake_warm_up(lengths, head_dim, group, dtype, progress=True, num_kv_heads=8, families=tuner.TUNE_FAMILIES):
        calls.append(tuple(lengths))
        device = torch.device("cpu")
        cache.write(configs={dispatch.tune_key("sparse_attention", device, dtype, head_dim, group, lengths[0]):
                             TuneEntry(64, 64, 8, 3)},
                    crossovers={dispatch.crossover_key(device, dtype, head_dim, group): crossover})

    monkeypatch.setattr(tuner, "warm_up", fake_warm_up)
    monkeypatch.setattr(dispatch, "_can_tune", lambda q: True)
    monkeypatch.setattr(dispatch, "_tuned_here", set())
