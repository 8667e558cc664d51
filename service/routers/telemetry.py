"""``POST /telemetry``: validated, idempotent ingestion on the write executor (token required)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from data.store import TelemetryStore
from service.deps import WriteQueue, get_settings, get_write_queue, require_token, writable_store
from service.settings import Settings

router = APIRouter(tags=["telemetry"])


class IngestResponse(BaseModel):
    stored: list[str]
    duplicates: list[str]
    rejected: list[dict[str, Any]] = Field(description="{index, record_id, reason} per invalid record")
    quarantined: list[dict[str, Any]] = Field(
        [], description="{index, record_id, reason} per implausible or conflicting record: kept, never trained on")


@router.post("/telemetry", response_model=IngestResponse, dependencies=[Depends(require_token)])
async def ingest(records: list[dict[str, Any]], settings: Annotated[Settings, Depends(get_settings)],
                 store: Annotated[TelemetryStore, Depends(writable_store)],
                 writes: Annotated[WriteQueue, Depends(get_write_queue)]) -> IngestResponse:
    """Store records; every input index comes back in exactly one list."""
    if len(records) > settings.max_records_per_request:
        raise HTTPException(413, f"at most {settings.max_records_per_request} records per request, got {len(records)}")
    rep = await writes.run(store.add, records)
    return IngestResponse(stored=rep.stored, duplicates=rep.duplicates, rejected=rep.rejected,
                          quarantined=rep.quarantined)
