"""The tuned-config cache: how fast each launch config is on a GPU, never which edges are read.

One JSON file in a user cache directory holds two tables:

* ``configs``: :class:`TuneKey` → :class:`TuneEntry` (tile sizes, warps, stages);
* ``crossovers``: :class:`CrossoverKey` → the prompt length from which the sparse
  path (index + attention) beats dense SDPA; ``null`` when it never did.

Lookups read the user file first, then the tables shipped as package data
(``autotune/*.json``). A missing entry gives a safe default and one log line;
nothing here benchmarks.

Writers take a lock file, re-read and merge, then replace the file atomically,
so two processes tuning at once lose nothing and a reader never sees half a
file. A file that is not valid JSON or not this schema is ignored with one
warning and replaced by the next write.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Optional

log = logging.getLogger("minference_fx.autotune")

SCHEMA = "minference-fx/autotune"
VERSION = 1
FILE_NAME = "autotune.json"
ENV_DIR = "MINFERENCE_FX_CACHE_DIR"

# The semantic config's default min_sparse_len: an untuned device behaves as before tuning existed.
DEFAULT_MIN_SPARSE_LEN = 8192
# What a ``null`` crossover dispatches as: sparse never won, so every length runs dense.
DENSE_ALWAYS = sys.maxsize


@dataclasses.dataclass(frozen=True, order=True)
class TuneEntry:
    """A launch config: changes speed, never the result."""

    BLOCK_M: int = 64
    BLOCK_N: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def launch(self) -> dict:
        """Keyword arguments of ``sparse_attention_triton`` for this config."""
        return dict(block_m=self.BLOCK_M, block_n=self.BLOCK_N, num_warps=self.num_warps, num_stages=self.num_stages)


DEFAULT_ENTRY = TuneEntry()
# What an untuned lookup launches, per kernel. The dense walk runs only heads that read no list, so
# its programs may own two index query tiles: 128 rows of 64-key steps with 4 warps were its best on an
# H200 at 32K and 128K at d128 (results/explore_dense_h200_2026-11-30.txt, _v2 to _v4, and the re-tunes of
# kernels d72d3989 and ba0c0a7c; at d64 those re-tunes chose 64 rows, the last with 128-key steps).
DEFAULT_ENTRIES = {"sparse_attention": DEFAULT_ENTRY, "dense_walk": TuneEntry(128, 64, 4, 2)}


@dataclasses.dataclass(frozen=True, order=True)
class CrossoverKey:
    """What a timing was measured on. The crossover times the index and attention kernels together, so it
    carries the source hash too."""

    source_hash: str
    """hash of the kernel sources' code (``identity.code_of``): an edited kernel invalidates its timings"""
    gpu: str
    """``torch.cuda.get_device_name()``; part of the key, never a condition"""
    capability: str
    """compute capability, "9.0" """
    triton: str
    dtype: str
    """torch dtype name without "torch.": "bfloat16" """
    head_dim: int
    group: int
    """query heads per kv head (GQA)"""


@dataclasses.dataclass(frozen=True, order=True)
class TuneKey(CrossoverKey):
    """A launch config is chosen per kernel and length bucket on top of what the crossover is keyed by."""

    kernel: str
    """e.g. "sparse_attention" (a key of ``space.SPACE``)"""
    bucket: int
    """``seq_bucket`` of the query length"""

    @classmethod
    def of(cls, kernel: str, measured_on: CrossoverKey, length: int) -> "TuneKey":
        return cls(**dataclasses.asdict(measured_on), kernel=kernel, bucket=seq_bucket(length))


def seq_bucket(length: int) -> int:
    """The power of two nearest to ``length`` in log scale: 40k → 32k, 50k → 64k (the split is at √2·2^k)."""
    if length <= 1:
        return 1
    low = 1 << (length.bit_length() - 1)
    # length >= √2·low  ⇔  length² >= 2·low², exact in integers
    return low << 1 if length * length >= 2 * low * low else low


# --------------------------------------------------------------------------- the table and its JSON


class ForeignFile(ValueError):
    """The file is not JSON of this schema and version."""


