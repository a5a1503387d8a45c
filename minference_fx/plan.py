"""Head plans: which sparse pattern each query head of one attention site runs.

A plan is what the rewrite pass bakes into the graph as constant arguments of
``minference::sparse_attention``. It is semantic (which keys may be read), never
about GPU tile sizes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from enum import Enum


class Pattern(str, Enum):
    # str-valued so it survives JSON and torch.compile guards
    DENSE = "dense"
    A_SHAPE = "a_shape"  # budgets: (sink keys, local window)
    VERTICAL_SLASH = "vertical_slash"  # budgets: (vertical columns, slash diagonals)
    BLOCK_SPARSE = "block_sparse"  # budgets: (key blocks per query block, unused)


# The op takes patterns as small ints: its schema has no enum type.
PATTERN_CODES = {
    Pattern.DENSE: 0,
    Pattern.A_SHAPE: 1,
    Pattern.VERTICAL_SLASH: 2,
    Pattern.BLOCK_SPARSE: 3,
}
PATTERN_FROM_CODE = {code: pattern for pattern, code in PATTERN_CODES.items()}
MAX_BUDGET = 2**30
"""The largest budget a plan may hold. The kernels keep budgets and key positions in int32 and round a budget up
to whole tiles there (2**31 - 1 rounded up wraps negative, and an A-shape head then read wrong keys); 2**30 keys
is past any prompt, so a larger budget means nothing more."""
LISTED_PATTERNS = frozenset({Pattern.VERTICAL_SLASH, Pattern.BLOCK_SPARSE})
"""Patterns whose keys the online index lists (dense and A-shape keys are enumerated from the plan); only
these can turn out near-dense at run time and be run dense (``kernels.guard.near_dense``)."""


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The pattern of one query head and its two budgets (meaning depends on the pattern)."""

    pattern: Pattern
    budget_a: int = 0
    budget_b: int = 0

    def __post_init__(self):
        object.__setattr__(self, "pattern", Pattern(self.pattern))
        negative = [f"{name} = {b}" for name, b in (("budget_a", self.budget_a), ("budget_b", self.budget_b)) if b < 0]
        if negative:
            raise ValueError(f"budgets must be >= 0, got {' and '.join(negative)} (budgets {self.budget_a}, "
                             f"{self.budget_b}) for {self.pattern.value}")
        if max(self.budget_a, self.budget_b) > MAX_BUDGET:
            raise ValueError(f"budgets must be <= {MAX_BUDGET} (the kernels hold them as int32), got "
                             f"{self.budget_a}, {self.budget_b} for {self.pattern.value}")
        if self.pattern is Pattern.A_SHAPE and self.budget_b < 1:
            # with none a query would not read itself; the kernels and the reference then disagree on which
            # tiles a one-row query tile reads (its own or none), so the plan says it instead of either
            raise ValueError(f"an A-shape head's local window (budget_b) must be >= 1, got {self.budget_b}")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Plans for every query head of one attention site, in head order."""

    heads: tuple[HeadPlan, ...]

    def op_arguments(self) -> tuple[list[int], list[int], list[int]]:
        """(pattern codes, budget_a, budget_b) as the op's int lists."""
        return (
            [PATTERN_CODES[h.pattern] for h in self.heads],
            [h.budget_a for h in self.heads],
            [h.budget_b for h in self.heads],
        )

    @staticmethod
    def from_op_arguments(patterns, budget_a, budget_b) -> "LayerPlan":
        if not (len(patterns) == len(budget_a) == len(budget_b)):
            raise ValueError(
                f"plan lists differ in length: patterns {len(patterns)}, budget_a {len(budget_a)}, budget_b {len(budget_b)}"
            )
        unknown = [(h, int(p)) for h, p in enumerate(patterns) if int(p) not in PATTERN_FROM_CODE]
        if unknown:
            raise ValueError(f"unknown pattern code(s) (head, code) {unknown}; the codes are "
                             f"{ {code: pattern.value for code, pattern in PATTERN_FROM_CODE.items()} }")
        heads = []
        for h, (p, a, b) in enumerate(zip(patterns, budget_a, budget_b)):
            try:
                heads.append(HeadPlan(PATTERN_FROM_CODE[int(p)], int(a), int(b)))
            except ValueError as e:
                # a HeadPlan does not know its place: name the head so a plan of 32 heads says which one is bad
                raise ValueError(f"head {h} of the plan: {e}") from None
        return LayerPlan(tuple(heads))


@functools.lru_cache(maxsize=4096)
def layer_plan(patterns: tuple, budget_a: tuple, budget_b: tuple) -> LayerPlan:
    """:meth:`LayerPlan.from_op_arguments`, remembered: the op and the background precompile build a site's plan
    from its constant arguments at every call, and a model has few distinct ones."""
    return LayerPlan.from_op_arguments(patterns, budget_a, budget_b)


