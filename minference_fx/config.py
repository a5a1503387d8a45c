"""Semantic config: which keys each (layer, query head) of a model may read.

The config is the output of the offline pattern search and the input of the
rewrite pass. It names a pattern and two budgets per query head; it never says
anything about GPUs, tile sizes or speed (that is the autotune cache's job), so
one file serves every device.

On disk it is versioned JSON. MInference's ``best_pattern`` files are a
different, unversioned format and are only read through the explicit
:func:`import_minference_best_pattern`, because a bare list carries no model
identity to check against.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import operator
import os
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from minference_fx.defaults import DEFAULTS, TUNED_CROSSOVER
from minference_fx.plan import MAX_BUDGET, HeadPlan, LayerPlan, Pattern, grown_plan, is_budget_growth, is_escalation

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

DEFAULT_DEFAULTS: dict[str, Any] = {
    # The ``defaults`` section of a config that leaves every key out: minference_fx.defaults.DEFAULTS as JSON.
    "min_sparse_len": DEFAULTS.min_sparse_len,
    "guard_threshold": DEFAULTS.guard_threshold,
    # [columns, diagonals]: a head the guard finds weak first tries an index of these budgets (backend option
    # guard_escalation); null: it runs dense at once
    "guard_escalation": list(DEFAULTS.guard_escalation) or None,
    # [keys, exponent]: past this many keys the vertical-slash and block-sparse budgets grow as (keys now / keys) **
    # exponent (backend option budget_growth); null: they stay as listed at every length
    "budget_growth": list(DEFAULTS.budget_growth) or None,
    "default_head": {"pattern": DEFAULTS.head.pattern.value, "budgets": list(DEFAULTS.budgets)},
}

MINFERENCE_PATTERN_TYPES = ("vertical_and_slash", "stream_llm", "block_sparse")
# MInference ignores v/s for block_sparse and always keeps 100 blocks of 64 keys.
MINFERENCE_BLOCK_SPARSE_BLOCKS = 100

_PATTERN_NAMES = ", ".join(p.value for p in Pattern)


class ConfigError(ValueError):
    """A semantic config that cannot be used; ``problems`` lists every reason."""

    _headline = "invalid semantic config"
    _joiner = "\n  - "

    def __init__(self, problems, *, source=None):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        self.source = None if source is None else str(source)
        super().__init__(self._format())

    def _format(self) -> str:
        head = self._headline + (f" ({self.source})" if self.source else "")
        if len(self.problems) == 1:
            return f"{head}: {self.problems[0]}"
        return f"{head}: {len(self.problems)} problems:{self._joiner}" + self._joiner.join(self.problems)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One way a config does not fit one attention site, or (``layer`` None, ``site`` "") the whole model.

    ``text`` says it without naming the site, so that the same problem at every layer of a 30-layer model is
    one line of :class:`ConfigMismatchError`'s message ("layers 0-29 (30 sites): ...") rather than 30.
    """

    text: str
    layer: int | None = None
    site: str = ""
    """the site's source line or module path (shown for a lone site, and as the example of a group)"""

    def __str__(self) -> str:
        where = "" if self.layer is None else f"layer {self.layer}"
        if self.site:
            where = f"{where} ({self.site})" if where else self.site
        return f"{where}: {self.text}" if where else self.text


def _layer_ranges(layers) -> str:
    """[0, 1, 2, 5, 7, 8] -> "layers 0-2, 5, 7-8"; [4] -> "layer 4"; long lists cut after a few ranges."""
    layers = sorted(set(layers))
    if len(layers) == 1:
        return f"layer {layers[0]}"
    ranges = []
    for layer in layers:
        if ranges and layer == ranges[-1][1] + 1:
            ranges[-1][1] = layer
        else:
            ranges.append([layer, layer])
    shown = [f"{a}-{b}" if b > a else f"{a}" for a, b in ranges]
    if len(shown) > 6:
        shown = shown[:5] + [f"... ({len(layers)} layers)"]
    return "layers " + ", ".join(shown)


