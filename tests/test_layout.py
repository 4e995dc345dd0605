"""The layout docs/design.md describes, checked: packages depend one way, no import
circles, no module past 500 lines, and the design's module table names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Lower layers never import higher ones: the engines know nothing of the scheduler,
# the scheduler nothing of HTTP, the server nothing of the benches; drafter training
# uses the engines' modules and reads the scheduler's disk tier (`--from-traffic`),
# nothing above them; `tandem.cli` dispatches to all.
LAYERS = ("engines", "scheduler", "training", "server", "bench", "tandem")
MAX_LINES = 500


def product_modules() -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every product module a module imports (type-checking imports included: a
    circle through them is still two modules that need each other to be read)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    def layer(name: str) -> int:
        return LAYERS.index(name.split(".")[0])

    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if layer(target) > layer(name)
    )


def test_no_import_circles() -> None:
    assert circles(import_graph(product_modules())) == []


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between sub-packages (`engines.drafting`, `server.openai`) and
    the modules beside them (`engines.state`): a circle here is two parts that need each
    other, even when no two modules do (adding a drafter kind should touch
    `engines/drafting/` and nothing that reaches back into it)."""

    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    parts: dict[str, set[str]] = {part(name): set() for name in graph}
    for name, targets in graph.items():
        parts[part(name)].update(part(t) for t in targets if part(t) != part(name))
    return parts


def test_no_import_circles_between_subpackages() -> None:
    assert circles(subpackage_graph(import_graph(product_modules()))) == []


def test_packages_depend_one_way() -> None:
    assert upward_imports(import_graph(product_modules())) == []


def test_the_checks_catch_a_circle_and_an_upward_import() -> None:
    graph = {
        "engines.a": {"engines.b"},
        "engines.b": {"engines.c"},
        "engines.c": {"engines.a", "server.x"},
        "server.x": set(),
    }
    assert circles(graph) == [["engines.a", "engines.b", "engines.c"]]
    assert upward_imports(graph) == ["engines.c -> server.x"]
    split = {"engines.p.a": {"engines.q.b"}, "engines.q.b": set(), "engines.q.c": {"engines.p.d"}}
    assert circles(split | {"engines.p.d": set()}) == []  # no two modules need each other
    assert circles(subpackage_graph({**split, "engines.p.d": set()})) == [
        ["engines.p", "engines.q"]
    ]


@pytest.mark.parametrize("name", sorted(product_modules()))
def test_module_is_small(name: str) -> None:
    lines = product_modules()[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def test_design_names_every_module() -> None:
    """The module table in docs/design.md lists exactly the modules that exist."""
    design = (ROOT / "docs" / "design.md").read_text()
    listed = set(re.findall(r"^\| `([\w/]+)\.py` \|", design, flags=re.MULTILINE))
    present = {
        str(path.relative_to(ROOT).with_suffix(""))
        for path in product_modules().values()
        if path.name != "__init__.py"
    }
    assert sorted(present - listed) == [], "modules missing from docs/design.md"
    assert sorted(listed - present) == [], "docs/design.md lists modules that do not exist"
