"""strict.py: the one parser of the project's mappings (unknown keys, number type, finiteness, range)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from balanced_loader.strict import check_keys, check_number, from_dict, number, yaml_loads


@dataclass(frozen=True, kw_only=True, slots=True)
class Inner:
    rate: float = 1.0
    count: int = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    pair: tuple[int, int] = (1, 2)
    limit: int | None = None


def test_from_dict_builds_nested_dataclasses():
    # YAML 1.2 floats: "1e-3" (no dot) is a number, not PyYAML's string
    got = from_dict(Outer, yaml_loads("{name: y, inner: {rate: 1e-3, count: 4}, pair: [3, 4]}"), "recipe")
    assert got == Outer(name="y", inner=Inner(rate=1e-3, count=4), pair=(3, 4))
    assert from_dict(Outer, None, "recipe") == Outer()


@pytest.mark.parametrize(("data", "message"), [
    ({"inner": {"rat": 1}}, "f.yaml: unknown key 'inner.rat'; allowed in inner: rate, count"),
    ({"nam": "z"}, "f.yaml: unknown key 'nam'; allowed in recipe: name, inner, pair, limit"),
    ({"inner": {"rate": math.inf}}, "f.yaml: inner.rate must be a finite number, got inf"),
    ({"inner": {"count": True}}, "f.yaml: inner.count must be an integer, got True"),
    ({"inner": {"count": 2.5}}, "f.yaml: inner.count must be an integer, got 2.5"),
    ({"pair": [1]}, "f.yaml: pair: expected a list of 2 values"),
])
def test_from_dict_errors_name_the_file_and_key(data, message):
    with pytest.raises(ValueError) as e:
        from_dict(Outer, data, "recipe", file="f.yaml")
    assert str(e.value).startswith(message)


def test_number_checks_type_finiteness_and_range():
    two = number({"a": 2.0}, "a", "w", integer=True)
    assert two == 2 and isinstance(two, int)
    assert number({}, "a", "w", default=7) == 7
    for v, msg in ((math.nan, "must be a finite number"), ("3", "must be a number"), (-1, "must be >= 0")):
        with pytest.raises(ValueError, match=f"w: 'a' {msg}"):
            number({"a": v}, "a", "w", minimum=0)
    with pytest.raises(ValueError, match="w: missing key 'a'"):
        number({}, "a", "w")
    with pytest.raises(ValueError, match="must be <= 1"):
        check_number(1.5, "fill", maximum=1)


def test_check_keys_names_unknown_and_allowed():
    check_keys({"tp": 1}, ("tp", "pp"), "pool 0")
    with pytest.raises(ValueError, match=r"pool 0: unknown option\(s\) \['cp'\]; allowed: \['pp', 'tp'\]"):
        check_keys({"cp": 1}, ("tp", "pp"), "pool 0", word="option")
