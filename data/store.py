"""Telemetry store: SQLAlchemy over SQLite (WAL) by default; any SQLAlchemy URL works.

One table, ``telemetry``, one row per :class:`memfit.schema.TelemetryRecord`; its columns are
generated from the schema (:data:`memfit.schema.ROW_FIELDS`), so there is one definition.

Ingestion is idempotent on ``record_id`` and never overwrites: a record whose id is already stored
with the same content is reported as a duplicate; with different content it is rejected as a
conflict. Invalid rows are rejected with pydantic's reason. Nothing is dropped silently:
:class:`IngestReport` lists every input by index.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import sqlalchemy as sa
from pydantic import ValidationError

from memfit.schema import ROW_FIELDS, TelemetryRecord

DEFAULT_DB = Path(__file__).parent / "telemetry.db"
DEFAULT_URL = f"sqlite:///{DEFAULT_DB}"


def _column_type(annotation: Any) -> sa.types.TypeEngine:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is list:
        return sa.Text()
    if annotation is bool:
        return sa.Boolean()
    if annotation is int:
        return sa.BigInteger()
    if annotation is float:
        return sa.Float()
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return sa.String(32)
    return sa.String(128)


def _table(metadata: sa.MetaData) -> sa.Table:
    cols = [
        sa.Column("record_id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("num_checkpointed_layers", sa.Integer, nullable=False),
    ]
    for name, (_part, info) in ROW_FIELDS.items():
        cols.append(sa.Column(name, _column_type(info.annotation), nullable=not info.is_required()))
    table = sa.Table("telemetry", metadata, *cols)
    sa.Index("ix_telemetry_family", table.c.model_name, table.c.micro_batch_size, table.c.seq_len)
    return table


@dataclass
class IngestReport:
    """Outcome of :meth:`TelemetryStore.add`: every input index lands in exactly one list."""

    stored: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {"index", "record_id", "reason"}

    @property
    def total(self) -> int:
        return len(self.stored) + len(self.duplicates) + len(self.rejected)


class TelemetryStore:
    """Append-only telemetry table.

    Args:
        url: SQLAlchemy URL; default ``sqlite:///data/telemetry.db``. SQLite gets WAL journaling.
    """

    def __init__(self, url: str | None = None) -> None:
        self.url = url or DEFAULT_URL
        if self.url.startswith("sqlite:///") and self.url != "sqlite:///:memory:":
            Path(self.url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine = sa.create_engine(self.url)
        if self.engine.dialect.name == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self.metadata = sa.MetaData()
        self.table = _table(self.metadata)
        self.metadata.create_all(self.engine)

    def add(self, records: Iterable[TelemetryRecord | dict[str, Any]]) -> IngestReport:
        """Validate and insert records (objects, nested dicts or flat rows) in one transaction."""
        report = IngestReport()
        rows: list[dict[str, Any]] = []
        batch_ids: dict[str, str] = {}
        for index, item in enumerate(records):
            try:
                rec = item if isinstance(item, TelemetryRecord) else _parse(item)
            except (ValidationError, ValueError, TypeError) as err:
                rid = item.get("record_id") if isinstance(item, dict) else None
                report.rejected.append({"index": index, "record_id": rid, "reason": _reason(err)})
                continue
            h = rec.content_hash()
            if rec.record_id in batch_ids:
                _classify(report, index, rec.record_id, batch_ids[rec.record_id] == h)
                continue
            batch_ids[rec.record_id] = h
            rows.append({**rec.to_row(), "content_hash": h, "_index": index})
        with self.engine.begin() as conn:
            existing: dict[str, str] = {}
            ids = [r["record_id"] for r in rows]
            for chunk in range(0, len(ids), 500):
                q = sa.select(self.table.c.record_id, self.table.c.content_hash).where(
                    self.table.c.record_id.in_(ids[chunk:chunk + 500]))
                existing.update(dict(conn.execute(q).all()))
            fresh = []
            for r in rows:
                index = r.pop("_index")
                if r["record_id"] in existing:
                    _classify(report, index, r["record_id"], existing[r["record_id"]] == r["content_hash"])
                else:
                    fresh.append(r)
                    report.stored.append(r["record_id"])
            if fresh:
                conn.execute(self.table.insert(), fresh)
        return report

    def count(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(self.table)).scalar_one()

    def record_ids(self) -> set[str]:
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(self.table.c.record_id)).scalars())

    def dataframe(self):
        """All rows as a pandas DataFrame (flat columns, see :meth:`TelemetryRecord.to_row`)."""
        import pandas as pd

        with self.engine.connect() as conn:
            return pd.read_sql(sa.select(self.table).order_by(self.table.c.created_at), conn)

    def records(self) -> list[TelemetryRecord]:
        return [TelemetryRecord.from_row(r) for r in self.dataframe().to_dict("records")]

    # -- files --------------------------------------------------------------------------------
    def export(self, path: str | Path) -> int:
        """Write all rows to ``.parquet`` or ``.csv``; returns the row count."""
        path = Path(path)
        df = self.dataframe().drop(columns=["content_hash"])
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".parquet":
            df.to_parquet(path, index=False)
        elif path.suffix == ".csv":
            df.to_csv(path, index=False)
        else:
            raise ValueError(f"path must end in .parquet or .csv, got {path.name!r}")
        return len(df)

    def import_file(self, path: str | Path) -> IngestReport:
        """Ingest a ``.parquet`` or ``.csv`` file written by :meth:`export` (or by hand, same columns)."""
        return self.add(read_rows(path))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a telemetry ``.parquet``/``.csv`` file as dicts (NaN -> None)."""
    import pandas as pd

    path = Path(path)
    if path.suffix == ".parquet":
        df = pd.read_parquet(path)
    elif path.suffix == ".csv":
        df = pd.read_csv(path)
    else:
        raise ValueError(f"path must end in .parquet or .csv, got {path.name!r}")
    df = df.astype(object).where(df.notna(), None)
    return df.to_dict("records")


def _parse(item: Any) -> TelemetryRecord:
    if not isinstance(item, dict):
        raise TypeError(f"record must be an object, got {type(item).__name__}")
    if "model" in item:
        return TelemetryRecord.model_validate(item)
    row = dict(item)
    if isinstance(row.get("created_at"), str):
        row["created_at"] = datetime.fromisoformat(row["created_at"])
    return TelemetryRecord.from_row(row)


def _reason(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'record'}: {e['msg']}" for e in err.errors())
    return str(err)


def _classify(report: IngestReport, index: int, rid: str, same: bool) -> None:
    if same:
        report.duplicates.append(rid)
    else:
        report.rejected.append({"index": index, "record_id": rid,
                                "reason": "record_id exists with different content (records are never overwritten)"})


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()
