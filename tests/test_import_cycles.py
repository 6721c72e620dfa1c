"""No import cycle anywhere in the repository's Python (eagle3/, reference/, benchmarks/, the
scripts, tests/): every `import` statement counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3", "reference")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "results" in rel.parts or rel.parts[0] == "runs":
            continue
        out[_module_name(path)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository modules `path` imports (a `from a.b import c` names a.b.c when that is a
    module, else a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                     else node.module for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path of names (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle_when_two_modules_import_each_other():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_repository_has_no_import_cycle():
    modules = _modules()
    assert any(m.startswith("eagle3.") for m in modules) and "reference.steps" in modules
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    # a package imports its submodules' names through its __init__ only: an edge to a
    # package from its own submodule is the package's init, which these packages keep empty
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
