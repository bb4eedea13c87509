"""The shape of the control plane, checked so that it stays:

- one arrow between the apps: ``apps.routing`` (where requests go) may import ``apps.replicas``
  (who serves); ``apps.replicas`` never imports ``apps.routing``, not even inside a function;
- the engine imports nothing from the control plane (it is reusable alone);
- nothing reaches for a process-wide router: it is built by the process start and handed on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, wherever it stands (functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from apps import routing`` names the package through its attribute
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if module.startswith(forbidden):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return out


def test_replicas_never_imports_routing():
    assert offenders("apps/replicas", ("apps.routing",)) == []


def test_the_engine_imports_nothing_of_the_control_plane():
    assert offenders("engine", ("apps", "controlplane", "django")) == []


@pytest.mark.parametrize("package", ["apps", "controlplane"])
def test_no_process_wide_router(package):
    """``get_router()`` / ``set_router()`` are gone: the router travels in arguments and scopes."""
    hits = [
        f"{path.relative_to(ROOT)}"
        for path in sorted((ROOT / package).rglob("*.py"))
        if "get_router(" in path.read_text() or "set_router(" in path.read_text()
    ]
    assert hits == []


def test_the_checker_sees_function_level_imports(tmp_path):
    """The rule would be empty if the walk missed imports inside functions."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from apps.routing.router import Router\n")
    assert imported_modules(sample) == [
        (2, "apps.routing.router"),
        (2, "apps.routing.router.Router"),
    ]