class ConfigMismatchError(ConfigError):
    """The config is valid but was made for a different model.

    ``problems`` lists each mismatch as a string, per site; the message groups those that are the same
    problem at several sites (:class:`Mismatch`) into one line with a count and the layers, so a config
    for the wrong model reads as a few lines whatever the model's depth.
    """

    _headline = "semantic config does not fit the model"
    _max_lines = 6

    def __init__(self, problems, *, source=None):
        if isinstance(problems, (str, Mismatch)):
            problems = [problems]
        # one entry per distinct mismatch, in the order found
        self.mismatches = list(dict.fromkeys(p if isinstance(p, Mismatch) else Mismatch(str(p)) for p in problems))
        super().__init__([str(m) for m in self.mismatches], source=source)

    def groups(self) -> list[tuple[str, list[Mismatch]]]:
        """(text, the mismatches that say it), in the order first found."""
        by_text: dict[str, list[Mismatch]] = {}
        for m in self.mismatches:
            by_text.setdefault(m.text, []).append(m)
        return list(by_text.items())

    @staticmethod
    def _group_line(text: str, group: list[Mismatch]) -> str:
        if len(group) == 1:
            return str(group[0])
        layers = [m.layer for m in group if m.layer is not None]
        where = f"{len(group)} sites"
        if layers:
            where = f"{_layer_ranges(layers)} ({where})"
        elif group[0].site:
            where += f", e.g. {group[0].site}"
        return f"{where}: {text}"

    def _format(self) -> str:
        head = self._headline + (f" ({self.source})" if self.source else "")
        lines = [self._group_line(text, group) for text, group in self.groups()]
        if len(lines) == 1:
            return f"{head}: {lines[0]}"
        count = len(lines)
        if count > self._max_lines:
            lines = lines[: self._max_lines - 1] + [f"... and {count - self._max_lines + 1} more"]
        return f"{head}: {count} problems:{self._joiner}" + self._joiner.join(lines)


class ConfigIndexError(ConfigError, IndexError):
    """A layer or head range outside the config (caught by ``except IndexError`` too)."""

    _headline = "out of range"


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    name: str = ""
    fingerprint: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Provenance:
    """Where the head patterns came from; informational, never read by the runtime."""

    tool_version: str = ""
    calibration_data: str = ""
    lengths: list[int] = dataclasses.field(default_factory=list)
    seed: int | None = None
    metric: str = ""
    date: str = ""
    notes: str = ""

    def __post_init__(self):
        # A tuple would survive in memory but come back from JSON as a list and break equality.
        if isinstance(self.lengths, tuple):
            self.lengths = list(self.lengths)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _as_int(value):
    """numpy and other integer-likes to int; anything else unchanged so validate can name it."""
    if isinstance(value, bool):
        return value
    try:
        return int(operator.index(value))
    except TypeError:
        return value


def _as_pattern(value):
    if isinstance(value, Pattern):
        return value
    try:
        return Pattern(value)
    except ValueError:
        # Kept raw: validate reports it with its location instead of failing here without one.
        return value


@dataclasses.dataclass(frozen=True)
class HeadEntry:
    pattern: Pattern
    budgets: tuple[int, int]
    score: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "pattern", _as_pattern(self.pattern))
        budgets = self.budgets
        if isinstance(budgets, (list, tuple)):
            budgets = tuple(_as_int(b) for b in budgets)
        object.__setattr__(self, "budgets", budgets)
        score = self.score
        if isinstance(score, (int, float)) and not isinstance(score, bool):
            score = float(score)
        object.__setattr__(self, "score", score)

    def plan(self) -> HeadPlan:
        return HeadPlan(self.pattern, self.budgets[0], self.budgets[1])

    def to_dict(self) -> dict:
        pattern = self.pattern.value if isinstance(self.pattern, Pattern) else self.pattern
        budgets = list(self.budgets) if isinstance(self.budgets, tuple) else self.budgets
        return {"pattern": pattern, "budgets": budgets, "score": self.score}


def _default_head_dict(value) -> Any:
    if not isinstance(value, Mapping):
        return value
    out = dict(value)
    if isinstance(out.get("pattern"), Pattern):
        out["pattern"] = out["pattern"].value
    if isinstance(out.get("budgets"), (list, tuple)):
        out["budgets"] = [_as_int(b) for b in out["budgets"]]
    return out


def _normalize_defaults(defaults) -> dict:
    if not isinstance(defaults, Mapping):
        return defaults
    out = json.loads(json.dumps(DEFAULT_DEFAULTS))
    out.update(defaults)
    out["default_head"] = _default_head_dict(out["default_head"])
    for key in ("guard_escalation", "budget_growth"):
        if isinstance(out.get(key), tuple):  # as JSON reads it back
            out[key] = list(out[key])
    return out


