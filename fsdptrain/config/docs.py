"""Field documentation read from the schema's attribute docstrings, and the Markdown page rendered from it.

``docs/configuration.md`` is generated from here (``python scripts/gen_config_docs.py``), and a test checks it is up
to date, so the documented fields, defaults and descriptions cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

from fsdptrain.config import SCHEMA_GROUPS
from fsdptrain.config import schema as config_module
from fsdptrain.config.fields import field_choices, field_item_range, field_range, flat_fields

GROUP_INTROS = {
    "model": "The policy (and value) model: a local Hugging Face folder, or a tiny model built from this config; "
    "`model.lora.*` trains LoRA adapters instead of every weight (see docs/lora.md).",
    "algorithm": "PPO/GRPO settings. Presets: `algorithm=ppo` (default, value model + GAE), `algorithm=grpo`.",
    "loss": "Loss aggregation (see docs/loss.md) and the fused loss's chunking.",
    "data": "Where experience comes from. Presets: `data=task` (default), `data=prompts` (your prompt files, see "
    "docs/your-task.md), `data=jsonl` (offline rollouts).",
    "reward": "Reward functions scoring each completion (see docs/your-task.md). A call (also of a tool or an "
    "environment method, docs/multi-turn.md) is bounded by `timeout_s`; the workers' imports are not counted against "
    "it (they have their own bound, 300 s); a stop signal gives a running call 10 s, then stops the run without "
    "saving that step (docs/checkpointing.md).",
    "rollout": "Generation of each step's experience.",
    "trainer": "The loop, the optimizers and the run directory. A run folder holds only what fsdptrain wrote (a "
    "folder of your own files is refused); SIGTERM or Ctrl-C stops at the next step boundary after a checkpoint "
    "(docs/checkpointing.md, \"Stopping a run\").",
    "parallel": "The device mesh and FSDP2 settings (see docs/scaling.md).",
    "logging": "Progress display, samples.jsonl and the experiment trackers.",
    "perf": "Performance accounting (see docs/performance.md).",
    "checkpoint": "Periodic checkpoints (see docs/checkpointing.md).",
    "check": "Tolerances of `fsdptrain check-metrics` (see docs/check-metrics.md).",
    "drafter": "An EAGLE-3 speculative-decoding drafter co-trained with the policy (see docs/drafter.md).",
    "sft": "Supervised fine-tuning on demonstrations, for `fsdptrain sft` only (see docs/sft.md).",
}


def field_docs() -> dict[str, dict[str, str]]:
    """``{schema class name: {field name: its attribute docstring}}`` for every dataclass in fsdptrain.config."""
    tree = ast.parse(inspect.getsource(config_module))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for prev, nxt in zip(node.body, node.body[1:]):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                fields[prev.target.id] = nxt.value.value.strip()
        docs[node.name] = fields
    return docs


def _default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _valid_text(f: dataclasses.Field) -> str:
    """The choices or the range the field declares, as the page shows them ("" when it declares neither)."""
    choices = field_choices(f)
    if choices is not None:
        text = ", ".join(f"`{c}`" for c in choices)
        if "each_of" in f.metadata:
            return f"each of {text}"
        return f"{text}, or `module:function`" if f.metadata["user_function"] else text
    item_bounds = field_item_range(f)
    if item_bounds is not None:
        return f"each an integer >= {item_bounds.low:g}"
    bounds = field_range(f)
    if bounds is None:
        return ""
    if bounds.low == -math.inf:
        return "finite"
    if bounds.high == math.inf:
        return f"{'>=' if bounds.low_in else '>'} {bounds.low:g}"
    return f"{'[' if bounds.low_in else '('}{bounds.low:g}, {bounds.high:g}{']' if bounds.high_in else ')'}"


def render_configuration_md() -> str:
    """The whole text of docs/configuration.md."""
    docs = field_docs()
    lines = [
        "# Configuration",
        "",
        "Generated from `fsdptrain/config/schema.py` by `python scripts/gen_config_docs.py`; a test keeps it in step.",
        "",
        "Set any field on the command line as `group.field=value` (`fsdptrain train trainer.steps=5`), pick a preset",
        "with `group=name` (`algorithm=grpo`, `data=jsonl`, `model=local`), print the result with `--cfg`, or bring",
        "your own config folder with `--config-dir DIR --config-name NAME` (list `config_schema` first in its",
        "defaults). The valid column shows each field's choices or range (declared on the field in the schema); they",
        "are validated right after composition: a bad value exits 2 with one line naming it. Numbers must be finite;",
        "null is allowed where the default is null. A config file of yours that is not valid YAML is one line with",
        "its file and line (exit 2). Hydra's own flags (`-m`/`--multirun`, `--info`, `--cfg job`, `-c`...) are not",
        "fsdptrain's: each is refused with one line (exit 2); `--help` lists the options there are. A config built",
        "to expand without bound is refused before it expands, in bounded time (one line, exit 2): a YAML file of",
        "your config folder (or a `hydra.searchpath` folder) whose aliases (`*a`) expand to more than 100,000",
        "values, a value whose interpolations",
        "(`${a}${a}`, nested) would resolve to more than 1,000,000 characters, and one that refers back to itself",
        "(fsdptrain/config/expansion.py counts both on the unexpanded structure). The count follows every reference",
        "(absolute, relative `${..x}`, bracketed `${a[0]}`, inside resolver arguments and quotes) and the resolvers",
        "`oc.select`, `oc.deprecated`, `oc.dict.keys`, `oc.dict.values` and `oc.env` (the variable's real length); a",
        "form it cannot size before resolving is refused: a key built from an interpolation (`${a.${b}}`) and any",
        "other resolver (`oc.create`, `oc.decode`, `hydra:`, `now:`). A config file the config library cannot build",
        "is refused with its file and line: values nested deeper than 32 levels, a recursive alias, a tag other than",
        "the plain ones (`!!binary`, `!!timestamp`, `!!set`, `!!omap`, `!!pairs`, `!custom`), a mapping key that is",
        "not a string, a number or a bool; any other failure of the library composing it is one line naming the file.",
        "",
    ]
    for group, schema in SCHEMA_GROUPS.items():
        lines += [f"## {group}", "", GROUP_INTROS[group], "", "| field | default | valid | meaning |",
                  "| --- | --- | --- | --- |"]
        for dotted, f, _, owner in flat_fields(schema, group):
            lines.append(f"| `{dotted}` | `{_default_text(f)}` | {_valid_text(f)} | {docs[owner.__name__][f.name]} |")
        lines.append("")
    return "\n".join(lines)
