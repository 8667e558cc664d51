"""FastAPI application: telemetry ingestion and health.

Endpoints so far:

* ``POST /telemetry`` — validated, idempotent ingestion of :class:`memfit.schema.TelemetryRecord`
  objects; bearer token when ``MEMFIT_TOKEN`` is set; answers what was stored, what was a duplicate
  and what was rejected with the reason.
* ``GET /v2/health/live`` — the process is up.
* ``GET /v2/health/ready`` — the telemetry store answers.

Errors are ``application/problem+json`` (RFC 9457).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from data.store import TelemetryStore
from service.settings import Settings

PROBLEM = "application/problem+json"


class IngestResponse(BaseModel):
    stored: list[str]
    duplicates: list[str]
    rejected: list[dict[str, Any]] = Field(description="{index, record_id, reason} per rejected record")


def problem(status: int, title: str, detail: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"type": "about:blank", "title": title, "status": status, "detail": detail, **extra},
                        status_code=status, media_type=PROBLEM)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="memfit", version="0.1.0")
    app.state.settings = settings
    app.state.store = TelemetryStore(settings.db_url)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return problem(413, "Payload Too Large", f"body must be at most {settings.max_body_bytes} bytes")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def validation_problem(_request: Request, exc: RequestValidationError):
        errors = [{"field": ".".join(str(x) for x in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return problem(422, "Unprocessable Content", detail, errors=errors)

    def require_token(authorization: str | None = Header(None)) -> None:
        if settings.token and authorization != f"Bearer {settings.token}":
            raise StarletteHTTPException(401, "a valid bearer token is required (Authorization: Bearer ...)")

    @app.exception_handler(StarletteHTTPException)
    async def http_problem(_request: Request, exc: StarletteHTTPException):
        return problem(exc.status_code, HTTPStatus(exc.status_code).phrase, str(exc.detail))

    @app.exception_handler(Exception)
    async def server_problem(_request: Request, exc: Exception):
        return problem(500, "Internal Server Error", type(exc).__name__)

    @app.post("/telemetry", response_model=IngestResponse, dependencies=[Depends(require_token)])
    def ingest(records: list[dict[str, Any]]) -> IngestResponse:
        if len(records) > settings.max_records_per_request:
            return problem(413, "Payload Too Large",
                           f"at most {settings.max_records_per_request} records per request, got {len(records)}")
        rep = app.state.store.add(records)
        return IngestResponse(stored=rep.stored, duplicates=rep.duplicates, rejected=rep.rejected)

    @app.get("/v2/health/live")
    def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/v2/health/ready")
    def ready():
        try:
            n = app.state.store.count()
        except Exception as err:  # the store is down: not ready
            return problem(503, "Service Unavailable", f"telemetry store: {type(err).__name__}")
        return {"status": "ready", "telemetry_records": n}

    return app

