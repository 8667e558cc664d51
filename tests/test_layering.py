"""Imports point downward (STYLE.md, "Layers"): ``memfit`` (the client) <- ``data`` <- ``model`` <- ``tracer`` (the
run-time tracer) <- ``service``, ``training`` (the offline jobs). Read statically (every import statement, at module level and inside functions) and checked at run time
(each package imported in a fresh interpreter: which higher packages got loaded)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the packages each package may import from (itself included)
ALLOWED = {
    "memfit": {"memfit"},
    "data": {"memfit", "data"},
    "model": {"memfit", "data", "model"},
    "tracer": {"memfit", "data", "model", "tracer"},
}
PROJECT = {"memfit", "data", "model", "tracer", "service", "training"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every absolute import statement in ``path``, inside functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_statement_points_up(package):
    upward = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in _imports(path)
        if name.split(".")[0] in PROJECT - ALLOWED[package]
    ]
    assert upward == []


def test_the_reader_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef f():\n    from tracer.phases import trace_terms\n    import service.app\n")
    assert _imports(f) == [(1, "os"), (4, "tracer.phases"), (5, "service.app")]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_importing_every_module_loads_no_higher_package(package):
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / package).rglob("*.py")
    )
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert len(modules) > 3
    assert (loaded & PROJECT) - ALLOWED[package] == set()


def _module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` its import statements name (an ``from a import b`` names ``a.b`` when
    that is a module of the package, else ``a``)."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / package).rglob("*.py")
    }
    graph = {}
    for module, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        graph[module] = {n for n in names if n in files and n != module and not module.startswith(n + ".")}
    return graph


@pytest.mark.parametrize("package", ["memfit", "model"])
def test_no_import_circle_inside_the_package(package):
    graph = _module_graph(package)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    circles = sorted(f"{a} -> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert circles == []
