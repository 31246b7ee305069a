"""The package installs what it imports: every module under minserve/ imports, and every
third-party module it imports (at the top or inside a function) is one of the distributions
pyproject.toml's [project].dependencies declares, so `pip install minserve` (the README's
first install, no extras) runs the engine, the server, the chapters' pictures and the course."""

import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

import minserve

ROOT = Path(__file__).resolve().parent.parent


def _canonical(distribution: str) -> str:
    """PEP 503's normalized name: `PyYAML`, `pydantic_core` -> `pyyaml`, `pydantic-core`."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _declared_dependencies() -> set[str]:
    """The distribution names in [project].dependencies, normalized."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_canonical(re.match(r"[A-Za-z0-9_.-]+", spec)[0]) for spec in project["dependencies"]}


def _imported_top_level_modules() -> dict[str, str]:
    """Each third-party top-level module imported anywhere in minserve/ -> one place it is."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "minserve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in ("minserve", "__future__"):
                    found.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_module_under_minserve_imports() -> None:
    failures: dict[str, str] = {}

    def record(name: str) -> None:
        failures[name] = repr(sys.exc_info()[1])

    for info in pkgutil.walk_packages(minserve.__path__, "minserve.", onerror=record):
        try:
            importlib.import_module(info.name)
        except Exception as error:  # every failure is reported, not only the first
            failures[info.name] = repr(error)
    assert failures == {}


def test_every_third_party_import_is_a_declared_dependency() -> None:
    declared = _declared_dependencies()
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module, where in _imported_top_level_modules().items():
        names = {_canonical(d) for d in distributions.get(module, [])}
        if not names & declared:
            undeclared[module] = f"{where} (installed from {sorted(names) or 'nothing'})"
    assert undeclared == {}, "imported in minserve/ but not in [project].dependencies"


def test_the_dependency_scan_sees_lazy_and_dotted_imports() -> None:
    imported = _imported_top_level_modules()
    assert "matplotlib" in imported  # `from matplotlib.figure import Figure` in minserve/viz
    assert "ipywidgets" in imported  # imported inside a widget function
    assert "transformers" in imported  # imported inside the chapter 0 checks
    assert "json" not in imported and "minserve" not in imported