@dataclasses.dataclass
class SemanticConfig:
    model: ModelIdentity
    layers: list[list[HeadEntry]]
    defaults: dict = dataclasses.field(default_factory=dict)
    provenance: Provenance = dataclasses.field(default_factory=Provenance)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        # Fill and canonicalise so that a config built in memory equals itself after a JSON round trip.
        self.defaults = _normalize_defaults(self.defaults)
        if isinstance(self.layers, (list, tuple)):
            self.layers = [list(layer) if isinstance(layer, tuple) else layer for layer in self.layers]

    # -- defaults ---------------------------------------------------------

    @property
    def min_sparse_len(self) -> int:
        return self.defaults["min_sparse_len"]

    @property
    def guard_threshold(self) -> float:
        return self.defaults["guard_threshold"]

    @property
    def guard_escalation(self) -> tuple:
        """(columns, diagonals) a weak head tries before it runs dense; () for none"""
        budgets = self.defaults.get("guard_escalation")
        return () if budgets is None else tuple(budgets)

    @property
    def budget_growth(self) -> tuple:
        """(keys, exponent) past which the listed budgets grow with the prompt; () for none"""
        growth = self.defaults.get("budget_growth")
        return () if growth is None else (int(growth[0]), float(growth[1]))

    @property
    def default_head(self) -> HeadEntry:
        d = self.defaults["default_head"]
        return HeadEntry(d["pattern"], tuple(d["budgets"]), None)

    def with_guard_threshold(self, threshold: float) -> "SemanticConfig":
        """A copy whose quality guard runs at ``threshold`` (validated like a loaded config's)."""
        return self._with_default("guard_threshold", threshold)

    def with_budget_growth(self, growth: tuple) -> "SemanticConfig":
        """A copy whose budgets grow by ``growth`` (keys, exponent), or not at all for () (validated)."""
        return self._with_default("budget_growth", list(growth) if growth else None)

    def _with_default(self, key: str, value) -> "SemanticConfig":
        copy = dataclasses.replace(self, defaults={**self.defaults, key: value})
        _raise_if(copy.validate(), None)
        return copy

    # -- checks -----------------------------------------------------------

    def validate(self) -> list[str]:
        """Every problem found, in a stable order; empty when the config is usable."""
        problems: list[str] = []
        if self.schema_version != SCHEMA_VERSION:
            problems.append(
                f"schema_version is {self.schema_version!r}, this version of minference-fx reads {SCHEMA_VERSION}"
            )
        problems += _model_problems(self.model)
        problems += _defaults_problems(self.defaults)
        problems += _provenance_problems(self.provenance)

        n_layers = getattr(self.model, "num_layers", None)
        n_heads = getattr(self.model, "num_q_heads", None)
        if not isinstance(self.layers, list):
            problems.append(f"layers must be a list of layers, got {type(self.layers).__name__}")
            return problems
        if _is_pos_int(n_layers) and len(self.layers) != n_layers:
            problems.append(f"config has {len(self.layers)} layers, model.num_layers is {n_layers}")
        for li, layer in enumerate(self.layers):
            if not isinstance(layer, list):
                problems.append(f"layer {li} must be a list of heads, got {type(layer).__name__}")
                continue
            if _is_pos_int(n_heads) and len(layer) != n_heads:
                problems.append(f"layer {li} has {len(layer)} heads, model.num_q_heads is {n_heads}")
            for hi, entry in enumerate(layer):
                where = f"layer {li} head {hi}"
                if not isinstance(entry, HeadEntry):
                    problems.append(f"{where}: expected a HeadEntry, got {type(entry).__name__}")
                    continue
                problems += _head_problems(where, entry.pattern, entry.budgets)
                if entry.score is not None and not (isinstance(entry.score, float) and math.isfinite(entry.score)):
                    problems.append(f"{where}: score must be a finite number or null, got {entry.score!r}")
        return problems

    # -- use --------------------------------------------------------------

    def plan_at(self, layer_idx: int, head_offset: int, num_heads: int, keys: int) -> LayerPlan:
        """:meth:`layer_plan` as the op runs it at a call of ``keys`` keys: grown by the config's budget growth."""
        return grown_plan(self.layer_plan(layer_idx, head_offset, num_heads), self.budget_growth, int(keys))

    def layer_plan(self, layer_idx: int, head_offset: int, num_heads: int) -> LayerPlan:
        """Plans of query heads [head_offset, head_offset + num_heads) of one layer.

        A tensor-parallel shard holds a slice of the heads, so the offset is global.
        """
        layer_idx, head_offset, num_heads = _as_int(layer_idx), _as_int(head_offset), _as_int(num_heads)
        # Negative indices would silently wrap around in Python; a site index is never negative.
        if not (isinstance(layer_idx, int) and 0 <= layer_idx < len(self.layers)):
            raise ConfigIndexError(
                f"layer {layer_idx!r} is not in the config, which has layers 0..{len(self.layers) - 1}"
            )
        layer = self.layers[layer_idx]
        if not (isinstance(head_offset, int) and isinstance(num_heads, int) and head_offset >= 0 and num_heads >= 0):
            raise ConfigIndexError(
                f"layer {layer_idx}: head offset {head_offset!r} and count {num_heads!r} must be non-negative integers"
            )
        if head_offset + num_heads > len(layer):
            raise ConfigIndexError(
                f"layer {layer_idx}: heads {head_offset}..{head_offset + num_heads - 1} requested, "
                f"the config has {len(layer)} query heads per layer"
            )
        return LayerPlan(tuple(entry.plan() for entry in layer[head_offset : head_offset + num_heads]))

    # -- JSON -------------------------------------------------------------

    def to_dict(self) -> dict:
        model = self.model.to_dict() if isinstance(self.model, ModelIdentity) else self.model
        prov = self.provenance.to_dict() if isinstance(self.provenance, Provenance) else self.provenance
        return {
            "schema_version": self.schema_version,
            "model": model,
            "provenance": prov,
            # Sorted so a defaults dict built in any order serialises the same.
            "defaults": json.loads(json.dumps(self.defaults, sort_keys=True)),
            "layers": [[e.to_dict() if isinstance(e, HeadEntry) else e for e in layer] for layer in self.layers],
        }

    def to_json(self) -> str:
        """Indented JSON with one head per line, so diffs between searches stay readable."""
        doc = self.to_dict()
        layers = doc.pop("layers")
        text = json.dumps(doc, indent=2, allow_nan=False)
        assert text.endswith("\n}")

        def head_line(h):
            return "      " + json.dumps(h, allow_nan=False)

        blocks = []
        for layer in layers:
            if layer:
                blocks.append("    [\n" + ",\n".join(head_line(h) for h in layer) + "\n    ]")
            else:
                blocks.append("    []")
        layers_text = "[\n" + ",\n".join(blocks) + "\n  ]" if blocks else "[]"
        return text[:-2] + ',\n  "layers": ' + layers_text + "\n}\n"

    def save(self, path) -> Path:
        """Validate, then write atomically (a reader never sees half a file)."""
        problems = self.validate()
        if problems:
            raise ConfigError(problems, source=path)
        text = self.to_json()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return path


