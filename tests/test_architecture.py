"""The import rules of docs/architecture.md, checked on the source: which package may import which, no import cycle
between modules, and no moepager import hidden inside a function below the command line."""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import moepager

PACKAGE = pathlib.Path(moepager.__file__).parent
FLOORS = {
    "types": 0, "errors": 0,
    "config": 1, "atomic_io": 1,
    "policies": 2, "predictors": 2,
    "store": 3,
    "experts": 4,
    "models": 5,
    "accel": 6,
    "checkpoints": 7,
    "planning": 8,
    "trace": 9,
    "runtime": 10,
    "server": 11,
    "cli": 12,
    "distributed": 13,
}
"""Each node imports only nodes on lower floors (docs/architecture.md, "Layers")."""
LOCAL_IMPORTS_ALLOWED = {"cli"}
"""Where a function may import moepager modules: commands load the engine only when they run."""


def node(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def module(path: pathlib.Path) -> str:
    return ".".join(("moepager",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


def imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(imported moepager module, at module level outside TYPE_CHECKING) for every import in the file."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
                   for n in ast.walk(block)}
    top = {id(n) for n in tree.body}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("moepager"):
            names = [n.module] if n.module != "moepager" else [f"moepager.{a.name}" for a in n.names]
        elif isinstance(n, ast.Import):
            names = [a.name for a in n.names if a.name.startswith("moepager.")]
        else:
            continue
        found += [(name, id(n) in top and id(n) not in typing_only) for name in names]
    return found


def sources() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_node_has_a_floor():
    assert {node(p) for p in sources()} <= set(FLOORS)


def test_imports_only_go_down():
    upward = []
    for path in sources():
        src = node(path)
        for name, _ in imports(path):
            dst = name.split(".")[1]
            if dst != src and FLOORS[dst] >= FLOORS[src]:
                upward.append(f"{module(path)} -> {name}")
    assert upward == []


def test_config_is_a_leaf():
    assert {name.split(".")[1] for name, _ in imports(PACKAGE / "config.py")} <= {"types", "errors"}


def test_no_moepager_import_inside_a_function_below_the_cli():
    hidden = [f"{module(p)} -> {name}" for p in sources() if node(p) not in LOCAL_IMPORTS_ALLOWED
              for name, top in imports(p) if not top and not _typing_only(p, name)]
    assert hidden == []


def _typing_only(path: pathlib.Path, name: str) -> bool:
    """Whether every import of `name` in the file sits under `if TYPE_CHECKING:` (annotations, not a dependency)."""
    return "TYPE_CHECKING" in path.read_text() and all(
        name not in line for line in path.read_text().splitlines() if line.startswith(("from ", "import ")))


def test_no_import_cycle_between_modules():
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sources():
        for name, top in imports(path):
            if top:
                graph[module(path)].add(name)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in graph.get(m, ()):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n] if n in stack else [m, n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in list(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
