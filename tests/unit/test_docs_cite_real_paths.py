"""Every `fsdptrain/...` path and `fsdptrain.x.y` name that the docs, the README, the examples' READMEs and the
package's own strings (error messages, log lines, docstrings) cite exists.

A path must be a file or a folder of the repository; a dotted name must be a module of the package or a name a module
defines (read with `ast`, so nothing is imported). The project spells torch.distributed in full
(docs/architecture.md), so a `dist.x` in the docs names nothing and is reported too.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATH_RE = re.compile(r"(?<![\w./-])fsdptrain/[\w./*-]*[\w*/]")
DOTTED_RE = re.compile(r"(?<![\w./-])fsdptrain(?:\.[A-Za-z_]\w*)+")
DIST_RE = re.compile(r"`dist\.\w+")
NOT_REPOSITORY_PATHS = {"fsdptrain/attempt_"}
"""Strings that look like a path but name something else: the prefix of our keys in torchrun's store."""


def cited(text: str) -> list[str]:
    """The paths and dotted names in ``text`` that start with fsdptrain, and any `dist.x`."""
    return PATH_RE.findall(text) + DOTTED_RE.findall(text) + [m[1:] for m in DIST_RE.findall(text)]


def _defined_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _defined_names(node.body + getattr(node, "orelse", []))
    return names


@cache
def _module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def missing(name: str, root: Path = ROOT) -> bool:
    """Whether the cited path or dotted name ``name`` names nothing under ``root``."""
    if name in NOT_REPOSITORY_PATHS:
        return False
    if name.startswith("dist."):
        return True
    if "/" in name:
        path = name.rstrip("/")
        return not (any(root.glob(path)) if "*" in path else (root / path).exists())
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        stem = root.joinpath(*parts[:end])
        source = stem / "__init__.py" if stem.is_dir() else stem.with_suffix(".py")
        if source.is_file():
            break
    else:
        return True
    rest = parts[end:]
    if not rest:
        return False
    body = _module_tree(source).body
    if rest[0] not in _defined_names(body):
        return not (stem.is_dir() and (stem / rest[0]).exists())
    classes = {n.name: n for n in body if isinstance(n, ast.ClassDef)}
    if len(rest) > 1 and rest[0] in classes:
        return rest[1] not in _defined_names(classes[rest[0]].body)
    return False


def _string_literals(path: Path) -> str:
    return "\n".join(n.value for n in ast.walk(_module_tree(path))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str))


def documents() -> dict[str, str]:
    """``{file relative to the repository: the text that cites}`` for every place the test reads."""
    files = [*sorted(ROOT.glob("docs/*.md")), ROOT / "README.md", *sorted(ROOT.glob("examples/**/README*"))]
    out = {str(p.relative_to(ROOT)): p.read_text() for p in files}
    out.update({str(p.relative_to(ROOT)): _string_literals(p) for p in sorted((ROOT / "fsdptrain").rglob("*.py"))})
    return out


def test_every_cited_path_and_name_exists():
    stale = sorted({f"{where}: {name}" for where, text in documents().items() for name in cited(text)
                    if missing(name)})
    assert stale == []


def test_the_test_reads_the_docs_and_the_messages():
    docs = documents()
    assert "README.md" in docs and "docs/architecture.md" in docs and "fsdptrain/cli.py" in docs
    assert sum(len(cited(text)) for text in docs.values()) > 50


@pytest.mark.parametrize("name, is_missing", [
    ("fsdptrain/rl/pg_terms.py", False),
    ("fsdptrain/rl/", False),
    ("fsdptrain/conf/model/*.yaml", False),
    ("fsdptrain/adv_estimators.py", True),
    ("fsdptrain.rl.pg_terms", False),
    ("fsdptrain.rl.pg_terms.PgTermSettings", False),
    ("fsdptrain.rl.pg_terms.PgTermSettings.clip_ratio_low", False),
    ("fsdptrain.rl.pg_terms.PgTermSettings.no_such_knob", True),
    ("fsdptrain.config.ConfigError", False),
    ("fsdptrain.export.export_hf", True),
    ("fsdptrain.packing.pack_sequences", True),
    ("fsdptrain.data.packing.no_such_function", True),
    ("dist.dp_size", True),
])
def test_a_stale_citation_is_found(name, is_missing):
    assert missing(name) is is_missing


def test_citations_are_cut_where_the_name_ends():
    text = "see `fsdptrain/rl/policy_loss.py`, or fsdptrain.rl.policy_loss.kl_penalty(). Also `dist.dp_size`."
    assert cited(text) == ["fsdptrain/rl/policy_loss.py", "fsdptrain.rl.policy_loss.kl_penalty", "dist.dp_size"]
