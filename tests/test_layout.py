"""The package's shape, read from its source with ``ast``: the pipeline stays visible.

Every module sits in a pipeline folder (walk -> measure -> plan -> execute -> report) or is
one of the few top-level ones; no import runs back up the pipeline; no import cycle among
autockpt modules (imports inside functions count); no module imports another module's
``_private`` name, no module over 500 lines, planners import nothing but the
request/response types they need, and every module says what it owns.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autockpt"
MAX_LINES = 500  # a module past this has grown a second concept: split it by concept
# what planners may import from the rest of the package: the types they take and return
PLANNER_IMPORTS = {"autockpt.plan", "autockpt.errors"}

# The pipeline, in the order it runs: a module may import its own folder and any folder
# before it, never one after it (no arrow back up). Planners are pure functions of costs,
# so the measuring code may call them; reports and integrations run the whole pipeline.
LAYERS = [
    {"errors", "plan", "models"},
    {"planners"},
    {"walkers"},
    {"measure"},
    {"planning"},
    {"execution"},
    {"api"},
    {"report", "integrations"},
    {"cli", "__main__", ""},  # "": the package's __init__
]
TOP_LEVEL = {"api", "cli", "errors", "plan", "__main__", ""}  # the only modules outside a folder


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every autockpt import in a module, anywhere in it."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, None) for a in node.names if a.name.startswith("autockpt"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("autockpt"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None) if sub in MODULES else (base, alias.name))
    return out


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _ in imports(name):
            while target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_counting_imports_inside_functions() -> None:
    graph = edges()
    assert "autockpt.api" in graph["autockpt.report.verification"]  # the reader sees real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def layer(name: str) -> int:
    """The pipeline layer of module ``name`` (its folder, or the module itself at the top)."""
    part = name.split(".")[1] if "." in name else ""
    return next(i for i, members in enumerate(LAYERS) if part in members)


def test_every_module_sits_in_a_pipeline_folder() -> None:
    loose = [
        n
        for n, path in MODULES.items()
        if n.count(".") == 1 and path.name != "__init__.py" and n.split(".")[1] not in TOP_LEVEL
    ]
    assert not loose, f"modules outside a pipeline folder: {loose}"
    folders = {n.split(".")[1] for n in MODULES if n.count(".") >= 2}
    assert folders <= set().union(*LAYERS), folders - set().union(*LAYERS)


def test_no_arrow_runs_back_up_the_pipeline() -> None:
    graph = edges()
    back = [f"{a} -> {b}" for a in graph for b in graph[a] if layer(b) > layer(a)]
    assert not back, back


def test_the_layer_rule_sees_an_arrow_back_up() -> None:
    assert layer("autockpt.measure.stage_profile") < layer("autockpt.report.tradeoff")
    assert layer("autockpt.walkers.chain") < layer("autockpt.measure.sandbox") < layer("autockpt.api")


def test_no_module_imports_another_modules_private_name() -> None:
    bad = [
        f"{name} imports {target}.{imported}"
        for name in MODULES
        for target, imported in imports(name)
        if (imported or target.rpartition(".")[2]).startswith("_")
        and not (imported or target.rpartition(".")[2]).startswith("__")
    ]
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_are_small_and_say_what_they_own(name: str) -> None:
    path = MODULES[name]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by responsibility"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc) > 20, f"{name} has no docstring saying what it owns"


def test_planners_import_only_their_request_and_response_types() -> None:
    for name in MODULES:
        if not name.startswith("autockpt.planners"):
            continue
        for target, _ in imports(name):
            owner = target if target in MODULES else target.rpartition(".")[0]
            assert owner.startswith("autockpt.planners") or owner in PLANNER_IMPORTS, (name, target)
        tree = ast.parse(MODULES[name].read_text())
        torch_imports = [
            n
            for n in ast.walk(tree)
            if (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch")
        ]
        assert not torch_imports, f"{name} imports torch"
    for allowed in PLANNER_IMPORTS:
        text = MODULES[allowed].read_text()
        assert "import torch" not in text, f"{allowed} is imported by planners and must stay torch-free"
