"""Telemetry: ``POST /telemetry`` (validated, idempotent ingestion on the write executor) and
``GET /telemetry/{record_id}`` (what the store keeps under an id). Both need the token when one is set.

The ingestion answer is linked (OpenAPI ``links``) to the read-back of each record it stored or
quarantined, so clients and stateful API tests can follow a posted record to what was kept.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, Field, WithJsonSchema
from starlette.exceptions import HTTPException

from data.store import TelemetryStore
from memfit.schema import TelemetryRecord
from service.deps import WriteQueue, get_settings, get_write_queue, readable_store, require_token, writable_store
from service.errors import problem_responses
from service.settings import Settings

router = APIRouter(tags=["telemetry"], dependencies=[Depends(require_token)])

#: one posted record: documented as a :class:`TelemetryRecord` (or a flat row), taken as it comes here and validated
#: by the store on the write executor, so a large batch never holds the event loop and an item that is not even an
#: object is rejected on its own, with its index, like any other invalid record
TelemetryIn = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"$ref": "#/components/schemas/TelemetryRecord"},  # in the schema through KeptTelemetry
                {"type": "object", "description": "a flat row: the columns of TelemetryRecord.to_row"},
            ]
        }
    ),
]

#: the record id as the schema defines it (length and characters), for the path parameter
RecordId = Annotated[str, *TelemetryRecord.model_fields["record_id"].metadata]


class IngestResponse(BaseModel):
    stored: list[str]
    duplicates: list[str]
    rejected: list[dict[str, Any]] = Field(description="{index, record_id, reason} per invalid record")
    quarantined: list[dict[str, Any]] = Field(
        [], description="{index, record_id, reason} per implausible or conflicting record: kept, never trained on"
    )


class QuarantinedCopy(BaseModel):
    received_at: datetime
    reason: str = Field(description="why it is kept apart (implausible values, or a conflict with the stored record)")
    record: dict[str, Any] = Field(description="the record as received")


class KeptTelemetry(BaseModel):
    record_id: str
    record: TelemetryRecord | None = Field(
        description="the stored record (the retraining job reads it); null when only quarantined copies exist"
    )
    quarantined: list[QuarantinedCopy] = Field(description="quarantined copies under this id, oldest first")


READ_OPERATION = "read_telemetry_record"


def _link(pointer: str, what: str) -> dict[str, Any]:
    return {
        "operationId": READ_OPERATION,
        "parameters": {"record_id": f"$response.body#{pointer}"},
        "description": f"read back the first {what} record",
    }


@router.post(
    "/telemetry",
    response_model=IngestResponse,
    responses={
        200: {
            "links": {
                "ReadStored": _link("/stored/0", "stored"),
                "ReadDuplicate": _link("/duplicates/0", "duplicate"),
                "ReadQuarantined": _link("/quarantined/0/record_id", "quarantined"),
            }
        },
        **problem_responses(503),
    },
)
async def ingest(
    records: list[TelemetryIn],
    settings: Annotated[Settings, Depends(get_settings)],
    store: Annotated[TelemetryStore, Depends(writable_store)],
    writes: Annotated[WriteQueue, Depends(get_write_queue)],
) -> IngestResponse:
    """Store records (nested :class:`TelemetryRecord` objects or flat rows); every input index comes
    back in exactly one list. An invalid record is rejected with its reason, not the whole request."""
    if len(records) > settings.max_records_per_request:
        raise HTTPException(413, f"at most {settings.max_records_per_request} records per request, got {len(records)}")
    rep = await writes.run(store.add, records)
    return IngestResponse(
        stored=rep.stored, duplicates=rep.duplicates, rejected=rep.rejected, quarantined=rep.quarantined
    )


@router.get(
    "/telemetry/{record_id}",
    response_model=KeptTelemetry,
    operation_id=READ_OPERATION,
    responses=problem_responses(404, 503, s404="nothing is kept under this id (never received, or rejected)"),
)
def read(
    record_id: Annotated[RecordId, Path()], store: Annotated[TelemetryStore, Depends(readable_store)]
) -> KeptTelemetry:
    """The stored record under ``record_id`` and any quarantined copies; 404 when there is neither."""
    stored, held = store.lookup(record_id)
    if stored is None and not held:
        raise HTTPException(404, f"no telemetry record {record_id!r} is stored or quarantined")
    return KeptTelemetry(record_id=record_id, record=stored, quarantined=[QuarantinedCopy(**h) for h in held])