# -- validation helpers ------------------------------------------------------


def _is_pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _model_problems(model) -> list[str]:
    if not isinstance(model, ModelIdentity):
        return [f"model must be a ModelIdentity, got {type(model).__name__}"]
    problems = []
    for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
        v = getattr(model, name)
        if v is None:
            problems.append(f"model.{name} is missing")
        elif not _is_pos_int(v):
            problems.append(f"model.{name} must be a positive integer, got {v!r}")
    if _is_pos_int(model.num_q_heads) and _is_pos_int(model.num_kv_heads) and model.num_q_heads % model.num_kv_heads:
        problems.append(
            f"model.num_q_heads ({model.num_q_heads}) is not a multiple of model.num_kv_heads ({model.num_kv_heads})"
        )
    for name in ("name", "fingerprint"):
        if not isinstance(getattr(model, name), str):
            problems.append(f"model.{name} must be a string, got {getattr(model, name)!r}")
    return problems


def _head_problems(where: str, pattern, budgets) -> list[str]:
    problems = []
    if not isinstance(pattern, Pattern):
        problems.append(f"{where}: unknown pattern {pattern!r} (expected one of {_PATTERN_NAMES})")
    if not (
        isinstance(budgets, (tuple, list))
        and len(budgets) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in budgets)
    ):
        problems.append(f"{where}: budgets must be two integers, got {budgets!r}")
    elif budgets[0] < 0 or budgets[1] < 0:
        problems.append(f"{where}: negative budget {tuple(budgets)}")
    elif max(budgets) > MAX_BUDGET:
        problems.append(f"{where}: budget {max(budgets)} over {MAX_BUDGET} (the kernels hold budgets as int32)")
    elif pattern is Pattern.A_SHAPE and budgets[1] < 1:
        problems.append(f"{where}: an A-shape head's local window must be >= 1, got {tuple(budgets)}")
    return problems


def _defaults_problems(defaults) -> list[str]:
    if not isinstance(defaults, Mapping):
        return [f"defaults must be a mapping, got {type(defaults).__name__}"]
    problems = []
    msl = defaults.get("min_sparse_len")
    if not (isinstance(msl, int) and not isinstance(msl, bool) and msl >= TUNED_CROSSOVER):
        problems.append(f"defaults.min_sparse_len must be a non-negative integer, or {TUNED_CROSSOVER} for this "
                        f"GPU's tuned crossover, got {msl!r}")
    gt = defaults.get("guard_threshold")
    if not (isinstance(gt, (int, float)) and not isinstance(gt, bool) and math.isfinite(gt) and 0 <= gt <= 1):
        problems.append(f"defaults.guard_threshold must be a number in [0, 1] (a share of attention mass), got {gt!r}")
    ge = defaults.get("guard_escalation")
    if ge is not None and not (isinstance(ge, list) and len(ge) == 2 and is_escalation(ge)):
        problems.append(f"defaults.guard_escalation must be [columns, diagonals], two integers in [1, {MAX_BUDGET}], "
                        f"or null, got {ge!r}")
    bg = defaults.get("budget_growth")
    if bg is not None and not (isinstance(bg, list) and len(bg) == 2 and is_budget_growth(bg)):
        problems.append(f"defaults.budget_growth must be [keys, exponent], an integer in [1, {MAX_BUDGET}] and a "
                        f"number in (0, 1], or null, got {bg!r}")
    dh = defaults.get("default_head")
    if not isinstance(dh, Mapping):
        problems.append(f"defaults.default_head must be a mapping with pattern and budgets, got {dh!r}")
    else:
        problems += _head_problems("defaults.default_head", _as_pattern(dh.get("pattern")), dh.get("budgets"))
    return problems


