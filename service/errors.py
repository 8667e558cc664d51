"""Domain exceptions -> HTTP, in one place. Every error body is ``application/problem+json`` (RFC 9457).

=================================================  ======  =========================================
exception                                          status  body
=================================================  ======  =========================================
request validation (pydantic)                      422     each field, its problem, the allowed range
:class:`memfit.errors.InvalidConfiguration`        422     the field and the allowed range (in detail too)
(``UnknownArchitecture``, ``UnknownModel``)
:class:`memfit.errors.ReadOnly`                    503     writes refused on a read-only server
:class:`memfit.errors.StoreBusy`                   503     ``Retry-After`` header
:class:`memfit.errors.ModelUnavailable`            503     why no model serves
HTTP errors raised by routes (401, 404, 413, ...)  same    the detail
anything else                                      500     the exception's type name only (a bug)
=================================================  ======  =========================================

Bodies never carry server paths or tracebacks.

:func:`install` also documents these answers in the OpenAPI schema, as they are sent: every 4xx/5xx
above is ``application/problem+json`` with the :class:`Problem` schema (routes name their own 404
and 503 with :func:`problem_responses`; 400, 413, 415 and 422 go on every operation with a body,
401 on every operation with the bearer security scheme; on a server without a token that scheme is
optional and no 401 is documented).
"""

from __future__ import annotations

import json
import logging
import types
import typing
from enum import Enum
from http import HTTPStatus
from typing import Any

import annotated_types as at
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from memfit.errors import InvalidConfiguration, Unavailable, close_names, pydantic_error_field

log = logging.getLogger("memfit.service")
PROBLEM = "application/problem+json"


class Problem(BaseModel):
    """RFC 9457 problem details, as every error answer carries them."""

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str = Field(description="the HTTP status phrase")
    status: int = Field(description="the HTTP status code")
    detail: str = Field(description="what went wrong, naming the field and the allowed range where one applies")
    errors: list[dict[str, Any]] | None = Field(
        None, description="422: one {field, message, allowed} per invalid field (allowed where a range exists)"
    )


_REASONS = {
    400: "the body could not be read (invalid UTF-8, or JSON nested too deeply): the detail names the byte",
    408: "the body did not arrive whole within the server's time limit",
    401: "a valid bearer token is required",
    404: "not found",
    413: "the body is larger than the server accepts",
    415: "the body is not application/json",
    422: "invalid input: each field, its problem and the allowed range",
    503: "temporarily unavailable (no model, read-only server or busy store); Retry-After when known",
}


