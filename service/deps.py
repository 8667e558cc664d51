"""Shared dependencies: the settings, the telemetry store, the model holder and the recommender.

Routes take them with ``Depends``; tests swap them with ``app.dependency_overrides``. They read
``app.state``, which :func:`service.app.create_app` fills once at start-up.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from data.store import TelemetryStore
from memfit.errors import ModelUnavailable, ReadOnly, StoreBusy
from service.models import ModelHolder
from service.recommender import Recommender
from service.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_holder(request: Request) -> ModelHolder:
    return request.app.state.models


def get_recommender(holder: Annotated[ModelHolder, Depends(get_holder)]) -> Recommender:
    """The serving model.

    Raises:
        ModelUnavailable: no version has passed the load checks.
    """
    holder.refresh()
    if holder.recommender is None:
        raise ModelUnavailable(
            f"no model loaded yet: run python -m training.retrain ({holder.last_error or 'registry empty'})"
        )
    return holder.recommender


def get_store(request: Request) -> TelemetryStore | None:
    """The telemetry store, or None on a read-only server."""
    return request.app.state.store


def readable_store(request: Request) -> TelemetryStore:
    """The store for reading telemetry back.

    Raises:
        ReadOnly: the server runs without a telemetry store (the reason says why).
    """
    store = request.app.state.store
    if store is None:
        raise ReadOnly(
            f"this server is read-only ({request.app.state.read_only_reason}); "
            "it serves recommendations but keeps no telemetry"
        )
    return store


def writable_store(request: Request) -> TelemetryStore:
    """The store for a write.

    Raises:
        ReadOnly: the server runs read-only (the reason says why).
    """
    store = request.app.state.store
    if store is None:
        raise ReadOnly(
            f"this server is read-only ({request.app.state.read_only_reason}); "
            "it serves recommendations but stores nothing"
        )
    return store


BEARER = HTTPBearer(
    auto_error=False,
    description="MEMFIT_TOKEN; needed when the server has one (always when it listens beyond loopback)",
)


def require_token(
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)],
) -> None:
    """Writes and telemetry reads need ``Authorization: Bearer <MEMFIT_TOKEN>`` when a token is
    configured (always off loopback). Declared as the OpenAPI ``HTTPBearer`` security scheme.

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer`` for a missing or wrong token.
    """
    if settings.token and (
        credentials is None or not secrets.compare_digest(credentials.credentials.encode(), settings.token.encode())
    ):
        raise HTTPException(
            401, "a valid bearer token is required (Authorization: Bearer ...)", headers={"WWW-Authenticate": "Bearer"}
        )


class WriteQueue:
    """Telemetry writes run on their own bounded executor, never on the pool that serves reads.

    At most ``max_pending`` writes wait; one more gets :class:`StoreBusy` (503 + ``Retry-After``)
    at once. When a write finds the store locked (after its busy timeout), writes fail fast for the
    ``Retry-After`` that followed, including those already queued, so none waits more than about
    one busy timeout.
    """

    def __init__(self, workers: int, max_pending: int) -> None:
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="memfit-write")
        self.max_pending = max_pending
        self.pending = 0
        self._busy_until = 0.0
        self._busy: StoreBusy | None = None

    def _guarded(self, fn, *args):
        if time.monotonic() < self._busy_until and self._busy is not None:
            raise StoreBusy(
                f"the telemetry store is busy ({self._busy}); retry later", retry_after_s=self._busy.retry_after_s
            )
        try:
            return fn(*args)
        except StoreBusy as err:
            self._busy, self._busy_until = err, time.monotonic() + (err.retry_after_s or 1)
            raise

    async def run(self, fn, *args):
        if self.pending >= self.max_pending:
            raise StoreBusy(f"{self.pending} telemetry writes are waiting; retry later", retry_after_s=1)
        self.pending += 1  # the event loop is single-threaded: no lock needed
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, self._guarded, fn, *args)
        finally:
            self.pending -= 1


def get_write_queue(request: Request) -> WriteQueue:
    return request.app.state.writes
