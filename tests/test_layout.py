"""The layout shows the architecture: the core never imports the tooling (``minference_fx.tools``).

The core is every module of ``minference_fx/`` (``kernels/`` among them) but ``tools/`` and the CLI, plus ``passes/`` and
``autotune/`` (pyproject.toml's package-dir maps them to ``minference_fx.passes`` and so on). Benchmarks, the eval,
the demo and the assets they fetch live in ``minference_fx.tools``; the CLI, the scripts and the tests import them.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = "minference_fx.tools"
# source folder -> the package it is imported as (pyproject.toml's [tool.setuptools] package-dir)
CORE_DIRS = {"minference_fx": "minference_fx", "passes": "minference_fx.passes", "autotune": "minference_fx.autotune"}
NOT_CORE = ("minference_fx/tools/", "minference_fx/cli.py")


def _core_files() -> dict[str, tuple[str, Path]]:
    """{module name: (its package, path)} of every core module."""
    out = {}
    for folder, package in CORE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(NOT_CORE):
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            module = ".".join([package, *parts])
            out[module] = (module if is_package else module.rpartition(".")[0], path)
    return out


def _is_tools(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def _tool_imports(package: str, tree: ast.AST) -> list[str]:
    """Every import in ``tree`` (at any depth, function-level too) that names minference_fx.tools, resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_tools(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if _is_tools(module):
                found.append(module)
            else:  # from minference_fx import tools
                found += [f"{module}.{alias.name}" for alias in node.names if _is_tools(f"{module}.{alias.name}")]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            name = node.args[0].value
            if _is_tools(name) or name.lstrip(".").startswith("tools"):
                found.append(name)
    return found


def test_the_resolver_sees_every_spelling():
    assert _tool_imports("minference_fx.passes", ast.parse("from ..tools import bench")) == ["minference_fx.tools"]
    assert _tool_imports("minference_fx", ast.parse("def f():\n    from . import tools")) == ["minference_fx.tools"]
    assert _tool_imports("minference_fx.autotune", ast.parse("from ..tools.bench import x")) == ["minference_fx.tools.bench"]
    assert _tool_imports("minference_fx", ast.parse("import minference_fx.tools.assets")) == ["minference_fx.tools.assets"]
    assert _tool_imports("minference_fx", ast.parse("importlib.import_module('minference_fx.tools.demo')"))
    assert not _tool_imports("minference_fx.autotune", ast.parse("from . import tuner\nfrom ..plan import Pattern"))


def test_no_core_module_imports_the_tools():
    files = _core_files()
    # the walk found the core: a moved folder would otherwise pass this test by finding nothing
    assert {"minference_fx", "minference_fx.backend", "minference_fx.passes", "minference_fx.kernels.attend",
            "minference_fx.autotune.workload", "minference_fx.search", "minference_fx.inspection"} <= set(files)
    offenders = {}
    for module, (package, path) in files.items():
        found = _tool_imports(package, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        if found:
            offenders[path.relative_to(ROOT).as_posix()] = found
    assert not offenders, f"the core imports tooling (move what it needs into the core): {offenders}"


def test_importing_the_core_loads_no_tool():
    modules = sorted(_core_files())
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m == {TOOLS!r} or m.startswith({TOOLS + '.'!r}))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def _checkout_packages() -> set[str]:
    """Names ``import`` finds in the checkout's root folder (where ``python -m pytest`` and ``python -c`` put it
    first on ``sys.path``): its folders with an ``__init__.py`` and its top-level modules."""
    return ({p.parent.name for p in ROOT.glob("*/__init__.py")} | {p.stem for p in ROOT.glob("*.py")}) - {"minference_fx"}


def test_no_folder_of_the_checkout_shadows_an_installed_package():
    """A top-level ``kernels/`` once stood where Hugging Face's ``kernels`` is imported: transformers 5.25 requires it
    and imports it while loading a model, and from the checkout's root it got ours (ImportError: CUDAProperties)."""
    from importlib.machinery import PathFinder

    names = _checkout_packages()
    assert {"passes", "autotune", "configs"} <= names  # the walk sees the folders
    # where each name would import from if the checkout's root were not on sys.path (the project's own editable
    # install maps its packages by a finder of its own, not by a path entry, so it is not among these)
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
    clashes = sorted(name for name in names if PathFinder.find_spec(name, elsewhere) is not None)
    assert not clashes, f"these folders of the checkout shadow installed packages of the same name: {clashes}"
