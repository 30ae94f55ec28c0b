"""Strict reading of the project's YAML files and mappings (cost files, graphs, candidates, recipes).

The one home of config parsing; every error is one ``ValueError`` line naming the file or section
and the key:

* :func:`read_yaml`: a file's parsed YAML (``mapping=True``: the document must be a mapping). A key
  given twice in one mapping is an error naming it and its line (PyYAML would keep the last).
* :func:`check_keys`: unknown keys of a flat mapping fail, naming them and the allowed ones.
* :func:`number` / :func:`check_number`: a number checked for type (``true`` is not 1), integrality,
  finiteness (no ``.inf`` / ``.nan``) and range.
* :func:`from_dict`: a (kw_only, frozen) dataclass built from a mapping, field by field from its type
  hints (nested dataclasses, ``X | None``, ``X | tuple[...]`` (a list is read as the tuple),
  ``tuple[...]``, ``dict``, scalars); unknown keys fail.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
_MISSING: Any = object()
# YAML 1.2 floats: PyYAML (YAML 1.1) reads 1e-3 (no dot) as a string; this pattern makes it a number
_YAML12_FLOAT = re.compile(r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
                           r"|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_LOADER: Any = None


class DuplicateKeyError(ValueError):
    """A mapping that gives one key twice (``ValueError``: one line naming the key and its line)."""


def yaml_loads(text: Any) -> Any:
    """``yaml.safe_load`` with YAML 1.2 floats: ``1e-6`` is a number (PyYAML's YAML 1.1 rules make it
    the string ``'1e-6'`` unless written ``1.0e-6``, a trap in cost files, recipes and ``--set``), and a
    key given twice in one mapping is a :class:`DuplicateKeyError` (PyYAML silently keeps the last)."""
    import yaml  # only the commands that read YAML pay for it

    global _LOADER
    if _LOADER is None:
        class Loader(yaml.SafeLoader):
            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                if isinstance(node, yaml.MappingNode):
                    seen: dict[Any, int] = {}  # key -> the line it was first given on
                    for key_node, _ in node.value:
                        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: overriding it is no repeat
                            continue
                        key = self.construct_object(key_node, deep=True)
                        line = key_node.start_mark.line + 1
                        try:
                            if key in seen:
                                raise DuplicateKeyError(f"duplicate key {key!r} on line {line} (first given on "
                                                        f"line {seen[key]}); give each key once")
                            seen[key] = line
                        except TypeError:  # an unhashable key: the base class reports it
                            continue
                return super().construct_mapping(node, deep=deep)

        Loader.yaml_implicit_resolvers = {k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
                                          for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
        Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
        _LOADER = Loader
    return yaml.load(text, Loader=_LOADER)  # a SafeLoader subclass: no arbitrary objects


def read_yaml(path: str, what: str, *, mapping: bool = False) -> Any:
    """Parsed content of ``path``; a missing file, bad YAML or a key given twice is one ``ValueError``
    naming ``what`` and ``path``. ``mapping``: the document must be a mapping (an empty file is ``{}``)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml_loads(f)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not text (expected YAML)") from None
    except DuplicateKeyError as e:
        raise ValueError(f"{what} {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{what} {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if mapping:
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ValueError(f"{what} {path} must be a YAML mapping (key: value lines), but its document is "
                             f"{_kind(data)}")
    return data


def _kind(data: Any) -> str:
    """What a YAML document is, for messages: ``a list``, ``the string 'x'``, ``the number 3``."""
    if isinstance(data, list):
        return f"a list of {len(data)} item(s)"
    if isinstance(data, str):
        return f"the string {data[:40]!r}"
    if isinstance(data, bool) or data is None:
        return f"the value {data!r}"
    return f"the {type(data).__name__} {data!r}"[:80]


def check_keys(d: Mapping[str, Any], allowed: Iterable[str], where: str, *, word: str = "key") -> None:
    """ValueError ``"{where}: unknown key(s) [...]; allowed: [...]"`` when ``d`` has a key outside ``allowed``."""
    allowed = sorted(allowed)
    unknown = sorted(set(d) - set(allowed), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown {word}(s) {unknown}; allowed: {allowed}")


def check_number(v: Any, what: str, *, integer: bool = False, minimum: float | None = None,
                 maximum: float | None = None) -> Any:
    """``v`` as an ``int`` (``integer``) or ``float``; ValueError ``"{what} must be ..."`` otherwise.

    Booleans are not numbers; an integer may be written ``2.0``; ``inf`` and ``nan`` never pass."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if integer and (not math.isfinite(v) or float(v) != int(v)):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {v!r}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{what} must be <= {maximum}, got {v!r}")
    return int(v) if integer else float(v)


def number(d: Mapping[str, Any], key: str, where: str, *, integer: bool = False, minimum: float | None = None,
           maximum: float | None = None, default: Any = _MISSING) -> Any:
    """``d[key]`` through :func:`check_number` (messages ``"{where}: 'key' must be ..."``); a missing key
    is an error unless ``default`` is given."""
    if key not in d:
        if default is _MISSING:
            raise ValueError(f"{where}: missing key '{key}'")
        return default
    return check_number(d[key], f"{where}: '{key}'", integer=integer, minimum=minimum, maximum=maximum)


def from_dict(cls: type[T], d: Any, where: str, *, file: str = "") -> T:
    """A dataclass ``cls`` from mapping ``d`` (``None``: all defaults), checked field by field.

    ``where`` names the section (``"recipe"`` for the top level; nested sections get dotted names);
    ``file`` (optional) is prefixed to every error. Fields starting with ``_`` and a field named
    ``path`` are not read from the mapping. A ``ValueError`` from ``cls`` itself is prefixed with ``where``.
    """
    try:
        return _build(cls, d, where)
    except ValueError as e:
        if file:
            raise ValueError(f"{file}: {e}") from None
        raise


def _build(cls: type[T], d: Any, where: str) -> T:
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {d!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "path" and not f.name.startswith("_")]
    unknown = sorted(set(d) - set(names), key=str)
    if unknown:
        pre = f"{where}." if where != "recipe" else ""
        raise ValueError(f"unknown key '{pre}{unknown[0]}'; allowed in {where}: {', '.join(names)}")
    kw = {name: _convert(d[name], hints[name], name if where == "recipe" else f"{where}.{name}")
          for name in names if name in d}
    try:
        return cls(**kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _convert(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp`` (int, float, bool, str, dict, tuple[...], X | None, dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if bool in inner and len(inner) > 1:  # bool | str: true / false, else the other type's rules
            if isinstance(value, bool):
                return value
            inner.remove(bool)
        if len(inner) > 1 and isinstance(value, (list, tuple)):  # X | tuple[...]: a list reads as the tuple
            inner.sort(key=lambda a: typing.get_origin(a) is not tuple)
        return _convert(value, inner[0], where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        return check_number(value, where, integer=True)
    if tp is float:
        return check_number(value, where)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    raise AssertionError(f"unsupported field type {tp!r} at {where}")
