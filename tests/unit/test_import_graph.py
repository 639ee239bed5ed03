"""The package's import graph: no cycles anywhere, and a scheduler that imports no I/O.

Read from the source with `ast`, not by importing: every `import` counts, at module
level or inside a function (a lazy import still ties the two modules together), except
those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import servegate

SRC = Path(servegate.__file__).resolve().parent.parent

SCHEDULER_FORBIDDEN = (
    "aiohttp",
    "servegate.gateway",
    "servegate.extproc",
    "servegate.datalayer",
    "servegate.simulator",
    "servegate.config",
)
"""What `scheduling/` may not import: it is pure (docs/architecture.md), so no HTTP
client, no data plane, no subscribers, no simulator and no process configuration."""


def _modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the `servegate` package under `src`: dotted name → (file, is package)."""
    out: dict[str, tuple[Path, bool]] = {}
    for path in sorted((src / "servegate").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere but the body of `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for other in node.orelse:
                if isinstance(other, ast.Import | ast.ImportFrom):
                    yield other
                yield from _imports(other)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node)


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module → the names it imports: servegate modules resolved to the module that holds
    them (`from servegate.x import y` is `servegate.x.y` when that is a module), and the
    dotted names of everything else as written."""
    modules = _modules(src)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join([*package, base] if base else package)
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for name in names:
                resolved = owner(name) if name.startswith("servegate") else name
                if resolved is not None and resolved != module:
                    targets.add(resolved)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def scheduler_violations(graph: dict[str, set[str]]) -> list[str]:
    """`module -> name` for each forbidden import of a module under `servegate.scheduling`."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module == "servegate.scheduling" or module.startswith("servegate.scheduling.")
        for target in targets
        if any(target == bad or target.startswith(f"{bad}.") for bad in SCHEDULER_FORBIDDEN)
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(SRC)


def test_the_graph_sees_the_whole_package(graph: dict[str, set[str]]) -> None:
    assert "servegate.scheduling.scheduler" in graph
    assert "servegate.gateway.app" in graph
    assert "servegate.scheduling.framework" in graph["servegate.scheduling.scheduler"]


def test_no_import_cycles_in_servegate(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_scheduler_imports_no_io_data_plane_or_config(graph: dict[str, set[str]]) -> None:
    assert scheduler_violations(graph) == []


def test_components_define_their_settings_and_config_imports_them(
    graph: dict[str, set[str]],
) -> None:
    """Settings are defined once, beside the component that reads them (health checks,
    metrics scrapes, KV events, outlier detection, tokenisation, flow control; model
    rewrites, which Kubernetes discovery reads too); config.py imports them, so no
    component imports config.py."""
    components = ("servegate.datalayer", "servegate.tokenization", "servegate.scheduling")
    offenders = sorted(
        module
        for module, targets in graph.items()
        if module.startswith(components) and "servegate.config" in targets
    )
    assert offenders == []
    assert {
        "servegate.datalayer.health",
        "servegate.datalayer.kvevents.settings",
        "servegate.datalayer.outlier",
        "servegate.datalayer.scraper",
        "servegate.rewrites",
        "servegate.tokenization.settings",
    } <= graph["servegate.config"]
    assert "servegate.config" not in graph["servegate.pool.discovery.policy"]


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """A lazy import in a function closes a cycle; an import under TYPE_CHECKING does not;
    a scheduler module that imports aiohttp or the config is named."""
    package = tmp_path / "servegate"
    (package / "scheduling").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "scheduling" / "__init__.py").write_text("")
    (package / "config.py").write_text("from servegate.scheduling import plugin\n")
    (package / "scheduling" / "plugin.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import aiohttp\n"
        "if TYPE_CHECKING:\n"
        "    from servegate import types\n"
        "def lazy() -> None:\n"
        "    from servegate.config import X\n"
    )
    (package / "types.py").write_text("from servegate.scheduling.plugin import lazy\n")
    found = import_graph(tmp_path)
    assert cycles(found) == [["servegate.config", "servegate.scheduling.plugin"]]
    assert scheduler_violations(found) == [
        "servegate.scheduling.plugin -> aiohttp",
        "servegate.scheduling.plugin -> servegate.config",
    ]
