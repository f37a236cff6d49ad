"""Layered configuration for every ``primerl`` entry point, as prime-rl documents it.

Sources, highest precedence first:

1. command line: ``--section.key value`` (or ``--section.key=value``) for every field, ``--flag`` /
   ``--no-flag`` for booleans, lists as ``--key a b`` or JSON (``--key '["a", "b"]'``);
2. config files: ``@ a.toml @ b.toml`` merged left to right (deep: a later file changes only the keys it
   sets), ``--section @ part.toml`` for one section;
3. environment: ``PRIMERL_`` + the field path in capitals, ``__`` between levels (``PRIMERL_MAX_STEPS``,
   ``PRIMERL_CKPT__INTERVAL``); variables whose first segment is no field are someone else's and ignored;
4. the field defaults.

An unknown key in any source is an error that names it, the source, and the nearest valid key. Every
entry point built on :func:`run_cli` also answers ``--help`` (every field with its default and
description, then the config resolved from the given sources) and ``--dry-run`` (the resolved config as
TOML, then exit 0).

How an entry point uses it::

    from pydantic import BaseModel, Field
    from core.layered_config import run_cli

    class CkptConfig(BaseModel):
        model_config = ConfigDict(extra="forbid")
        interval: int = Field(0, ge=0, description="Save every this many steps; 0 = only at the end.")

    class TrainerConfig(BaseModel):
        model_config = ConfigDict(extra="forbid")
        max_steps: int = Field(10, ge=1, description="Optimizer steps.")
        ckpt: CkptConfig = Field(default_factory=CkptConfig, description="Checkpointing.")

    def main(argv: list[str] | None = None) -> int:
        cfg = run_cli(TrainerConfig, argv, prog="primerl trainer")  # exits on --help, --dry-run, bad config
        ...

    # primerl trainer @ base.toml @ small.toml --max-steps 6 --ckpt.interval 3 --dry-run

Programmatic use (tests, a launcher building a child's config): :func:`load_config` returns the model
or raises :class:`ConfigError`, with ``env=`` to replace ``os.environ`` and ``overrides=`` for values
that beat every source.

Why here: the loader is needed by ``server`` (``primerl serve``) and by the library packages (``grpo``'s
``primerl rl / trainer / orchestrator``), and library packages may not import ``server``. ``engines`` is
the lowest layer, importable by every package and importing none, so the loader can never close a cycle;
it depends only on pydantic and prime-rl's own CLI parser (``prime-pydantic-config``, module
``pydantic_config``), whose flag parser and help renderer it reuses.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import sys
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, ValidationError

# The package's ``__init__`` rebinds ``pydantic_config.cli`` to the function; the module is what we reuse.
_ppc = importlib.import_module("pydantic_config.cli")

M = TypeVar("M", bound=BaseModel)

ENV_PREFIX = "PRIMERL_"


class ConfigError(ValueError):
    """A configuration that cannot be loaded: unknown key, bad value, missing or malformed file."""


# ---------------------------------------------------------------- schema walking


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field of this annotation may hold as a table (Optional / unions unwrapped)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _item_type(annotation: Any) -> Any:
    """``T`` of ``list[T]`` / ``tuple[T, ...]`` (Optional unwrapped), else None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        found = [_item_type(a) for a in typing.get_args(annotation)]
        return next((f for f in found if f is not None), None)
    if origin in (list, tuple, set):
        args = typing.get_args(annotation)
        return args[0] if args else None
    return None


