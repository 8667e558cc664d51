"""Service settings: one object, read once (environment ``MEMFIT_*`` first, then flags), passed down.

Every writable path lies under ``data_dir``: the telemetry store (``<data_dir>/telemetry.db`` unless
``db_url`` says otherwise) and the model registry (``<data_dir>/models``). Front ends build one
:class:`Settings` (``Settings(**flags)``: flags given on the command line override the environment,
flags not given leave it alone) and hand it to :func:`service.app.create_app`; nothing rebuilds it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Runtime configuration.

    Attributes:
        data_dir: the one directory the service writes under (default: the checkout's ``data/``).
        db_url: SQLAlchemy URL of the telemetry store (default ``sqlite:///<data_dir>/telemetry.db``).
        registry_dir: model registry folder (default ``<data_dir>/models``).
        token: bearer token for write endpoints. Required when ``host`` is not a loopback address
            (start-up is refused without one); optional on loopback.
        host / port: bind address for ``python -m service`` and ``python -m training.main``.
        read_only: serve recommendations only; writes answer 503. Also entered by itself when the
            telemetry store cannot be opened for writing (read-only data directory).
        sqlite_busy_timeout_s: how long a write waits for a locked SQLite database before 503.
        write_workers / max_pending_writes: the telemetry executor's threads, and how many writes may
            wait for it before new ones get 503 + Retry-After (reads never queue behind writes).
        max_body_bytes: requests with a larger body get 413.
        body_timeout_s: a body not received whole this many seconds after its request started gets 408.
        max_pending_traces / max_pending_traces_per_client: never-seen configurations queued for tracing at once,
            in all and per client address; beyond them the answer stays provisional with "tracing deferred".
        max_records_per_request: telemetry records accepted in one POST.
        warm_up: at start-up, import transformers and resolve the catalog's HF configs in the
            background, so the first HF-config request does not pay for it.
        start_tracer: after the warm-up, start the tracing process (it imports PyTorch, 2-4 s of CPU), so the
            first never-seen configuration waits only for its trace.
        log_level: what the server logs to stderr (uvicorn's and memfit's loggers): ``info`` adds each trace and
            allocation-stream recording of the tracing process, and uvicorn's access lines.
    """

    model_config = SettingsConfigDict(env_prefix="MEMFIT_", validate_default=True)

    data_dir: Path = REPO_DATA_DIR
    db_url: str | None = None
    registry_dir: Path | None = None
    token: str | None = Field(None, min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    read_only: bool = False
    sqlite_busy_timeout_s: float = Field(2.0, gt=0, le=60)
    write_workers: int = Field(2, ge=1, le=64)
    max_pending_writes: int = Field(32, ge=1, le=100_000)
    max_body_bytes: int = Field(4 << 20, ge=1024)
    body_timeout_s: float = Field(30.0, gt=0, le=3600)
    max_pending_traces: int = Field(8, ge=1, le=1024)
    max_pending_traces_per_client: int = Field(2, ge=1, le=1024)
    max_records_per_request: int = Field(10_000, ge=1)
    warm_up: bool = True
    start_tracer: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "warning"

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        if self.db_url is None:
            self.db_url = f"sqlite:///{self.data_dir / 'telemetry.db'}"
        if self.registry_dir is None:
            self.registry_dir = self.data_dir / "models"
        if self.token is None and not is_loopback(self.host) and not self.read_only:
            raise ValueError(
                f"MEMFIT_TOKEN is required when listening on {self.host!r} (not loopback): "
                "telemetry writes and model reloads must not be open to the network"
            )
        return self
