"""kvd's packages import each other in one direction only (docs/architecture.md, "Import directions").

Every import under kvd/ counts, at module level or inside a function (a lazy import is still a dependency:
it only moves the moment the cycle bites), under `if TYPE_CHECKING:` too. Starting another program by
module name (`python -m kvd.worker`, `python -m kvd.cli`) is a process boundary, not an import.

To move modules between packages, edit PACKAGES (which package a module belongs to) and ALLOWED (which
packages each may import): nothing else here names a package. The gateway's stricter rule, no torch at all
(in kvd.request, which it imports, too), is tests/test_gateway.py::test_the_gateway_imports_no_torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

KVD = Path(__file__).resolve().parents[1] / "kvd"

# Module prefix -> the package (node) it belongs to; the longest prefix that matches wins, and "kvd" alone is
# the top-level package's __init__ (its lazy LLM and SamplingParams). A module no prefix covers fails the test:
# a new package must be placed here.
PACKAGES = {
    "kvd": "kvd",
    "kvd.cli": "kvd.cli",
    "kvd.settings": "kvd.settings",
    "kvd.private_cache": "kvd.private_cache",
    "kvd.demo": "kvd.demo",
    "kvd.top": "kvd.top",
    "kvd.kernels": "kvd.kernels",
    "kvd.distributed": "kvd.distributed",
    "kvd.parallel": "kvd.parallel",
    "kvd.model": "kvd.model",
    "kvd.engine": "kvd.engine",
    "kvd.worker": "kvd.worker",
    "kvd.server": "kvd.server",
    "kvd.gateway": "kvd.gateway",
    "kvd.request": "kvd.request",
}

# Package -> the packages it may import; lower layers first. Edges, not layers: each one is a dependency
# someone chose, and a new one is a design decision made here, in review.
ALLOWED: dict[str, set[str]] = {
    "kvd.settings": set(),
    # The request surface every front end shares (sampling parameters, schemas, tool calling): torch-free, so
    # it imports no other kvd package, and the gateway can take it.
    "kvd.request": set(),
    # Pins the compilers' cache folders: every package that imports torch calls it first.
    "kvd.private_cache": set(),
    "kvd.kernels": {"kvd.private_cache"},
    # Tensor parallelism's primitives (shard, collectives, step commands): the model and engine use them.
    "kvd.distributed": {"kvd.private_cache"},
    # Forming the group (rendezvous, secret, rank 0's launch): held by the engine, so below it.
    "kvd.parallel": {"kvd.distributed"},
    "kvd.model": {"kvd.private_cache", "kvd.kernels", "kvd.distributed"},
    "kvd.engine": {
        "kvd.settings",
        "kvd.private_cache",
        "kvd.kernels",
        "kvd.distributed",
        "kvd.parallel",
        "kvd.model",
        "kvd.request",
    },
    # A worker rank's process runs a ModelRunner on a loaded shard: above the engine and the model.
    "kvd.worker": {"kvd.distributed", "kvd.parallel", "kvd.model", "kvd.engine"},
    "kvd": {"kvd.engine", "kvd.request"},
    # Torch-free (tests/test_gateway.py): of the rest of kvd, only the request surface, and the settings table
    # its flags come from (shared with `kvd serve --http`).
    "kvd.gateway": {"kvd.request", "kvd.settings"},
    "kvd.server": {
        "kvd",
        "kvd.settings",
        "kvd.distributed",
        "kvd.engine",
        "kvd.worker",
        "kvd.gateway",
        "kvd.request",
    },
    "kvd.demo": set(),
    "kvd.top": set(),
    "kvd.cli": {"kvd", "kvd.settings", "kvd.engine", "kvd.server", "kvd.gateway", "kvd.top"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(KVD.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    """The node of `module` (None: no PACKAGES prefix covers it)."""
    best = None
    for prefix in PACKAGES:
        covers = module == prefix or (prefix != "kvd" and module.startswith(prefix + "."))
        if covers and (best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else PACKAGES[best]


def imports_in(text: str, module: str, is_package: bool, modules: set[str]) -> list[tuple[str, int]]:
    """(module, line) of every kvd module that `module`'s source `text` imports; `from a import b` is a.b when
    that is a module, else a."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, up level - 1 packages
                parts = package.split(".")
                base = ".".join(
                    [*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])]
                )
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in modules else base, node.lineno))
    return [(m, line) for m, line in found if m == "kvd" or m.startswith("kvd.")]


def package_graph() -> tuple[dict[tuple[str, str], list[str]], list[str]]:
    """{(from package, to package): where} over every import between two packages; the unplaced modules."""
    paths = sorted(KVD.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    edges: dict[tuple[str, str], list[str]] = {}
    unplaced = sorted(m for m in modules if package_of(m) is None)
    for path in paths:
        source = package_of(module_name(path))
        is_package = path.name == "__init__.py"
        for target, line in imports_in(path.read_text(), module_name(path), is_package, modules):
            destination = package_of(target)
            if source and destination and source != destination:
                where = f"{path.relative_to(KVD.parent)}:{line} imports {target}"
                edges.setdefault((source, destination), []).append(where)
    return edges, unplaced


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path whose first and last node are the same; None when it has none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_every_module_belongs_to_a_package_of_the_table():
    _, unplaced = package_graph()
    assert not unplaced, f"add these modules' package to PACKAGES and ALLOWED: {unplaced}"
    assert set(ALLOWED) == set(PACKAGES.values())
    modules = {module_name(p) for p in KVD.rglob("*.py")}
    stale = [p for p in PACKAGES if not any(m == p or m.startswith(p + ".") for m in modules)]
    assert not stale, f"PACKAGES names modules that no longer exist: {stale}"


def test_imports_between_packages_follow_the_allowed_directions():
    edges, _ = package_graph()
    wrong = [
        f"{source} -> {destination}: {'; '.join(where)}"
        for (source, destination), where in sorted(edges.items())
        if destination not in ALLOWED[source]
    ]
    assert not wrong, "imports against the allowed directions:\n" + "\n".join(wrong)


def test_the_packages_import_each_other_without_a_cycle():
    assert find_cycle(ALLOWED) is None, f"ALLOWED itself has a cycle: {find_cycle(ALLOWED)}"
    edges, _ = package_graph()
    graph: dict[str, set[str]] = {}
    for source, destination in edges:
        graph.setdefault(source, set()).add(destination)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_checker_sees_lazy_and_relative_imports_and_cycles():
    modules = {module_name(p) for p in KVD.rglob("*.py")}
    lazy = "def f():\n    from kvd.worker.run import run_worker\n"
    assert imports_in(lazy, "kvd.engine.probe", False, modules) == [("kvd.worker.run", 2)]
    assert imports_in("from ..model import loader\n", "kvd.engine.probe", False, modules) == [
        ("kvd.model.loader", 1)
    ]
    assert imports_in("from . import shm\n", "kvd.distributed", True, modules) == [("kvd.distributed.shm", 1)]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
