"""Bounds on how far a config may expand, checked before anything expands it (docs/configuration.md).

A YAML file can name one node many times through aliases (``*a``), and an OmegaConf string can name other values
many times through interpolations (``${a}${a}``); nested, either grows exponentially (a "billion laughs" file: nine
levels of ten aliases are 10^9 values from a few hundred bytes), and building or resolving it would hang the CLI
and exhaust memory. Both sizes are counted here on the unexpanded structure, each node once (memoised), so the check
takes time linear in the file: a YAML file's values with every alias expanded (:func:`yaml_expansion`), and each
config value's length once resolved (:func:`interpolation_sizes`). A config over either bound is refused with one
line naming the file or the key.

What the count of an interpolation sees: a plain reference ``${a.b}`` (absolute, relative ``${.x}``/``${..x}``, or
indexed ``${a[0]}``) counts the size of what it names; the key of ``oc.select`` and ``oc.deprecated`` counts the
same; any other resolver's call counts as its own text (with the references inside its arguments). A value that
refers back to itself (a cycle) is refused with the same one line, naming the key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from fsdptrain.registry.errors import ConfigError
from fsdptrain.registry.user_paths import user_path

MAX_YAML_VALUES = 100_000
"""A config file whose values, with every alias expanded, outnumber this is refused (ours hold a few hundred)."""
MAX_VALUE_CHARS = 1_000_000
"""A config value longer than this once its interpolations are resolved is refused."""

_SELECTING = ("oc.select", "oc.deprecated")


MAX_YAML_DEPTH = 32
"""A config file nesting deeper than this is refused (ours nest three levels; OmegaConf and hydra build a value by
recursion and fail past Python's stack)."""
YAML_TAGS = frozenset(f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "seq", "map",
                                                                 "merge"))
