"""The import graph of jpaged and its kernels: modules, import edges, upward imports and cycles.

Usage: ``python scripts/import_graph.py [--edges]`` from the repository root. It reads the source
(nothing is imported or run). A module's *room* is its folder below the package (``jpaged.core``,
``jpaged.runner``, ...; top-level modules are their own room); rooms are ranked by `LAYERS`, low to
high, and an *upward* import is one from a lower room to a higher one (e.g. the runner importing
the engine). Cycles are the strongly connected groups of modules that import one another.
"""
import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jpaged", "pallas_kernels", "jpaged_kernels")
# low to high: a room may import its own and lower rooms
LAYERS = [
    ("pallas_kernels", "jpaged_kernels"),
    ("jpaged.utils", "jpaged.logger", "jpaged.progress", "jpaged.sharding"),
    ("jpaged.sampling_params", "jpaged.outputs", "jpaged.lora.request", "jpaged.spec_decode"),
    ("jpaged.config",),
    ("jpaged.config_resolution", "jpaged.core", "jpaged.models", "jpaged.lora", "jpaged.sample", "jpaged.loading"),
    ("jpaged.runner",),
    ("jpaged.engine", "jpaged.agents"),
    ("jpaged.llm", "jpaged.entrypoints", "jpaged.serve", "jpaged.integrations", "jpaged.testing"),
]


def modules() -> dict[str, str]:
    """module name -> file path, for every .py under the packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    found[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return found


def imports(path: str, module: str, known: dict) -> set[str]:
    """The known modules ``path`` imports (``from a import b`` counts a.b when that is a module)."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def layer(module: str) -> int | None:
    for rank, rooms in enumerate(LAYERS):
        if any(module == r or module.startswith(r + ".") for r in rooms):
            return rank
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every import edge")
    args = parser.parse_args()
    known = modules()
    graph = {m: imports(p, m, known) for m, p in sorted(known.items())}
    edges = sorted((a, b) for a, bs in graph.items() for b in bs)
    # a package's __init__ re-exporting its own modules is not an upward import
    upward = [(a, b) for a, b in edges
              if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)]
    unranked = sorted(m for m in known if layer(m) is None)
    print(f"modules: {len(known)}  import edges: {len(edges)}  upward imports: {len(upward)}  "
          f"cycles: {len(cycles(graph))}")
    for a, b in upward:
        print(f"upward: {a} -> {b}")
    for group in cycles(graph):
        print("cycle:", " <-> ".join(group))
    for m in unranked:
        print("unranked:", m)
    if args.edges:
        for a, b in edges:
            print(f"{a} -> {b}")


if __name__ == "__main__":
    main()