def _fields_of(models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """Field name -> annotation over every model a table may be (the union of their fields)."""
    out: dict[str, Any] = {}
    for model in models:
        for name, info in model.model_fields.items():
            out.setdefault(name, info.annotation)
            if info.validation_alias and isinstance(info.validation_alias, str):
                out.setdefault(info.validation_alias, info.annotation)
    return out


def _all_paths(models: Sequence[type[BaseModel]], prefix: str = "") -> list[str]:
    paths: list[str] = []
    for name, ann in _fields_of(models).items():
        path = f"{prefix}{name}"
        paths.append(path)
        paths.extend(_all_paths(_models_in(ann), f"{path}."))
    return paths


def _annotation_at(cls: type[BaseModel], path: Sequence[str]) -> Any:
    """The annotation of the field at ``path`` (None when the path leaves the schema)."""
    models: list[type[BaseModel]] = [cls]
    ann: Any = None
    for part in path:
        ann = _fields_of(models).get(part)
        if ann is None:
            return None
        models = _models_in(ann)
    return ann


def check_keys(cls: type[BaseModel], data: Mapping[str, Any], source: str) -> None:
    """Raise :class:`ConfigError` for the first key of ``data`` that ``cls`` has no field for."""

    def walk(models: list[type[BaseModel]], table: Mapping[str, Any], prefix: str) -> None:
        fields = _fields_of(models)
        extra_ok = any(m.model_config.get("extra") == "allow" for m in models)
        for key, value in table.items():
            if key not in fields:
                if extra_ok:
                    continue
                raise ConfigError(_unknown_key_message(cls, fields, f"{prefix}{key}", source))
            inner = _models_in(fields[key])
            if inner and isinstance(value, Mapping):
                walk(inner, value, f"{prefix}{key}.")
            items = _models_in(_item_type(fields[key]))
            if items and isinstance(value, list):  # [[env]] arrays of tables: each table checked
                for i, item in enumerate(value):
                    if isinstance(item, Mapping):
                        walk(items, item, f"{prefix}{key}[{i}].")

    walk([cls], data, "")


def _unknown_key_message(cls: type[BaseModel], siblings: Mapping[str, Any], path: str, source: str) -> str:
    prefix, _, key = path.rpartition(".")
    near = difflib.get_close_matches(key, list(siblings), n=1, cutoff=0.6)
    nearest = f"{prefix}.{near[0]}" if near and prefix else (near[0] if near else "")
    if not nearest:  # maybe the key sits in the wrong section: search every path
        found = difflib.get_close_matches(path, _all_paths([cls]), n=1, cutoff=0.6)
        nearest = found[0] if found else ""
    hint = f"; did you mean '{nearest}'?" if nearest else f"; valid keys here: {', '.join(sorted(siblings))}"
    return f"unknown config key '{path}' in {source}{hint}"


# ---------------------------------------------------------------- sources


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``; tables merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        out[key] = deep_merge(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return out


def _coerce_texts(cls: type[BaseModel], data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = (*prefix, key)
        if isinstance(value, Mapping):
            out[key] = _coerce_texts(cls, value, path)
        else:
            out[key] = _text_value(cls, path, value) if isinstance(value, str) else value
    return out


def _nest(path: Sequence[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path):
        out = {part: out}
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read: {exc.strerror}") from exc


def _text_value(cls: type[BaseModel], path: Sequence[str], raw: str) -> Any:
    """A string from the environment or a flag as the field wants it: JSON for tables and lists, ``a,b``
    for a list or tuple (scalars stay strings: pydantic converts ``"8"`` for an int field)."""
    ann = _annotation_at(cls, path)
    if ann is str:
        return raw
    if raw[:1] in ("{", "["):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    if typing.get_origin(ann) in (list, tuple, set):
        return [part for part in raw.split(",") if part]
    return raw


def read_env(
    cls: type[BaseModel],
    environ: Mapping[str, str],
    *,
    prefix: str = ENV_PREFIX,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The environment's layer: ``PREFIX_A__B=v`` -> ``{"a": {"b": v}}`` for variables naming a field.

    ``aliases`` maps whole variable names to dotted paths (``{"PRIMERL_ENGINE": "engine.type"}``); the
    canonical variable wins over its alias. An alias whose value is a JSON table sets the whole table.
    """
    top = _fields_of([cls])
    canonical: dict[str, Any] = {}
    aliased: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        upper = name.upper()
        alias = (aliases or {}).get(upper)
        if alias is not None:
            path = alias.split(".")
            if raw.startswith("{") and len(path) > 1 and upper[len(prefix) :].lower() == path[0]:
                path = path[:1]
            value = _text_value(cls, path, raw)
            check_keys(cls, _nest(path, value), f"environment variable {name}")
            aliased = deep_merge(aliased, _nest(path, value))
            continue
        if not upper.startswith(prefix.upper()):
            continue
        path = upper[len(prefix) :].lower().split("__")
        if path[0] not in top or not all(path):
            continue  # another tool's variable (PRIMERL_VLLM_VENV, PRIMERL_VERIFIER__...)
        layer = _nest(path, _text_value(cls, path, raw))
        check_keys(cls, layer, f"environment variable {name}")
        canonical = deep_merge(canonical, layer)
    return deep_merge(aliased, canonical)


def split_files(argv: Sequence[str]) -> tuple[list[tuple[list[str], Path]], list[str]]:
    """``@ FILE`` / ``@FILE`` (root) and ``--section @ FILE`` (one section) out of ``argv``, in order."""
    files: list[tuple[list[str], Path]] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("@"):
            target = arg[1:] or (args[i + 1] if i + 1 < len(args) else "")
            if not target:
                raise ConfigError("'@' must be followed by a config file path")
            files.append(([], Path(target)))
            i += 1 if arg[1:] else 2
            continue
        nxt = args[i + 1] if i + 1 < len(args) else ""
        if arg.startswith("--") and nxt.startswith("@"):
            target = nxt[1:] or (args[i + 2] if i + 2 < len(args) else "")
            if not target:
                raise ConfigError(f"'{arg} @' must be followed by a config file path")
            files.append((arg[2:].replace("-", "_").split("."), Path(target)))
            i += 2 if nxt[1:] else 3
            continue
        rest.append(arg)
        i += 1
    return files, rest


def _kebab_flag(token: str) -> str:
    if not token.startswith("--"):
        return token
    flag, eq, value = token.partition("=")
    return flag.replace("_", "-") + eq + value


def parse_flags(cls: type[BaseModel], args: Sequence[str]) -> dict[str, Any]:
    """``--a.b value`` / ``--flag`` / ``--no-flag`` tokens as a nested dict (prime-pydantic-config's parser)."""
    # TOML spells keys snake_case, the parser kebab-case: accept both (``--engine.toy.vocab_size 64``).
    remaining = [_kebab_flag(a) for a in args]
    out: dict[str, Any] = {}
    try:
        optional = _ppc._find_optional_model_paths(cls)
        if optional:
            remaining, part = _ppc._expand_bare_optional_flags(remaining, optional)
            out = deep_merge(out, part)
        json_paths = _ppc._find_json_value_field_paths(cls)
        if json_paths:
            remaining, part = _ppc._extract_json_value_args(remaining, json_paths)
            out = deep_merge(out, part)
        remaining, part = _ppc._parse_cli_to_dict(remaining, cls, optional)
    except _ppc.ConfigFileError as exc:
        raise ConfigError(str(exc)) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"a command-line value is not valid JSON: {exc}") from exc
    if remaining:
        raise ConfigError(f"unrecognized arguments: {' '.join(remaining)} (flags look like --section.key VALUE)")
    return _coerce_texts(cls, deep_merge(out, part))


# ---------------------------------------------------------------- resolution


def resolve_layers(
    cls: type[BaseModel],
    argv: Sequence[str] = (),
    *,
    files: Sequence[str | Path] = (),
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
    env_aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The merged raw dict (env < files < CLI flags < ``overrides``), every key checked, not validated."""
    merged = read_env(cls, os.environ if env is None else env, prefix=env_prefix, aliases=env_aliases)
    argv_files, flags = split_files(argv)
    for section, path in [*(([], Path(f)) for f in files), *argv_files]:
        layer = _nest(section, read_toml(path))
        check_keys(cls, layer, f"config file {path}")
        merged = deep_merge(merged, layer)
    cli_layer = parse_flags(cls, flags)
    check_keys(cls, cli_layer, "the command line")
    merged = deep_merge(merged, cli_layer)
    if overrides:
        check_keys(cls, overrides, "the overrides")
        merged = deep_merge(merged, overrides)
    return merged


def validate(cls: type[M], data: Mapping[str, Any]) -> M:
    try:
        return cls.model_validate(dict(data))
    except ValidationError as exc:
        lines = [f"invalid configuration ({exc.error_count()} error(s)):"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "<root>"
            got = err.get("input")
            shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
            lines.append(f"  {where}: {err['msg']}{shown}")
        raise ConfigError("\n".join(lines)) from exc


def load_config(cls: type[M], argv: Sequence[str] = (), **kwargs: Any) -> M:
    """Resolve and validate ``cls`` from ``argv`` (``@`` files and flags), the environment and defaults.

    Keyword arguments are :func:`resolve_layers`'s. Raises :class:`ConfigError`.
    """
    return validate(cls, resolve_layers(cls, argv, **kwargs))


def to_toml(config: BaseModel) -> str:
    """The config as TOML that loads back to the same config (None fields, which TOML cannot hold, left out)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True, by_alias=False))


def help_text(cls: type[BaseModel], prog: str, description: str | None = None) -> str:
    """Every field (flag, type, default, description), as prime-pydantic-config renders it."""
    usage = (
        "\nSources, highest first: --section.key VALUE flags > @ FILE.toml (several merge left to right) > "
        f"{ENV_PREFIX}SECTION__KEY environment variables > defaults. --dry-run prints the resolved config as "
        "TOML and exits.\n"
    )
    return _ppc._render_help(cls, prog=prog, description=(description or "") + usage, wide=False)


def run_cli(
    cls: type[M],
    argv: Sequence[str] | None = None,
    *,
    prog: str,
    description: str | None = None,
    **kwargs: Any,
) -> M:
    """:func:`load_config` for an entry point: handles ``--help`` and ``--dry-run``, exits 2 on a bad config.

    ``--help`` prints every field, then the config as the other given sources resolve it; ``--dry-run``
    prints the resolved config as TOML. Both exit 0 (``SystemExit``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    want_help = any(a in ("-h", "--help") for a in args)
    dry_run = "--dry-run" in args
    args = [a for a in args if a not in ("-h", "--help", "--dry-run")]
    try:
        config = load_config(cls, args, **kwargs)
    except ConfigError as exc:
        if want_help:
            print(help_text(cls, prog, description))
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if want_help:
        print(help_text(cls, prog, description))
        print("# resolved config (files, environment and flags given with --help)\n" + to_toml(config))
        raise SystemExit(0)
    if dry_run:
        sys.stdout.write(to_toml(config))
        raise SystemExit(0)
    return config
