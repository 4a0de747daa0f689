"""What a config error says: :class:`ConfigError`, ONE line, the key first, then what is wrong in words a launch log
keeps (``optim.lr=0.0: must be > 0``, ``unknown key model.layer (did you mean model.layers?)``); and the translation of
pydantic's multi-line validation report into it."""

import difflib
import math
import typing
from typing import Annotated, Any, Literal, Mapping, Sequence

import pydantic

__all__ = ["ConfigError", "one_line", "short", "suggest"]

_UNKNOWN = ("unexpected_keyword_argument", "extra_forbidden")
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


class ConfigError(ValueError):
    """A configuration error; the message is one line naming the key (``section.key``)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # multi-line messages interleave in multi-process logs


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def suggest(name: str, options: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the option closest to a misspelt ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _type_name(hint: Any) -> str:
    """``int``, ``list of str``, ``str or null``: a field's type hint in the words of YAML."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return type(args[0]).__name__
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin is typing.Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    return hint.__name__


def one_line(err: pydantic.ValidationError, sections: Mapping[str, type], section: str = "") -> ConfigError:
    """The first of pydantic's errors validating a config (``section`` empty) or one section of it; ``sections`` maps
    section names to their classes."""
    errors = err.errors(include_url=False)
    e = next((e for e in errors if e["type"] in _UNKNOWN), errors[0])  # a misspelt key explains the errors it causes
    kind, value, ctx = e["type"], e["input"], e.get("ctx") or {}
    if isinstance(ctx.get("error"), ConfigError):  # a cross-field rule, already one line
        return ctx["error"]
    section, *rest = ([section] if section else []) + list(e["loc"])
    if section not in sections:
        return ConfigError(f"unknown section {section!r}{suggest(str(section), list(sections))}; "
                           f"sections are {', '.join(sections)}")
    if not rest:
        return ConfigError(f"{section}: expected a mapping of keys, got {type(value).__name__} {short(value)}")
    name, *index = rest
    fields = sections[section].__pydantic_fields__
    if name not in fields or kind in _UNKNOWN:
        options = [f"{section}.{k}" for k in fields]
        return ConfigError(f"unknown key {section}.{name}{suggest(f'{section}.{name}', options)}")
    key, hint = f"{section}.{name}" + "".join(f"[{i}]" for i in index), fields[name].annotation
    if index:
        hint = typing.get_args(hint)[0]  # Tuple[Str, ...] -> Str
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    if base is float and type(value) is int:
        try:
            value = float(value)  # as it would have been stored
        except OverflowError:  # past float's range
            return ConfigError(f"{key}={short(value)}: must be finite")
    if isinstance(value, float) and not math.isfinite(value):
        return ConfigError(f"{key}={value!r}: must be finite")
    if kind == "literal_error" and isinstance(value, str):
        return ConfigError(f"{key}={value!r}: must be one of {', '.join(map(repr, typing.get_args(base)))}")
    if kind in _BOUNDS:  # a float key's bound as written (1, not 1.0)
        bound = str(next(iter(ctx.values()))).removesuffix(".0")
        return ConfigError(f"{key}={value!r}: must be {_BOUNDS[kind]} {bound}")
    if kind.endswith("_type") or kind == "literal_error":
        return ConfigError(f"{key}: expected {_type_name(hint)}, got {type(value).__name__} {short(value)}")
    return ConfigError(f"{key}={short(value)}: {e['msg']}")
