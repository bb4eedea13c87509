"""The shape of the control plane, checked so that it stays:

- one arrow between the apps: ``apps.routing`` (where requests go) may import ``apps.replicas``
  (who serves); ``apps.replicas`` never imports ``apps.routing``, not even inside a function;
- the engine imports nothing from the control plane (it is reusable alone);
- nothing reaches for a process-wide router: it is built by the process start and handed on.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


# ----- the routing app's wings --------------------------------------------------------------------
DECISION_FORBIDDEN = ("apps.routing.proxy", "apps.routing.feeds", "django", "aiohttp")


def test_the_decision_imports_neither_the_proxy_nor_the_feeds_nor_django_nor_aiohttp():
    """apps/routing/decision is computation over in-memory state: readable and testable alone."""
    assert offenders("apps/routing/decision", DECISION_FORBIDDEN) == []
    # of the apps, it leans on itself and on the one Django-free module of replicas
    allowed = ("apps.routing.decision", "apps.replicas.targets")
    leaning = [
        line
        for line in offenders("apps/routing/decision", ("apps.", "controlplane"))
        if not line.split(" imports ", 1)[1].startswith(allowed)
    ]
    assert leaning == []


def test_importing_the_decision_loads_no_django_aiohttp_proxy_or_feeds():
    """The same rule at run time, through every module the decision imports."""
    modules = sorted(
        "apps.routing.decision." + path.stem
        for path in (ROOT / "apps/routing/decision").glob("*.py")
        if path.stem != "__init__"
    )
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"print(sorted(m for m in sys.modules if m.startswith({DECISION_FORBIDDEN!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_apps_import_nothing_of_the_engines_http_front():
    """What the engine's front and the router's proxy both need is in serving/, which both
    import. The one exception is ``manage.py runengine``: it is the engine's command line."""
    runengine = "apps/replicas/management/commands/runengine.py:"
    assert [x for x in offenders("apps", ("engine.server",)) if not x.startswith(runengine)] == []
    assert offenders("controlplane", ("engine.server",)) == []


def test_serving_leans_on_neither_side():
    assert offenders("serving", ("engine", "apps", "controlplane", "django")) == []


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
    sample.write_text("def f():\n    from apps.routing.decision.router import Router\n")
    assert imported_modules(sample) == [
        (2, "apps.routing.decision.router"),
        (2, "apps.routing.decision.router.Router"),
    ]


# ----- the benchmarks, the tests and the process helpers they share -----------------------------
def test_bench_imports_nothing_from_the_tests():
    """The load generator and its runs stand alone: what they share with the tests is harness's."""
    assert offenders("bench", ("tests",)) == []


def test_the_test_support_imports_nothing_from_bench():
    assert offenders("tests/support", ("bench",)) == []


def test_harness_imports_neither_bench_nor_the_tests():
    """Both import harness, so it must lean on neither (else the two depend on each other again)."""
    assert offenders("harness", ("bench", "tests")) == []


# ----- the engine's own arrows -------------------------------------------------------------------
def package_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package; a package is its ``__init__``."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_arrows(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever the import stands.

    ``from engine.x import Name`` is an arrow to ``engine.x`` (the longest imported prefix that
    is a module). Importing ``engine.sim.runner`` also runs ``engine.sim``'s ``__init__``, so it
    is an arrow to that package too, unless the importer lies inside it: Python imported a
    module's own packages before the module, so importing them again runs nothing and closes no
    circle."""
    modules = package_modules(package_dir)
    arrows: dict[str, set[str]] = {}
    for name, path in modules.items():
        arrows[name] = set()
        for _, imported in imported_modules(path):
            parts = imported.split(".")
            targets = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
            target = next((t for t in targets if t in modules), None)
            if target is None:
                continue
            runs = [t for t in targets[targets.index(target) :] if t in modules]
            arrows[name] |= {t for t in runs if t != name and not name.startswith(t + ".")}
    return arrows


def strongly_connected(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components (modules that reach one another), each sorted."""
    reach = {name: _reachable(name, arrows) for name in arrows}
    components, placed = [], set()
    for name in sorted(arrows):
        if name not in placed:
            component = sorted({other for other in reach[name] if name in reach[other]} | {name})
            placed.update(component)
            components.append(component)
    return components


def _reachable(start: str, arrows: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in arrows.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_engine_has_no_circle():
    """No engine module imports another that imports it back, directly or round a longer loop,
    not even inside a function: a circle makes the import order matter and the modules one."""
    relative = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in package_modules(ROOT / "engine").values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []  # ``imported_modules`` skips relative imports: the graph would miss them
    circles = [c for c in strongly_connected(module_arrows(ROOT / "engine")) if len(c) > 1]
    assert circles == []


def test_the_engine_has_no_circle_through_its_subpackages():
    """The same with ``engine.sim`` and ``engine.server`` each taken whole: the simulation is
    one of the engine's runners, so nothing in it may drive ``engine.llm_engine``."""
    arrows: dict[str, set[str]] = {}
    for name, targets in module_arrows(ROOT / "engine").items():
        whole = ".".join(name.split(".")[:2])  # engine.sim.runner -> engine.sim
        arrows.setdefault(whole, set()).update(".".join(t.split(".")[:2]) for t in targets)
        arrows[whole].discard(whole)
    assert [c for c in strongly_connected(arrows) if len(c) > 1] == []


def test_the_circle_finder_sees_a_circle(tmp_path):
    """A circle through a function-level import and a package's ``__init__`` is found; a module
    importing its own package is no circle."""
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.sub.b import B\n",
        "sub/__init__.py": "from pkg import c\n",
        "sub/b.py": "import pkg.sub\nB = 1\n",
        "c.py": "import pkg.a\n",
        "d.py": "from pkg import a\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    arrows = module_arrows(tmp_path / "pkg")
    assert arrows["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and arrows["pkg.sub.b"] == set()
    circle = ["pkg.a", "pkg.c", "pkg.sub"]
    assert strongly_connected(arrows) == [["pkg"], circle, ["pkg.d"], ["pkg.sub.b"]]
