"""sslkit's modules import one another without a circle, counting imports made for type checking only."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "sslkit"


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the sslkit modules it imports at module level (``if TYPE_CHECKING:`` blocks included, and the
    packages a dotted import runs first, but not the module's own packages); imports inside functions are left
    out (they run after loading)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            for stmt in node.body if isinstance(node, ast.If) else [node]:
                targets: list[str] = []
                if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("sslkit"):
                    targets = [stmt.module, *(f"{stmt.module}.{a.name}" for a in stmt.names)]
                elif isinstance(stmt, ast.Import):
                    targets = [a.name for a in stmt.names if a.name.startswith("sslkit")]
                for target in targets:
                    parts = target.split(".")
                    graph[name] |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & modules.keys()
        # a module's own packages are being imported when it is (their __init__ imported it): not an edge back
        parts = name.split(".")
        graph[name] -= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle() -> None:
    graph = _graph()
    assert "sslkit.events" in graph["sslkit.task"] and "sslkit.task" in graph["sslkit.train_steps.stages"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
