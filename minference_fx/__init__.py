"""minference-fx: a torch.compile backend for fast long-context prefill.

``torch.compile(model, backend="minference")`` rewrites every causal attention
it understands into ``minference::sparse_attention`` (dynamic sparse attention
per head) and leaves the rest dense, with a report saying why.
"""
import dataclasses

from .backend import minference_backend, recent_reports
from .config import (
    ConfigError,
    ConfigMismatchError,
    SemanticConfig,
    default_config,
    import_minference_best_pattern,
    load_config,
    model_identity_from_hf,
)
from .inspection import inspect
from .kernels.guard import STATS as _GUARD_STATS
from .op import sparse_attention
from .plan import HeadPlan, LayerPlan, Pattern
from .verify import VerifyError
from .versions import warn_if_untested

warn_if_untested()  # once: Python imports a module once


def guard_stats():
    """Counters of the runtime quality guard (on GPU only with MINFERENCE_FX_GUARD_STATS=1: counting syncs)."""
    return dataclasses.replace(_GUARD_STATS)

__all__ = [
    "ConfigError",
    "ConfigMismatchError",
    "HeadPlan",
    "LayerPlan",
    "Pattern",
    "SemanticConfig",
    "VerifyError",
    "default_config",
    "guard_stats",
    "import_minference_best_pattern",
    "inspect",
    "load_config",
    "model_identity_from_hf",
    "minference_backend",
    "recent_reports",
    "sparse_attention",
]
