"""YAML configs + `--set section.key=value` + CLI flags -> a validated EngineConfig and sampling defaults.

Precedence, lowest first: the dataclass defaults, the YAML file, the environment aliases (MINI_ENGINE_OPS=0,
MINI_ENGINE_ATTN=unified: minillm/config.py), `--set` overrides (in order), explicit flags.
Every mistake raises ConfigError naming the key, the value and what is allowed, before any engine work starts.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml

from minillm.config import ConfigError, EngineConfig, env_alias_values
from minillm.sampling_params import SamplingParams
from minillm.untrusted import load_yaml, short_repr

# Sampling defaults for generate / serve-stdin when neither the config nor the input line sets a value.
# NOTE: configs/default.yaml mirrors these; a test keeps the two equal.
SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 64}

ENGINE_SECTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig))
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "structured")   # per request
SECTIONS = ENGINE_SECTIONS + ("sampling",)


def _suggest(word: str, choices: Iterable[str]) -> str:
    if len(word) > 64:   # no key is this long; do not spend time comparing it
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown(what: str, name: str, choices: Iterable[str]) -> ConfigError:
    choices = list(choices)
    return ConfigError(f"unknown {what} {short_repr(name)}{_suggest(name, choices)}; valid: {', '.join(choices)}")


def _engine_field(section: str, key: str) -> dataclasses.Field:
    cls = type(getattr(EngineConfig(), section))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        raise _unknown(f"key in section {section!r}:", key, fields)
    return fields[key]


def _check_key(section: str, key: str) -> None:
    """Check that section.key exists (type checks run once all values are in)."""
    if section not in SECTIONS:
        raise _unknown("config section", section, SECTIONS)
    if section == "sampling":
        if key not in SAMPLING_KEYS:
            raise _unknown("key in section 'sampling':", key, SAMPLING_KEYS)
    else:
        _engine_field(section, key)


MAX_CONFIG_FILE_BYTES = 1 << 20


def read_yaml_file(path: Path, what: str = "config file") -> Any:
    """A YAML file's content through the bounded loader; every failure is a ConfigError naming the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}" if not path.exists() else f"{what} {path} is not a file")
    try:
        if path.stat().st_size > MAX_CONFIG_FILE_BYTES:
            raise ConfigError(f"{what} {path} is {path.stat().st_size:,} bytes; the limit is "
                              f"{MAX_CONFIG_FILE_BYTES:,}")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text: {e}") from None
    try:
        return load_yaml(text)
    except (yaml.YAMLError, ValueError) as e:   # ValueError: TooNested
        raise ConfigError(f"{what} {path} is not valid YAML: {yaml_problem(e)}") from None


def yaml_problem(e: Exception) -> str:
    """A YAML error in one line: PyYAML's own message spans several, with a copy of the offending text."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem is None:
        return " ".join(str(e).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{context + ': ' if context else ''}{problem}{where}"


def _read_yaml(path: Path) -> dict[str, dict[str, Any]]:
    data = read_yaml_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections ({', '.join(SECTIONS)})")
    out: dict[str, dict[str, Any]] = {}
    for section, body in data.items():
        section = str(section)
        if section not in SECTIONS:
            raise _unknown("config section", section, SECTIONS)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"config section {section!r} in {path} must be a mapping of key: value")
        for key, value in body.items():
            _check_key(section, str(key))
            out.setdefault(section, {})[str(key)] = value
    return out


def parse_set(item: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); the value is read as YAML (so `null`, `true`, `0.5` work)."""
    name, sep, raw = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set expects section.key=value (e.g. scheduler.max_num_seqs=64), "
                          f"got {short_repr(item)}")
    try:
        value = load_yaml(raw)
    except (yaml.YAMLError, ValueError) as e:   # ValueError: TooNested
        raise ConfigError(f"--set {name}: value {short_repr(raw)} is not valid YAML: {yaml_problem(e)}") from None
    return section, key, value


def _flag_target(name: str) -> tuple[str, str]:
    if name == "model":
        return "model", "model"
    if name not in EngineConfig.KWARGS:
        raise _unknown("engine flag", name, ["model", *EngineConfig.KWARGS])
    return EngineConfig.KWARGS[name]


def _build_engine(values: dict[str, dict[str, Any]]) -> EngineConfig:
    # The sections' own validate() checks types and ranges, as it does for LLM(**kw) and hand-built configs.
    base = EngineConfig()
    sections = {s: dataclasses.replace(getattr(base, s), **values.get(s, {})) for s in ENGINE_SECTIONS}
    return EngineConfig(**sections).validate()


def _build_sampling(values: dict[str, Any]) -> dict[str, Any]:
    merged = {**SAMPLING_DEFAULTS, **values}
    try:
        SamplingParams(**merged)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"sampling: {e}") from None
    return merged


def load_config(path: Path | None, sets: Iterable[str] = (), **flag_overrides: Any) -> tuple[EngineConfig, dict]:
    """Build the engine config and the sampling defaults.

    path: a YAML file, or None for the built-in defaults. sets: `section.key=value` strings.
    flag_overrides: EngineConfig.KWARGS names (plus `model`); None means "flag not given" and is skipped.
    """
    values = _read_yaml(Path(path)) if path is not None else {}
    for section, body in env_alias_values().items():   # MINI_ENGINE_OPS / MINI_ENGINE_ATTN, over the file
        values.setdefault(section, {}).update(body)
    for item in sets:
        section, key, value = parse_set(item)
        _check_key(section, key)
        values.setdefault(section, {})[key] = value
    for name, value in flag_overrides.items():
        if value is not None:
            section, key = _flag_target(name)
            values.setdefault(section, {})[key] = value
    return _build_engine(values), _build_sampling(values.get("sampling", {}))
