"""Command-line flags made from dataclass fields, so that a setting is written once: as a field
with its default and its help (`setting`). Its absl flag (`define_flags`), the config read back
from the parsed flags (`parsed_values`, `replace`) and what a checkpoint records follow from it.

A field with help is a flag: an enum flag when it has `choices`, else of its annotation's kind
(`bool`, `int`, `float`, `str`, each maybe `| None`). A field without help whose value is a
dataclass with flags is a group: its flags stand in its place, under their own names (the main
job's `TrainConfig.model`, a `ModelConfig`: `--d_model`, not `--model.d_model`). Any other field is
no flag (tests set it). A flag the command line spells otherwise than its field (the main job's
`--capacity_factor`, 'none' for None; the cross-DC flags of a `migration`) is defined by the job
(`define_flags`'s `custom`) and read back by it.

Defined only when a command runs: importing this module, or a config built with it, leaves absl's
global flag registry alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from absl import flags

HELP, CHOICES = "help", "choices"

# The absl flag of each annotation (an unset flag of any kind is None).
_DEFINE = {
    "bool": flags.DEFINE_bool,
    "int": flags.DEFINE_integer,
    "float": flags.DEFINE_float,
    "str": flags.DEFINE_string,
}


def setting(default, help: str, *, choices=None):  # noqa: A002  (absl's name for it)
    """A dataclass field that is also a flag: its default and its --help text; `choices`, when
    given, the values an enum flag accepts."""
    metadata = {HELP: help} if choices is None else {HELP: help, CHOICES: tuple(choices)}
    return dataclasses.field(default=default, metadata=metadata)


def _is_group(value) -> bool:
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and any(HELP in f.metadata for f in dataclasses.fields(value))
    )


def flag_fields(config) -> list[tuple[dataclasses.Field, object]]:
    """(field, its value in `config`) of every flag of the dataclass value `config`, a group's
    flags in the group's place."""
    out = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if HELP in field.metadata:
            out.append((field, value))
        elif _is_group(value):
            out.extend(flag_fields(value))
    return out


def _kind(field: dataclasses.Field) -> str:
    spelled = field.type if isinstance(field.type, str) else field.type.__name__
    kind = spelled.removesuffix(" | None")
    if kind not in _DEFINE:
        raise TypeError(f"the flag {field.name} ({spelled}) needs a definition of its own (custom)")
    return kind


def define_flags(
    defaults, custom: dict[str, Callable] | None = None, module_name: str | None = None
) -> None:
    """One absl flag per flag of `defaults` (a config whose values are the flags' defaults), with
    its field's help. `custom`: flag name -> `define(default, help)`, which defines that field's
    flag (or flags) itself. `module_name`: the module --helpfull lists the flags under (default:
    the config's), rather than this one."""
    custom = custom or {}
    module_name = module_name or type(defaults).__module__
    for field, default in flag_fields(defaults):
        text = field.metadata[HELP]
        if field.name in custom:
            custom[field.name](default, text)
        elif CHOICES in field.metadata:
            choices = list(field.metadata[CHOICES])
            flags.DEFINE_enum(field.name, default, choices, text, module_name=module_name)
        else:
            _DEFINE[_kind(field)](field.name, default, text, module_name=module_name)


def parsed_values(defaults, skip=()) -> dict:
    """The parsed value of every flag of `defaults` (name -> value), but those named in `skip`
    (the custom ones, which their job reads back)."""
    return {
        field.name: flags.FLAGS[field.name].value
        for field, _ in flag_fields(defaults)
        if field.name not in skip
    }


def replace(config, **changes):
    """`config` with `changes`, each named as its flag would be: a field of `config`, or of a
    group of it (`replace(train_config, d_model=64)` changes `train_config.model.d_model`).
    TypeError naming a name that is neither."""
    own = {f.name: changes.pop(f.name) for f in dataclasses.fields(config) if f.name in changes}
    for field in dataclasses.fields(config):
        value = own.get(field.name, getattr(config, field.name))
        if changes and _is_group(value):
            names = {f.name for f in dataclasses.fields(value)}
            inner = {name: changes.pop(name) for name in list(changes) if name in names}
            if inner:
                own[field.name] = replace(value, **inner)
    if changes:
        raise TypeError(f"{type(config).__name__} has no field {', '.join(sorted(changes))}")
    return dataclasses.replace(config, **own)
