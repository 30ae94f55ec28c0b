"""The architecture rules of docs/architecture.md as code (AST, not text), for tests/test_architecture.py.

Every function takes the root of a tree, so the tests run the same rules on this repository and on small
trees built to break one rule each. Findings are strings; an empty list means the rule holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("balanced_loader", "parallel_runtime")
MAX_LINES = 600

# What each room of balanced_loader may import of balanced_loader (its floors below); a room is a
# top-level module or folder. The root package (__init__) and __main__ may import anything.
BL_FLOORS: dict[str, set[str]] = {
    "plan": set(), "strict": set(),
    "cost": {"strict"},
    "presets": {"cost", "strict"},
    "simulate": {"cost", "plan", "presets"},
    "schedule": {"strict"},
    "outputs": set(),
    "data": {"strict", "plan", "schedule", "outputs"},
    "build": {"data", "outputs", "strict"},
    "batches": {"data", "plan", "schedule", "strict"},
    "calibration": {"cost", "strict"},
    "planning": {"cost", "plan", "simulate", "strict", "presets", "loader_args"},
    "spindle": {"cost", "plan", "presets", "strict", "simulate", "outputs"},
    "materialize": {"data", "plan"},
    "loader_args": {"schedule"},
    "dataset_view": set(),
    "loader": {"batches", "calibration", "cost", "data", "loader_args", "materialize", "plan", "planning", "presets",
               "schedule", "dataset_view", "strict"},
    "wrapping": {"data", "loader", "loader_args"},
    "diagnostics": {"cost", "data", "plan", "simulate", "outputs", "strict", "planning", "batches", "build", "presets"},
    "integrations": {"cost", "data", "loader", "loader_args", "materialize", "planning", "plan", "wrapping",
                     "outputs", "presets", "schedule", "simulate", "strict", "batches"},
    "cli": {"batches", "build", "cost", "data", "diagnostics", "loader", "loader_args", "materialize", "outputs",
            "plan", "planning", "presets", "schedule", "simulate", "spindle", "strict", "calibration"},
}


def py_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    return [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module named by a (possibly relative) ``from ... import``."""
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(root: Path, path: Path, tree: ast.AST) -> list[str]:
    """Every dotted name ``path`` imports anywhere (function-level too; ``import_module("x")`` counts)."""
    mod = module_name(root, path)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, path.name == "__init__.py", node)  # "a.b.c": a module, or a name in "a.b"
            out += [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append(arg.value)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                out.append(str(arg.values[0].value).rstrip(".") + ".*")  # import_module(f"pkg.{x}"): all of pkg
    return out


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> our modules it imports (the longest module prefix of each imported name)."""
    files = py_files(root, packages)
    modules = {module_name(root, p) for p in files}
    graph: dict[str, set[str]] = {}
    for p in files:
        mod = module_name(root, p)
        found: set[str] = set()
        for name in imported_names(root, p, ast.parse(p.read_text(), str(p))):
            if name.endswith(".*"):
                found.update(m for m in modules if m.startswith(name[:-1]))
                continue
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                cand = ".".join(parts[:k])
                if cand in modules:
                    found.add(cand)
                    break
        found.discard(mod)
        graph[mod] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Import circles: strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[str] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append("import circle: " + " <-> ".join(sorted(comp)))
    return out


def room(mod: str) -> str | None:
    """The room of a balanced_loader module (its top-level module or folder); None for the package itself."""
    parts = mod.split(".")
    return parts[1] if parts[0] == "balanced_loader" and len(parts) > 1 else None


def layering(graph: dict[str, set[str]], floors: dict[str, set[str]] = BL_FLOORS) -> list[str]:
    """Imports that run up the floors: balanced_loader never imports parallel_runtime, and a room imports only
    its own modules and the rooms ``floors`` lists for it."""
    out = []
    for mod, deps in sorted(graph.items()):
        if not mod.startswith("balanced_loader"):
            continue
        here = room(mod)
        for d in sorted(deps):
            if d.startswith("parallel_runtime"):
                out.append(f"upward import: {mod} imports {d} (balanced_loader never imports parallel_runtime)")
                continue
            there = room(d)
            if here in (None, "__main__") or there is None or there == here:
                continue
            if here not in floors:
                out.append(f"unknown room: {mod} (add '{here}' to the floors of tests/arch.py and "
                           f"docs/architecture.md)")
            elif there not in floors[here]:
                out.append(f"upward import: {mod} imports {d} ('{here}' may import {sorted(floors[here])})")
    return out


def _is_torch_distributed(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value == "torch.distributed" or node.value.startswith("torch.distributed."))


def torch_distributed(root: Path, package: str = "balanced_loader", allowed: frozenset[str] = frozenset()
                      ) -> list[str]:
    """``torch.distributed`` reached from ``package`` by any route: an import, ``import_module``,
    ``sys.modules[...]`` / ``.get``, ``getattr(torch, "distributed")`` or the attribute ``torch.distributed``.
    ``allowed``: files (relative to ``root``) that may look an already initialized default group up."""
    out = []
    for p in py_files(root, (package,)):
        if str(p.relative_to(root)) in allowed:
            continue
        tree = ast.parse(p.read_text(), str(p))
        where = p.relative_to(root)
        for name in imported_names(root, p, tree):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                out.append(f"torch.distributed imported in {where}: {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and _is_torch_distributed(node.slice):
                out.append(f"torch.distributed reached in {where}:{node.lineno} (a subscript)")
            elif isinstance(node, ast.Call) and any(_is_torch_distributed(a) for a in node.args) and \
                    getattr(node.func, "attr", getattr(node.func, "id", "")) not in ("import_module", "__import__"):
                out.append(f"torch.distributed reached in {where}:{node.lineno} (a call with its name)")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and node.args[1].value == "distributed":
                out.append(f"torch.distributed reached in {where}:{node.lineno} (getattr)")
            elif isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                out.append(f"torch.distributed reached in {where}:{node.lineno} (torch.distributed)")
    return out


_PATH_LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader", "load_source"}


def path_loading(root: Path, folders: tuple[str, ...] = ("tests", "tools")) -> list[str]:
    """Code loaded by file path in tests and tools (importlib's spec_from_file_location, runpy.run_path,
    SourceFileLoader, exec of a file) and ``sys.path`` edits: tools are thin scripts over the installed
    package, tests import packages (a tool is run as a command, never imported)."""
    out = []
    for folder in folders:
        for p in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(p.read_text(), str(p))
            where = p.relative_to(root)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                    if name in _PATH_LOADERS:
                        out.append(f"path loading in {where}:{node.lineno} ({name})")
                    elif name == "exec" and node.args and isinstance(node.args[0], ast.Call):
                        out.append(f"path loading in {where}:{node.lineno} (exec of a file's text)")
                    elif name in ("insert", "append") and isinstance(node.func, ast.Attribute) and \
                            isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "path" and \
                            isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "sys":
                        out.append(f"sys.path edit in {where}:{node.lineno}")
    return out


def long_modules(root: Path, packages: tuple[str, ...] = PACKAGES, limit: int = MAX_LINES) -> list[str]:
    """Modules over ``limit`` lines whose docstring does not say why they are one module ("Why one module")."""
    out = []
    for p in py_files(root, packages):
        text = p.read_text()
        n = len(text.splitlines())
        if n > limit:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why one module" not in doc:
                out.append(f"module over {limit} lines without a 'Why one module' paragraph: {p.relative_to(root)} "
                           f"({n} lines)")
    return out
