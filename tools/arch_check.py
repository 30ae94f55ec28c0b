"""Architecture check: import circles, sys.path edits, module sizes, top-level module count.

Scans both packages with the AST (function-level imports included) and prints one line per
finding; exits 1 when a rule is broken. Usage: python tools/arch_check.py [--graph]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("balanced_loader", "parallel_runtime")
MAX_LINES = 600
MAX_TOP_MODULES = 10


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """Absolute module named by a (possibly relative) ``from ... import``."""
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Our modules that ``path`` imports anywhere in its body (a package import counts as its __init__)."""
    mod = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()

    def add(name: str) -> None:
        # "a.b.c" may be a module or a name inside module "a.b": take the longest module prefix.
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in modules:
                found.add(cand)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(mod, path.name == "__init__.py", node)
            for alias in node.names:
                add(f"{target}.{alias.name}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                add(arg.value)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                # import_module(f"pkg.{name}"): a hidden import of every module under "pkg."
                prefix = str(arg.values[0].value)
                found.update(m for m in modules if m.startswith(prefix))
    found.discard(mod)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def parent_packages(mod: str) -> list[str]:
    parts = mod.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", action="store_true", help="print every module's imports")
    args = ap.parse_args()
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports_of(p, modules) for p in files}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first; a package __init__ that imports
    # its own submodules is not a circle, so parents are not added as edges here.
    bad = 0
    for comp in cycles(graph):
        print("import circle:", " <-> ".join(comp))
        bad += 1
    for p in files:
        n = len(p.read_text().splitlines())
        if n > MAX_LINES:
            print(f"module over {MAX_LINES} lines: {p.relative_to(ROOT)} ({n})")
            bad += 1
    tools = [p for p in sorted((ROOT / "tools").rglob("*.py")) if p.name != "arch_check.py"]
    syspath = [p for p in tools if "sys.path" in p.read_text()]
    for p in syspath:
        print("sys.path edit:", p.relative_to(ROOT))
        bad += 1
    top = [p for p in (ROOT / "balanced_loader").glob("*.py")]
    if len(top) > MAX_TOP_MODULES:
        print(f"{len(top)} modules at the top of balanced_loader/ (at most {MAX_TOP_MODULES})")
        bad += 1
    if args.graph:
        for mod in sorted(graph):
            print(mod, "->", ", ".join(sorted(graph[mod])))
    lines = sum(len(p.read_text().splitlines()) for p in files)
    print(f"{len(files)} modules, {lines} lines; {len(cycles(graph))} import circles, {len(syspath)} sys.path edits,"
          f" {sum(len(p.read_text().splitlines()) > MAX_LINES for p in files)} modules over {MAX_LINES} lines,"
          f" {len(top)} top-level modules in balanced_loader")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
