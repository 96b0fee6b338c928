"""Configuration: plain-Python config files, then typed ``--key=value`` overrides.

``python train.py config/train_stdlib.py --batch_size=8 --attention_backend=sdpa``

* A positional argument is a config file: a Python file whose top-level assignments set keys.
  It is looked up relative to the current directory, then to the directory of the script.
* ``--key=value`` sets one key. The value is parsed as the type of the key: ``int``,
  ``float`` (an int is accepted), ``bool`` (``True/False``, ``true/false``, ``1/0``), ``str``
  (quotes optional) or a tuple of ints (``[64,128]``, ``(64, 128)``, ``64,128`` or ``64``).
* An unknown key, a value of the wrong type, or an argument of another form is an error that
  names the key and the value; a close match of a misspelt key is suggested.

Unlike nanoGPT's configurator, nothing is ``exec``-ed into the script's globals: the keys are the
fields of a dataclass, and the result is a new instance of it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_BOOL_STRINGS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


class ConfigError(ValueError):
    """A bad config file, key or value."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    if _is_int_tuple(tp):
        return "a tuple of ints"
    return getattr(tp, "__name__", str(tp))


def _is_int_tuple(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return origin in (tuple, list, Sequence, typing.Sequence) or (
        origin is not None and getattr(origin, "__name__", "") == "Sequence"
    )


def coerce(key: str, value: Any, tp: Any, source: str) -> Any:
    """Check that a Python value (from a config file, or parsed) has the type of ``key``."""

    def fail() -> ConfigError:
        return ConfigError(
            f"{source}: {key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})"
        )

    if tp is bool:
        if not isinstance(value, bool):
            raise fail()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise fail()
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise fail()
        if not math.isfinite(value):
            raise ConfigError(f"{source}: {key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise fail()
        return value
    if _is_int_tuple(tp):
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = (value,)
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
        ):
            raise fail()
        return tuple(int(v) for v in value)
    raise TypeError(f"config key {key!r} has a type the configurator does not handle: {tp!r}")


def parse_value(key: str, raw: str, tp: Any) -> Any:
    """Parse the text of ``--key=raw`` as the type ``tp`` of ``key``."""
    source = f"--{key}={raw}"
    if tp is bool:
        b = _BOOL_STRINGS.get(raw.strip().lower())
        if b is None:
            raise ConfigError(f"{source}: {key} must be a bool (True/False), got {raw!r}")
        return b
    if tp is str:
        try:
            lit = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw
        return lit if isinstance(lit, str) else raw
    text = raw.strip()
    if tp is float:  # nan, inf and 1e999 are floats to float() but not finite
        try:
            number = float(text)
        except ValueError:
            number = 0.0
        if not math.isfinite(number):
            raise ConfigError(f"{source}: {key} must be a finite float, got {raw!r}")
    if _is_int_tuple(tp) and text and text[0] not in "[(":
        text = f"({text},)"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"{source}: {key} must be {_type_name(tp)}, got {raw!r}") from None
    return coerce(key, value, tp, source)


def _unknown(key: str, known: Sequence[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{source}: unknown config key {key!r}{hint} (known keys: {', '.join(sorted(known))})")


def resolve_path(path: str, base_dir: Path | None) -> Path:
    """A config file: as given (relative to the current directory), else relative to ``base_dir``."""
    p = Path(path)
    if p.is_file():
        return p
    if base_dir is not None and not p.is_absolute() and (base_dir / p).is_file():
        return base_dir / p
    where = f" or in {str(base_dir)!r}" if base_dir is not None else ""
    raise ConfigError(f"config file {path!r} not found (looked in the current directory{where})")


def read_config_file(path: Path) -> dict[str, Any]:
    """The top-level names a config file defines (modules, functions and ``_private`` names skipped)."""
    namespace: dict[str, Any] = {"__file__": str(path), "__name__": "__config__"}
    code = compile(path.read_text(), str(path), "exec")
    exec(code, namespace)
    return {
        k: v
        for k, v in namespace.items()
        if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))
    }


def load_config(
    cls: type[T], argv: Sequence[str], base_dir: Path | None = None, defaults: T | None = None
) -> T:
    """Build an instance of the dataclass ``cls`` from config files and ``--key=value`` overrides,
    applied in order over ``defaults`` (or ``cls()``)."""
    types_ = _field_types(cls)
    values = dataclasses.asdict(defaults if defaults is not None else cls())
    for arg in argv:
        if not arg.startswith("--"):
            path = resolve_path(arg, base_dir)
            for key, value in read_config_file(path).items():
                if key not in types_:
                    raise _unknown(key, list(types_), f"config file {str(path)!r}")
                values[key] = coerce(key, value, types_[key], f"config file {str(path)!r}")
            continue
        body = arg[2:]
        if "=" not in body:
            raise ConfigError(f"argument {arg!r} must have the form --key=value")
        key, raw = body.split("=", 1)
        if key not in types_:
            raise _unknown(key, list(types_), f"argument {arg!r}")
        values[key] = parse_value(key, raw, types_[key])
    return cls(**values)
