"""Reading text that a user or a file supplies: JSON and YAML with bounded depth and size, short reprs.

Python's json and PyYAML recurse once per nesting level, so a line of 1,000 `[` ends in a RecursionError; and a
YAML document can define an alias of an alias of a list (billion laughs) that costs nothing to load but
expands to 9**9 values as soon as anything walks or prints it. Everything that parses user text goes through
here and gets a ValueError naming the limit instead.
"""
from __future__ import annotations

import json
from typing import Any

import yaml

MAX_JSON_DEPTH = 32           # a request needs 3 levels (line -> messages -> message)
MAX_YAML_DEPTH = 32           # a config needs 3 (section -> key -> list value)
MAX_YAML_VALUES = 100_000     # values after alias expansion; a config file has a few dozen


class TooNested(ValueError):
    """JSON or YAML nested deeper, or expanding to more values, than the limits above."""


def short_repr(value: Any, limit: int = 80) -> str:
    """repr() for error messages: cut to `limit` characters. Containers are cut before they are printed,
    so a huge (or self-referencing) value costs no more than a small one."""
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 8:
        head = list(value.items())[:8] if isinstance(value, dict) else list(value)[:8]
        text = f"{type(value).__name__} of {len(value)} items starting {_bounded_repr(head)}"
    else:
        text = _bounded_repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bounded_repr(value: Any) -> str:
    try:
        return repr(value)
    except RecursionError:
        return f"<deeply nested {type(value).__name__}>"


# ---------------------------------------------------------------- JSON

def loads_json(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads without NaN/Infinity (they are not JSON and slip past range checks), refusing values nested
    deeper than `max_depth`. Raises ValueError (json.JSONDecodeError or TooNested)."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
    except RecursionError:
        raise TooNested(f"nested deeper than {max_depth} levels") from None
    if json_depth(value) > max_depth:
        raise TooNested(f"nested deeper than {max_depth} levels")
    return value


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed")


MAX_INT_DIGITS = 4300   # Python's own limit on int(str); checked here so the message names the number, not sys


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-')):,} digits (at most {MAX_INT_DIGITS:,} are "
                         f"allowed)")
    return int(digits)


def json_depth(value: Any) -> int:
    """Nesting depth of lists and dicts (a scalar is 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return deepest


# ---------------------------------------------------------------- YAML

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (two `sampling:` blocks), where PyYAML keeps the
    last silently. A key that overrides one brought in by a `<<` merge is not a duplicate."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:   # an unhashable key: the base constructor names that problem
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found duplicate key {short_repr(key)}",
                                                            key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load that refuses documents nested deeper than MAX_YAML_DEPTH or expanding (through aliases)
    to more than MAX_YAML_VALUES values, before any Python object is built. Raises yaml.YAMLError or
    TooNested. A key given twice in one mapping is a yaml.YAMLError too."""
    loader = _UniqueKeyLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise TooNested(f"nested deeper than {MAX_YAML_DEPTH} levels") from None
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Count the values the node graph stands for once every alias is expanded (a shared node counts once per
    use), memoised per node so the count itself stays linear in the document's size."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            on_path.discard(key)
            if size[key] > MAX_YAML_VALUES:
                raise TooNested(f"expands to more than {MAX_YAML_VALUES:,} values (aliases of aliases?)")
            if depth[key] > MAX_YAML_DEPTH:
                raise TooNested(f"nested deeper than {MAX_YAML_DEPTH} levels")
            continue
        if key in size:
            continue
        if key in on_path:
            raise TooNested("holds an alias to itself (a recursive structure)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if id(k) not in size)
