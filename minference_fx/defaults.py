"""Every default of the backend and of the semantic config, written once.

The backend without a config, :func:`minference_fx.config.default_config`, a config file that leaves a
``defaults`` key out, the search and the autotune workload all read :data:`DEFAULTS`, so compiling with no
config and compiling with ``default_config(model)`` run the same plans, from the same length, under the same
guard. Nothing else in the package writes these numbers.

This module imports only :mod:`minference_fx.plan`, so every other module (kernels, autotune, op, passes,
backend) may import it.
"""
from __future__ import annotations

import dataclasses

from .plan import HeadPlan, Pattern

TUNED_CROSSOVER = -1
"""``min_sparse_len`` that means "this GPU's tuned dense/sparse crossover" (``autotune.dispatch.tuned_min_sparse_len``,
which falls back to ``autotune.dispatch.untuned_crossover`` on a device with none measured)."""


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The defaults, typed; :data:`DEFAULTS` is the one instance the package reads."""

    head: HeadPlan = HeadPlan(Pattern.VERTICAL_SLASH, 1000, 6096)
    """MInference's own fallback for heads its search did not list (vertical-slash, 1000 columns, 6096 diagonals):
    every head of a model compiled without a config, and the ``default_head`` of a config"""

    min_sparse_len: int = TUNED_CROSSOVER
    """prompts shorter than this run dense SDPA; the default is the tuned crossover of the GPU that runs the model
    (a semantic config says nothing about speed)"""

    guard_threshold: float = 0.8
    """a vertical-slash head whose index keeps less than this share of the last rows' attention mass runs dense for
    that call (the runtime quality guard; 0 = off). 0.8 keeps the worst head's recall at or above 0.8 on SmolLM2
    at 32K, 64K and 128K for 0.4-4 % more computed tiles; 0.5 left heads at 0.56-0.76 (BENCHMARKS.md, fidelity)."""

    guard_escalation: tuple = ()
    """(columns, diagonals) a head the guard finds weak tries before it runs dense; () runs it dense at once. Off by
    default: a model's config turns it on where it measured better (its ``defaults.guard_escalation``)."""

    budget_growth: tuple = ()
    """(keys, exponent): past ``keys`` keys, vertical-slash and block-sparse budgets grow as (prompt keys / keys) **
    exponent (:func:`~minference_fx.plan.grown_plan`); () keeps them as the plan says at every length."""

    untuned_min_sparse_len: int = 8192
    """the least crossover a device without a measured one uses (the floor of ``autotune.dispatch.untuned_crossover``):
    below it sparse attention saves less than its index costs"""

    @property
    def budgets(self) -> tuple[int, int]:
        """The default head's two budgets (vertical columns, slash diagonals)."""
        return (self.head.budget_a, self.head.budget_b)


DEFAULTS = Defaults()
