"""Service settings, from the environment (``MEMFIT_`` prefix) via pydantic-settings."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Runtime configuration.

    Attributes:
        db_url: SQLAlchemy URL of the telemetry store (default: SQLite file under data/).
        registry_dir: model registry folder (default: data/models).
        token: bearer token required by write endpoints when set.
        host / port: bind address for ``python -m service``.
        max_body_bytes: requests with a larger body get 413.
        max_records_per_request: telemetry records accepted in one POST.
    """

    model_config = SettingsConfigDict(env_prefix="MEMFIT_")

    db_url: str | None = None
    registry_dir: str | None = None
    token: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_body_bytes: int = Field(4 << 20, ge=1024)
    max_records_per_request: int = Field(10_000, ge=1)
