"""FastAPI application: recommendations, predictions, telemetry ingestion, model lifecycle, metrics.

* ``POST /recommend`` — smallest k whose bounded peak fits, its layers, the curve over k, breakdown,
  recompute cost; or ``fits=false`` with the shortfall and alternatives that fit.
* ``POST /predict`` — peak, bound and breakdown for fully specified configurations (a batch).
* ``POST /telemetry`` — validated, idempotent ingestion (bearer token when ``MEMFIT_TOKEN`` is set).
* ``GET /models``, ``POST /models/reload`` (token) — versions, current, metrics; reload now.
* ``GET /v2/health/live``, ``GET /v2/health/ready`` (ready only with a model loaded), ``GET /metrics``.

Errors are ``application/problem+json`` (RFC 9457) naming the field and the allowed range.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import Histogram
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from data.store import TelemetryStore
from memfit.api import PredictRequest, PredictResponse, Recommendation, RecommendRequest
from model.overhead import OverheadModel
from model.registry import Registry
from model.terms import TermsCache
from service.limits import BodyLimitMiddleware, problem
from service.models import ModelHolder
from service.settings import Settings
from service.tracing import BackgroundTracer

log = logging.getLogger("memfit.service")

RECOMMENDED_K = Histogram("memfit_recommended_k", "Recommended number of checkpointed layers",
                          buckets=(0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128))
PREDICTED_PEAK_GIB = Histogram("memfit_predicted_peak_gib", "Predicted peak allocated memory at the recommended k",
                               buckets=(1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 141, 192, 256, 512))


class IngestResponse(BaseModel):
    stored: list[str]
    duplicates: list[str]
    rejected: list[dict[str, Any]] = Field(description="{index, record_id, reason} per rejected record")


def _overhead_from(store: TelemetryStore) -> OverheadModel:
    """Learn the GPU overhead from CUDA telemetry in the store (defaults when there is none)."""
    import sqlalchemy as sa

    t = store.table
    q = sa.select(t.c.method, t.c.device_name, t.c.peak_allocated_bytes, t.c.peak_reserved_bytes,
                  t.c.outside_torch_bytes, t.c.oom).where(t.c.method == "cuda")
    import pandas as pd

    with store.engine.connect() as conn:
        rows = pd.DataFrame(conn.execute(q).mappings().all())
    return OverheadModel().fit(rows) if len(rows) else OverheadModel()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="memfit", version="0.1.0",
                  description="Fit LLM training into GPU memory with the least activation recomputation.")
    store = TelemetryStore(settings.db_url)
    terms = TermsCache(settings.db_url)
    holder = ModelHolder(Registry(settings.registry_dir), _overhead_from(store), terms=terms,
                         tracer=BackgroundTracer(terms))
    holder.refresh()
    app.state.settings, app.state.store, app.state.models = settings, store, holder
    Instrumentator(excluded_handlers=["/metrics"]).instrument(app).expose(app, include_in_schema=False)

    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def validation_problem(_request: Request, exc: RequestValidationError):
        errors = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":  # loc holds the character position, not a field
                errors.append({"field": "body", "message": f"invalid JSON at character {e['loc'][-1]}: "
                                                           f"{e.get('ctx', {}).get('error', e['msg'])}"})
            else:
                errors.append({"field": ".".join(str(x) for x in e["loc"]), "message": e["msg"]})
        return problem(422, "; ".join(f"{e['field']}: {e['message']}" for e in errors)[:2000], errors=errors[:50])

    @app.exception_handler(StarletteHTTPException)
    async def http_problem(_request: Request, exc: StarletteHTTPException):
        return problem(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def server_problem(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return problem(500, type(exc).__name__)

    def require_token(authorization: str | None = Header(None)) -> None:
        if settings.token and authorization != f"Bearer {settings.token}":
            raise StarletteHTTPException(401, "a valid bearer token is required (Authorization: Bearer ...)")

    def recommender():
        holder.refresh()
        if holder.recommender is None:
            raise StarletteHTTPException(503, "no model loaded yet: run python -m training.retrain "
                                              f"({holder.last_error or 'registry empty'})")
        return holder.recommender

    def bad_input(err: Exception) -> StarletteHTTPException:
        if isinstance(err, ValidationError):
            part = {"ModelSpec": "model", "TrainingConfig": "training"}.get(err.title, err.title)
            msg = "; ".join(f"{'.'.join([part, *map(str, e['loc'])])}: {e['msg']}" for e in err.errors())
        else:
            msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        return StarletteHTTPException(422, msg)

    @app.post("/recommend", response_model=Recommendation)
    def recommend(req: RecommendRequest) -> Recommendation:
        rec = recommender()
        try:
            out = rec.recommend(req)
        except (KeyError, ValueError) as err:
            raise bad_input(err) from err
        if out.k is not None:
            RECOMMENDED_K.observe(out.k)
        PREDICTED_PEAK_GIB.observe(out.predicted_peak_bytes / 2**30)
        return out

    @app.post("/predict", response_model=PredictResponse)
    def predict(req: PredictRequest) -> PredictResponse:
        rec = recommender()
        try:
            out = [rec.predict(item, i) for i, item in enumerate(req.items)]
        except (KeyError, ValueError) as err:
            raise bad_input(err) from err
        return PredictResponse(predictions=out, model_version=rec.version)

    @app.post("/telemetry", response_model=IngestResponse, dependencies=[Depends(require_token)])
    def ingest(records: list[dict[str, Any]]) -> IngestResponse:
        if len(records) > settings.max_records_per_request:
            raise StarletteHTTPException(413, f"at most {settings.max_records_per_request} records per request, "
                                              f"got {len(records)}")
        rep = store.add(records)
        return IngestResponse(stored=rep.stored, duplicates=rep.duplicates, rejected=rep.rejected)

    @app.get("/models")
    def models() -> dict[str, Any]:
        holder.refresh()
        reg = holder.registry
        versions = []
        for v in reg.versions():
            try:
                meta = reg.meta(v)
                versions.append({"version": v, "created_at": meta.get("created_at"), "metrics": meta.get("metrics")})
            except (OSError, ValueError) as err:
                versions.append({"version": v, "error": f"unreadable meta.json: {type(err).__name__}"})
        return {"current": reg.current(), "serving": holder.recommender.version if holder.recommender else None,
                "last_error": holder.last_error, "versions": versions}

    @app.post("/models/reload", dependencies=[Depends(require_token)])
    def reload() -> dict[str, Any]:
        swapped = holder.refresh(force=True)
        return {"serving": holder.recommender.version if holder.recommender else None, "swapped": swapped,
                "last_error": holder.last_error}

    @app.get("/v2/health/live")
    def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/v2/health/ready")
    def ready():
        holder.refresh()
        if holder.recommender is None:
            return problem(503, f"no model loaded ({holder.last_error or 'registry empty'})")
        try:
            n = store.count()
        except Exception as err:  # the store is down: not ready
            return problem(503, f"telemetry store: {type(err).__name__}")
        return {"status": "ready", "model_version": holder.recommender.version, "telemetry_records": n}

    return app
