"""Model lifecycle and health: ``GET /models``, ``POST /models/reload`` (token), ``/v2/health/*``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from data.store import TelemetryStore
from service.deps import get_holder, get_store, require_token
from service.errors import problem, problem_responses
from service.models import ModelHolder

router = APIRouter(tags=["admin"])


@router.get("/models")
def models(holder: Annotated[ModelHolder, Depends(get_holder)]) -> dict[str, Any]:
    """Registered versions with their metrics, the current one, the serving one and any refusal."""
    holder.refresh()
    reg = holder.registry
    versions = []
    for v in reg.versions():
        try:
            meta = reg.meta(v)
            versions.append({"version": v, "created_at": meta.get("created_at"), "metrics": meta.get("metrics")})
        except (OSError, ValueError) as err:
            versions.append({"version": v, "error": f"unreadable meta.json: {type(err).__name__}"})
    return {
        "current": reg.current(),
        "serving": holder.recommender.version if holder.recommender else None,
        "last_error": holder.last_error,
        "versions": versions,
    }


@router.post("/models/reload", dependencies=[Depends(require_token)])
def reload(holder: Annotated[ModelHolder, Depends(get_holder)]) -> dict[str, Any]:
    """Load the registry's current version now (it is refused, and the serving one kept, if it fails a check).

    Returns ``serving`` (the version now served), ``previous`` (the one served before), ``reloaded`` (the current
    version was loaded and passed its checks, the same version included: its files are read again), ``swapped``
    (the served version changed) and ``last_error`` (why a version was refused, else None)."""
    previous = holder.recommender.version if holder.recommender else None
    reloaded = holder.refresh(force=True)
    serving = holder.recommender.version if holder.recommender else None
    return {
        "serving": serving,
        "previous": previous,
        "reloaded": reloaded,
        "swapped": serving != previous,
        "last_error": holder.last_error,
    }


@router.get("/v2/health/live")
def live() -> dict[str, str]:
    return {"status": "live"}


@router.get("/v2/health/ready", responses=problem_responses(503))
def ready(
    request: Request,
    holder: Annotated[ModelHolder, Depends(get_holder)],
    store: Annotated[TelemetryStore | None, Depends(get_store)],
):
    """200 while a model serves (read-only servers included); details name a refused model version."""
    holder.refresh()
    details: dict[str, Any] = {"model": holder.status(), "warmed_up": request.app.state.warmed_up.is_set()}
    if holder.recommender is None:
        return problem(503, f"no model loaded ({holder.last_error or 'registry empty'})", details=details)
    if store is None:
        details["telemetry"] = f"read-only: {request.app.state.read_only_reason}"
        n = None
    else:
        try:
            n = store.count()
        except Exception as err:  # noqa: BLE001 - the store is down: not ready
            return problem(503, f"telemetry store: {type(err).__name__}", details=details)
    return {
        "status": "ready",
        "model_version": holder.recommender.version,
        "telemetry_records": n,
        "read_only": store is None,
        "details": details,
    }
