"""absl flags generated from the fields of a settings dataclass.

Each field says what its flag is in ``dataclasses.field(metadata=...)``:

- ``"help"`` (required): the help text;
- ``"choices"``: the allowed values (the flag is an enum);
- ``"flag"``: ``False`` for a field that has no flag (internal or benchmark-only; say why in the
  help), or a string to name the flag differently from the field (where two dataclasses of one
  program share a field name);
- ``"group"``: the ``--help`` group, when not the dataclass's.

The flag's kind comes from the field's annotation: ``bool``, ``int``, ``float``, ``str`` (an enum with
``choices`` or a ``Literal``), ``X | None`` as ``X``; ``list[str]`` (also ``str | list[str]``) a
repeatable flag; ``list[int]`` comma-separated integers; a ``dict``, a dataclass or ``object``
JSON text. Every flag's default is None: the value was not set, the dataclass's (or a preset's)
default applies. Validation stays in the dataclass: a flag only parses the text.
"""
import dataclasses
import json
import types
import typing
from dataclasses import dataclass

from absl import flags

NO_DEFAULT = object()  # a field with neither a default nor a default factory


@dataclass(frozen=True)
class FieldFlag:
    """One dataclass field as a command-line flag."""

    name: str            # the flag's name
    field: str           # the dataclass field it sets
    owner: type          # the dataclass
    group: str           # the --help group
    kind: str            # bool | int | float | str | enum | multi_str | int_list | json
    help: str
    choices: tuple = ()
    default: object = NO_DEFAULT  # the dataclass's default


class IntListParser(flags.ArgumentParser):
    """``2,7,11`` -> ``[2, 7, 11]``."""

    def parse(self, argument):
        if isinstance(argument, list):
            return argument
        try:
            return [int(x) for x in str(argument).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"expected comma-separated integers, got {argument!r}") from None

    def flag_type(self):
        return "comma-separated integers"


class JsonParser(flags.ArgumentParser):
    """JSON text -> the Python value it denotes."""

    def parse(self, argument):
        if not isinstance(argument, str):
            return argument
        try:
            return json.loads(argument)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e})") from None

    def flag_type(self):
        return "JSON"


def _kind(annotation, where: str) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if any(typing.get_origin(a) is list and typing.get_args(a) == (str,) for a in options) \
                and all(a is str or typing.get_origin(a) is list for a in options):
            return "multi_str"  # e.g. `str | list[str] | None`: one or more strings
        if len(options) == 1:
            return _kind(options[0], where)
        raise TypeError(f"{where}: no flag kind for the union {annotation}")
    if origin is typing.Literal:
        return "enum"
    if origin in (list, tuple):
        element = args[0] if args else None
        return {str: "multi_str", int: "int_list"}.get(element, "json")
    if annotation in (bool, int, float, str):
        return annotation.__name__
    if origin is dict or annotation in (dict, object) or dataclasses.is_dataclass(annotation):
        return "json"
    raise TypeError(f"{where}: no flag kind for the type {annotation}")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return NO_DEFAULT


def field_flags(cls, group: str) -> list[FieldFlag]:
    """The flags of ``cls``'s fields, in field order, ``group`` unless a field names another.

    A field typed by a dataclass (a nested config such as ``EngineConfig.cache``) contributes that
    dataclass's fields instead, in its own ``group`` (the field's, else the field's name).
    Raises ValueError for a field without help text and TypeError for a type no flag can carry.
    """
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        where = f"{cls.__name__}.{f.name}"
        meta = f.metadata
        if not (isinstance(meta.get("help"), str) and meta["help"].strip()):
            raise ValueError(f"{where}: no help text (give it field(metadata={{'help': ...}}))")
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
            out += field_flags(annotation, meta.get("group", f.name))
            continue
        if meta.get("flag", True) is False:
            continue
        choices = tuple(meta.get("choices", ()))
        kind = _kind(annotation, where)
        if typing.get_origin(annotation) is typing.Literal:
            choices = choices or typing.get_args(annotation)
        if choices and kind in ("str", "enum"):
            kind = "enum"
        elif choices or kind == "enum":
            raise TypeError(f"{where}: choices need a str field, not {annotation}")
        name = meta["flag"] if isinstance(meta.get("flag"), str) else f.name
        out.append(FieldFlag(name, f.name, cls, meta.get("group", group), kind, meta["help"].strip(),
                             choices, _default(f)))
    return out


def shown(value) -> str:
    """A default as the help text shows it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value) if value else "none"
    return str(value)


def define(spec: FieldFlag, flag_values: flags.FlagValues, default=None) -> None:
    """Defines ``spec``'s flag in ``flag_values``; ``default``: the program's own default (None: the
    dataclass's applies and the flag reads None until set)."""
    text = spec.help
    if spec.default is not NO_DEFAULT:
        if default is None:
            text += f" (default: {shown(spec.default)})"
        else:
            text += f" (default: {shown(default)}; {spec.owner.__name__} default: {shown(spec.default)})"
    common = dict(flag_values=flag_values)
    if spec.kind == "bool":
        flags.DEFINE_bool(spec.name, default, text, **common)
    elif spec.kind == "int":
        flags.DEFINE_integer(spec.name, default, text, **common)
    elif spec.kind == "float":
        flags.DEFINE_float(spec.name, default, text, **common)
    elif spec.kind == "str":
        flags.DEFINE_string(spec.name, default, text, **common)
    elif spec.kind == "enum":
        flags.DEFINE_enum(spec.name, default, [str(c) for c in spec.choices], text, **common)
    elif spec.kind == "multi_str":
        flags.DEFINE_multi_string(spec.name, default, text, **common)
    elif spec.kind == "int_list":
        flags.DEFINE(IntListParser(), spec.name, default, text, serializer=flags.CsvListSerializer(","), **common)
    else:
        flags.DEFINE(JsonParser(), spec.name, default, text, **common)


def set_values(specs: list[FieldFlag], flag_values: flags.FlagValues) -> dict:
    """``{field name: value}`` for the flags of ``specs`` that hold a value."""
    return {s.field: flag_values[s.name].value for s in specs if flag_values[s.name].value is not None}
