"""The tested range: pyproject states it, the import warns past it."""
import re
from pathlib import Path

import pytest

from minference_fx import versions


def test_release_reads_local_and_dev_versions():
    assert versions.release("2.14.1+cu130") == (2, 14, 1)
    assert versions.release("5.25.0.dev0") == (5, 25, 0)


def test_only_newer_than_tested_is_named():
    newer = versions.untested({"torch": "2.16.0", "triton": "3.9.0", "transformers": "5.24.0+local"})
    assert newer == ["torch 2.16.0 (tested up to 2.15.0)"]
    assert versions.untested({"torch": "2.11.0+cpu", "triton": None, "transformers": "5.17.0"}) == []


def test_import_warns_naming_the_versions(monkeypatch):
    monkeypatch.setattr(versions, "installed", {"torch": "2.16.0", "triton": "3.10.0", "transformers": "5.24.0"}.get)
    with pytest.warns(UserWarning, match=r"installed: torch 2\.16\.0 \(tested up to 2\.15\.0\), triton 3\.10\.0"):
        versions.warn_if_untested()


def test_pyproject_states_the_tested_range():
    """The upper bounds admit the newest tested release and nothing past its minor release; the lower the oldest."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    deps = tomllib.loads(text)["project"]
    specs = deps["dependencies"] + deps["optional-dependencies"]["transformers"]
    for name in ("torch", "triton", "transformers"):
        (spec,) = [s for s in specs if re.match(rf"{name}\b", s)]
        low, high = re.findall(r">=([\d.]+)", spec)[0], re.findall(r"<([\d.]+)", spec)[0]
        assert versions.release(low) <= versions.release(versions.OLDEST[name])
        assert versions.release(versions.NEWEST[name]) < versions.release(high)
        newest = versions.release(versions.NEWEST[name])
        assert versions.release(high) <= (newest[0], newest[1] + 1, 0), spec


def test_ci_pins_the_stacks_the_warning_names():
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    for stack, pins in (("OLDEST", versions.OLDEST), ("LATEST", versions.NEWEST)):
        line = re.search(rf"^{stack}=\((.*)\)$", ci, re.M).group(1)
        assert dict(re.findall(r'"(\w+)==([\d.]+)"', line)) == pins
