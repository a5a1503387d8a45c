"""Python's own standard-library sources as a code corpus: every Python install has them, nothing to fetch.

The perplexity and RULER-style haystacks of a coder model read it beside Austen's prose. The text is
deterministic for one Python install: the files (tests and site-packages left out) are sorted by path,
shuffled with a fixed seed so that neighbouring modules of one package do not fill a whole window, and joined
with a ``# file: <path>`` line before each. Another Python version has other sources, so results record the
version, the file count and the text's sha256 (:meth:`CodeCorpus.describe`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import random
import sysconfig
from pathlib import Path
from typing import Optional

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""installed packages and the test suites (large, and full of deliberately odd code)"""
DEFAULT_MAX_CHARS = 4_000_000
"""about a million tokens of code: room for a 128K-token window at any of many offsets"""


@dataclasses.dataclass(frozen=True)
class CodeCorpus:
    text: str
    root: str
    files: int
    """source files joined into ``text``"""
    python: str
    seed: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def describe(self) -> dict:
        """Everything but the text: what a results file records to say which code it read."""
        return {"root": self.root, "files": self.files, "chars": len(self.text), "python": self.python,
                "seed": self.seed, "sha256": self.sha256}


def stdlib_root() -> Path:
    """The directory of the standard library's sources (where ``os`` lives)."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Every ``.py`` under ``root`` outside :data:`SKIPPED_DIRS`, as sorted POSIX paths relative to it."""
    found = []
    for folder, dirs, files in os.walk(root):  # os.walk does not follow symlinked folders: no cycles
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def stdlib_code(seed: int = 0, max_chars: int = DEFAULT_MAX_CHARS, root: Optional[Path] = None) -> CodeCorpus:
    """The shuffled sources joined until ``max_chars`` characters are reached (the file that crosses it whole).

    Files that are not UTF-8 are left out (a handful of encoding examples).
    """
    root = Path(root) if root is not None else stdlib_root()
    files = source_files(root)
    if not files:
        raise ValueError(f"no Python sources under {root} (a Python install without its .py files?); "
                         "pass root= a directory of .py files")
    random.Random(seed).shuffle(files)
    parts, total = [], 0
    for rel in files:
        try:
            source = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        part = f"# file: {rel}\n{source.rstrip()}\n\n\n"
        parts.append(part)
        total += len(part)
        if total >= max_chars:
            break
    if not parts:
        raise ValueError(f"none of the {len(files)} Python sources under {root} could be read as UTF-8")
    return CodeCorpus("".join(parts), str(root), len(parts), platform.python_version(), seed)
