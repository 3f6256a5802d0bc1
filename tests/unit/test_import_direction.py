"""The layout's import rules (docs/architecture.md), read from every module's source with `ast`.

A numerics module never imports torch.distributed, a model, data or the loop; `rollout/` never imports a recipe
(`train/`) and nothing below it imports `rollout/`; `generation/` imports no rollout, recipe, loss or check, and
nothing below it imports `generation/`; `metrics/` and `storage/` import nothing of fsdptrain but themselves; a model
module never imports a loss or a collective; `registry/` imports nothing of fsdptrain above it, and `config/` and `rl/`
import nothing of fsdptrain but themselves and `registry/`; imports never form a cycle; the modules the CLI's parent
process loads never import torch at module level. Imports under `if TYPE_CHECKING:` never run, so they are skipped for
the torch-at-import rule, but they are edges of the picture of the code: they count for the other rules and for cycles.
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
                       "fsdptrain.check", "fsdptrain.rollout", "fsdptrain.generation"),
    "fsdptrain.rewards": ("torch.distributed", "fsdptrain.model", "fsdptrain.distributed", "fsdptrain.train",
                          "fsdptrain.check", "fsdptrain.rollout", "fsdptrain.generation"),
    "fsdptrain.model": ("torch.distributed", "fsdptrain.rl", "fsdptrain.distributed", "fsdptrain.train",
                        "fsdptrain.check", "fsdptrain.rollout", "fsdptrain.generation"),
    "fsdptrain.distributed": ("fsdptrain.rl", "fsdptrain.train", "fsdptrain.check", "fsdptrain.rollout",
                              "fsdptrain.generation", "fsdptrain.run"),
    "fsdptrain.run": ("fsdptrain.train", "fsdptrain.rollout", "fsdptrain.check", "fsdptrain.generation"),
    "fsdptrain.generation": ("fsdptrain.train", "fsdptrain.check", "fsdptrain.rollout", "fsdptrain.rl",
                             "fsdptrain.rewards"),
    "fsdptrain.rollout": ("fsdptrain.train", "fsdptrain.check"),
    "fsdptrain.train": ("fsdptrain.check",),
    "fsdptrain.config": ("torch", "fsdptrain.model", "fsdptrain.data", "fsdptrain.distributed", "fsdptrain.train",
                         "fsdptrain.check", "fsdptrain.rewards", "fsdptrain.rollout", "fsdptrain.generation"),
}
# part -> the only parts of fsdptrain its modules may import (the layers at the bottom)
ONLY_FSDPTRAIN = {
    "fsdptrain.registry": ("fsdptrain.registry",),
    "fsdptrain.metrics": ("fsdptrain.metrics",),
    "fsdptrain.storage": ("fsdptrain.storage",),
    "fsdptrain.config": ("fsdptrain.config", "fsdptrain.registry"),
    "fsdptrain.rl": ("fsdptrain.rl", "fsdptrain.registry", "fsdptrain.metrics"),
}
# part -> the modules it may import despite FORBIDDEN: none; an exemption is a layer drawn wrong
ALLOWED: dict[str, tuple[str, ...]] = {}
TORCH_FREE_AT_IMPORT = ("fsdptrain.cli", "fsdptrain.config.compose", "fsdptrain.launch",
                        "fsdptrain.distributed.torchrun",
                        "fsdptrain.config", "fsdptrain.registry")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str) -> list[tuple[str, bool, bool]]:
    """``(imported module, runs at module level, only under `if TYPE_CHECKING:`)`` for every import."""
    found: list[tuple[str, bool, bool]] = []

    def visit(node: ast.AST, top: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for branch in child.body:
                    visit(ast.Module(body=[branch], type_ignores=[]), False, True)
                for branch in child.orelse:
                    visit(ast.Module(body=[branch], type_ignores=[]), top, typing_only)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top, typing_only) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative import
                    package = module.rsplit(".", child.level)[0]
                    base = f"{package}.{base}" if base else package
                found.append((base, top, typing_only))
                found.extend((f"{base}.{alias.name}", top, typing_only) for alias in child.names)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            visit(child, top and not nested, typing_only)

    visit(ast.parse(source), True, False)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken rule in ``{module name: source}``: forbidden imports, torch at import time, and cycles."""
    modules = set(sources)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    problems = []
    for module, source in sorted(sources.items()):
        for target, top, typing_only in imports_of(source, module):
            for part, banned in FORBIDDEN.items():
                allowed = any(_within(target, a) for a in ALLOWED.get(part, ()))
                if _within(module, part) and not allowed and any(_within(target, b) for b in banned):
                    problems.append(f"{module} imports {target}")
            for part, allowed in ONLY_FSDPTRAIN.items():
                if (_within(module, part) and _within(target, "fsdptrain") and target != "fsdptrain"
                        and not any(_within(target, a) for a in allowed)):
                    problems.append(f"{module} imports {target}")
            torch_free = any(_within(module, m) for m in TORCH_FREE_AT_IMPORT)
            if top and torch_free and _within(target, "torch"):
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
    ("fsdptrain.rl.policy_loss", "import torch.distributed\n", "fsdptrain.rl.policy_loss imports torch.distributed"),
    ("fsdptrain.rl.policy_loss", "from fsdptrain.model.loading import TINY_CONFIG\n",
     "fsdptrain.rl.policy_loss imports fsdptrain.model.loading"),
    ("fsdptrain.rl.policy_loss", "def f():\n    from fsdptrain.train import rl\n",
     "fsdptrain.rl.policy_loss imports fsdptrain.train"),
    ("fsdptrain.model.forward", "from fsdptrain.rl.policy_loss import policy_loss\n",
     "fsdptrain.model.forward imports fsdptrain.rl.policy_loss"),
    ("fsdptrain.cli", "import torch\n", "fsdptrain.cli imports torch at module level"),
    # the two holes issue 24 found: config/ reaching into rl/, rl/ into a top-level module
    ("fsdptrain.config.validate", "from fsdptrain.rl.aggregate import AGG_MODES\n",
     "fsdptrain.config.validate imports fsdptrain.rl.aggregate"),
    ("fsdptrain.rl.pg_terms", "from fsdptrain.cli import main\n", "fsdptrain.rl.pg_terms imports fsdptrain.cli"),
    ("fsdptrain.rl.pg_terms", "from fsdptrain.config import ConfigError\n",
     "fsdptrain.rl.pg_terms imports fsdptrain.config"),
    ("fsdptrain.registry.names", "from fsdptrain.config.schema import DTYPES\n",
     "fsdptrain.registry.names imports fsdptrain.config.schema"),
    ("fsdptrain.registry.user_functions", "import torch\n",
     "fsdptrain.registry.user_functions imports torch at module level"),
    ("fsdptrain.rl.policy_loss",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fsdptrain.model import loading\n",
     "fsdptrain.rl.policy_loss imports fsdptrain.model"),
    ("fsdptrain.distributed.collectives", "from fsdptrain.rl.policy_loss import policy_loss\n",
     "fsdptrain.distributed.collectives imports fsdptrain.rl.policy_loss"),
    # rollouts sit below the loop and above model/, data/, rewards/
    ("fsdptrain.rollout.rollout_source", "from fsdptrain.train.rl import Trainer\n",
     "fsdptrain.rollout.rollout_source imports fsdptrain.train.rl"),
    ("fsdptrain.generation.generate", "from fsdptrain.rollout.turns import run_turns\n",
     "fsdptrain.generation.generate imports fsdptrain.rollout.turns"),
    ("fsdptrain.data.conversation", "from fsdptrain.rollout.turns import run_turns\n",
     "fsdptrain.data.conversation imports fsdptrain.rollout.turns"),
])
def test_a_planted_violation_is_reported(module, source, expected):
    sources = {**package_sources(), module: source}
    assert expected in violations(sources)


def test_a_planted_cycle_is_reported():
    sources = {"fsdptrain.a": "from fsdptrain import b\nimport fsdptrain.b\n", "fsdptrain.b": "import fsdptrain.a\n"}
    assert violations(sources) == ["import cycle: fsdptrain.a -> fsdptrain.b -> fsdptrain.a"]


def test_a_type_checking_only_cycle_is_reported():
    sources = {"fsdptrain.a": "import fsdptrain.b\n",
               "fsdptrain.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fsdptrain.a import A\n"}
    assert violations(sources) == ["import cycle: fsdptrain.a -> fsdptrain.b -> fsdptrain.a"]


def test_type_checking_imports_do_not_run_at_import():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert violations({"fsdptrain.cli": source}) == []
    assert imports_of(source, "fsdptrain.cli")[-1] == ("torch", False, True)


def test_no_function_over_80_lines():
    long_functions = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions[f"{module_name(p, PACKAGE)}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert long_functions == {}
