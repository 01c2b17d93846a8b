"""Bounded parsing of user text: JSON depth, YAML depth and alias expansion, short reprs for messages."""
import time

import pytest
import yaml

from minillm.untrusted import (MAX_JSON_DEPTH, MAX_YAML_DEPTH, MAX_YAML_VALUES, TooNested, json_depth, load_yaml,
                               loads_json, short_repr)


def nested_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def laughs(levels: int, width: int = 9) -> str:
    """A YAML flow list whose last anchor expands to width**levels strings (each anchor is defined before use)."""
    items = ['&l0 [' + ", ".join(['"lol"'] * width) + ']']
    items += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


# ---------------------------------------------------------------- JSON

@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 200_000])
def test_json_nested_past_the_limit_is_refused(depth):
    with pytest.raises(TooNested, match=f"deeper than {MAX_JSON_DEPTH}"):
        loads_json(nested_list(depth))


def test_json_at_the_limit_and_objects_count_as_levels():
    assert json_depth(loads_json(nested_list(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    deep_objects = '{"a": ' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(TooNested):
        loads_json(deep_objects)


def test_json_depth_of_mixed_values():
    assert json_depth(5) == 0
    assert json_depth({"messages": [{"role": "user", "content": "x"}]}) == 3
    assert json_depth([[1], [[2]], []]) == 3


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"a": -Infinity}'])
def test_json_constants_outside_the_standard_are_refused(text):
    with pytest.raises(ValueError, match="not allowed"):
        loads_json(text)


def test_long_flat_json_is_quick():
    text = "[" + ",".join(["7"] * 200_000) + "]"
    t0 = time.perf_counter()
    assert len(loads_json(text)) == 200_000
    assert time.perf_counter() - t0 < 2.0


# ---------------------------------------------------------------- YAML

def test_billion_laughs_is_refused_at_once():
    t0 = time.perf_counter()
    with pytest.raises(TooNested, match=f"more than {MAX_YAML_VALUES:,} values"):
        load_yaml(f"sampling:\n  stop: {laughs(9)}\n")
    assert time.perf_counter() - t0 < 1.0


def test_shared_aliases_within_the_budget_load():
    data = load_yaml(f"x: {laughs(3)}")           # 9**3 = 729 strings after expansion
    assert len(data["x"][2]) == 9 and data["x"][2][0][0][0] == "lol"
    assert load_yaml("base: &b {k: 1}\nother:\n  <<: *b\n  j: 2\n") == {"base": {"k": 1}, "other": {"k": 1, "j": 2}}


@pytest.mark.parametrize("text", ["a: &a [*a]", "a: &a {k: *a}", "- &x [1, [2, *x]]"])
def test_an_alias_to_itself_is_refused(text):
    with pytest.raises(TooNested, match="itself"):
        load_yaml(text)


@pytest.mark.parametrize("text", [nested_list(MAX_YAML_DEPTH + 1), nested_list(5_000),
                                  "- " * (MAX_YAML_DEPTH + 2) + "x", "{a: " * 3_000 + "1" + "}" * 3_000],
                         ids=["flow-33", "flow-5000", "block-34", "mapping-3000"])
def test_yaml_nested_too_deep_is_refused(text):
    with pytest.raises(TooNested, match="deeper"):
        load_yaml(text)


@pytest.mark.parametrize("text", ["a: [1", "a: 1\n---\nb: 2", "!!python/object:os.system x", "*undefined"])
def test_broken_or_unsafe_yaml_is_a_yaml_error(text):
    with pytest.raises(yaml.YAMLError):
        load_yaml(text)


@pytest.mark.parametrize("text, value", [("", None), ("# only a comment", None), ("1e9", "1e9"), ("1.0e+9", 1e9),
                                         ("[a, b]", ["a", "b"]), ("null", None)])
def test_plain_documents_load_as_safe_load_would(text, value):
    assert load_yaml(text) == value == yaml.safe_load(text)


# ---------------------------------------------------------------- messages

def test_short_repr_cuts_long_and_huge_values():
    assert short_repr("x" * 500).endswith("...") and len(short_repr("x" * 500)) == 80
    assert short_repr(list(range(10**6))).startswith("list of 1000000 items starting [0, 1, 2")
    assert short_repr({"a": 1}) == "{'a': 1}"
    looped = []
    looped.append(looped)
    assert short_repr(looped) == "[[...]]"
    deep = []
    for _ in range(10_000):
        deep = [deep]
    assert "deeply nested" in short_repr(deep)


def test_a_huge_integer_is_refused_naming_its_digits_not_python_internals():
    from minillm.untrusted import loads_json
    assert loads_json("[" + "9" * 4300 + "]") == [int("9" * 4300)]
    for text in ("9" * 5000, "-" + "9" * 5000):
        with pytest.raises(ValueError, match="an integer of 5,000 digits \\(at most 4,300 are allowed\\)") as e:
            loads_json(text)
        assert "sys." not in str(e.value)