def problem_responses(*statuses: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for problem+json answers, for a route decorator's ``responses=``.

    ``descriptions`` override the default wording per status (keys ``s404`` etc.).
    """
    return {
        status: {
            "description": descriptions.get(f"s{status}", _REASONS.get(status, HTTPStatus(status).phrase)),
            "content": {PROBLEM: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for status in statuses
    }


def _document(app: FastAPI) -> None:
    """Make ``app.openapi()`` describe the error answers as they are sent (see the module docstring)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = generate()
        tokenless = not app.state.settings.token
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        for operations in spec.get("paths", {}).values():
            for op in operations.values():
                responses = op.setdefault("responses", {})
                wanted = []
                if "requestBody" in op:
                    wanted += [400, 413, 415, 422]
                if "422" in responses:
                    wanted.append(422)
                if op.get("security"):
                    if tokenless:  # no token configured (loopback): the bearer scheme is optional, never 401
                        op["security"].append({})
                    else:
                        wanted.append(401)
                for status, entry in problem_responses(*wanted).items():
                    responses[str(status)] = entry  # replaces FastAPI's application/json 422
        for unused in ("HTTPValidationError", "ValidationError"):
            if f'"#/components/schemas/{unused}"' not in json.dumps(spec):
                schemas.pop(unused, None)
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def problem(status: int, detail: str, *, headers: dict[str, str] | None = None, **extra: Any) -> Response:
    """An ``application/problem+json`` response."""
    body = {"type": "about:blank", "title": HTTPStatus(status).phrase, "status": status, "detail": detail, **extra}
    return Response(json.dumps(body), status_code=status, media_type=PROBLEM, headers=headers)


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> X; ``Annotated[X, ...]`` -> X."""
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(args) == 1 or len(models) == 1:
                annotation = models[0] if models else args[0]
                continue
        return annotation


def _walk(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> tuple[Any, type[BaseModel] | None, bool]:
    """Follow ``loc`` (list indices skipped) into ``model``: the field info of its last named key (None where a key
    is not a field), the pydantic model of the object there (None where it is not one model: a union of several,
    a plain value) and whether ``loc`` ends on a list field itself rather than on one of its items."""
    info = None
    is_list = False
    for key in loc:
        if isinstance(key, int) or model is None:  # list index
            is_list = False
            continue
        info = model.model_fields.get(str(key))
        if info is None:
            return None, None, False
        inner = _unwrap(info.annotation)
        is_list = typing.get_origin(inner) is list
        if is_list:
            inner = _unwrap(typing.get_args(inner)[0])
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    return info, model, is_list


def model_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model of the object at ``loc`` inside ``model`` (list indices skipped), None where it is not
    one model (a union of several, a plain value) or ``loc`` names no field."""
    return _walk(model, loc)[1]


def allowed_range(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str | None:
    """The allowed values of the field at ``loc`` inside ``model`` in words, e.g. ``an integer in [1, 16384]``."""
    info, model, is_list = _walk(model, loc)
    if info is not None and is_list:  # the list itself (e.g. an empty batch): its length bounds
        lo = next((m.min_length for m in info.metadata if isinstance(m, at.MinLen)), 0)
        hi = next((m.max_length for m in info.metadata if isinstance(m, at.MaxLen)), None)
        if lo or hi is not None:
            return f"a list of {lo} to {hi} items" if hi is not None else f"a list of at least {lo} items"
    if info is None or model is not None:
        return None
    kind = _unwrap(info.annotation)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return f"one of {[e.value for e in kind]}"
    lo = hi = None
    lo_open = hi_open = False
    for m in info.metadata:
        if isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, at.Le):
            hi = m.le
        elif isinstance(m, at.Lt):
            hi, hi_open = m.lt, True
        elif isinstance(m, at.MaxLen):
            return f"a string of at most {m.max_length} characters"
    name = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(kind)
    if lo is None and hi is None:
        return name
    return (
        f"{name or 'a number'} in {'(' if lo_open else '['}{'-inf' if lo is None else lo}, "
        f"{'inf' if hi is None else hi}{')' if hi_open else ']'}"
    )


def _union_branch_errors_merged(errors: list[dict[str, Any]], body_model: type[BaseModel] | None) -> list[dict]:
    """Pydantic reports a value that matches no member of a union once per member, under a tag that is no field
    (``model.str``, ``model.ArchitectureIn``, ``model.dict[str,any]``): those type errors become one at the field."""

    def union_tag(path: tuple[Any, ...]) -> bool:  # path[-1] names a union member of the field path[-2]
        if len(path) < 2 or isinstance(path[-1], int):
            return False
        holder = model_at(body_model, path[:-2])
        if holder is None or str(path[-2]) not in holder.model_fields:
            return False
        member = model_at(body_model, path[:-1])
        return member is None or str(path[-1]) not in member.model_fields

    out, seen = [], set()
    for e in errors:
        loc = tuple(e["loc"])
        path = loc[1:] if loc and loc[0] == "body" else loc
        if not (str(e.get("type", "")).endswith("_type") and union_tag(path)):
            out.append(e)
        elif loc[:-1] not in seen:
            seen.add(loc[:-1])
            got = "null" if e.get("input") is None else type(e.get("input")).__name__
            out.append({**e, "loc": loc[:-1], "type": "union_type", "msg": f"wrong type (got {got})"})
    return out


def _validation_errors(exc: RequestValidationError, body_model: type[BaseModel] | None) -> list[dict[str, Any]]:
    out = []
    for e in _union_branch_errors_merged(list(exc.errors()), body_model):
        loc = tuple(e["loc"])
        if e.get("type") == "json_invalid":  # loc holds the character position, not a field
            out.append(
                {
                    "field": "body",
                    "message": f"invalid JSON at character {loc[-1]}: {e.get('ctx', {}).get('error', e['msg'])}",
                }
            )
            continue
        path = loc[1:] if loc and loc[0] == "body" else loc
        field, msg, allowed = pydantic_error_field(e, path)
        if e.get("type") == "finite_number":
            msg = "must be a finite number (NaN and Infinity are not numbers)"
        if e.get("type") == "extra_forbidden" and path:  # a misspelt field: name the close ones and every known one
            known = list(getattr(model_at(body_model, path[:-1]), "model_fields", {}))
            if known:
                close = close_names(str(path[-1]), known, n=2)
                msg = f"unknown field{'; did you mean ' + ' or '.join(map(repr, close)) + '?' if close else ''}"
                allowed = f"one of {known}"
        allowed = allowed or allowed_range(body_model, path)
        # what a section or a union field may be, where allowed_range has no range: the field's description, else
        # the section's fields
        section = model_at(body_model, path)
        parent = model_at(body_model, path[:-1]) if path else None
        info = parent.model_fields.get(str(path[-1])) if parent is not None else None
        described = info.description if info is not None and info.description else None
        fields = f"an object with fields {list(section.model_fields)}" if section is not None else None
        if e.get("type") == "union_type":
            allowed = allowed or described
        elif e.get("type") in ("model_type", "model_attributes_type") and section is not None:
            # a section that is no object (model_attributes_type as FastAPI validates bodies, from_attributes=True)
            msg = f"must be an object (got {'null' if e.get('input') is None else type(e.get('input')).__name__})"
            allowed = allowed or fields
        elif e.get("type") == "missing" and path:
            msg = "required"
            allowed = allowed or described or fields
        item = {"field": field, "message": msg}
        if allowed:
            item["allowed"] = allowed
        out.append(item)
    return out


def with_allowed(message: str, allowed: str | None) -> str:
    """``message (allowed: ...)``: the allowed range appended to a field's problem, unless there is none or the
    message already names it or its own list (an :class:`InvalidConfiguration`'s own ``must be <allowed>``,
    ``(allowed: ...)`` or ``; allowed: ...``). The one wording of the allowed range in the service's 422 detail and in
    ``memfit recommend``'s errors."""
    if not allowed or str(allowed) in message or "allowed:" in message:
        return message
    return f"{message} (allowed: {allowed})"


def field_problem(field: str, message: str, allowed: str | None) -> str:
    """A field's problem without the field: the message with its leading field name (or a section of it, e.g.
    ``training: `` or ``items.0.training: ``) removed, then the allowed range (:func:`with_allowed`). Named by
    its field in the 422 ``detail`` of a recommender check and by its flag in ``memfit recommend``'s errors
    (:func:`service.cli.flag_problem`)."""
    parts = field.split(".")
    for n in range(len(parts), 0, -1):
        message = message.removeprefix(".".join(parts[:n]) + ": ")
    return with_allowed(message, allowed)


def validation_detail(errors: list[dict[str, Any]]) -> str:
    """The 422 ``detail``: one ``field: message (allowed: ...)`` per error, joined by ``; ``. A message of an
    :class:`InvalidConfiguration` raised inside a validator already names its field and the allowed values,
    so it is shown as it is (not ``field: field: ... (allowed: ...) (allowed: ...)``)."""
    parts = []
    for e in errors:
        if e["message"].startswith(f"{e['field']}:"):
            parts.append(e["message"])
        else:
            parts.append(with_allowed(f"{e['field']}: {e['message']}", e.get("allowed")))
    return "; ".join(parts)


def body_problem(cause: BaseException | None) -> tuple[str, str] | None:
    """``(message, allowed)`` for a body the JSON parser could not read (FastAPI answers 400 with the parser's
    exception as the cause): bytes that are not UTF-8, or nesting deeper than Python's parser recurses (its
    recursion limit, about 1000 levels); None for another cause."""
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"invalid {cause.encoding.upper()} at byte {cause.start} ({cause.reason})",
            "a UTF-8 encoded JSON document",
        )
    if isinstance(cause, RecursionError):
        return (
            "JSON nested too deeply to parse",
            "JSON nested at most 16 levels inside a model's config (memfit.api.MAX_CONFIG_DEPTH)",
        )
    return None


