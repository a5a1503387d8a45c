"""The tuned-config cache: how fast each launch config is on a GPU, never which edges are read.

One JSON file in a user cache directory holds three tables:

* ``configs``: :class:`TuneKey` → :class:`TuneEntry` (tile sizes, warps, stages);
* ``crossovers``: :class:`CrossoverKey` → the prompt length from which the sparse
  path (index + attention) beats dense SDPA; ``null`` when it never did;
* ``costs``: :class:`CrossoverKey` → :class:`WalkCost`, what the op's cost model weighs a head's
  sparse walk against the fused SDPA with. A table written before it existed has none; the version stays 1, so
  a release from before reads a newer file (it ignores ``costs``) and drops them when it writes.

Lookups read the user file first, then the tables shipped as package data
(``autotune/*.json``). A missing entry gives a safe default and one log line;
nothing here benchmarks.

Writers take a lock file, re-read and merge, then replace the file atomically,
so two processes tuning at once lose nothing and a reader never sees half a
file. A file that is not valid JSON or not this schema is ignored with one
warning and replaced by the next write. A cache that cannot be read at all (a
directory of the file's name, a cache directory that is a file, a symlink loop,
no permission) is ignored with one warning too, and one that cannot be written
is warned about and left alone: a forward pass then runs on the shipped tables
and defaults, never fails on the cache.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Optional

from ..cost import WalkCost
from ..defaults import DEFAULTS

log = logging.getLogger("minference_fx.autotune")

SCHEMA = "minference-fx/autotune"
VERSION = 1
FILE_NAME = "autotune.json"
ENV_DIR = "MINFERENCE_FX_CACHE_DIR"

# The semantic config's default min_sparse_len: an untuned device behaves as before tuning existed.
DEFAULT_MIN_SPARSE_LEN = DEFAULTS.untuned_min_sparse_len
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
# H200 at 32K and 128K at d128 (results/explore_dense_h200_2026-11-30.txt, _v2 to _v4 at commit 6fb579a, and the re-tunes of
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

    def __str__(self) -> str:
        # what the warnings name: the device and shape in words (the dataclass repr stays for debugging)
        device = self.gpu if self.capability == "none" else f"{self.gpu} (compute capability {self.capability})"
        return (f"{device}, triton {self.triton}, {self.dtype}, head dim {self.head_dim}, GQA {self.group}, "
                f"kernel sources {self.source_hash}")


@dataclasses.dataclass(frozen=True, order=True)
class TuneKey(CrossoverKey):
    """A launch config is chosen per kernel and length bucket on top of what the crossover is keyed by."""

    kernel: str
    """e.g. "sparse_attention" (a key of ``space.SPACE``)"""
    bucket: int
    """``seq_bucket`` of the query length"""

    def __str__(self) -> str:
        # bucket 0 stands for every bucket of the shape (resolve's borrowing)
        where = f" at the {self.bucket}-token bucket" if self.bucket else ""
        return f"{self.kernel}{where} on {super().__str__()}"

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
    costs: dict[CrossoverKey, WalkCost] = dataclasses.field(default_factory=dict)

    def merged(self, newer: "Table") -> "Table":
        return Table({**self.configs, **newer.configs}, {**self.crossovers, **newer.crossovers},
                     {**self.costs, **newer.costs})

    def __bool__(self) -> bool:
        return bool(self.configs or self.crossovers or self.costs)

    def to_json(self) -> str:
        configs = [{"key": dataclasses.asdict(k), "entry": dataclasses.asdict(self.configs[k])} for k in sorted(self.configs)]
        crossovers = [{"key": dataclasses.asdict(k), "min_sparse_len": self.crossovers[k]} for k in sorted(self.crossovers)]
        costs = [{"key": dataclasses.asdict(k), "cost": dataclasses.asdict(self.costs[k])} for k in sorted(self.costs)]
        doc = {"schema": SCHEMA, "version": VERSION, "configs": configs, "crossovers": crossovers, "costs": costs}
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Table":
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, an over-long int, nesting past the stack
            raise ForeignFile(f"not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ForeignFile(f"schema is not {SCHEMA!r}")
        if doc.get("version") != VERSION:
            raise ForeignFile(f"version {doc.get('version')!r}, this minference-fx reads version {VERSION}")
        try:
            configs = {_record(TuneKey, row["key"]): _record(TuneEntry, row["entry"]) for row in doc["configs"]}
            crossovers = {_record(CrossoverKey, row["key"]): _length(row["min_sparse_len"]) for row in doc["crossovers"]}
            costs = {_record(CrossoverKey, row["key"]): checked_cost(_record(WalkCost, row["cost"]))
                     for row in doc.get("costs", [])}
        except (KeyError, TypeError, ValueError) as e:
            raise ForeignFile(f"malformed record ({e})") from None
        return cls(configs, crossovers, costs)


def _record(cls, raw):
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict) or set(raw) != set(fields):
        raise ValueError(f"{cls.__name__} needs fields {sorted(fields)}, got {raw!r}")
    for name, value in raw.items():
        # bool is an int to Python, never to this schema; a float field takes a JSON integer too
        kind = fields[name] if isinstance(fields[name], str) else fields[name].__name__
        want = {"int": (int,), "float": (float, int)}.get(kind, (str,))
        if type(value) not in want:
            raise ValueError(f"{cls.__name__}.{name} = {value!r} is not {want[0].__name__}")
    return cls(**raw)


MAX_COST_LENGTH = 1 << 40
"""the longest ``measured_at`` a cost may carry (a larger one is no measurement, and overflows a float)"""


def checked_cost(cost: WalkCost) -> WalkCost:
    """``cost`` with float rates, or ValueError when it is no measurement: a rate that is not a positive finite
    number, a negative or infinite index share, a length outside [0, :data:`MAX_COST_LENGTH`]. A table holding one
    is foreign as a whole, so a bad measurement must never be written (the tuner checks before it writes)."""
    try:
        rate, share = float(cost.walk_rate), float(cost.index_share)
    except OverflowError:
        raise ValueError(f"{cost}: a rate too large for a float") from None
    if not (math.isfinite(rate) and rate > 0 and math.isfinite(share) and share >= 0
            and 0 <= cost.measured_at <= MAX_COST_LENGTH):
        raise ValueError(f"{cost} needs a finite walk_rate > 0, a finite index_share >= 0 and 0 <= measured_at <= "
                         f"{MAX_COST_LENGTH}")
    return WalkCost(rate, share, cost.measured_at)


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


def _warn_once(memo_key, message: str, *args) -> None:
    if memo_key not in _warned:
        _warned.add(memo_key)
        log.warning(message, *args)


def _os_error(e: OSError) -> tuple:
    """What identifies an OSError across calls (its text names the path, which the key holds already)."""
    return type(e).__name__, e.errno


def _read(path: Path) -> tuple[Table, Optional[str]]:
    """The table in ``path`` and, when it was ignored, why (None: read, or missing)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Table(), None
    except UnicodeDecodeError:
        text = ""  # binary garbage: report it like bad JSON
    except OSError as e:
        # a directory of the file's name, a cache directory that is a file, a symlink loop, no permission
        why = f"cannot read it ({e})"
        _warn_once((str(path), "read", *_os_error(e)),
                   "ignoring the autotune cache %s: %s; using the shipped tables and defaults", path, why)
        return Table(), why
    try:
        return Table.from_json(text), None
    except ForeignFile as e:
        try:
            st = path.stat()
            version = (st.st_mtime_ns, st.st_size)
        except OSError:  # gone or changed since the read
            version = None
        # once per version of the file: a file broken again after a rewrite is news
        _warn_once((str(path), *version) if version else (str(path), "foreign", str(e)),
                   "ignoring the autotune cache %s: %s; the next tuning run rewrites it", path, e)
        return Table(), str(e)


