"""`key=value` text to typed config fields, generic over a dataclass's annotations: what lets an arm override any
field of `RLConfig`, `GRPOConfig` or `CorrectionConfig` (`;learning_rate=2e-3;group_size=4`) and a field added
later (by annotation alone) without a parser of its own.

The value grammar, by the field's annotation:
- `int`: an integer (`4`, `-1`); `float`: a float (`2e-3`, `0.2`); `bool`: `true` or `false`;
- `str`: the text as it is (the config's own validation names the allowed values);
- `tuple[X, ...]`: `+`-joined elements (`rs=token_k3:0.1+seq_mean_k1:1.001`; empty text: the empty tuple);
  `tuple[X, Y]`: exactly that many `+`-joined elements;
- `X | None`: `none` for None (unless X is `str`, where `none` is text), else X's grammar;
- a class with a `parse` classmethod (e.g. `NumericPolicy`): that method.

`format_value` writes a value back in this grammar, so `parse_value(cls, key, format_value(v)) == v`. A config
refines the grammar of one of its fields by its own `parse_option` classmethod (which calls `parse_option`
here for the rest), and validates the value as its `__post_init__` does.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


@functools.cache
def field_types(cls: type) -> dict[str, typing.Any]:
    """The resolved annotation of every init field of dataclass `cls`, in field order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def is_nested_config(tp) -> bool:
    """Whether annotation `tp` is a nested config (a dataclass without a text `parse`, set field by field)."""
    return dataclasses.is_dataclass(tp) and not callable(getattr(tp, "parse", None))


def _describe(tp) -> str:
    """What the grammar of annotation `tp` accepts, in words."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number (e.g. 0.2, 2e-3)"
    if tp is str:
        return "text"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"'+'-joined items, each {_describe(args[0])} (empty: none)"
        return f"{len(args)} '+'-joined items (" + ", ".join(_describe(a) for a in args) + ")"
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return "none or " + " or ".join(_describe(a) for a in inner)
    return f"a {getattr(tp, '__name__', tp)} string"


def _convert(tp, text: str):
    """`text` as a value of annotation `tp`; ValueError (without context) when it is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        low = text.strip().lower()
        if low not in _TRUE + _FALSE:
            raise ValueError
        return low in _TRUE
    if tp in (int, float):
        try:
            return tp(text.strip())
        except ValueError:
            raise ValueError from None  # the caller says what is allowed
    if tp is str:
        return text
    if origin is tuple:
        items = [] if not text.strip() else [t.strip() for t in text.split("+")]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], t) for t in items)
        if len(items) != len(args):
            raise ValueError
        return tuple(_convert(a, t) for a, t in zip(args, items))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if type(None) in args and str not in inner and text.strip().lower() == "none":
            return None
        for one in inner:
            try:
                return _convert(one, text)
            except ValueError:
                continue
        raise ValueError
    parse = getattr(tp, "parse", None)
    if callable(parse):
        return parse(text.strip())
    raise TypeError(f"no text grammar for a field of type {tp!r}")


def parse_option(cls: type, key: str, text: str):
    """The typed value of field `key` of dataclass `cls` written as `text` (the module docstring's grammar),
    checked as `cls`'s own validation checks it alone. Errors name the key, the value and what is allowed; an
    unknown key lists the allowed ones."""
    types_ = field_types(cls)
    if key not in types_:
        raise ValueError(f"unknown {cls.__name__} option {key!r}; allowed: {', '.join(types_)}")
    tp = types_[key]
    if is_nested_config(tp):
        raise ValueError(f"{cls.__name__}.{key} is a nested config; set its fields by name "
                         f"({', '.join(field_types(tp))})")
    if not isinstance(text, str):
        raise ValueError(f"{cls.__name__}.{key} = {text!r}: expected text")
    try:
        value = _convert(tp, text)
    except ValueError as err:
        detail = f" ({err})" if str(err) else ""
        raise ValueError(f"{cls.__name__}.{key} = {text!r}: allowed {_describe(tp)}{detail}") from None
    try:
        cls(**{key: value})  # the config's own checks of this one value
    except (ValueError, TypeError) as err:
        raise ValueError(f"{cls.__name__}.{key} = {text!r}: {err}") from None
    return value


def format_value(value) -> str:
    """`value` as `parse_option` reads it back (floats by `repr`, so they round-trip exactly)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "+".join(format_value(v) for v in value)
    compact = getattr(value, "compact", None)
    if callable(compact):
        return compact()
    return repr(value) if isinstance(value, float) else str(value)
