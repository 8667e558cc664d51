"""FastAPI application: wiring only. Routes live in :mod:`service.routers`, dependencies in
:mod:`service.deps`, the mapping of domain exceptions to problem+json in :mod:`service.errors`.

* ``POST /recommend``, ``POST /predict`` — answers from the serving model (never wait on the store).
* ``POST /telemetry`` — idempotent ingestion on its own bounded executor (token; see :class:`Settings`);
  ``GET /telemetry/{record_id}`` — the stored record and quarantined copies under an id (token).
* ``GET /models``, ``POST /models/reload`` (token), ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /metrics``.

Start-up never fails on a damaged model (it is refused; ready says why) or on a read-only data
directory (the server runs read-only: it recommends, writes answer 503).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from prometheus_fastapi_instrumentator import Instrumentator

from data.store import TelemetryStore
from model.plausibility import telemetry_store
from model.registry import Registry
from model.terms import TermsCache
from service import errors
from service.deps import WriteQueue
from service.limits import BodyLimitMiddleware
from service.models import ModelHolder, overhead_from
from service.routers import admin, recommend, telemetry
from service.settings import Settings
from service.tracing import BackgroundTracer

log = logging.getLogger("memfit.service")


def open_store(settings: Settings) -> tuple[TelemetryStore | None, str | None]:
    """The telemetry store, or ``(None, reason)`` when the server must run read-only."""
    if settings.read_only:
        return None, "MEMFIT_READ_ONLY is set"
    url = settings.db_url
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        path = Path(url.removeprefix("sqlite:///"))
        where = path if path.exists() else path.parent
        while not where.exists():
            where = where.parent
        if not os.access(where, os.W_OK) or (path.exists() and not os.access(path.parent, os.W_OK)):
            return None, "the data directory is not writable"
    try:
        return telemetry_store(url, busy_timeout_s=settings.sqlite_busy_timeout_s), None
    except Exception as err:  # noqa: BLE001 - any failure to open for writing means read-only, not a crash
        log.error("telemetry store unavailable, serving read-only: %s: %s", type(err).__name__, err)
        return None, f"the telemetry store cannot be opened ({type(err).__name__})"


#: where the serving process's fit decision takes allocation streams from unless ``MEMFIT_ALLOCATOR_STREAMS`` says
#: otherwise (:func:`tracer.stream_source.configured_source`): recorded ones, the missing asked of its tracing process
STREAMS_DEFAULT = "cache"


def create_app(settings: Settings | None = None) -> FastAPI:
    """The application for ``settings`` (default: read from the environment once, here)."""
    settings = settings or Settings()
    store, reason = open_store(settings)
    terms = TermsCache(store.url if store is not None else None)  # read-only: traced terms kept in memory
    tracer = BackgroundTracer(
        terms, max_pending=settings.max_pending_traces, max_per_client=settings.max_pending_traces_per_client
    )
    from tracer.stream_source import configured_source  # no PyTorch here: streams recorded elsewhere

    holder = ModelHolder(
        Registry(settings.registry_dir),
        overhead_from(store),
        terms=terms,
        tracer=tracer,
        streams=configured_source(STREAMS_DEFAULT, request=tracer.streams),
    )
    holder.refresh()
    warmed_up = threading.Event()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = threading.Event()
        warming = None
        if settings.warm_up:
            warming = threading.Thread(
                target=_warm_up,
                args=(warmed_up, stop, tracer if settings.start_tracer else None),
                name="memfit-warm-up",
                daemon=True,
            )
            warming.start()
        else:  # no start-up work to wait for
            warmed_up.set()
        yield
        # the warm-up builds models on the meta device, and transformers sets process-wide state while it builds
        # one (the default dtype): it must not outlive the application into whatever the process runs next
        stop.set()
        if warming is not None:
            warming.join()
        app.state.writes.executor.shutdown(wait=True)
        # the same application served again (uvicorn's reload, a test's second client) writes on a fresh executor:
        # its threads start on the first write
        app.state.writes = WriteQueue(settings.write_workers, settings.max_pending_writes)
        tracer.shutdown()

    app = FastAPI(
        title="memfit",
        version="0.1.0",
        lifespan=lifespan,
        description="Fit LLM training into GPU memory with the least activation recomputation.",
    )
    app.state.settings, app.state.store, app.state.models = settings, store, holder
    app.state.read_only_reason, app.state.warmed_up = reason, warmed_up
    app.state.writes = WriteQueue(settings.write_workers, settings.max_pending_writes)
    Instrumentator(excluded_handlers=["/metrics"]).instrument(app).expose(app, include_in_schema=False)
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )
    errors.install(app)
    for r in (recommend.router, telemetry.router, admin.router):
        app.include_router(r)
    return app


def serve(settings: Settings, app: FastAPI | None = None) -> None:
    """Run ``app`` (default: :func:`create_app` of ``settings``) with uvicorn on ``settings.host``:``settings.port``,
    logging at ``settings.log_level`` to stderr: uvicorn's loggers and memfit's (``memfit.*``)."""
    import uvicorn

    memfit_log = logging.getLogger("memfit")
    memfit_log.setLevel(settings.log_level.upper())
    if not memfit_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        memfit_log.addHandler(handler)
    uvicorn.run(app or create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)


def _warm_up(done: threading.Event, stop: threading.Event, tracer: BackgroundTracer | None) -> None:
    """Resolve the catalog's architectures, then start ``tracer``'s process (it imports PyTorch: the first
    never-seen configuration then waits only for its trace); None: it starts with the first trace."""
    from service.recommender import warm_up

    try:
        log.info("warm-up: %d catalog architectures resolved", warm_up(stop))
    except Exception:
        log.exception("warm-up failed")
    finally:
        done.set()
    if tracer is not None and not stop.is_set():
        tracer.start()
