"""The import rules of docs/architecture.md, checked on the source: which package may import which, no import cycle
between modules (annotations' imports under `if TYPE_CHECKING:` count: a cycle in types is a cycle in design), no
moepager import hidden inside a function below the command line, no module calling another's private methods, and no
measured figure in the code's docstrings and comments."""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize
from collections import defaultdict

import moepager

PACKAGE = pathlib.Path(moepager.__file__).parent
FLOORS = {
    "types": 0, "errors": 0,
    "config": 1, "atomic_io": 1,
    "policies": 2, "predictors": 2,
    "store": 3,
    "experts": 4,
    "models.config": 5, "models.naming": 5,
    "models.specs": 6,
    "checkpoints": 7,
    "models": 8,
    "accel": 9,
    "loading": 10,
    "planning": 11,
    "trace": 12,
    "placements": 13,
    "runtime": 14,
    "server": 15,
    "cli": 16,
    "distributed": 17,
}
"""Each node imports only nodes on lower floors (docs/architecture.md, "Layers"). A node is a top-level folder or
module, or one of the modules named here on a floor of their own below their folder: an architecture's checkpoint
spec (`models/specs.py`, with the `ModelConfig` and the expert tensor names it gives), which the formats read without
importing model code."""
LOCAL_IMPORTS_ALLOWED = {"cli"}
"""Where a function may import moepager modules: commands load the engine only when they run."""


def node_of(name: str) -> str:
    """The node of the module `name` ("moepager.models.specs" -> "models.specs", "moepager.models.moe" -> "models")."""
    parts = name.split(".")[1:]
    return ".".join(parts[:2]) if ".".join(parts[:2]) in FLOORS else parts[0]


def node(path: pathlib.Path) -> str:
    return node_of(module(path))


def module(path: pathlib.Path) -> str:
    return ".".join(("moepager",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


TOP, TYPING, LOCAL = "top", "typing", "local"
"""Where an import sits: at module level, under `if TYPE_CHECKING:` (anywhere), or inside a function or block."""


def imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """(imported moepager module, where it sits: TOP, TYPING or LOCAL) for every import in the file."""
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
        where = TYPING if id(n) in typing_only else TOP if id(n) in top else LOCAL
        found += [(name, where) for name in names]
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
            dst = node_of(name)
            if dst != src and FLOORS[dst] >= FLOORS[src]:
                upward.append(f"{module(path)} -> {name}")
    assert upward == []


def test_config_is_a_leaf():
    assert {name.split(".")[1] for name, _ in imports(PACKAGE / "config.py")} <= {"types", "errors"}


def test_no_moepager_import_inside_a_function_below_the_cli():
    hidden = [f"{module(p)} -> {name}" for p in sources() if node(p) not in LOCAL_IMPORTS_ALLOWED
              for name, where in imports(p) if where == LOCAL]
    assert hidden == []


def test_a_local_import_in_a_file_with_type_checking_is_still_found(tmp_path):
    """The hole the 2026-12-01 review found: a function-local import passed in any file that mentions TYPE_CHECKING."""
    source = tmp_path / "buffer.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moepager.store.store import X\n"
                      "def want():\n    from moepager.policies.prefetch import PrefetchAware\n")
    assert imports(source) == [("moepager.store.store", TYPING), ("moepager.policies.prefetch", LOCAL)]


def test_no_module_calls_another_modules_private_methods():
    """A method whose name starts with one underscore is called (or passed) only through `self` or `cls`: what another
    module needs is a declared hook, not a private part."""
    trees = {p: ast.parse(p.read_text()) for p in sources()}
    private = {f.name for tree in trees.values() for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
               and f.name.startswith("_") and not f.name.startswith("__")}
    reached = [f"{module(p)}:{n.lineno} {ast.unparse(n)}" for p, tree in trees.items() for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr in private
               and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]
    assert reached == []


def test_no_import_cycle_between_modules():
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sources():
        for name, where in imports(path):
            if where != LOCAL:
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


PLACEMENT_PLUGINS = {"resident", "paged", "hybrid", "cpu_experts", "remote"}
"""moepager/placements/'s plug-in modules (registered in `PLACEMENTS`)."""
NAMES_A_PLACEMENT = {"moepager.distributed.roles": {"moepager.placements.remote"}}
"""Modules outside placements/ allowed to import a plug-in: OD-MoE's worker ranks build what `remote` places on them."""


def test_nothing_outside_the_placements_folder_names_a_placement():
    """The composition root finds a placement in the registry (`moepager.placements.resolve`); adding one is a file in
    placements/ and a registry line, and no other module changes."""
    named = [f"{module(p)} -> {name}" for p in sources() if node(p) != "placements" for name, _ in imports(p)
             if name.split(".")[:2] == ["moepager", "placements"] and name.split(".")[-1] in PLACEMENT_PLUGINS
             and name not in NAMES_A_PLACEMENT.get(module(p), ())]
    assert named == []


MEASURED = re.compile(r"\b\d[\d.,]*(?:\s*/\s*\d[\d.,]*)*\s*(?:tok/s|GB/s|MB/s|us|µs|ms|s)\b"
                      r"|\b\d[\d.]*x (?:faster|slower)")
"""A measured figure: a rate, a time (seconds too) or a speed-up (the 2026-12-01 review's F10)."""
SPECIFIED = {"15.8 / 31.5 / 63 GB/s"}
"""Figures that are specifications, not measurements (PCIe's nominal rates, planning/cost.py)."""


def test_docstrings_and_comments_state_contracts_not_measurements():
    """A measured figure lives in benchmarks/README.md (or docs/history/), not in the code that it measured
    (docs/architecture.md, "One figure, one place"): no rate, time or speed-up in a docstring or comment of the package,
    Python or C++."""
    found = []
    for path in [*sources(), *sorted((PACKAGE / "accel" / "csrc").glob("*.[ch]*"))]:
        text = path.read_text()
        if path.suffix == ".py":
            tokens = tokenize.generate_tokens(io.StringIO(text).readline)
            notes = [t.string for t in tokens if t.type == tokenize.COMMENT
                     or t.type == tokenize.STRING and t.string.lstrip("rbuf").startswith('"""')]
        else:
            notes = [line.split("//", 1)[1] for line in text.splitlines() if "//" in line]
        found += [f"{module(path) if path.suffix == '.py' else path.name}: {m.group(0)}" for note in notes
                  for m in MEASURED.finditer(note) if m.group(0) not in SPECIFIED]
    assert found == []
