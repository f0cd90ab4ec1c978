"""Code the default suite never runs (the GPU tests, the CUDA benchmarks, the benchmarks that read ../shared's traces)
still speaks the package's current API: every config dataclass it builds is given fields that exist, and every
moepager name it imports (at the top or inside a function) is there. A config field moved into a sub-config once broke
a benchmark only CI's trace-reading run reached; these checks find that on any host, with no GPU and no traces."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib

import moepager.config

ROOT = pathlib.Path(moepager.__file__).parent.parent
CONFIGS = {name: {f.name for f in dataclasses.fields(obj)} for name, obj in vars(moepager.config).items()
           if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == "moepager.config"}
"""Each config dataclass of moepager/config.py and the fields it takes."""


def python_files() -> list[pathlib.Path]:
    return sorted(p for folder in ("moepager", "benchmarks", "tests", "scripts") if (ROOT / folder).is_dir()
                  for p in (ROOT / folder).rglob("*.py"))


def called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def unknown_config_fields(tree: ast.AST) -> list[str]:
    """`EngineConfig(expert_dtype=...)` where EngineConfig has no such field: 'line: Class(field=)'."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and (name := called_name(n)) in CONFIGS:
            found += [f"{n.lineno}: {name}({k.arg}=)" for k in n.keywords if k.arg and k.arg not in CONFIGS[name]]
    return found


def missing_imports(tree: ast.AST) -> list[str]:
    """`from moepager.x import y` (anywhere in the file) where moepager.x has no y and no submodule y."""
    found = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.ImportFrom) and n.level == 0 and n.module
                and n.module.split(".")[0] in ("moepager", "benchmarks")):
            continue
        try:
            mod = importlib.import_module(n.module)
        except ImportError as e:
            found.append(f"{n.lineno}: {n.module} ({e})")
            continue
        for alias in n.names:
            if alias.name != "*" and not hasattr(mod, alias.name):
                try:
                    importlib.import_module(f"{n.module}.{alias.name}")
                except ImportError:
                    found.append(f"{n.lineno}: {n.module}.{alias.name}")
    return found


def test_every_config_built_anywhere_names_fields_that_exist():
    bad = {str(p.relative_to(ROOT)): got for p in python_files()
           if (got := unknown_config_fields(ast.parse(p.read_text())))}
    assert not bad, bad


def test_every_moepager_import_anywhere_resolves():
    bad = {str(p.relative_to(ROOT)): got for p in python_files()
           if (got := missing_imports(ast.parse(p.read_text())))}
    assert not bad, bad


def test_the_checks_find_a_moved_field_and_a_moved_name():
    """The review's case: a field that moved into a sub-config, and a name that moved to another module."""
    tree = ast.parse("from moepager.config import EngineConfig\n"
                     "def f():\n"
                     "    from moepager.config import NoSuchConfig\n"
                     "    return EngineConfig(device='cuda', expert_dtype='int8')\n")
    assert unknown_config_fields(tree) == ["4: EngineConfig(expert_dtype=)"]
    assert missing_imports(tree) == ["3: moepager.config.NoSuchConfig"]
