"""The module graph of core has no import circle among the layers issue 40 names.

Edges are read with ``ast`` from every ``import`` / ``from ... import`` in a module, the ones
inside functions included (a lazy import is still a circle, only hidden), so the check does not
depend on the order modules happen to be imported in.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"

#: The modules of the two circles named in issue 40 (errors <-> session <-> generation/stream <->
#: parallel/session; profile <-> kernel_profile) and the leaves they now share.
LAYERS = ("core.errors", "core.session", "core.generation.stream", "core.generation.tokens",
          "core.generation.sampling", "core.generation.loop", "core.generation.generate",
          "core.parallel.session", "core.profile", "core.kernel_profile", "core.engine.request")
#: Edges still allowed, each with its reason. Session(tensor_parallel=R > 1) returns a
#: TensorParallelSession (Session.__new__), which subclasses Session: the fixed-batch facade
#: stays (core.run's tensor parallel runs on the engine's step runner, core.parallel.runner).
KNOWN = {("core.session", "core.parallel.session")}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in CORE.rglob("*.py"):
        parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the core modules it imports anywhere in its body (``from pkg import mod``
    counts as an edge to ``pkg.mod``; an edge to an enclosing package is left out)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in mods:
                        edges[name].add(target)
                    elif source in mods and not name.startswith(source + "."):
                        edges[name].add(source)
        edges[name].discard(name)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``edges`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_circle_and_passes_a_chain():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_edges_see_lazy_imports():
    """kernel_profile imports core.profile inside a function: the reader must see it."""
    edges = _edges(_modules())
    assert "core.profile" in edges["core.kernel_profile"]
    assert "core.parallel.session" in edges["core.session"]  # the KNOWN edge, also a lazy import


def test_no_import_circle_among_the_named_layers():
    edges = _edges(_modules())
    sub = {m: {t for t in edges[m] if t in LAYERS and (m, t) not in KNOWN} for m in LAYERS}
    assert _cycle(sub) is None, f"import circle: {' -> '.join(_cycle(sub) or [])}"


def test_errors_sampling_and_token_rows_are_leaves():
    edges = _edges(_modules())
    assert edges["core.errors"] == set()
    assert edges["core.generation.sampling"] == set()
    assert edges["core.generation.tokens"] == {"core.errors"}


def test_profile_does_not_dispatch_kernels():
    """`lockstep profile --kernels` is dispatched by the CLI (core.cli.cmd_profile)."""
    edges = _edges(_modules())
    assert "core.kernel_profile" not in edges["core.profile"]
    assert "core.kernel_profile" in edges["core.cli"]