def _provenance_problems(prov) -> list[str]:
    if not isinstance(prov, Provenance):
        return [f"provenance must be a Provenance, got {type(prov).__name__}"]
    problems = []
    for name in ("tool_version", "calibration_data", "metric", "date", "notes"):
        if not isinstance(getattr(prov, name), str):
            problems.append(f"provenance.{name} must be a string, got {getattr(prov, name)!r}")
    if not (isinstance(prov.lengths, list) and all(_is_pos_int(n) for n in prov.lengths)):
        problems.append(f"provenance.lengths must be a list of positive integers, got {prov.lengths!r}")
    if prov.seed is not None and not (isinstance(prov.seed, int) and not isinstance(prov.seed, bool)):
        problems.append(f"provenance.seed must be an integer or null, got {prov.seed!r}")
    return problems


# -- parsing -----------------------------------------------------------------

_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelIdentity))
_PROVENANCE_KEYS = tuple(f.name for f in dataclasses.fields(Provenance))
_TOP_KEYS = ("schema_version", "model", "provenance", "defaults", "layers")
_HEAD_KEYS = ("pattern", "budgets", "score")


def _unknown_keys(where: str, d: Mapping, known) -> list[str]:
    # Flagged rather than ignored: a misspelt key would otherwise silently fall back to a default.
    return [f"{where}: unknown key {k!r}" for k in d if k not in known]


def _parse_head(where: str, raw, problems: list[str]) -> HeadEntry:
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: expected an object with pattern, budgets, score; got {raw!r}")
        return _PLACEHOLDER
    problems += _unknown_keys(where, raw, _HEAD_KEYS)
    if "pattern" not in raw or "budgets" not in raw:
        missing = [k for k in ("pattern", "budgets") if k not in raw]
        problems.append(f"{where}: missing {', '.join(missing)}")
        return _PLACEHOLDER
    budgets = raw["budgets"]
    if isinstance(budgets, list):
        budgets = tuple(budgets)
    return HeadEntry(raw["pattern"], budgets, raw.get("score"))


# Stands in for a malformed head so the head count stays right and the head is reported once.
_PLACEHOLDER = HeadEntry(Pattern.DENSE, (0, 0), None)