@dataclasses.dataclass
class Table:
    configs: dict[TuneKey, TuneEntry] = dataclasses.field(default_factory=dict)
    crossovers: dict[CrossoverKey, Optional[int]] = dataclasses.field(default_factory=dict)

    def merged(self, newer: "Table") -> "Table":
        return Table({**self.configs, **newer.configs}, {**self.crossovers, **newer.crossovers})

    def __bool__(self) -> bool:
        return bool(self.configs or self.crossovers)

    def to_json(self) -> str:
        configs = [{"key": dataclasses.asdict(k), "entry": dataclasses.asdict(self.configs[k])} for k in sorted(self.configs)]
        crossovers = [{"key": dataclasses.asdict(k), "min_sparse_len": self.crossovers[k]} for k in sorted(self.crossovers)]
        doc = {"schema": SCHEMA, "version": VERSION, "configs": configs, "crossovers": crossovers}
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Table":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ForeignFile(f"not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ForeignFile(f"schema is not {SCHEMA!r}")
        if doc.get("version") != VERSION:
            raise ForeignFile(f"version {doc.get('version')!r}, this minference-fx reads version {VERSION}")
        try:
            configs = {_record(TuneKey, row["key"]): _record(TuneEntry, row["entry"]) for row in doc["configs"]}
            crossovers = {_record(CrossoverKey, row["key"]): _length(row["min_sparse_len"]) for row in doc["crossovers"]}
        except (KeyError, TypeError, ValueError) as e:
            raise ForeignFile(f"malformed record ({e})") from None
        return cls(configs, crossovers)


def _record(cls, raw):
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict) or set(raw) != set(fields):
        raise ValueError(f"{cls.__name__} needs fields {sorted(fields)}, got {raw!r}")
    for name, value in raw.items():
        want = int if fields[name] in (int, "int") else str
        # bool is an int to Python, never to this schema
        if type(value) is not want:
            raise ValueError(f"{cls.__name__}.{name} = {value!r} is not {want.__name__}")
    return cls(**raw)


def _length(value) -> Optional[int]:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"min_sparse_len = {value!r} is not null or an int >= 0")
    return value


# --------------------------------------------------------------------------- files


def cache_dir() -> Path:
    """``$MINFERENCE_FX_CACHE_DIR``, else ``$XDG_CACHE_HOME/minference-fx``, else ``~/.cache/minference-fx``."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minference-fx"


def cache_path() -> Path:
    return cache_dir() / FILE_NAME


_warned: set = set()


def read_table(path) -> Table:
    """The table in ``path``; empty when the file is missing, foreign or corrupt (then warned about once)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Table()
    except UnicodeDecodeError:
        text = ""  # binary garbage: report it like bad JSON
    try:
        return Table.from_json(text)
    except ForeignFile as e:
        st = path.stat()
        # once per version of the file: a file broken again after a rewrite is news
        if (str(path), st.st_mtime_ns, st.st_size) not in _warned:
            _warned.add((str(path), st.st_mtime_ns, st.st_size))
            log.warning("ignoring the autotune cache %s: %s; the next tuning run rewrites it", path, e)
        return Table()


def write(configs: Optional[dict] = None, crossovers: Optional[dict] = None, path=None) -> Path:
    """Merge these records into the user cache file (or ``path``), atomically and under a lock."""
    path = Path(path) if path is not None else cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    update = Table(dict(configs or {}), dict(crossovers or {}))
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        # re-read under the lock: another process may have written since we last looked
        table = read_table(path).merged(update)
        _replace(path, table.to_json())
    forget()
    return path


def _replace(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def shipped_paths() -> list[Path]:
    """Tables shipped as package data, in name order."""
    root = resources.files(__package__)
    return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".json"))


# --------------------------------------------------------------------------- lookups

_memo: dict = {}
_missed: set = set()


def forget() -> None:
    """Drop what this process remembers of the files (after a write, or in tests)."""
    _memo.clear()


def remembered(memo_key, compute):
    """``compute()`` once per ``memo_key`` until :func:`forget`: run-time lookups stay dict lookups."""
    try:
        return _memo[memo_key]
    except KeyError:
        value = _memo[memo_key] = compute()
        return value


def _tables(path) -> list[Table]:
    path = Path(path) if path is not None else cache_path()
    memo_key = ("tables", str(path))
    if memo_key not in _memo:
        _memo[memo_key] = [read_table(path)] + [read_table(p) for p in shipped_paths()]
    return _memo[memo_key]