def read_table(path) -> Table:
    """The table in ``path``; empty when the file is missing, or unreadable, foreign or corrupt (then warned
    about once)."""
    return _read(Path(path))[0]


def write(configs: Optional[dict] = None, crossovers: Optional[dict] = None, path=None,
          costs: Optional[dict] = None) -> Optional[Path]:
    """Merge these records into the user cache file (or ``path``), atomically and under a lock.

    Returns the path written, or None when the cache location cannot take a file (see :func:`unwritable`):
    then nothing is stored and one warning says why, so a forward that tunes on a miss runs on what it has.
    An error while the new file replaces the old one (a full disk) raises, and the old file stands."""
    path = Path(path) if path is not None else cache_path()
    update = Table(dict(configs or {}), dict(crossovers or {}), dict(costs or {}))
    try:
        lock = _locked(path)
    except OSError as e:
        return _not_written(path, e)
    with lock:
        # re-read under the lock: another process may have written since we last looked
        text = read_table(path).merged(update).to_json()
        try:
            fd, tmp = _temporary(path)
        except OSError as e:  # a directory that takes no new file
            return _not_written(path, e)
        _replace(path, fd, tmp, text)
    forget()
    return path


def unwritable(path=None) -> Optional[str]:
    """Why the user cache file (or ``path``) cannot be written, or None when it can (its directory is made
    then): the directory cannot be made or is a file, the lock file cannot be opened or locked, a directory has
    the file's name, or the directory takes no new file."""
    path = Path(path) if path is not None else cache_path()
    try:
        with _locked(path):
            fd, tmp = _temporary(path)
            os.close(fd)
            Path(tmp).unlink()
    except OSError as e:
        return str(e)
    return None


