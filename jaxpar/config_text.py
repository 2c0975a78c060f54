"""The config as people read and write it: each field's meaning, taken from its own comment
in its dataclass (written once, there: beside the field or right above it), and TOML files
of overrides.

  jaxpar train llama --print-config [PREFIX]            key=value lines with their meaning
  jaxpar train llama --print-config --as-toml > run.toml
  jaxpar train llama --config run.toml [--set ...]       the file's keys, then --set on top

A TOML file holds tables named after the config's sections (`[train]`, `[mesh.hosts]`); each
key is an override, checked as `--set` checks it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import pathlib
import textwrap
import tokenize
from typing import Any

from jaxpar.errors import ConfigError


def field_comments(cls: type) -> dict[str, str]:
    """{field: its own comment} of the class and of the dataclasses it derives from (a
    subclass's own comment wins; a field it declares again without one keeps its base's)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_own_comments(base))
    return out


@functools.cache
def _own_comments(cls: type) -> dict[str, str]:
    """{field: its own comment} from the dataclass's source (empty when it cannot be read):
    the comment beside the field, else the unbroken comment lines right above it. A comment
    above a field that has one beside it, or above a run of fields (the next field follows
    with no comment of its own), heads a group and is no field's meaning; so is one followed
    by a blank line."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        body = ast.parse(source).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return {}
    comments = _comments(source)
    lines = source.splitlines()

    def beside(stmt) -> str:
        return " ".join(comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments)

    fields = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for stmt, after in zip(body, body[1:] + [None]):
        name = getattr(getattr(stmt, "target", None), "id", None)
        if not isinstance(stmt, ast.AnnAssign) or name not in fields:
            continue
        first = stmt.lineno  # the first of the comment lines right above it
        while first > 1 and lines[first - 2].strip().startswith("#"):
            first -= 1
        heads_run = isinstance(after, ast.AnnAssign) and after.lineno == stmt.end_lineno + 1 and not beside(after)
        text = beside(stmt) or ("" if heads_run else " ".join(comments[n] for n in range(first, stmt.lineno)))
        if text:
            out[name] = text
    return out


def _comments(source: str) -> dict[int, str]:
    """{line number: the text of the comment on that line}."""
    try:
        return {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    except (tokenize.TokenError, SyntaxError):
        return {}


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
    for key, value in flatten(config).items():
        section, _, name = key.rpartition(".")
        lines = tables.setdefault(section, [])
        lines += [f"# {line}" for line in textwrap.wrap(docs.get(key, ""), 96)]
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
    return [FileOverride(f"{key}={_override_value(key, value, path)}", path) for key, value in _leaves(tree)]


class FileOverride(str):
    """A `key=value` override read from a --config file, which it remembers (`file`), so an
    error it causes names the file (jaxpar.config.apply_overrides)."""

    file: str

    def __new__(cls, text: str, file: str) -> "FileOverride":
        override = super().__new__(cls, text)
        override.file = file
        return override


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