def install(app: FastAPI) -> None:
    """Register the handlers of the table above on ``app`` and document them in its OpenAPI schema."""
    _document(app)

    def body_model(request: Request) -> type[BaseModel] | None:
        route = request.scope.get("route")
        field = getattr(getattr(route, "body_field", None), "field_info", None)
        ann = getattr(field, "annotation", None)
        return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError) -> Response:
        errors = _validation_errors(exc, body_model(request))
        return problem(422, validation_detail(errors)[:2000], errors=errors[:50])

    @app.exception_handler(InvalidConfiguration)
    async def invalid(_request: Request, exc: InvalidConfiguration) -> Response:
        # the detail names the field and its allowed range too, for a client that reads only the detail
        return problem(
            422,
            f"{exc.field}: {field_problem(exc.field, exc.message, exc.allowed)}",
            errors=[{"field": exc.field, "message": exc.message, "allowed": exc.allowed}],
        )

    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> Response:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return problem(503, str(exc), headers=headers)

    @app.exception_handler(HTTPException)
    async def http(_request: Request, exc: HTTPException) -> Response:
        unreadable = body_problem(exc.__cause__) if exc.status_code == 400 else None
        if unreadable is not None:  # FastAPI's "There was an error parsing the body" named nothing
            message, allowed = unreadable
            return problem(
                400,
                f"body: {message} (allowed: {allowed})",
                errors=[{"field": "body", "message": message, "allowed": allowed}],
            )
        return problem(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server(_request: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return problem(500, f"internal error ({type(exc).__name__}); the server log has the details")
