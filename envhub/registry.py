"""Environments by name.

Invariant: ``make_env(name, config)`` returns a fresh environment instance each call (one
per episode); factories receive the hub's config section, never the settings root. The
ready environments (sql-qa, code-math, web-lookup, web-browse) are registered here by
import path, so importing the registry does not import Playwright or psycopg.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from core.errors import InvalidArgument
from envhub.base import Environment
from envhub.config import EnvHubConfig

EnvFactory = Callable[[EnvHubConfig], Environment]

_FACTORIES: dict[str, EnvFactory] = {}
_LAZY: dict[str, str] = {
    "sql-qa": "envhub.envs.sql_qa:make",
    "code-math": "envhub.envs.code_math:make",
    "web-lookup": "envhub.envs.web_lookup:make",
    "web-browse": "envhub.envs.web_browse:make",
}


def register(name: str, factory: EnvFactory) -> None:
    """Register (or replace) an environment factory under ``name``."""
    _FACTORIES[name] = factory


def names() -> tuple[str, ...]:
    return tuple(sorted(set(_FACTORIES) | set(_LAZY)))


def make_env(name: str, config: EnvHubConfig | None = None) -> Environment:
    """A new instance of the environment registered as ``name``."""
    factory = _FACTORIES.get(name)
    if factory is None and name in _LAZY:
        module, attr = _LAZY[name].split(":")
        factory = getattr(importlib.import_module(module), attr)
        _FACTORIES[name] = factory
    if factory is None:
        raise InvalidArgument(f"unknown environment {name!r}; registered: {', '.join(names())}")
    return factory(config or EnvHubConfig())
