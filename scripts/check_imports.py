"""Import graph of src/kiln: cycles between files, cycles between packages, and imports against the
dependency direction.

    python scripts/check_imports.py        # prints what it finds; exit 1 if anything

Every `import kiln...` / `from kiln... import` statement counts, at module level or inside a function
(a function-level import is still a dependency; it only hides a cycle from the interpreter), except
those under `if TYPE_CHECKING:`, which never run (annotations only). An import
of `kiln.a.b` is an edge to the module `kiln.a.b`, not to the package `kiln.a` that Python also runs
first, as import-linter counts them (otherwise every package whose `__init__` re-exports its modules
would be a cycle). `from kiln.a import b` is an edge to `kiln.a.b` when that is a module, else to
`kiln.a`.

The direction (docs/architecture.md): server and entrypoints (`kiln generate`) -> distributed ->
engine -> loaders (checkpoint files into models) -> models -> ops -> quant; kiln.jax and kiln.patch
(Kiln's kernels swapped into Hugging Face models) over ops only; the
tooling (bench, verify, profile, tune) on top of everything. A package never imports one above it. (The tuning
cache that kernels read at run time is `kiln.ops.tuned_configs`; `kiln.tune` is the tuner.)
The `kiln` package itself and `kiln.cli` (the entry point that imports every subcommand) are left out
of the package checks.

tests/test_import_graph.py runs these checks against an allow-list of the known exceptions.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# "X above Y": X may import Y, Y must never import X (the relation is closed transitively below)
_DIRECTLY_ABOVE = {
    "kiln.entrypoints": {"kiln.distributed", "kiln.engine"},
    "kiln.server": {"kiln.distributed", "kiln.engine"},
    "kiln.distributed": {"kiln.engine"},
    "kiln.engine": {"kiln.loaders", "kiln.models"},
    "kiln.loaders": {"kiln.models"},
    "kiln.models": {"kiln.ops", "kiln.quant"},
    "kiln.jax": {"kiln.ops"},
    "kiln.patch": {"kiln.ops"},
    "kiln.ops": {"kiln.quant"},
}
TOOLING = ("kiln.bench", "kiln.verify", "kiln.profile", "kiln.tune")
RUNTIME = (
    "kiln.ops", "kiln.models", "kiln.engine", "kiln.server", "kiln.distributed", "kiln.loaders",
    "kiln.quant", "kiln.jax", "kiln.entrypoints", "kiln.patch",
)  # fmt: skip
ROOT_MODULES = ("kiln", "kiln.cli")


def _above() -> dict[str, set[str]]:
    """package -> every package below it (transitively)."""
    below = {pkg: set(lower) for pkg, lower in _DIRECTLY_ABOVE.items()}
    for pkg in TOOLING:
        below[pkg] = set(RUNTIME)
    changed = True
    while changed:
        changed = False
        for lower in below.values():
            extra = set().union(*(below.get(p, set()) for p in lower)) - lower
            if extra:
                lower |= extra
                changed = True
    return below


BELOW = _above()


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Module name -> file for every module of the kiln package."""
    modules = {}
    for path in sorted((src / "kiln").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a kiln module (None outside kiln)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:  # relative: resolve against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    # `from kiln.a import b` imports the module kiln.a.b when there is one
    return [f"{source}.{alias.name}" for alias in node.names] + [source]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST):
    """Every import statement in `tree`, at any depth, except in the body of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """module -> {imported kiln module: line of the first such import}, top-level and in functions."""
    modules = module_files(src)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _runtime_imports(tree):
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                # a name that is a module wins; the bare `from X` source counts only when no name was one
                targets = {_resolve(n, modules) for n in names[:-1] if n in modules}
                if not targets:
                    targets = {_resolve(names[-1], modules)}
            else:
                targets = {_resolve(n, modules) for n in names}
            for target in targets - {None, module}:
                edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def package_of(module: str) -> str | None:
    """Top-level package (kiln.ops, ...) of a module; None for the kiln package itself and kiln.cli."""
    if module in ROOT_MODULES:
        return None
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the file-level imports behind it ("a -> b:line")."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, imports in graph.items():
        for target, line in imports.items():
            a, b = package_of(module), package_of(target)
            if a and b and a != b:
                edges[(a, b)].append(f"{module} -> {target} (line {line})")
    return dict(edges)


def strongly_connected(nodes, successors) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in successors(node):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(start: str, members: set[str], successors) -> list[str]:
    """A shortest cycle from `start` back to itself inside `members` (breadth-first)."""
    parents: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(successors(node)):
            if nxt == start:
                path = [node]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if nxt in members and nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is on no cycle inside {sorted(members)}")


def cycles(nodes, successors) -> list[list[str]]:
    """For each group of nodes that reach each other, the shortest cycle through each member,
    without repeats: enough to see every loop there is to break (not every simple cycle)."""
    found: dict[tuple[str, ...], list[str]] = {}
    for component in strongly_connected(nodes, successors):
        members = set(component)
        for start in component:
            cycle = shortest_cycle(start, members, successors)
            ring = cycle[:-1]
            first = ring.index(min(ring))
            ring = ring[first:] + ring[:first]  # each loop written from its smallest name
            found.setdefault(tuple(ring), [*ring, ring[0]])
    return sorted(found.values())


def file_cycles(
    graph: dict[str, dict[str, int]], ignored: set[tuple[str, str]] = frozenset()
) -> list[list[str]]:
    """Cycles between modules (see `cycles`), leaving out `ignored` (importer, imported) edges."""
    return cycles(graph, lambda module: [t for t in graph[module] if (module, t) not in ignored])


def package_cycles(
    packages: dict[tuple[str, str], list[str]], ignored: set[tuple[str, str]] = frozenset()
) -> list[list[str]]:
    """Cycles between top-level packages (see `cycles`), leaving out `ignored` package edges."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in packages:
        if (a, b) not in ignored:
            succ[a].append(b)
    return cycles({p for edge in packages for p in edge}, lambda package: succ[package])


def direction_violations(packages: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    """Package imports that point up: (lower, higher) -> the file imports behind each."""
    return {(a, b): why for (a, b), why in sorted(packages.items()) if a in BELOW.get(b, set())}


def main() -> int:
    graph = import_graph()
    packages = package_graph(graph)
    cycles, pkg_cycles, upward = file_cycles(graph), package_cycles(packages), direction_violations(packages)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports between them")
    print(f"\nfile cycles: {len(cycles)}")
    for cycle in cycles:
        print("  " + " -> ".join(cycle))
    print(f"\npackage cycles: {len(pkg_cycles)}")
    for cycle in pkg_cycles:
        print("  " + " -> ".join(cycle))
        for a, b in zip(cycle[:-1], cycle[1:], strict=True):
            print(f"      {a} -> {b}: {'; '.join(packages[(a, b)][:3])}")
    print(f"\nimports against the direction: {len(upward)}")
    for (a, b), why in upward.items():
        print(f"  {a} -> {b}: {'; '.join(why[:3])}" + (f" (+{len(why) - 3} more)" if len(why) > 3 else ""))
    return 1 if cycles or pkg_cycles or upward else 0


if __name__ == "__main__":
    sys.exit(main())
