"""What a tuned number was measured on: the device, the Triton version and the kernel sources."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from importlib import resources

import torch

# Every file whose edit can change how fast the op's sparse path runs; reference.py is
# in because it fixes BLOCK and the vertical-slash minima, guard.py for the mass estimate.
KERNEL_SOURCES = ("attend.py", "index.py", "guard.py", "reference.py", "tables.py")


@dataclasses.dataclass(frozen=True)
class DeviceIdentity:
    gpu: str
    capability: str


@functools.lru_cache(maxsize=None)
def kernel_source_hash() -> str:
    root = resources.files("minference_fx.kernels")
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        path = root.joinpath(name)
        # a file that is gone still changes the hash, rather than breaking every lookup
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"<missing>") + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def triton_version() -> str:
    import triton

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