def _not_written(path: Path, e: OSError) -> None:
    _warn_once((str(path), "write", *_os_error(e)), "cannot write the autotune cache %s (%s); nothing was stored "
               "(point %s at a writable directory)", path, e, ENV_DIR)
    return None


def _locked(path: Path):
    """The lock file of ``path``, open and locked (closing it unlocks); OSError when the location cannot take
    the cache file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # "File exists" would not say what is wrong with it
        os.stat(path.parent)  # a symlink loop or a dangling link raises its own error here
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)) from None
    if path.is_dir():  # os.replace would fail on it only after the lock and the temporary file
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    lock = open(path.with_name(path.name + ".lock"), "a")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    except BaseException:
        lock.close()
        raise
    return lock


def _temporary(path: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)


def _replace(path: Path, fd: int, tmp: str, text: str) -> None:
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


def _release(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in version.split("+")[0].split("."))


def _other_triton(key, records: list) -> tuple[Optional[str], list]:
    """``(release, values)``: the values of ``records`` ((record key, value) pairs, the user cache's last) whose key
    is ``key`` but for its triton release, of the newest such release (same GPU, kernel sources and shape), or
    ``(None, [])``. Within a release the user cache's come last, so they win where a caller keeps the last.

    A launch config, a crossover and a cost change speed only, and the kernels compile alike across releases: the
    sm_90a PTX of every shipped launch is byte-identical under triton 3.6 and 3.9 (BENCHMARKS.md section 6). So a
    user on today's triton runs the GPU's table tuned under an older release rather than untuned defaults."""
    found = [(k.triton, value) for k, value in records
             if k.triton != key.triton and dataclasses.replace(k, triton=key.triton) == key]
    if not found:
        return None, []
    newest = max((release for release, _ in found), key=_release)
    return newest, [value for release, value in found if release == newest]


def _records(path, field: str) -> list:
    """Every ``(key, value)`` of ``field`` ("configs", "crossovers", "costs") in the tables, the user cache's last."""
    return [item for table in reversed(_tables(path)) for item in getattr(table, field).items()]


def _borrowed(key, what: str, release: str) -> None:
    if (what, key) not in _missed:
        _missed.add((what, key))
        log.warning("no %s tuned under triton %s for %s; using the one tuned on this GPU under triton %s (run "
                    "`minference-fx autotune` to tune this release)", what, key.triton, key, release)


def find(key: TuneKey, path=None) -> Optional[TuneEntry]:
    """The stored entry for ``key`` (user cache first, then shipped tables), or None."""
    for table in _tables(path):
        if key in table.configs:
            return table.configs[key]
    return None


def resolve(key: TuneKey, path=None) -> tuple[TuneEntry, Optional[int]]:
    """The config for ``key`` and the bucket it was tuned at: its own bucket's; else the nearest tuned bucket
    (log scale, the larger on a tie) of the same kernel and shape; else the same from the buckets the newest other
    triton release tuned on this GPU and kernels (:func:`_other_triton`); else ``(the kernel's default, None)``.

    A launch config changes speed only, and a neighbour's is the better guess: on the H200 the tuned
    configs of 32K, 64K and 128K agree, so a 256K prompt runs the 128K config rather than the untuned one."""
    entry = find(key, path)
    if entry is not None:
        return entry, key.bucket
    shape = dataclasses.replace(key, bucket=0)
    # the user cache's records come last, so they win
    tuned = {k.bucket: e for k, e in _records(path, "configs") if dataclasses.replace(k, bucket=0) == shape}
    if not tuned:  # no bucket of the shape under this release: the newest other release's, same GPU and kernels
        release, buckets = _other_triton(shape, [(dataclasses.replace(k, bucket=0), (k.bucket, e))
                                                 for k, e in _records(path, "configs")])
        tuned = dict(buckets)  # the user cache's come last, so they win
        if release is not None:
            _borrowed(shape, f"{key.kernel} launch config", release)
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
    """Prompt length from which the sparse path runs: tuned (else tuned on this GPU under the newest other triton
    release, :func:`_other_triton`), :data:`DENSE_ALWAYS`, or ``untuned`` (each fallback logged once)."""
    for table in _tables(path):
        if key in table.crossovers:
            length = table.crossovers[key]
            return DENSE_ALWAYS if length is None else length
    release, lengths = _other_triton(key, _records(path, "crossovers"))
    if release is not None:
        _borrowed(key, "crossover", release)
        return DENSE_ALWAYS if lengths[-1] is None else lengths[-1]
    if (key, untuned) not in _missed:
        _missed.add((key, untuned))
        log.warning("no tuned dense/sparse crossover for %s; sparse from %d tokens "
                    "(run `minference-fx autotune` on the GPU that runs the model)", key, untuned)
    return untuned


def lookup_cost(key: CrossoverKey, path=None) -> Optional[WalkCost]:
    """The measured :class:`WalkCost` for ``key`` (user cache first, then shipped tables; else the newest other
    triton release's on this GPU, :func:`_other_triton`), or None."""
    for table in _tables(path):
        if key in table.costs:
            return table.costs[key]
    _, costs = _other_triton(key, _records(path, "costs"))
    return costs[-1] if costs else None


def cautious_cost(key: CrossoverKey, path=None) -> Optional[WalkCost]:
    """For a GPU with no cost measured at ``key``: the slowest walk rate and the dearest index measured for the same
    dtype, head dim and group on any GPU or kernel hash in the tables, or None (none measured, or a CPU key).

    Every (GPU, shape) measured so far walks at 0.70-0.82 of the fused SDPA's rate per tile (BENCHMARKS.md section
    6), so the near-dense rule alone (:data:`~minference_fx.cost.UNTUNED_COST`) left heads keeping 70-90 % of their
    tiles on the slower walk: on an H100 whose table lacked Llama-3-8B's shape the op ran 0.83x cuDNN on the
    scattered family at 32K, 1.04x once tuned. Guessing the slowest rate routes a few heads that a faster GPU would
    have walked a little faster; a routed head's output is dense attention's, so only speed is at stake."""
    if key.capability == "none":
        return None
    same_shape = lambda k: (k.dtype, k.head_dim, k.group) == (key.dtype, key.head_dim, key.group)  # noqa: E731
    measured = [c for k, c in _records(path, "costs") if same_shape(k) and c.measured_at > 0]
    if not measured:
        return None
    dearest_index = max(measured, key=lambda c: c.index_share * c.measured_at)
    return WalkCost(walk_rate=min(c.walk_rate for c in measured), index_share=dearest_index.index_share,
                    measured_at=dearest_index.measured_at)


def describe(path=None) -> str:
    """The user cache and the shipped tables as text, one record a line (a table ignored says why)."""
    path = Path(path) if path is not None else cache_path()
    blocks = [_describe_table(f"user cache {path}", *_read(path))]
    blocks += [_describe_table(f"shipped table {p.name}", *_read(p)) for p in shipped_paths()]
    return "\n".join(blocks)


def _describe_table(title: str, table: Table, ignored: Optional[str] = None) -> str:
    lines = [title + ":"]
    if ignored is not None:
        return lines[0] + f" empty (ignored: {ignored})"
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
    for k in sorted(table.costs):
        c = table.costs[k]
        lines.append(f"  cost {k.gpu} sm{k.capability} triton {k.triton} src {k.source_hash} {k.dtype} "
                     f"d{k.head_dim} g{k.group}: sparse walk at {c.walk_rate:.3f}x the fused SDPA's rate per tile, "
                     f"index {c.index_share:.4f} of the dense layer at {c.measured_at} keys")
    return "\n".join(lines)
