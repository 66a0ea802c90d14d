"""The layering rule: core imports nothing else from ember; optim, data, models import only core;
nothing imports launch; no module of the package edits sys.path. Fails with file:line for each."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {
    "core": {"core"},
    "optim": {"core", "optim"},
    "data": {"core", "data"},
    "models": {"core", "models"},
}


def _ember_imports(path: pathlib.Path, package: str):
    tree = ast.parse(path.read_text(), filename=str(path))
    rel_parts = path.relative_to(ROOT).parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ember" and len(parts) > 1:
                    yield node.lineno, parts[1]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[0] == "ember":
                parts = node.module.split(".")
                targets = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
                for t in targets:
                    yield node.lineno, t
            elif node.level > 0:
                base = list(rel_parts[:-1])
                up = node.level - 1
                if up > len(base):
                    continue
                base = base[: len(base) - up] if up else base
                mod = base + (node.module.split(".") if node.module else [])
                if mod:
                    yield node.lineno, mod[0]
                else:  # `from .. import x` at the package root
                    for a in node.names:
                        yield node.lineno, a.name


def test_layering():
    bad = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for lineno, target in _ember_imports(path, package):
                if target in {"core", "optim", "data", "models", "launch"} and target not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{lineno} imports ember.{target}")
    for path in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".venv") for part in path.parts) or path.parts[len(ROOT.parts)] in {"launch", "tests"}:
            continue
        for lineno, target in _ember_imports(path, ""):
            if target == "launch":
                bad.append(f"{path.relative_to(ROOT)}:{lineno} imports ember.launch")
    assert not bad, "layering violations (core <- optim/data/models <- launch):\n" + "\n".join(bad)


PACKAGE_DIRS = ("core", "optim", "data", "models", "launch")


def _package_files():
    yield from sorted(ROOT.glob("*.py"))
    for package in PACKAGE_DIRS:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_module_edits_sys_path():
    bad = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "modules that touch sys.path (import through the installed package instead):\n" + "\n".join(bad)


def test_launch_is_a_package_its_scripts_import_from():
    for script in ("train.py", "tpu_pod.py", "bench.py", "ckpt.py", "bench_ckpt.py", "bench_scale.py", "bench_house.py",
                   "spmd_run.py"):
        text = (ROOT / "launch" / script).read_text()
        assert "import _" not in text, f"launch/{script} imports a private sibling by file name"
    assert (ROOT / "launch" / "__init__.py").is_file()