def find(key: TuneKey, path=None) -> Optional[TuneEntry]:
    """The stored entry for ``key`` (user cache first, then shipped tables), or None."""
    for table in _tables(path):
        if key in table.configs:
            return table.configs[key]
    return None


def resolve(key: TuneKey, path=None) -> tuple[TuneEntry, Optional[int]]:
    """The config for ``key`` and the bucket it was tuned at: its own bucket's; else the nearest tuned bucket
    (log scale, the larger on a tie) of the same kernel and shape; else ``(the kernel's default, None)``.

    A launch config changes speed only, and a neighbour's is the better guess: on the H200 the tuned
    configs of 32K, 64K and 128K agree, so a 256K prompt runs the 128K config rather than the untuned one."""
    entry = find(key, path)
    if entry is not None:
        return entry, key.bucket
    shape = dataclasses.replace(key, bucket=0)
    tuned = {}
    for table in reversed(_tables(path)):  # the user cache last, so it wins
        tuned.update({k.bucket: e for k, e in table.configs.items() if dataclasses.replace(k, bucket=0) == shape})
    if not tuned:
        return DEFAULT_ENTRIES.get(key.kernel, DEFAULT_ENTRY), None
    distance = lambda b: (abs(b.bit_length() - key.bucket.bit_length()), -b)  # noqa: E731 (buckets are powers of 2)
    nearest = min(tuned, key=distance)
    return tuned[nearest], nearest


def lookup(key: TuneKey, path=None) -> TuneEntry:
    """The tuned launch config for ``key`` (see :func:`resolve`); a key not tuned itself is logged once."""
    entry, bucket = resolve(key, path)
    if bucket != key.bucket and key not in _missed:
        _missed.add(key)
        if bucket is None:
            log.warning("no tuned config for %s; using %s (run `minference-fx autotune` on this GPU)", key, entry)
        else:
            log.warning("no tuned config for %s; using %s, tuned for the %d-token bucket (run `minference-fx autotune "
                        "--lengths %d` to tune this one)", key, entry, bucket, key.bucket)
    return entry


def has_crossover(key: CrossoverKey, path=None) -> bool:
    """Whether a crossover (a length, or dense-always) is stored for ``key``."""
    return any(key in table.crossovers for table in _tables(path))


def lookup_crossover(key: CrossoverKey, path=None, untuned: int = DEFAULT_MIN_SPARSE_LEN) -> int:
    """Prompt length from which the sparse path runs: tuned, :data:`DENSE_ALWAYS`, or ``untuned`` (logged once)."""
    for table in _tables(path):
        if key in table.crossovers:
            length = table.crossovers[key]
            return DENSE_ALWAYS if length is None else length
    if (key, untuned) not in _missed:
        _missed.add((key, untuned))
        log.warning("no tuned dense/sparse crossover for %s; sparse from %d tokens "
                    "(run `minference-fx autotune` on the GPU that runs the model)", key, untuned)
    return untuned


def describe(path=None) -> str:
    """The user cache and the shipped tables as text, one record a line."""
    path = Path(path) if path is not None else cache_path()
    blocks = [_describe_table(f"user cache {path}", read_table(path))]
    blocks += [_describe_table(f"shipped table {p.name}", read_table(p)) for p in shipped_paths()]
    return "\n".join(blocks)


def _describe_table(title: str, table: Table) -> str:
    lines = [title + ":"]
    if not table:
        return lines[0] + " empty"
    for k in sorted(table.configs):
        e = table.configs[k]
        lines.append(f"  {k.kernel} {k.gpu} sm{k.capability} triton {k.triton} src {k.source_hash} {k.dtype} "
                     f"d{k.head_dim} g{k.group} len~{k.bucket}: BLOCK_M={e.BLOCK_M} BLOCK_N={e.BLOCK_N} "
                     f"num_warps={e.num_warps} num_stages={e.num_stages}")
    for k in sorted(table.crossovers):
        length = table.crossovers[k]
        shown = "never (dense at every measured length)" if length is None else f"sparse from {length}"
        lines.append(f"  crossover {k.gpu} sm{k.capability} triton {k.triton} src {k.source_hash} {k.dtype} "
                     f"d{k.head_dim} g{k.group}: {shown}")
    return "\n".join(lines)
