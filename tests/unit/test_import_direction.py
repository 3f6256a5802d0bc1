"""The layout's import rules (docs/architecture.md), read from every module's source with `ast`.

A numerics module never imports torch.distributed, a model, data or the loop; a model module never imports a loss or a
collective; imports never form a cycle; the modules the CLI's parent process loads never import torch at module level.
Imports under `if TYPE_CHECKING:` are annotations only and are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdptrain"

# part -> prefixes its modules must not import
FORBIDDEN = {
    "fsdptrain.rl": ("torch.distributed", "fsdptrain.model", "fsdptrain.data", "fsdptrain.distributed",
                     "fsdptrain.train", "fsdptrain.check", "fsdptrain.rewards", "transformers"),
    "fsdptrain.data": ("torch.distributed", "fsdptrain.model", "fsdptrain.distributed", "fsdptrain.train",
                       "fsdptrain.check"),
    "fsdptrain.rewards": ("torch.distributed", "fsdptrain.model", "fsdptrain.distributed", "fsdptrain.train",
                          "fsdptrain.check"),
    "fsdptrain.model": ("torch.distributed", "fsdptrain.rl", "fsdptrain.distributed", "fsdptrain.train",
                        "fsdptrain.check"),
    "fsdptrain.distributed": ("fsdptrain.rl", "fsdptrain.train", "fsdptrain.check"),
    "fsdptrain.train": ("fsdptrain.check",),
    "fsdptrain.config": ("torch", "fsdptrain.model", "fsdptrain.data", "fsdptrain.distributed", "fsdptrain.train",
                         "fsdptrain.check", "fsdptrain.rewards"),
}
# part -> the modules it may import despite FORBIDDEN: the collectives reduce the typed metric containers
ALLOWED = {"fsdptrain.distributed": ("fsdptrain.rl.metrics", "fsdptrain.rl.metric_buffers")}
TORCH_FREE_AT_IMPORT = ("fsdptrain.cli", "fsdptrain.compose", "fsdptrain.launch", "fsdptrain.plugins",
                        "fsdptrain.distributed.torchrun", "fsdptrain.config", "fsdptrain.rl.names")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import outside `if TYPE_CHECKING:` blocks."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative import
                    package = module.rsplit(".", child.level)[0]
                    base = f"{package}.{base}" if base else package
                found.append((base, top))
                found.extend((f"{base}.{alias.name}", top) for alias in child.names)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            visit(child, top and not nested)

    visit(ast.parse(source), True)
    return found


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken rule in ``{module name: source}``: forbidden imports, torch at import time, and cycles."""
    modules = set(sources)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    problems = []
    for module, source in sorted(sources.items()):
        for target, top in imports_of(source, module):
            for part, banned in FORBIDDEN.items():
                inside = module == part or module.startswith(part + ".")
                allowed = any(target == a or target.startswith(a + ".") for a in ALLOWED.get(part, ()))
                if inside and not allowed and any(target == b or target.startswith(b + ".") for b in banned):
                    problems.append(f"{module} imports {target}")
            torch_free = any(module == m or module.startswith(m + ".") for m in TORCH_FREE_AT_IMPORT)
            if top and torch_free and (target == "torch" or target.startswith("torch.")):
                problems.append(f"{module} imports {target} at module level")
            if target in modules and target != module:
                graph[module].add(target)
    problems.extend(f"import cycle: {' -> '.join(c)}" for c in _cycles(graph))
    return sorted(set(problems))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def package_sources() -> dict[str, str]:
    return {module_name(p, PACKAGE): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_the_package_follows_the_import_rules():
    assert violations(package_sources()) == []


@pytest.mark.parametrize("module, source, expected", [
    ("fsdptrain.rl.policy", "import torch.distributed\n", "fsdptrain.rl.policy imports torch.distributed"),
    ("fsdptrain.rl.policy", "from fsdptrain.model.build import TINY_CONFIG\n",
     "fsdptrain.rl.policy imports fsdptrain.model.build"),
    ("fsdptrain.rl.policy", "def f():\n    from fsdptrain.train import loop\n", "fsdptrain.rl.policy imports fsdptrain.train"),
    ("fsdptrain.model.forward", "from fsdptrain.rl.policy import policy_loss\n",
     "fsdptrain.model.forward imports fsdptrain.rl.policy"),
    ("fsdptrain.cli", "import torch\n", "fsdptrain.cli imports torch at module level"),
    ("fsdptrain.distributed.collectives", "from fsdptrain.rl.policy import policy_loss\n",
     "fsdptrain.distributed.collectives imports fsdptrain.rl.policy"),
])
def test_a_planted_violation_is_reported(module, source, expected):
    sources = {**package_sources(), module: source}
    assert expected in violations(sources)


def test_a_planted_cycle_is_reported():
    sources = {"fsdptrain.a": "from fsdptrain import b\nimport fsdptrain.b\n", "fsdptrain.b": "import fsdptrain.a\n"}
    assert violations(sources) == ["import cycle: fsdptrain.a -> fsdptrain.b -> fsdptrain.a"]


def test_type_checking_imports_are_annotations_only():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fsdptrain.train.loop import Trainer\n"
    assert all(not t.startswith("fsdptrain.train") for t, _ in imports_of(source, "fsdptrain.train.progress"))


def test_no_module_over_450_lines_and_no_function_over_80():
    long_files = {module_name(p, PACKAGE): n for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > 450}
    long_functions = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions[f"{module_name(p, PACKAGE)}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert long_files == {} and long_functions == {}