def is_escalation(value) -> bool:
    """Whether ``value`` can be the guard's escalation budgets: (columns, diagonals), two ints in [1, MAX_BUDGET],
    or empty for none (an option and a config's ``defaults.guard_escalation`` are checked alike)."""
    if not isinstance(value, (tuple, list)):
        return False
    return len(value) == 0 or (len(value) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_BUDGET for x in value))


def escalation_of(escalate_a: int, escalate_b: int) -> tuple:
    """The op's ``escalate_a``/``escalate_b`` arguments as escalation budgets: () when both are 0 (none)."""
    return (int(escalate_a), int(escalate_b)) if escalate_a or escalate_b else ()


def escalation_arguments(escalation: tuple) -> tuple[int, int]:
    """The inverse of :func:`escalation_of`: escalation budgets as the op's ``escalate_a``/``escalate_b``, (0, 0) for
    none."""
    return (int(escalation[0]), int(escalation[1])) if escalation else (0, 0)


@functools.lru_cache(maxsize=4096)
def escalated_plan(plan: LayerPlan, budgets: tuple[int, int]) -> LayerPlan | None:
    """The plan whose index the heads the quality guard finds weak fall back to: every vertical-slash head with at
    least ``budgets`` (columns, diagonals), every other head dense (the fallback index lists only vertical-slash
    heads, the only ones the guard checks). None when no head's budgets are raised: the fallback index would be
    the call's own. Remembered, as :func:`layer_plan`: the op asks at every call."""
    columns, diagonals = budgets
    if not any(h.pattern is Pattern.VERTICAL_SLASH and (h.budget_a < columns or h.budget_b < diagonals)
               for h in plan.heads):
        return None
    return LayerPlan(tuple(
        HeadPlan(Pattern.VERTICAL_SLASH, max(h.budget_a, columns), max(h.budget_b, diagonals))
        if h.pattern is Pattern.VERTICAL_SLASH else HeadPlan(Pattern.DENSE) for h in plan.heads))


def is_budget_growth(value) -> bool:
    """Whether ``value`` can be a budget growth: (keys, exponent), an int in [1, MAX_BUDGET] and a real in (0, 1],
    or empty for none (an option and a config's ``defaults.budget_growth`` are checked alike)."""
    if not isinstance(value, (tuple, list)):
        return False
    if len(value) == 0:
        return True
    if len(value) != 2:
        return False
    keys, exponent = value
    return (isinstance(keys, int) and not isinstance(keys, bool) and 1 <= keys <= MAX_BUDGET
            and isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and math.isfinite(exponent)
            and 0 < exponent <= 1)


def growth_of(grow_from: int, grow_exponent: float) -> tuple:
    """The op's ``grow_from``/``grow_exponent`` arguments as a budget growth: () when ``grow_from`` is 0 (none)."""
    return (int(grow_from), float(grow_exponent)) if grow_from else ()


GROWTH_STEPS_PER_OCTAVE = 8
"""A growth's ratio of lengths is rounded up to a power of 2 ** (1 / this): each grown plan has pinned per-head
tables of its own (``kernels.tables``, kept for the process, since a captured graph replays their copies), so the
plans must come from a few steps, not from every prompt length. An eighth of an octave adds at most 9 % to a ratio."""


def growth_factor(growth: tuple, keys: int) -> float:
    """What ``growth`` (keys0, exponent) multiplies the listed budgets by at a call of ``keys`` keys: 1 up to keys0,
    then (keys / keys0) ** exponent, with the ratio rounded up to a step of :data:`GROWTH_STEPS_PER_OCTAVE`."""
    if not growth or keys <= growth[0]:
        return 1.0
    # less a rounding error, so that an exact power of two of keys0 lands on its own step, not the next
    steps = math.ceil(GROWTH_STEPS_PER_OCTAVE * math.log2(keys / growth[0]) - 1e-9)
    return 2.0 ** (steps / GROWTH_STEPS_PER_OCTAVE * growth[1])


@functools.lru_cache(maxsize=4096)
def grown_plan(plan: LayerPlan, growth: tuple, keys: int) -> LayerPlan:
    """``plan`` at a call of ``keys`` keys under ``growth`` (keys0, exponent): past keys0 keys, every vertical-slash
    head's columns and diagonals and every block-sparse head's blocks times :func:`growth_factor`, rounded up.

    Budgets count keys (or blocks), not a share of the row, so a plan searched at keys0 keeps a smaller share of
    each row at a longer prompt; exponent 1 keeps the share, 0.5 lets it fall as 1 / sqrt(keys). A-shape heads
    (a fixed sink and window) and dense heads stay as they are; so does every head at keys0 keys or fewer. The
    guard's escalation budgets do not grow: a head grown past them has no larger index to try."""
    factor = growth_factor(growth, keys)
    if factor == 1.0:
        return plan

    def grow(budget: int) -> int:
        return min(math.ceil(budget * factor), MAX_BUDGET)

    return LayerPlan(tuple(HeadPlan(h.pattern, grow(h.budget_a), grow(h.budget_b)) if h.pattern in LISTED_PATTERNS
                           else h for h in plan.heads))
