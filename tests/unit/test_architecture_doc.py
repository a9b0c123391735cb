"""docs/architecture.md names every module of zero_plugin, and names no module that does not exist.

Pure file reading: no torch, no process group.  A module is named by its path relative to ``zero_plugin/`` in
backticks (``comm/layout.py``); an ``__init__.py`` must be named only when it holds code beyond its docstring,
imports, ``__all__`` and dunder constants (``integrations/lightning/__init__.py`` registers strategies).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zero_plugin"
DOC = ROOT / "docs" / "architecture.md"


def _holds_code(init: Path) -> bool:
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id.startswith("__") and t.id.endswith("__") for t in targets):
                continue  # __all__, __version__
        return True
    return False


def _modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and not _holds_code(path):
            continue
        found.add(path.relative_to(PACKAGE).as_posix())
    return found


def _named_paths() -> set[str]:
    """Every backticked ``*.py`` path in the doc, ``zero_plugin/`` prefix removed."""
    named = set()
    for span in re.findall(r"`([^`\s]+\.py)`", DOC.read_text()):
        named.add(span.removeprefix("zero_plugin/"))
    return named


def test_every_module_is_named():
    missing = sorted(_modules() - _named_paths())
    assert not missing, f"docs/architecture.md does not name these modules (add a Layout row each): {missing}"


def test_every_named_module_exists():
    """A backticked path under one of the package's folders, or a bare file name, must name a module that exists."""
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    basenames = {m.rsplit("/", 1)[-1] for m in modules}
    stale = []
    for path in sorted(_named_paths()):
        head, _, _ = path.partition("/")
        if "/" not in path:
            if path not in basenames:
                stale.append(path)
        elif head in folders and path not in modules:
            stale.append(path)
    assert not stale, f"docs/architecture.md names modules that do not exist under zero_plugin/: {stale}"
