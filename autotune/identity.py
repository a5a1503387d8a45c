"""What a tuned number was measured on: the device, the Triton version and the kernel sources."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import re
import tokenize
from importlib import resources

import torch
import triton

# Every file whose code edit can change how fast the op's sparse path runs; reference.py is
# in because it fixes BLOCK and the vertical-slash minima, guard.py for the mass estimate, fit.py for the
# compile options every launch passes and the smaller configs a GPU short of shared memory steps down to.
KERNEL_SOURCES = ("attend.py", "index.py", "guard.py", "reference.py", "tables.py", "fit.py")


@dataclasses.dataclass(frozen=True)
class DeviceIdentity:
    gpu: str
    capability: str


def code_of(source: str) -> str:
    """``source`` without comments, string statements (docstrings) and blank lines: the part whose edit
    can change how fast the kernels run, so that a comment fixed does not void every tuned table.

    Only COMMENT tokens and single-string statements are cut, both located by tokenize the same way on
    every Python version (the device's 3.12 and CI's 3.11 differ in how they tokenize f-strings, which
    are kept as written)."""
    lines = io.StringIO(source).readlines()  # split as tokenize reads them, so token rows index this list
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    significant = [t for t in tokens if t.type not in (tokenize.NL, tokenize.COMMENT)]  # what statements are made of
    for t in tokens:
        if t.type == tokenize.COMMENT:  # runs to the end of its line
            row = t.start[0] - 1
            lines[row] = lines[row].rstrip().removesuffix(t.string.rstrip())
    starts = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    for i, t in enumerate(significant):
        begins = i == 0 or significant[i - 1].type in starts
        # 3.12 splits f-strings into FSTRING_* tokens, 3.11 keeps them one STRING: never cut one on either
        plain = t.type == tokenize.STRING and "f" not in re.match(r"[A-Za-z]*", t.string).group().lower()
        if plain and begins and i + 1 < len(significant) and significant[i + 1].type == tokenize.NEWLINE:
            for row in range(t.start[0] - 1, t.end[0]):
                lines[row] = ""
    return "\n".join(line.rstrip() for line in lines if line.strip())


@functools.lru_cache(maxsize=None)
def kernel_source_hash() -> str:
    root = resources.files("minference_fx.kernels")
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        path = root.joinpath(name)
        # a file that is gone still changes the hash, rather than breaking every lookup
        code = code_of(path.read_text(encoding="utf-8")) if path.is_file() else "<missing>"
        h.update(name.encode() + b"\0" + code.encode() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def triton_version() -> str:
    return triton.__version__


@functools.lru_cache(maxsize=None)
def device_identity(device: torch.device) -> DeviceIdentity:
    """Name and compute capability of ``device``; host queries only, no sync, cached per device."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return DeviceIdentity(torch.cuda.get_device_name(index), f"{major}.{minor}")
    # CPU runs only dispatch (the reference has no launch config), but the crossover is still keyed
    return DeviceIdentity(device.type, "none")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
