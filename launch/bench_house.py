"""The house's figures for one or more checkouts: how much code `core/` holds, how much of it compiles,
and how much of it reaches into torch's private names (issue 33's "figures of the house").

    python launch/bench_house.py .                                   # this tree
    git worktree add /tmp/base b419829 && python launch/bench_house.py /tmp/base .   # before, after

Counted over `core/**.py` without `core/testing/`: code lines (no blank or comment lines); the
compile machinery's share (`MACHINERY`); private torch names (`PRIVATE`: `torch._*`, `._C.*`,
`_foreach_*`, `TorchDispatchMode`, `aten._*`) inside `core/compat/` and elsewhere; the
`is_dynamo_compiling()` branches; `torch.func.vjp` calls; the files holding thread-local state
(`threading.local`, `ContextVar`);
the import circles among `core/`'s modules (module-level imports) and the function-local imports of
ember modules; the imports from a lower layer to a higher one (`LAYERS`).
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import sys
from typing import Dict, List, Set

MACHINERY = ("jit.py", "jit_backends/", "compat/inductor", "compat/shared_subgraph", "compat/functorch",
             "compat/xla_loop", "compat/scan", "remat", "scan_rolled", "shared_call", "autograd_grad",
             "scan.py", "define_once")
"""Paths under `core/` (prefixes) that make up the compile machinery."""

LAYERS = (("types", "pytree", "compat", "define_once", "dataclass_json", "config_checks", "registry", "protocols",
           "local_shards"),
          ("trace_context",),
          ("autograd_grad", "remat", "remat_barrier", "remat_policies", "remat_scan", "scan", "scan_rolled",
           "shared_call", "transforms", "tree_math", "random"),
          ("jit", "jit_backends", "xla", "device"))
"""`core/`'s layers, bottom first (top-level module or folder names): trees, types and torch access; the
trace context; the transforms; `jit` and its backends; then everything else (step_fns, partition_specs,
checkpoint, ...). A module imports only from its own layer and those below."""

CALL = {"is_dynamo_compiling() branches": re.compile(r"(?<!`)\bis_dynamo_compiling\(\)"),
        "torch.func.vjp calls": re.compile(r"(?<!`)\btorch\.func\.vjp\(")}
"""Calls counted in code (a name quoted in a docstring, `like_this()`, is not a call)."""

PRIVATE = re.compile(r"torch\._[A-Za-z]\w*|\._C\.\w+|_foreach_\w+|TorchDispatchMode|torch\.ops\.aten\._\w+")

FIGURES = ("core code lines", "compile machinery lines", "private torch names in core/compat/",
           "private torch names elsewhere in core/", "is_dynamo_compiling() branches", "torch.func.vjp calls",
           "files with a thread-local", "import circles", "function-local ember imports",
           "import circles counting function-local imports", "imports against the layers")


def _code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


def _module(relative: str) -> str:
    parts = relative[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> List[str]:
    """The `core/` modules (dotted, relative to core) an import statement may need: for
    `from <base> import a, b`, `<base>.a` and `<base>.b` where they are modules, else `<base>`."""
    if isinstance(node, ast.Import):
        return [a.name[len("ember.core."):] for a in node.names if a.name.startswith("ember.core.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        if not (node.module or "").startswith("ember.core"):
            return []
        base = (node.module or "")[len("ember.core"):].lstrip(".")
    else:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)] if node.level > 1 else package
        base = ".".join(p for p in package + [node.module or ""] if p)
    return [base] + [f"{base}.{a.name}".lstrip(".") for a in node.names]


def _parents(module: str) -> List[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _import_graph(core: pathlib.Path, inside_functions: bool = False) -> Dict[str, Set[str]]:
    """Module -> the core modules it imports at module level (also in functions with `inside_functions`)."""
    paths = {_module(p.relative_to(core).as_posix()): p for p in core.rglob("*.py")
             if not p.relative_to(core).as_posix().startswith("testing/")}
    graph: Dict[str, Set[str]] = {}
    for name, path in paths.items():
        tree, is_package = ast.parse(path.read_text()), path.name == "__init__.py"
        found: Set[str] = set()
        for node in ast.walk(tree) if inside_functions else tree.body:
            imported = _imported(node, name, is_package)
            if not imported:
                continue
            base, *named = imported
            modules = [m for m in named if m in paths]
            found.update(modules if named and len(modules) == len(named) else [base, *modules])
        # importing `a.b.c` first runs the packages `a` and `a.b`, those around `name` aside (already running)
        found.update(parent for m in list(found) for parent in _parents(m) if parent not in _parents(name))
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return next((i for i, names in enumerate(LAYERS) if top in names), len(LAYERS))


def _circles(graph: Dict[str, Set[str]]) -> int:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    count = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            size = 0
            while True:
                w = stack.pop()
                on.discard(w)
                size += 1
                if w == v:
                    break
            count[0] += size > 1

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return count[0]


def _local_imports(text: str) -> int:
    """Imports of ember modules inside function bodies."""
    count = 0
    for fn in ast.walk(ast.parse(text)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ember")):
                    count += 1
                elif isinstance(node, ast.Import) and any(a.name.startswith("ember") for a in node.names):
                    count += 1
    return count


def figures(root: pathlib.Path) -> Dict[str, int]:
    """The `FIGURES` of the checkout at `root`."""
    core = root / "core"
    if not core.is_dir():
        raise SystemExit(f"bench_house: {root} has no core/ folder; pass the root of an ember checkout.")
    out = dict.fromkeys(FIGURES, 0)
    for path in sorted(core.rglob("*.py")):
        relative = path.relative_to(core).as_posix()
        if relative.startswith("testing/"):
            continue
        text = path.read_text()
        lines = _code_lines(text)
        out["core code lines"] += lines
        if any(relative.startswith(m) for m in MACHINERY):
            out["compile machinery lines"] += lines
        where = "in core/compat/" if relative.startswith("compat/") else "elsewhere in core/"
        out[f"private torch names {where}"] += len(PRIVATE.findall(text))
        for name, pattern in CALL.items():
            out[name] += len(pattern.findall(text))
        out["files with a thread-local"] += "threading.local" in text or "ContextVar(" in text
        out["function-local ember imports"] += _local_imports(text)
    out["import circles"] = _circles(_import_graph(core))
    everywhere = _import_graph(core, inside_functions=True)
    out["import circles counting function-local imports"] = _circles(everywhere)
    out["imports against the layers"] = sum(_layer(d) > _layer(m) for m, deps in everywhere.items() for d in deps)
    return out


def table(roots: List[pathlib.Path]) -> str:
    """A markdown table: one row per figure, one column per checkout."""
    columns = [figures(r) for r in roots]
    lines = ["| figure | " + " | ".join(str(r) for r in roots) + " |", "|---" + "|---:" * len(roots) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{c[name]:,}" for c in columns) + " |" for name in FIGURES]
    return "\n".join(lines)


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+", type=pathlib.Path, help="ember checkouts, e.g. a baseline worktree and .")
    print(table(parser.parse_args(argv).roots))


if __name__ == "__main__":
    main(sys.argv[1:])
