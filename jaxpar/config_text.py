"""The config as people read and write it: each field's meaning, taken from the comments
beside it in its dataclass (written once, there), and TOML files of overrides.

  jaxpar train llama --print-config [PREFIX]            key=value lines with their meaning
  jaxpar train llama --print-config --as-toml > run.toml
  jaxpar train llama --config run.toml [--set ...]       the file's keys, then --set on top

A TOML file holds tables named after the config's sections (`[train]`, `[mesh.hosts]`); each
key is an override, checked as `--set` checks it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import pathlib
import re
import textwrap
import tokenize
from typing import Any

from jaxpar.errors import ConfigError

_FIELD = re.compile(r"^(\s+)(\w+)\s*:[^=]+")  # `    name: type [= default]` in a class body


def field_comments(cls: type) -> dict[str, str]:
    """`_own_comments` of the class and of the dataclasses it derives from (a subclass's
    own comment wins)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_own_comments(base))
    return out


def _own_comments(cls: type) -> dict[str, str]:
    """{field: its comment}: the comment lines right above the field (or above the run of
    fields it belongs to, with no blank line between) and the one beside it, from the
    dataclass's source (empty when the source cannot be read)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    beside = _line_comments(source)
    out: dict[str, str] = {}
    above: list[str] = []
    group: list[str] = []  # the comment above the run of fields this one is in
    body = None  # the class body's indentation
    names = {f.name for f in dataclasses.fields(cls)}
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD.match(line)
        if match and (body is None or match.group(1) == body) and match.group(2) in names:
            body = match.group(1)
            own = [beside[number]] if number in beside else []
            group = above or ([] if own else group)  # a field's own comment ends the run's
            text = " ".join(group + own)
            if text:
                out[match.group(2)] = text
        elif not match or match.group(1) == body:
            group = []  # a blank line, or anything but a field, ends the run
        above = []
    return out


def _line_comments(source: str) -> dict[int, str]:
    """{line number: the comment that ends that line of code}."""
    out, code_lines = {}, set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and tok.start[0] in code_lines:
                out[tok.start[0]] = tok.string.lstrip("#").strip()
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
                code_lines.add(tok.start[0])
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def field_docs(config: Any, prefix: str = "") -> dict[str, str]:
    """{'train.steps': its meaning, ...} for every documented leaf key of `config`."""
    out: dict[str, str] = {}
    comments = field_comments(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(field_docs(value, f"{prefix}{f.name}."))
        elif f.name in comments:
            out[prefix + f.name] = comments[f.name]
    return out


def listing(config: Any, prefix: str = "") -> str:
    """`--print-config [PREFIX]`: each key=value (under PREFIX), a choice's values and the
    field's meaning beside it."""
    from jaxpar.choices import choice_fields
    from jaxpar.config import flatten

    choices, docs = choice_fields(config), field_docs(config)
    lines = []
    for key, value in flatten(config).items():
        if not key.startswith(prefix):
            continue
        notes = ([" | ".join(map(str, choices[key]))] if key in choices else []) + ([docs[key]] if key in docs else [])
        lines.append(f"{key}={value}" + (f"  # {'; '.join(notes)}" if notes else ""))
    if not lines:
        raise ConfigError(f"--print-config {prefix}: no key starts with {prefix!r}; use a section such as train, "
                          "mesh, parallel, optim, model")
    return "\n".join(lines)


def to_toml(config: Any) -> str:
    """Every key of `config` as TOML, a table per section, each field's meaning and choices
    as comments: `read_toml` of it gives `config` back."""
    from jaxpar.choices import choice_fields
    from jaxpar.config import flatten

    choices, docs = choice_fields(config), field_docs(config)
    tables: dict[str, list[str]] = {}
    said = None  # a run of fields under one comment shows it once
    for key, value in flatten(config).items():
        section, _, name = key.rpartition(".")
        lines = tables.setdefault(section, [])
        if key in docs and docs[key] != said:
            lines += [f"# {line}" for line in textwrap.wrap(docs[key], 96)]
        said = docs.get(key)
        if key in choices:
            lines.append(f"# one of: {' | '.join(map(str, choices[key]))}")
        lines.append(f"{name} = {_toml_value(key, value)}")
    return "\n\n".join(f"[{section}]\n" + "\n".join(lines) for section, lines in tables.items()) + "\n"


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    raise ConfigError(f"{key}={value!r} has no TOML form (only booleans, numbers and strings)")


def read_toml(path: str) -> list[str]:
    """The `key=value` overrides a TOML file holds (tables are sections), checked by
    `apply_overrides` as `--set` is. A missing or malformed file is refused in one line."""
    import tomllib

    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        tree = tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path} is not TOML: {e}") from None
    return [f"{key}={_override_value(key, value, path)}" for key, value in _leaves(tree)]


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _override_value(key: str, value: Any, path: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ConfigError(f"--config {path}: {key} = {value!r} is a {type(value).__name__}; config values are "
                      "booleans, numbers or strings")
