"""sslkit's import map: no circle and no private name across modules, counting imports inside functions and those
made for type checking only; the layers' contracts; few modules at the top of the package."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from helpers import REPO

PACKAGE = REPO / "sslkit"


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The file parsed once for every test of this module (the package does not change while they run)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement of the file: at module level, under ``if TYPE_CHECKING:`` and inside functions (they
    run later, but a circle through them is a circle of the design all the same)."""
    return [n for n in ast.walk(_tree(path)) if isinstance(n, ast.ImportFrom | ast.Import)]


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Module -> the sslkit modules it imports anywhere in it (and the packages a dotted import runs first, but not
    the module's own packages)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for stmt in _imports(path):
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
    assert "sslkit.builder" in graph["sslkit.launch.cli"]  # (imported inside a function: counted)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_private_name_is_imported_from_another_module() -> None:
    """What two modules share is public and named: ``from sslkit.x import _name`` only inside ``sslkit.x``."""
    found = [f"{_module(path)} takes {stmt.module}.{alias.name}" for path in PACKAGE.rglob("*.py")
             for stmt in _imports(path) if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("sslkit")
             for alias in stmt.names if alias.name.startswith("_") and stmt.module != _module(path)]
    assert not found, found


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


#: (who, what it must never import, why): the layers, downwards only.
CONTRACTS = [
    (("sslkit.config",), ("sslkit.builder",), "validation never builds a model"),
    (("sslkit.hooks",), ("sslkit.tools", "sslkit.launch", "sslkit.builder"), "hooks run inside a built task"),
    (("sslkit.models", "sslkit.methods"), ("sslkit.builder",), "models and methods are built, they do not build"),
    (("sslkit.task", "sslkit.trainer", "sslkit.clock", "sslkit.events", "sslkit.guard", "sslkit.registry",
      "sslkit.errors", "sslkit.distributed", "sslkit.checkpoint", "sslkit.checkpointing", "sslkit.parallel",
      "sslkit.train_steps", "sslkit.data", "sslkit.models", "sslkit.methods", "sslkit.optim", "sslkit.config",
      "sslkit.reliability", "sslkit.stability"),
     ("sslkit.launch", "sslkit.tools", "sslkit.builder"), "the core and its parts know nothing of their start"),
    (("sslkit.evaluation",), ("sslkit.launch", "sslkit.tools", "sslkit.builder"),
     "evaluation holds protocols only: the tools on a run folder use them, not the other way round"),
]


@pytest.mark.parametrize(("who", "never", "why"), CONTRACTS, ids=[c[0][0] for c in CONTRACTS])
def test_layers_import_downwards_only(who: tuple[str, ...], never: tuple[str, ...], why: str) -> None:
    graph = _graph()
    broken = sorted(f"{a} -> {b}" for a in graph if _under(a, who) for b in graph[a] if _under(b, never))
    assert not broken, f"{why}: {broken}"


#: The layers of docs/architecture.md, from the edge down: a module imports its own layer's modules and those below,
#: never one above (imports inside functions and for type checking counted).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the edge: commands, processes, run folders, the launcher", ("sslkit.launch",)),
    ("what runs on a run folder after training", ("sslkit.tools",)),
    ("reads the config, builds the task", ("sslkit.builder",)),
    ("the config: schema, checks, composition; never builds a model", ("sslkit.config",)),
    ("the parts a task is made of", ("sslkit.hooks", "sslkit.methods", "sslkit.models", "sslkit.evaluation")),
    ("a task's state written and read back", ("sslkit.checkpoint", "sslkit.checkpointing")),
    ("the core: the task, the loop, the step, its guard",
     ("sslkit.task", "sslkit.trainer", "sslkit.train_steps", "sslkit.reliability", "sslkit.guard",
      "sslkit.stability")),
    ("what the core reads and updates with", ("sslkit.data", "sslkit.optim")),
    ("the ground: processes, clock, events, registry, errors, whole files",
     ("sslkit.parallel", "sslkit.distributed", "sslkit.clock", "sslkit.events", "sslkit.registry",
      "sslkit.console", "sslkit.errors", "sslkit.files")),
]


def _layer(module: str) -> int | None:
    return next((i for i, (_, packages) in enumerate(LAYERS) if _under(module, packages)), None)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` from a module to one in a layer above it."""
    return sorted(f"{a} ({LAYERS[la][0]}) -> {b} ({LAYERS[lb][0]})" for a in graph for b in graph[a]
                  if (la := _layer(a)) is not None and (lb := _layer(b)) is not None and lb < la)


def test_every_module_is_in_a_layer_and_every_import_runs_down() -> None:
    graph = _graph()
    unplaced = sorted(m for m in graph if m not in ("sslkit", "sslkit.__main__") and _layer(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (add them where they belong): {unplaced}"
    assert not _upward(graph), f"imports from a lower layer up: {_upward(graph)}"


def test_the_layer_check_finds_an_upward_import() -> None:
    """The trainer taking Event through hooks.base (what issue 53 found) is reported; through sslkit.events not."""
    assert _upward({"sslkit.trainer": {"sslkit.hooks.base"}}) == [
        "sslkit.trainer (the core: the task, the loop, the step, its guard) -> sslkit.hooks.base (the parts a task "
        "is made of)"]
    assert _upward({"sslkit.trainer": {"sslkit.events"}, "sslkit.hooks.base": {"sslkit.task"}}) == []


def test_few_modules_at_the_top_of_the_package() -> None:
    """Each concern in its folder (launch/, tools/, checkpointing/, ...): at most 14 modules directly under sslkit/
    besides the package's own ``__init__`` and ``__main__``."""
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 14, top
    assert {"registry.py", "task.py", "trainer.py", "distributed.py", "checkpoint.py"} <= set(top)  # the fixed names


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _functions() -> list[tuple[str, str, int]]:
    return [(_module(path), node.name, node.end_lineno - node.lineno + 1) for path in PACKAGE.rglob("*.py")
            for node in ast.walk(_tree(path))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None]


def test_no_function_is_over_90_lines_and_build_task_is_a_composition() -> None:
    """Short functions: none in sslkit/ over 90 lines (docstring included); build_task, which composes the
    builders, at most 60."""
    functions = _functions()
    assert not [f for f in functions if f[2] > 90], sorted(f for f in functions if f[2] > 90)
    assert next(n for m, f, n in functions if (m, f) == ("sslkit.builder", "build_task")) <= 60
