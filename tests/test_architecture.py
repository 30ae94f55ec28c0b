"""The architecture rules hold on this repository, and each rule catches a tree built to break it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from arch import circles, import_graph, layering, long_modules, path_loading, torch_distributed

ROOT = Path(__file__).resolve().parents[1]
# contract 4: rank and world_size default to the initialized process group; resolve_world reads its rank
# and size (never a collective, never an import) and is the one place in balanced_loader that may
READS_THE_DEFAULT_GROUP = frozenset({"balanced_loader/loader_args.py"})


def test_the_repository_keeps_every_rule():
    graph = import_graph(ROOT)
    assert len(graph) > 100
    problems = (circles(graph) + layering(graph) + torch_distributed(ROOT, allowed=READS_THE_DEFAULT_GROUP)
                + path_loading(ROOT)
                + long_modules(ROOT))
    assert problems == []


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    for pkg in ("balanced_loader", "parallel_runtime"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


def test_a_circle_is_caught(tmp_path):
    root = tree(tmp_path, {"balanced_loader/data/__init__.py": "", "balanced_loader/data/a.py": "from . import b\n",
                           "balanced_loader/data/b.py": "def f():\n    from balanced_loader.data import a\n"})
    assert circles(import_graph(root)) == ["import circle: balanced_loader.data.a <-> balanced_loader.data.b"]


@pytest.mark.parametrize(("src", "what"), [
    ("from balanced_loader.loader import BalancedLoader\n", "balanced_loader.loader"),
    ("import importlib\nimportlib.import_module('balanced_loader.loader')\n", "balanced_loader.loader"),
    ("from parallel_runtime import model\n", "parallel_runtime"),
])
def test_an_upward_import_is_caught(tmp_path, src, what):
    root = tree(tmp_path, {"balanced_loader/data/__init__.py": "", "balanced_loader/data/x.py": src,
                           "balanced_loader/loader.py": "", "parallel_runtime/model.py": ""})
    found = layering(import_graph(root))
    assert len(found) == 1 and found[0].startswith("upward import: balanced_loader.data.x imports " + what)


@pytest.mark.parametrize("src", [
    "import torch.distributed as dist\n",
    "from torch import distributed\n",
    "import importlib\nd = importlib.import_module('torch.distributed')\n",
    "import sys\nd = sys.modules['torch.distributed']\n",
    "import sys\nd = sys.modules.get('torch.distributed')\n",
    "import torch\nd = getattr(torch, 'distributed')\n",
    "import torch\nd = torch.distributed.get_rank()\n",
])
def test_torch_distributed_in_balanced_loader_is_caught_by_any_route(tmp_path, src):
    root = tree(tmp_path, {"balanced_loader/calibration/__init__.py": "", "balanced_loader/calibration/s.py": src})
    assert torch_distributed(root)
    root2 = tree(tmp_path / "ok", {"parallel_runtime/x.py": src})  # the runtime may
    assert torch_distributed(root2) == []


@pytest.mark.parametrize("src", [
    "import importlib.util\nspec = importlib.util.spec_from_file_location('t', 'tools/x.py')\n",
    "import runpy\nrunpy.run_path('tools/x.py')\n",
    "exec(open('tools/x.py').read())\n",
    "import sys\nsys.path.insert(0, 'tools')\n",
])
def test_a_path_loaded_tool_is_caught(tmp_path, src):
    root = tree(tmp_path, {"tests/test_x.py": src, "tools/y.py": "print(1)\n"})
    assert len(path_loading(root)) == 1


def test_a_long_module_must_say_why_it_is_one(tmp_path):
    body = "x = 1\n" * 700
    root = tree(tmp_path, {"balanced_loader/a.py": '"""A."""\n' + body,
                           "balanced_loader/b.py": '"""B.\n\nWhy one module: one kernel family."""\n' + body})
    found = long_modules(root)
    assert len(found) == 1 and "balanced_loader/a.py" in found[0]
