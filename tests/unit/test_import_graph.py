"""The daemon's modules import each other without cycles, and none is over 450 lines.

Every import counts: at module level, inside a function (a lazy import is still a
dependency, only a later one), and under `if TYPE_CHECKING:` (a cycle mypy must untangle
is one a reader must too). So the request's path reads top-down: the pool returns settled
waiters instead of importing ops, and the TCP listener names what it needs of the server
as a Protocol instead of importing it.
"""

from __future__ import annotations

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parents[2] / "daemon"
MAX_LINES = 450  # issue 26: small modules, each with one job


def module_paths() -> dict[str, Path]:
    """Every module under daemon/ by dotted name (a package by its own name)."""
    return {".".join(p.relative_to(DAEMON).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(DAEMON.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> set[str]:
    """The daemon's modules an import statement loads: `from a.b import c` is a.b.c when
    c is a module, else a.b; a relative import is resolved against `package`."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
    found = set()
    for target in targets:
        while target and target not in modules:  # `import a.b.c` of a non-module name
            target = target.rpartition(".")[0]
        if target:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the daemon's modules it imports, anywhere in its body."""
    paths = module_paths()
    names = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= imported(node, package, names)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                found.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_daemon_has_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 30 and "kvprefetchd.supervisor.loop" in graph
    assert cycles(graph) == []


def test_imports_in_functions_and_under_type_checking_count() -> None:
    source = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvprefetchd.a import A\n"
        "def f():\n    from kvprefetchd import b\n    import kvprefetchd.c.d\n"
        "from .e import x\n"
    )
    modules = {"kvprefetchd.a", "kvprefetchd.b", "kvprefetchd.c", "kvprefetchd.e"}
    found: set[str] = set()
    for node in ast.walk(source):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= imported(node, "kvprefetchd", modules)
    assert found == modules


def test_the_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_daemon_module_is_over_450_lines() -> None:
    over = {name: count for name, path in module_paths().items()
            if (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines: {over}"
