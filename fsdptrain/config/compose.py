"""Compose and validate a config through hydra's compose API, turning every user mistake into one-line ConfigError.

No ``@hydra.main``, no edits of ``sys.argv``: the CLI hands the overrides over as a list. The packaged ``conf/`` is the
primary config directory; with ``--config-dir`` the user's folder is primary and ours stays on the search path, so a
user's config can list ``config_schema`` and our presets (``model: tiny``, ``algorithm: grpo``) in its defaults.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional, Sequence

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdptrain.config import SCHEMA_GROUPS, ConfigError, register_schemas, validate
from fsdptrain.config.expansion import check_interpolations, check_yaml_files
from fsdptrain.config.validate import renamed_key_message
from fsdptrain.registry.errors import first_line

PACKAGE_CONF_DIR = Path(__file__).resolve().parents[1] / "conf"



def _omegaconf_message(err: OmegaConfBaseException) -> str:
    full_key = getattr(err, "full_key", None)
    msg = getattr(err, "msg", None) or first_line(str(err))
    if "not in" in msg and full_key:
        renamed = renamed_key_message(full_key)
        if renamed:
            return renamed
        group = full_key.split(".")[0]
        schema = SCHEMA_GROUPS.get(group)
        if schema is not None and "." in full_key:
            valid = ", ".join(f.name for f in dataclasses.fields(schema))
            return f"unknown config key '{full_key}'; valid keys in '{group}': {valid}"
        return f"unknown config key '{full_key}'; valid top-level keys: {', '.join(SCHEMA_GROUPS)}"
    return f"{full_key}: {first_line(msg)}" if full_key else first_line(msg)


def _hydra_message(err: HydraException) -> str:
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf_message(cause)
    text = str(err)
    if isinstance(err, MissingConfigException):
        options = getattr(err, "options", None)
        head = first_line(text)
        return f"{head}; available: {', '.join(options)}" if options else head
    if isinstance(err, OverrideParseException):
        lines = [line for line in text.strip().splitlines() if line and not line.startswith("See ")]
        return "; ".join(lines[:2])
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "In 'mine': ValidationError raised while composing config:"
        return f"{lines[0]} {lines[1]}"
    return first_line(text)


def _library_failure(where: str, err: BaseException) -> str:
    """The one line of a config the checks let through but hydra or OmegaConf could not build."""
    if isinstance(err, RecursionError):
        return f"{where}: the config nests or refers too deep for the config library to build: flatten it"
    return f"{where}: the config library cannot build it ({type(err).__name__}: {first_line(err)}): fix the file"


def _yaml_message(err: "yaml.YAMLError") -> str:
    """``file:line: not valid YAML (problem)`` for a config file that does not parse."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or first_line(str(err))
    if mark is None:
        return f"a config file is not valid YAML ({problem})"
    return f"{mark.name}:{mark.line + 1}: not valid YAML ({problem}): fix the file"


def _check_no_extra_keys(cfg: DictConfig) -> None:
    """Reject keys added with ``+key=value`` that the schema does not know (they would be silently ignored)."""
    for group, value in cfg.items():
        if group not in SCHEMA_GROUPS:
            raise ConfigError(f"unknown config key '{group}'; valid top-level keys: {', '.join(SCHEMA_GROUPS)}")
        known = [f.name for f in dataclasses.fields(SCHEMA_GROUPS[group])]
        for key in value.keys():
            if key not in known:
                renamed = renamed_key_message(f"{group}.{key}")
                if renamed:
                    raise ConfigError(renamed)
                raise ConfigError(f"unknown config key '{group}.{key}'; valid keys in '{group}': {', '.join(known)}")


def _own_error(err: BaseException) -> Optional[ConfigError]:
    """Our own ConfigError raised inside a resolver, unwrapped from hydra's and OmegaConf's exceptions."""
    while err is not None and not isinstance(err, ConfigError):
        err = err.__cause__ or err.__context__
    return err


def _user_config_folders(primary: Path, overrides: Sequence[str]) -> list[Path]:
    """The folders of the user's own config files hydra may read: ``--config-dir`` and every ``file://`` folder of a
    ``hydra.searchpath`` override (ours, ``conf/``, is not the user's)."""
    folders = [] if primary == PACKAGE_CONF_DIR else [primary]
    for item in overrides:
        if item.lstrip("+~").split("=", 1)[0] == "hydra.searchpath":
            folders += [Path(found) for found in re.findall(r"file://([^,\]\s'\"]+)", item)]
    return [folder for folder in folders if folder.is_dir() and folder.resolve() != PACKAGE_CONF_DIR]


def _required(message: str):
    raise ConfigError(message)


def compose_config(
    overrides: Sequence[str] = (),
    *,
    config_dir: Optional[str] = None,
    config_name: str = "config",
) -> DictConfig:
    """Compose ``config_name`` with ``overrides`` and validate it; raise ConfigError with one line on any mistake."""
    register_schemas()
    OmegaConf.register_new_resolver("fsdptrain_required", _required, replace=True)
    overrides = list(overrides)
    if config_dir is None:
        primary = PACKAGE_CONF_DIR
    else:
        primary = Path(config_dir).expanduser().resolve()
        if not primary.is_dir():
            raise ConfigError(f"--config-dir {config_dir!r} is not a directory")
    for folder in _user_config_folders(primary, overrides):  # before hydra builds a file that expands without bound
        problem = check_yaml_files(folder)
        if problem is not None:
            raise ConfigError(problem)
    if config_dir is not None:
        overrides = [f"hydra.searchpath=[file://{PACKAGE_CONF_DIR}]"] + overrides
    try:
        with initialize_config_dir(config_dir=str(primary), version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
        problem = check_interpolations(OmegaConf.to_container(cfg, resolve=False))
        if problem is not None:  # before OmegaConf resolves values that expand without bound
            raise ConfigError(problem)
        OmegaConf.resolve(cfg)
        _check_no_extra_keys(cfg)
        missing = sorted(OmegaConf.missing_keys(cfg))
    except ConfigError:
        raise
    except yaml.YAMLError as err:  # the user's own config file is not YAML
        raise ConfigError(_yaml_message(err)) from None
    except HydraException as err:
        raise _own_error(err) or ConfigError(_hydra_message(err)) from None
    except OmegaConfBaseException as err:
        raise _own_error(err) or ConfigError(_omegaconf_message(err)) from None
    except Exception as err:  # noqa: BLE001 - the config library failing on a shape the checks let through
        where = str(primary / f"{config_name}.yaml") if config_dir is not None else "the config (conf/ and overrides)"
        raise _own_error(err) or ConfigError(_library_failure(where, err)) from None
    if missing:
        raise ConfigError(f"missing required value: {missing[0]} (set it with {missing[0]}=...)")
    validate(cfg)
    return cfg
