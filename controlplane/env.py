"""Helpers that turn environment variables into Django settings values.

Kept apart from ``settings.py`` so they can be unit-tested without configuring Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_POSTGRES_SCHEMES = {"postgres", "postgresql", "pgsql"}


def env_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """Read a boolean flag; anything outside the usual spellings is an error, not False."""
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_list(environ: Mapping[str, str], name: str, default: list[str]) -> list[str]:
    """Read a comma-separated list, dropping blanks."""
    raw = environ.get(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def parse_database_url(url: str, *, base_dir: Path) -> dict[str, Any]:
    """Turn ``postgres://user:pass@host:port/name?opt=v`` or ``sqlite:///path`` into a DATABASES
    entry.

    SQLite follows the SQLAlchemy convention: three slashes for a path relative to
    ``base_dir``, four for an absolute path, ``sqlite://:memory:`` for memory.
    Query parameters of a Postgres URL (``sslmode=require``...) go to ``OPTIONS``.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in _POSTGRES_SCHEMES:
        return _postgres_database(parts)
    if scheme == "sqlite":
        return sqlite_database(_sqlite_path(url, base_dir=base_dir))
    raise ValueError(
        f"unsupported DATABASE_URL scheme {parts.scheme!r} (use postgres:// or sqlite://)"
    )


def _postgres_database(parts) -> dict[str, Any]:
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ValueError("DATABASE_URL names no database (postgres://user@host:port/NAME)")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        # Credentials may hold '@', ':' or '/'; URLs carry them percent-encoded.
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": unquote(parts.hostname or ""),
        # An empty port lets libpq use its default (5432 or PGPORT).
        "PORT": str(parts.port) if parts.port else "",
        "OPTIONS": dict(parse_qsl(parts.query)),
    }


def _sqlite_path(url: str, *, base_dir: Path) -> str:
    rest = url.split("://", 1)[1]
    if rest in (":memory:", "/:memory:", ""):
        return ":memory:"
    # urlsplit would treat the first component as a host, so slice the path by hand.
    path = Path(unquote(rest[1:] if rest.startswith("/") else rest))
    return str(path if path.is_absolute() else base_dir / path)


def sqlite_database(path: str) -> dict[str, Any]:
    """A SQLite DATABASES entry tuned for one server process with concurrent writers."""
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": path,
        "OPTIONS": {
            # Take the write lock at BEGIN so two writers queue instead of failing with
            # "database is locked" half-way through a transaction.
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            # WAL lets the dashboard read while the router writes stats.
            "init_command": "PRAGMA journal_mode=WAL;",
        },
    }


def channel_layers(redis_url: str | None) -> dict[str, Any]:
    """Redis when several processes must see each other's messages, else in-process memory."""
    if redis_url:
        return {
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {"hosts": [redis_url]},
            }
        }
    return {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def namespaced_settings(
    environ: Mapping[str, str], prefix: str, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """Copy ``defaults``, overriding each key from ``{prefix}{KEY}`` coerced to the default's
    type."""
    resolved = dict(defaults)
    for key, default in defaults.items():
        name = f"{prefix}{key}"
        if name in environ:
            resolved[key] = _coerce(environ, name, default)
    return resolved


def _coerce(environ: Mapping[str, str], name: str, default: Any) -> Any:
    # bool first: bool is a subclass of int.
    if isinstance(default, bool):
        return env_bool(environ, name, default)
    raw = environ[name]
    try:
        return type(default)(raw) if isinstance(default, (int, float)) else raw
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {type(default).__name__}") from None
