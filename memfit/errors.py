"""memfit's domain exceptions. The service maps them to HTTP in one place (:mod:`service.errors`).

Each carries the field it is about (dotted path, e.g. ``model.num_key_value_heads``) and, where one
exists, the allowed range, so every answer to bad input names both.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any


class MemfitError(Exception):
    """Base of memfit's domain exceptions."""


class InvalidConfiguration(MemfitError, ValueError):
    """A configuration value is out of range or of the wrong type.

    Attributes:
        field: dotted path of the offending field. allowed: the allowed range or values, in words.
    """

    def __init__(self, field: str, allowed: str, got: object = None, *, message: str | None = None) -> None:
        self.field, self.allowed = field, allowed
        shown = "NaN" if isinstance(got, float) and math.isnan(got) else repr(got)
        self.message = message or f"{field}: must be {allowed}" + ("" if got is None else f", got {shown[:80]}")
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def within(self, prefix: str) -> InvalidConfiguration:
        """The same error with ``prefix.`` in front of the field (e.g. ``model``), and in front of the message where
        it starts with the field or its section (``training: ...``); a message that names no field (an unknown
        model's) stays as it is (it read ``items.0.unknown model 'x'``)."""
        section = self.field.split(".")[0]
        named = self.message.startswith((f"{section}:", f"{section}."))
        return type(self)(
            f"{prefix}.{self.field}", self.allowed, message=f"{prefix}.{self.message}" if named else self.message
        )


def pydantic_error_field(error: dict, path: tuple = ()) -> tuple[str, str, str | None]:
    """``(field, message, allowed)`` of one pydantic error dict (``ValidationError.errors()`` item) at
    ``path``: an :class:`InvalidConfiguration` raised inside a model validator names its own field below
    ``path``; other errors name their location, with pydantic's ``"Value error, "`` prefix removed."""
    inner = (error.get("ctx") or {}).get("error")
    if isinstance(inner, InvalidConfiguration):
        prefix = ".".join(str(x) for x in path)
        return (
            f"{prefix}.{inner.field}" if prefix else inner.field,
            f"{prefix}.{inner.message}" if prefix else inner.message,
            inner.allowed,
        )
    field = ".".join(str(x) for x in path) or "body"
    return field, str(error.get("msg", "")).removeprefix("Value error, "), None


def invalid_from_validation(err: Any) -> InvalidConfiguration:
    """The first error of a pydantic ``ValidationError`` as one :class:`InvalidConfiguration` naming its field
    (dotted location), pydantic's message and the value given, instead of pydantic's multi-line dump."""
    first = err.errors()[0]
    field, msg, allowed = pydantic_error_field(first, tuple(first.get("loc", ())))
    got = first.get("input")
    shown = "" if isinstance(got, dict) or msg.startswith(field) else f", got {got!r}"[:90]
    message = msg if msg.startswith(field) else f"{field}: {msg}{shown}"
    return InvalidConfiguration(field, allowed or msg, message=message)


def close_names(name: str, names: Iterable[str], n: int = 4) -> list[str]:
    """Up to ``n`` of ``names`` close to an unknown ``name``, closest first, each once: those that start with it
    (``H100`` -> ``H100-80GB``), those it starts with (``T4-16GB`` -> ``T4``), then :func:`difflib.get_close_matches`'
    (similarity ratio >= 0.6). Compared
    case-insensitively with ``_`` and spaces read as ``-``, as the catalog and the GPU table read names; the names
    are returned as given. The one suggestion of an unknown model name and an unknown GPU name."""

    def norm(text: str) -> str:
        return text.strip().lower().replace("_", "-").replace(" ", "-")

    if len(name) > 200:  # no name is that long; the similarity search would cost seconds (quadratic in length)
        return []
    key, by_norm = norm(name), {}
    for known in names:
        by_norm.setdefault(norm(known), known)
    if not key:
        return []
    ratio = {k: difflib.SequenceMatcher(None, key, k).ratio() for k in by_norm}
    # names that start with it (H100 -> H100-80GB), then names it starts with (T4-16GB -> T4), closest first
    prefixed = sorted((k for k in by_norm if k.startswith(key)), key=lambda k: -ratio[k])
    prefixed += sorted((k for k in by_norm if key.startswith(k) and k not in prefixed), key=lambda k: -ratio[k])
    similar = difflib.get_close_matches(key, list(by_norm), n=len(by_norm))
    return [by_norm[k] for k in dict.fromkeys([*prefixed, *similar])][:n]


class UnknownArchitecture(InvalidConfiguration):
    """A ``model_type`` that neither transformers nor memfit knows; give ``architecture_fallback``
    to have it predicted as a known family."""


class UnknownModel(InvalidConfiguration, KeyError):
    """A model name that is not in the catalog (also a ``KeyError`` for older callers)."""

    def __str__(self) -> str:
        return self.message


class Unavailable(MemfitError):
    """Temporarily unable to answer; ``retry_after_s`` says when to try again (None: not soon)."""

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreBusy(Unavailable):
    """The telemetry store is locked or saturated with writes."""


class ReadOnly(Unavailable):
    """The server runs read-only (its data directory cannot be written): it recommends, it does not store."""


class ModelUnavailable(Unavailable):
    """No model version passed its load checks yet."""