def _parse_config(doc, problems: list[str]) -> SemanticConfig:
    if not isinstance(doc, Mapping):
        raise ConfigError(f"expected a JSON object at the top level, got {type(doc).__name__}")
    problems += _unknown_keys("config", doc, _TOP_KEYS)
    if "schema_version" not in doc:
        problems.append("schema_version is missing")

    raw_model = doc.get("model")
    if not isinstance(raw_model, Mapping):
        problems.append(f"model must be an object, got {raw_model!r}")
        raw_model = {}
    problems += _unknown_keys("model", raw_model, _MODEL_KEYS)
    model = ModelIdentity(
        **{k: raw_model.get(k) for k in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim")},
        name=raw_model.get("name", ""),
        fingerprint=raw_model.get("fingerprint", ""),
    )

    raw_prov = doc.get("provenance", {})
    if not isinstance(raw_prov, Mapping):
        problems.append(f"provenance must be an object, got {raw_prov!r}")
        raw_prov = {}
    problems += _unknown_keys("provenance", raw_prov, _PROVENANCE_KEYS)
    provenance = Provenance(**{k: v for k, v in raw_prov.items() if k in _PROVENANCE_KEYS})

    defaults = doc.get("defaults", {})
    if not isinstance(defaults, Mapping):
        problems.append(f"defaults must be an object, got {defaults!r}")
        defaults = {}
    problems += _unknown_keys("defaults", defaults, tuple(DEFAULT_DEFAULTS))
    if isinstance(defaults.get("default_head"), Mapping):
        problems += _unknown_keys("defaults.default_head", defaults["default_head"], _HEAD_KEYS)
    defaults = _normalize_defaults(defaults)
    default_entry = _PLACEHOLDER
    dh = defaults.get("default_head")
    if isinstance(dh, Mapping) and isinstance(dh.get("budgets"), list):
        default_entry = HeadEntry(dh.get("pattern"), tuple(dh["budgets"]), None)

    raw_layers = doc.get("layers")
    layers: list[list[HeadEntry]] = []
    if not isinstance(raw_layers, list):
        problems.append(f"layers must be a list, got {raw_layers!r}")
    else:
        n_heads = model.num_q_heads if _is_pos_int(model.num_q_heads) else None
        for li, raw_layer in enumerate(raw_layers):
            if isinstance(raw_layer, list):
                layers.append([_parse_head(f"layer {li} head {hi}", h, problems) for hi, h in enumerate(raw_layer)])
            elif isinstance(raw_layer, Mapping) and n_heads is not None:
                # A partial layer: heads keyed by index, unlisted heads take the default head.
                layers.append(_keyed_layer(li, raw_layer, n_heads, default_entry, _parse_head, problems))
            else:
                problems.append(f"layer {li} must be a list of heads (or an object keyed by head index)")
                layers.append([])

    return SemanticConfig(
        model=model,
        layers=layers,
        defaults=defaults,
        provenance=provenance,
        schema_version=doc.get("schema_version"),
    )


def _head_index(key, n_heads: int) -> int | None:
    try:
        hi = int(key)
    except (TypeError, ValueError):
        return None
    if str(hi) != str(key).strip() or not 0 <= hi < n_heads:
        return None
    return hi


def _keyed_layer(li: int, raw_layer: Mapping, n_heads: int, default, parse, problems: list) -> list:
    """A layer given as {head index: entry}: unlisted heads keep ``default``; ``parse`` returns None to keep it too."""
    layer = [default] * n_heads
    seen = set()
    for key, value in raw_layer.items():
        hi = _head_index(key, n_heads)
        if hi is None:
            problems.append(f"layer {li}: head key {key!r} is not an index in 0..{n_heads - 1}")
            continue
        if hi in seen:
            problems.append(f"layer {li}: head {hi} is given twice")
            continue
        seen.add(hi)
        entry = parse(f"layer {li} head {hi}", value, problems)
        if entry is not None:
            layer[hi] = entry
    return layer


def _raise_if(problems: list[str], source) -> None:
    if problems:
        # One message per problem even if two checks noticed the same thing.
        raise ConfigError(list(dict.fromkeys(problems)), source=source)


def _read_json(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read: {e}", source=path) from e
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON: {e}", source=path) from e
    except _DuplicateKey as e:
        raise ConfigError(f"key {e.args[0]!r} appears twice in one object (JSON keeps only the last)", source=path) from e


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_config(source, *, model: ModelIdentity | None = None) -> SemanticConfig:
    """A validated SemanticConfig from a path, a dict in the on-disk layout, or a SemanticConfig.

    With ``model``, also refuses a config made for another model (see :func:`check_fits`).
    """
    if isinstance(source, SemanticConfig):
        config, where = source, None
        _raise_if(config.validate(), where)
    else:
        if isinstance(source, (str, os.PathLike)):
            where = Path(source)
            doc = _read_json(where)
            if isinstance(doc, list):
                raise ConfigError(
                    "this looks like a MInference best_pattern file (a top-level list); it has no model "
                    "identity, so read it with import_minference_best_pattern(path, model)",
                    source=where,
                )
        elif isinstance(source, Mapping):
            where, doc = None, source
        else:
            raise TypeError(f"load_config takes a path, a dict or a SemanticConfig, not {type(source).__name__}")
        problems: list[str] = []
        try:
            config = _parse_config(doc, problems)
        except ConfigError as e:
            raise ConfigError(e.problems, source=where) from None
        _raise_if(problems + config.validate(), where)
    if model is not None:
        check_fits(config, model)
    return config


# -- construction ------------------------------------------------------------


def _tool_version() -> str:
    try:
        return f"minference-fx {metadata.version('minference-fx')}"
    except Exception:
        return "minference-fx (version unknown)"


def default_config(
    model: ModelIdentity,
    *,
    pattern: Pattern = DEFAULTS.head.pattern,
    budgets: tuple[int, int] = DEFAULTS.budgets,
    min_sparse_len: int = DEFAULTS.min_sparse_len,
) -> SemanticConfig:
    """Every head of every layer the same; no search behind it.

    With no arguments it runs as the backend runs without a config (``minference_fx.defaults.DEFAULTS``): the
    default head everywhere, sparse from this GPU's tuned crossover (``min_sparse_len`` -1), the default guard.
    """
    pattern = Pattern(pattern)
    entry = HeadEntry(pattern, tuple(budgets), None)
    return SemanticConfig(
        model=model,
        layers=[[entry] * model.num_q_heads for _ in range(model.num_layers)],
        defaults={
            "min_sparse_len": min_sparse_len,
            "default_head": {"pattern": pattern.value, "budgets": list(budgets)},
        },
        provenance=Provenance(tool_version=_tool_version(), notes=f"default_config: every head {pattern.value} {tuple(budgets)}"),
    )


def _minference_entry(where: str, raw, problems: list[str]) -> HeadEntry | None:
    if not isinstance(raw, (list, tuple)) or len(raw) not in (3, 4):
        problems.append(f"{where}: expected [pattern_type, v, s, score], got {raw!r}")
        return None
    kind, v, s = raw[0], raw[1], raw[2]
    score = raw[3] if len(raw) == 4 else None
    budgets = []
    for name, x in (("v", v), ("s", s)):
        # MInference's search writes floats in some files; only whole numbers are budgets.
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        if not (isinstance(x, int) and not isinstance(x, bool)):
            problems.append(f"{where}: {name} must be an integer, got {x!r}")
            return None
        budgets.append(x)
    if kind == "vertical_and_slash":
        pattern = Pattern.VERTICAL_SLASH
    elif kind == "stream_llm":
        pattern = Pattern.A_SHAPE  # v is the sink (n_init), s the local window (n_local)
    elif kind == "block_sparse":
        pattern, budgets = Pattern.BLOCK_SPARSE, [MINFERENCE_BLOCK_SPARSE_BLOCKS, 0]
    else:
        problems.append(
            f"{where}: unknown MInference pattern type {kind!r} (expected one of {', '.join(MINFERENCE_PATTERN_TYPES)})"
        )
        return None
    if score is not None and not (isinstance(score, (int, float)) and not isinstance(score, bool)):
        problems.append(f"{where}: score must be a number, got {score!r}")
        return None
    return HeadEntry(pattern, tuple(budgets), score)


def import_minference_best_pattern(path_or_list, model: ModelIdentity) -> SemanticConfig:
    """A SemanticConfig from MInference's best_pattern JSON (one dict per layer, keyed by query head).

    Budgets are kept as written: MInference's runtime floors (v >= 30, s >= 50) and
    clipping to the sequence length belong to the op, not to the config.
    """
    source = None
    if isinstance(path_or_list, (str, os.PathLike)):
        source = Path(path_or_list)
        raw = _read_json(source)
    else:
        raw = path_or_list
    if not isinstance(raw, list):
        raise ConfigError(
            f"a best_pattern file is a list with one object per layer, got {type(raw).__name__}", source=source
        )
    default = HeadEntry(DEFAULTS.head.pattern, DEFAULTS.budgets, None)
    n_heads = model.num_q_heads
    problems: list[str] = []
    layers: list[list[HeadEntry]] = []
    for li, raw_layer in enumerate(raw):
        if not isinstance(raw_layer, Mapping):
            problems.append(f"layer {li}: expected an object keyed by head index, got {type(raw_layer).__name__}")
            continue
        missing = sorted(set(range(n_heads)) - {_head_index(key, n_heads) for key in raw_layer})
        if missing:  # MInference runs such heads as its default too; said, since a gap may mean another model
            log.warning("best_pattern layer %d lists no entry for query heads %s (of %d): they get MInference's "
                        "default head, %s %s", li, missing, n_heads, DEFAULTS.head.pattern.value, DEFAULTS.budgets)
        layers.append(_keyed_layer(li, raw_layer, n_heads, default, _minference_entry, problems))
    name = source.name if source is not None else "an in-memory list"
    config = SemanticConfig(
        model=model,
        layers=layers,
        defaults={"default_head": dict(DEFAULT_DEFAULTS["default_head"])},
        provenance=Provenance(
            tool_version=_tool_version(),
            metric="MInference best_pattern score",
            notes=f"imported from MInference best_pattern JSON ({name}); "
            "stream_llm -> a_shape(sink=v, window=s), block_sparse -> block_sparse(100 blocks)",
        ),
    )
    _raise_if(problems + config.validate(), source)
    return config


def model_identity_from_hf(hf_config) -> ModelIdentity:
    """Identity of a transformers model from its PretrainedConfig (or an equivalent dict)."""
    if isinstance(hf_config, Mapping):
        hf_config = SimpleNamespace(**hf_config)
    model_type = getattr(hf_config, "model_type", "") or ""
    cfg = hf_config
    if getattr(cfg, "num_hidden_layers", None) is None and hasattr(cfg, "get_text_config"):
        # Multimodal wrappers keep the decoder's shape in a nested text config.
        cfg = cfg.get_text_config()
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if layers is None or heads is None:
        raise ConfigError(f"cannot read num_hidden_layers/num_attention_heads from a {type(hf_config).__name__}")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None:
        if hidden is None:
            raise ConfigError(f"cannot infer head_dim: {type(hf_config).__name__} has neither head_dim nor hidden_size")
        head_dim = hidden // heads
    fields = {
        "num_layers": int(layers),
        "num_q_heads": int(heads),
        "num_kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
    }
    key = dict(fields, model_type=model_type, vocab_size=getattr(cfg, "vocab_size", None), hidden_size=hidden)
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return ModelIdentity(**fields, name=model_type, fingerprint=fingerprint)


_MISSING = object()


def _source_name(source) -> str:
    name = getattr(source, "name", None)
    return name() if callable(name) else str(name)


def _resolve_source(source, parent, frame_locals: dict, frame_globals: dict):
    """The value of one step of a Dynamo source chain (``L['self']._modules['model']`` ...), given its base's
    value; ``_MISSING`` for a kind of step this does not follow."""
    kind = type(source).__name__
    if kind == "LocalSource":
        return frame_locals.get(source.local_name, _MISSING)
    if kind == "GlobalSource":
        return frame_globals.get(source.global_name, _MISSING)
    if parent is _MISSING:
        return _MISSING
    if kind.endswith(("NNModuleSource", "ParamBufferSource")):  # a tag on the same object
        return parent
    if kind == "AttrSource":
        value = parent
        for part in source.member.split("."):
            value = getattr(value, part, _MISSING)
            if value is _MISSING:
                break
        return value
    if kind in ("GetItemSource", "DictGetItemSource") and not getattr(source, "index_is_slice", False):
        index = source.index
        if isinstance(index, (str, int)) and not isinstance(index, bool):
            try:
                return parent[index]
            except Exception:
                return _MISSING
    return _MISSING


def traced_model_identities(gm) -> list[ModelIdentity]:
    """Identities of the transformers models whose parameters the Dynamo graph ``gm`` reads, outermost first,
    for a backend to check a config's fingerprint against; empty where they cannot be told.

    A graph holds only tensors (no model config, no model type), so the fingerprint of
    :func:`model_identity_from_hf` cannot be computed from it. Dynamo keeps with each parameter input the
    source it came from in the traced frame (``L['self']._modules['model']...``); during a backend call that
    frame is Dynamo's current one, so the modules on those paths can be looked up, and every
    ``transformers.PreTrainedModel`` among them gives its identity. Empty when transformers is not imported,
    the graph reads no parameters (a function given tensors), or Dynamo's private frame API has moved: then the
    backend has only the graph's layers, heads and head dim to compare (``backend.check_config_fits``).
    """
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if pretrained is None:
        return []
    try:
        # here, not at the top: Dynamo's private module (moved between torch versions: the except below), and
        # importing Dynamo costs a second that `import minference_fx` does not pay; a trace has it loaded
        from torch._dynamo.symbolic_convert import InstructionTranslator

        root = InstructionTranslator.current_tx().output.root_tx
        frame_locals, frame_globals = dict(root.f_locals), dict(root.f_globals)
    except Exception:  # not inside a Dynamo trace, or a torch whose Dynamo keeps its frame elsewhere
        return []
    values: dict[str, Any] = {}
    models: dict[int, Any] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        chain, source = [], getattr(node.meta.get("grapharg"), "source", None)
        while source is not None and len(chain) < 64:
            chain.append(source)
            source = getattr(source, "base", None)
        value = _MISSING
        for step in reversed(chain):  # from the frame's local inwards
            try:
                name = _source_name(step)
            except Exception:
                break
            if name not in values:
                values[name] = _resolve_source(step, value, frame_locals, frame_globals)
            value = values[name]
            if value is _MISSING or isinstance(value, torch.Tensor):  # the parameter itself: no module below
                break
            if isinstance(value, pretrained):
                models.setdefault(id(value), value)
    identities = []
    for model in models.values():
        try:
            identities.append(model_identity_from_hf(model.config))
        except Exception:  # a config without the sizes (not a causal LM): nothing to compare
            continue
    return list(dict.fromkeys(identities))  # a causal LM and its base model share one config


def check_fits(config, model: ModelIdentity) -> None:
    """Raise ConfigMismatchError naming every way ``config`` was made for a different model."""
    if not isinstance(config, SemanticConfig):
        config = load_config(config)
    c = config.model
    mismatches = []
    if c.num_layers != model.num_layers:
        mismatches.append(f"config is for {c.num_layers} layers, model has {model.num_layers}")
    if c.num_q_heads != model.num_q_heads:
        mismatches.append(f"config has {c.num_q_heads} query heads per layer, model has {model.num_q_heads}")
    if c.num_kv_heads != model.num_kv_heads:
        mismatches.append(f"config has {c.num_kv_heads} KV heads, model has {model.num_kv_heads}")
    if c.head_dim != model.head_dim:
        mismatches.append(f"config has head dim {c.head_dim}, model has {model.head_dim}")
    # An empty fingerprint means "not recorded", e.g. a hand-written identity.
    if c.fingerprint and model.fingerprint and c.fingerprint != model.fingerprint:
        mismatches.append(f"fingerprint {c.fingerprint} differs from the model's {model.fingerprint}")
    if mismatches:
        raise ConfigMismatchError(mismatches)
