"""The releases this project is tested on, and one warning when a newer one is installed.

CI (``.ci/run``) runs the whole suite on the oldest and the newest stack below. A newer torch, triton or
transformers may trace attention differently; the passes then leave what they cannot read dense (with the
reason in the report), and ``options={"verify": True}`` checks each rewrite against the traced model.
"""
from __future__ import annotations

import re
import warnings
from importlib import metadata

OLDEST = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
NEWEST = {"torch": "2.15.0", "triton": "3.9.0", "transformers": "5.25.0"}


def release(version: str) -> tuple:
    """The numeric release of a version string: "2.14.1+cu130" -> (2, 14, 1); "5.25.0.dev0" -> (5, 25, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def installed(package: str):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def untested(versions: dict) -> list[str]:
    """"package X (tested up to Y)" for each installed version newer than the newest tested one."""
    return [f"{name} {version} (tested up to {NEWEST[name]})" for name, version in versions.items()
            if version is not None and release(version) > release(NEWEST[name])]


def warn_if_untested() -> None:
    newer = untested({name: installed(name) for name in NEWEST})
    if newer:
        warnings.warn(f"minference-fx is tested on torch {OLDEST['torch']}-{NEWEST['torch']}, triton "
                      f"{OLDEST['triton']}-{NEWEST['triton']}, transformers {OLDEST['transformers']}-"
                      f"{NEWEST['transformers']}; installed: {', '.join(newer)}. Attention it cannot read stays "
                      "dense; options={'verify': True} checks each rewrite against the traced model",
                      stacklevel=3)
