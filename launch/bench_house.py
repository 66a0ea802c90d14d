"""The house's figures for one or more checkouts: how much code `core/` holds, how much of it compiles,
and how much of it reaches into torch's private names (issue 33's "figures of the house").

    python launch/bench_house.py .                                   # this tree
    git worktree add /tmp/base b419829 && python launch/bench_house.py /tmp/base .   # before, after

Counted over `core/**.py` without `core/testing/`: code lines (no blank or comment lines); the
compile machinery's share (`MACHINERY`); private torch names (`PRIVATE`: `torch._*`, `._C.*`,
`_foreach_*`, `TorchDispatchMode`, `aten._*`) inside `core/compat/` and elsewhere; the
`is_dynamo_compiling()` branches; and `torch.func.vjp` calls.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import Dict, List

MACHINERY = ("jit.py", "jit_backends/", "compat/inductor", "compat/shared_subgraph", "compat/functorch",
             "compat/xla_loop", "compat/torch_scan", "remat", "rolled_loop", "shared_call", "autograd_grad",
             "scan.py", "define_once")
"""Paths under `core/` (prefixes) that make up the compile machinery."""

CALL = {"is_dynamo_compiling() branches": re.compile(r"(?<!`)\bis_dynamo_compiling\(\)"),
        "torch.func.vjp calls": re.compile(r"(?<!`)\btorch\.func\.vjp\(")}
"""Calls counted in code (a name quoted in a docstring, `like_this()`, is not a call)."""

PRIVATE = re.compile(r"torch\._[A-Za-z]\w*|\._C\.\w+|_foreach_\w+|TorchDispatchMode|torch\.ops\.aten\._\w+")

FIGURES = ("core code lines", "compile machinery lines", "private torch names in core/compat/",
           "private torch names elsewhere in core/", "is_dynamo_compiling() branches", "torch.func.vjp calls")


def _code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


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