"""The tags a config file may carry: the values OmegaConf builds (``!!binary``, ``!!timestamp``, ``!!set``,
``!!omap``, ``!!pairs`` and any ``!custom`` tag are refused)."""
_NULLS = ("", "~", "null", "Null", "NULL")
"""A plain scalar YAML reads as null (a null key is one no config can hold)."""
_KEY_TAGS = frozenset(f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool"))


class _Refused(Exception):
    def __init__(self, node: yaml.Node, why: str):
        super().__init__(f"{node.start_mark.line + 1}: {why}")


def _compose(path: Path) -> list[yaml.Node]:
    """The file's documents as YAML nodes, composed without resolving plain scalars (BaseLoader: a tag on a node was
    written in the file); YAMLError for a file that does not parse, RecursionError for one nested past the stack."""
    return [document for document in yaml.compose_all(path.read_text(encoding="utf-8", errors="replace"),
                                                       Loader=yaml.BaseLoader) if document is not None]


def _expansion(documents: list[yaml.Node]) -> int:
    """The nodes of ``documents`` with every alias expanded; _Refused for a shape OmegaConf cannot build (a node
    inside itself, nesting past :data:`MAX_YAML_DEPTH`, a tag outside :data:`YAML_TAGS`, a key that is not a string,
    a number or a bool)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        if id(node) in open_nodes:
            raise _Refused(node, "a node that contains itself (a recursive alias), which no config can hold")
        if depth > MAX_YAML_DEPTH:
            raise _Refused(node, f"values nest deeper than {MAX_YAML_DEPTH} levels")
        if node.tag not in YAML_TAGS:
            raise _Refused(node, f"the tag {node.tag!r} makes a value the config library cannot hold (it takes "
                                 "strings, numbers, bools, null, lists and mappings)")
        known = sizes.get(id(node))
        if known is not None:
            return known
        open_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, _ in node.value:
                if (not isinstance(key, yaml.ScalarNode) or key.tag not in _KEY_TAGS
                        or (key.style is None and key.value in _NULLS)):
                    raise _Refused(key, "a mapping key that is not a string, a number or a bool")
            total = 1 + sum(size(key, depth + 1) + size(value, depth + 1) for key, value in node.value)
        else:
            total = 1
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    return sum(size(document, 0) for document in documents)


def yaml_expansion(path: Path) -> int:
    """The number of nodes (scalars, sequences, mappings, and mapping keys) of the YAML file ``path`` with every
    alias expanded; 0 for a file that does not parse (hydra reports that one) or that :func:`yaml_problem` refuses."""
    try:
        return _expansion(_compose(path))
    except (yaml.YAMLError, RecursionError, _Refused):
        return 0


def yaml_problem(path: Path) -> Optional[str]:
    """One line naming ``path`` (and its line) when the config library could not build it or it expands past
    :data:`MAX_YAML_VALUES`, else None (a file that is not YAML at all is left to hydra's one line)."""
    try:
        count = _expansion(_compose(path))
    except yaml.YAMLError:
        return None
    except RecursionError:
        return f"{path}: values nest deeper than {MAX_YAML_DEPTH} levels: flatten the file"
    except _Refused as err:
        return f"{path}:{err}: fix the file"
    if count > MAX_YAML_VALUES:
        return (f"{path}: its YAML aliases expand to {count} values, more than {MAX_YAML_VALUES} (a file built to "
                f"expand without bound): write the values out, or fix the file")
    return None


def check_yaml_files(folder: Path) -> Optional[str]:
    """One line naming the first YAML file under ``folder`` that is not a regular file, that the config library cannot
    build, or that expands past :data:`MAX_YAML_VALUES`; else None."""
    for path in sorted([*folder.rglob("*.yaml"), *folder.rglob("*.yml")]):
        try:  # what it is before hydra opens it: a named pipe would hold the CLI forever
            user_path(path, key="config file")
        except ConfigError as err:
            return str(err)
        problem = yaml_problem(path)
        if problem is not None:
            return problem
    return None


def _flatten(value: Any, key: str, out: dict[str, Any]) -> None:
    out[key] = value
    if isinstance(value, dict):
        for name, item in value.items():
            _flatten(item, f"{key}.{name}" if key else str(name), out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _flatten(item, f"{key}.{index}" if key else str(index), out)


def _target(reference: str, where: str) -> Optional[str]:
    """The absolute dotted key a plain reference made in the value at ``where`` names; None for a resolver call."""
    text = reference.strip()
    if ":" in text:
        name, _, args = text.partition(":")
        if name.strip() not in _SELECTING:
            return None
        text = args.split(",")[0].strip()
    text = re.sub(r"\[([^\]]*)\]", r".\1", text)
    if text.startswith("."):
        dots = len(text) - len(text.lstrip("."))
        parent = where.split(".")[:-dots] if dots <= where.count(".") + 1 else []
        text = ".".join([*parent, text[dots:]]).strip(".")
    return text


class Unfollowed(ValueError):
    """An interpolation form the count does not follow (its size is not known before resolving): refused."""


FOLLOWED_RESOLVERS = ("oc.select", "oc.deprecated", "oc.dict.keys", "oc.dict.values", "oc.env", "fsdptrain_required")
"""The resolvers the count follows; any other (``oc.create``, ``oc.decode``, ``hydra:``, ``now:``...) is refused."""


def _interpolations(ctx) -> bool:
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar

    return isinstance(ctx, Grammar.InterpolationContext) or any(
        _interpolations(child) for child in (ctx.getChildren() if hasattr(ctx, "getChildren") else ()))


def _text_size(value: str, where: str, size) -> int:
    """The length of the string ``value`` (held at ``where``) once OmegaConf resolves it, read from OmegaConf's own
    grammar: a reference counts the size of what it names, a followed resolver its result, literal text and escapes
    their length. Unfollowed for any form the count cannot size (a key built from an interpolation, another
    resolver)."""
    from antlr4 import Token
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar
    from omegaconf.grammar_parser import parse

    try:
        tree = parse(value)
    except Exception:  # noqa: BLE001 - not valid interpolation syntax: OmegaConf reports it when it resolves
        return len(value)

    def reference(ctx, text: str) -> int:
        if _interpolations(ctx):
            raise Unfollowed(f"{where}: the interpolation ${{{ctx.getText()}}} builds a key from another "
                             "interpolation")
        return size(_target(text, where))

    def walk(ctx) -> int:
        if isinstance(ctx, Grammar.InterpolationNodeContext):
            return reference(ctx, ctx.getText()[2:-1])
        if isinstance(ctx, Grammar.InterpolationResolverContext):
            name = ctx.resolverName().getText()
            if name not in FOLLOWED_RESOLVERS:
                raise Unfollowed(f"{where}: the resolver {name!r} in {ctx.getText()} is not one the expansion bound "
                                 f"follows ({', '.join(FOLLOWED_RESOLVERS)})")
            elements = ctx.sequence().element() if ctx.sequence() is not None else []
            if not elements or name == "fsdptrain_required":
                return len(ctx.getText())
            first, defaults = elements[0], sum(walk(element) for element in elements[1:])
            if name == "oc.env":
                if _interpolations(first):
                    raise Unfollowed(f"{where}: {ctx.getText()} names its variable through an interpolation")
                return len(os.environ.get(first.getText().strip(), "")) + defaults
            return reference(first, first.getText().strip()) + defaults
        if not hasattr(ctx, "getChildren"):  # a token: literal text, an escape (the end of input is none)
            return 0 if ctx.getSymbol().type == Token.EOF else len(ctx.getText())
        return sum(walk(child) for child in ctx.getChildren())

    return walk(tree)


def interpolation_sizes(raw: dict) -> dict[str, int]:
    """``{dotted key: size}`` of every value of the unresolved config ``raw`` (``OmegaConf.to_container(cfg,
    resolve=False)``): a string's length once its interpolations are resolved; a container's, at least the length of
    its text (a container interpolated into a string is its text): its items' sizes, its keys and punctuation.
    Counted on the references, never by resolving them (module docstring); Unfollowed for a form it cannot count."""
    values: dict[str, Any] = {}
    _flatten(raw, "", values)
    sizes: dict[str, int] = {}
    pending: set[str] = set()

    def size(key: str) -> int:
        if key in pending:
            raise RecursionError(key)
        if key in sizes:
            return sizes[key]
        pending.add(key)
        value = values.get(key)
        if isinstance(value, dict):
            total = 2 + sum(len(str(name)) + 4 + size(f"{key}.{name}" if key else str(name)) for name in value)
        elif isinstance(value, list):
            total = 2 + sum(2 + size(f"{key}.{index}" if key else str(index)) for index in range(len(value)))
        elif isinstance(value, str) and "${" in value:
            total = _text_size(value, key, size)
        else:
            total = len(str(value))
        pending.discard(key)
        sizes[key] = total
        return total

    for key in values:
        size(key)
    return sizes


def check_interpolations(raw: dict) -> Optional[str]:
    """One line naming the first config value that resolves to more than :data:`MAX_VALUE_CHARS`, else None."""
    try:
        sizes = interpolation_sizes(raw)
    except Unfollowed as err:
        return (f"{err}: fsdptrain refuses what its bound on config expansion cannot count before resolving; write "
                f"the value out (docs/configuration.md)")
    except RecursionError as err:  # ours (a cycle, naming its key) or Python's (a chain deeper than its stack)
        where = f"{err.args[0]}: " if err.args and isinstance(err.args[0], str) and " " not in err.args[0] else ""
        return (f"{where}its interpolations (${{...}}) refer back to themselves, or nest too deep to resolve: fix "
                f"the value")
    over = {key: value for key, value in sizes.items() if key and value > MAX_VALUE_CHARS}
    if not over:
        return None
    key = max(over, key=lambda name: (name.count("."), over[name]))  # a value rather than the group holding it
    return (f"{key}: its interpolations (${{...}}) expand to about {over[key]} characters, more than "
            f"{MAX_VALUE_CHARS} (a config built to expand without bound): fix the value")
