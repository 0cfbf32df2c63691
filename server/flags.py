"""Command-line flags made from the config dataclasses, so that each default and each flag has one home: the field.

A field is a flag when its metadata has a "help"; its flag name is "--" plus the field name with dashes, unless
the metadata's "flag" names another. "choices" limits its values; "env" names an environment variable whose
value, when set, replaces the default. A field whose type is a dataclass is a sub-config: its fields
become flags of the same parser. `serve`, `calibrate` and every benchmark add their flags this way, and
`config_as_argv` turns a config back into the flags that rebuild it (for the servers a benchmark starts).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def flag_dest(field: dataclasses.Field) -> str:
    return flag_name(field).removeprefix("--").replace("-", "_")


def add_config_flags(
    parser: argparse.ArgumentParser, config_cls: type, skip: tuple[str, ...] = (), choices: dict | None = None,
) -> None:
    """Add a flag for every flag field of CONFIG_CLS and its sub-configs, except the fields named in SKIP. CHOICES
    (field name -> values) gives the choices of a field whose module cannot name them (the drafter's: the registry
    imports the config)."""
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if dataclasses.is_dataclass(hints[field.name]):
            add_config_flags(parser, hints[field.name], skip, choices)
        elif "help" in field.metadata and field.name not in skip:
            _add_flag(parser, field, hints[field.name], (choices or {}).get(field.name))


def _add_flag(parser: argparse.ArgumentParser, field: dataclasses.Field, hint: Any, choices: tuple | None) -> None:
    name, meta = flag_name(field), field.metadata
    if hint is bool:
        action = "store_false" if field.default else "store_true"
        parser.add_argument(name, action=action, dest=flag_dest(field), help=meta["help"])
        return
    default = os.environ.get(meta["env"], field.default) if meta.get("env") else field.default
    parser.add_argument(
        name, type=_value_type(hint), default=default, choices=choices or meta.get("choices"), dest=flag_dest(field),
        help=meta["help"] + _default_note(default),
    )


def _value_type(hint: Any) -> type:
    """int for `int | None`, and likewise: the type a flag's text is parsed as."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _default_note(default: Any) -> str:
    return "" if default is None or isinstance(default, bool) else f" (default: {default})"


def config_from_args(config_cls: type[ConfigT], args: argparse.Namespace, **values: Any) -> ConfigT:
    """CONFIG_CLS with every flag field taken from ARGS, sub-configs built the same way; VALUES (field name ->
    value, at any depth) replace what ARGS says, for fields that are not flags of the command (bench's drafter)."""
    hints = typing.get_type_hints(config_cls)
    kwargs = {}
    for field in dataclasses.fields(config_cls):
        if dataclasses.is_dataclass(hints[field.name]):
            kwargs[field.name] = config_from_args(hints[field.name], args, **values)
        elif field.name in values:
            kwargs[field.name] = values[field.name]
        elif "help" in field.metadata and hasattr(args, flag_dest(field)):
            kwargs[field.name] = getattr(args, flag_dest(field))
    return config_cls(**kwargs)


def config_as_argv(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild CONFIG from its defaults: one per flag field whose value is not the default."""
    argv = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            argv += config_as_argv(value, skip)
        elif "help" in field.metadata and field.name not in skip and value != field.default:
            argv += [flag_name(field)] if isinstance(value, bool) else [flag_name(field), str(value)]
    return argv


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of PARSER and of its subcommands, at any depth (what the docs may name)."""
    names = set()
    for action in parser._actions:
        names.update(option for option in action.option_strings if option.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= parser_flags(sub)
    return names
