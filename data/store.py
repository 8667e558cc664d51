"""Telemetry store: SQLAlchemy over SQLite (WAL) by default; any SQLAlchemy URL works.

Table ``telemetry`` holds one row per :class:`memfit.schema.TelemetryRecord`; its columns are
generated from the schema (:data:`memfit.schema.ROW_FIELDS`), so there is one definition. The
retraining job reads only this table.

Ingestion is idempotent on ``record_id`` and never overwrites: a record whose id is already stored
with the same content is reported as a duplicate. Records that are valid but implausible
(:func:`implausibility`: a CUDA peak above the device's memory without an OOM, non-finite numbers)
and records whose id is stored with different content go to table ``telemetry_quarantine`` with
the reason and the full record as JSON: kept, never trained on. Invalid rows are rejected with
pydantic's reason. Nothing is dropped silently: :class:`IngestReport` lists every input by index.

A locked SQLite database waits at most ``busy_timeout_s`` (default 2 s), then
:class:`memfit.errors.StoreBusy` is raised, so a write storm cannot hold requests for 30 s.
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError

from memfit.errors import StoreBusy
from memfit.schema import ROW_FIELDS, Method, TelemetryRecord

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


def _quarantine_table(metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        "telemetry_quarantine",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("record_id", sa.String(64), nullable=False, index=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("record_json", sa.Text, nullable=False),
    )


def parameter_bounds(rec: TelemetryRecord) -> tuple[int, int]:
    """Loose bounds on ``total_params`` from the shapes: ``(lower, upper)``.

    A decoder layer holds at least the attention projections (q and o: ``h × heads × d`` each; k and
    v: ``h × kv × d`` each) and a two-matrix MLP (``2 h f`` per expert), the model at least one
    ``V × h`` embedding; at most a gated three-matrix MLP, norms and biases (``8 h``), untied input
    and output embeddings, 4096 learned positions, and LoRA adapters of the given rank on seven
    projections. The shipped catalog's counts fall within 0.94-1.01 of these; plausibility allows 2x.
    """
    m, t = rec.model, rec.training
    d = m.head_dim or m.hidden_size // m.num_attention_heads
    h, f, experts = m.hidden_size, m.intermediate_size, m.num_experts or 1
    attn = 2 * h * m.num_attention_heads * d + 2 * h * m.num_key_value_heads * d
    lower = m.num_layers * (attn + 2 * h * f * experts) + m.vocab_size * h
    upper = m.num_layers * (attn + 3 * h * f * experts + 8 * h) + 2 * m.vocab_size * h + 4096 * h
    upper += m.num_layers * (t.lora_rank or 0) * 7 * 2 * (h + f)
    return lower, upper


def implausibility(rec: TelemetryRecord) -> str | None:
    """Why a schema-valid record cannot be a real measurement, or None when it is plausible.

    * a ``cuda`` peak (allocated or reserved) above the device's memory without ``oom`` (the CUDA
      allocator cannot hand out more than the device holds; the fake tracker can, so it is exempt), and a
      ``cpu_tracker`` peak above ``device_memory_bytes`` (a real CPU run's device is the host: the reporter
      records its physical memory);
    * a ``cuda`` reserved peak below the allocated peak (the caching allocator reserves what it allocates);
    * a non-finite number anywhere (``step_time_s`` of Infinity, NaN);
    * a parameter count more than 2x outside :func:`parameter_bounds` of the shapes;
    The physics rules (a peak below the resident weights or the init/forward snapshots, ``recomputed_layers``
    above L, a step time of 0) need the predictor's model-state count, a layer above this one: the store applies
    them through its ``physics`` argument (:func:`model.plausibility.telemetry_store` passes
    :func:`model.plausibility.physics_violation`).
    """
    m, dev = rec.measurement, rec.cluster.device_memory_bytes
    lower, upper = parameter_bounds(rec)
    if not lower / 2 <= rec.model.total_params <= 2 * upper:
        return (
            f"total_params={rec.model.total_params} disagrees with the shapes (between {lower} and {upper} "
            "expected, 2x allowed)"
        )
    for part in (rec.model, rec.training, rec.cluster, m):
        for name, value in part:
            if isinstance(value, float) and not math.isfinite(value):
                return f"{name}={value} is not a finite number"
    if m.method is Method.CPU_TRACKER and not m.oom and m.peak_allocated_bytes > dev:
        return (
            f"peak_allocated_bytes={m.peak_allocated_bytes} exceeds device_memory_bytes={dev} without oom: real "
            "CPU tensors cannot hold more than the host's memory"
        )
    if m.method is Method.CUDA and not m.oom:
        for name in ("peak_allocated_bytes", "peak_reserved_bytes"):
            value = getattr(m, name)
            if value is not None and value > dev:
                return (
                    f"{name}={value} exceeds device_memory_bytes={dev} without oom: "
                    "a CUDA peak cannot exceed the device"
                )
        if m.peak_reserved_bytes is not None and m.peak_reserved_bytes < m.peak_allocated_bytes:
            return (
                f"peak_reserved_bytes={m.peak_reserved_bytes} is below peak_allocated_bytes="
                f"{m.peak_allocated_bytes}: the caching allocator reserves at least what it allocates"
            )
    return None


@dataclass
class IngestReport:
    """Outcome of :meth:`TelemetryStore.add`: every input index lands in exactly one list."""

    stored: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {"index", "record_id", "reason"}
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # {"index", "record_id", "reason"}

    @property
    def total(self) -> int:
        return len(self.stored) + len(self.duplicates) + len(self.rejected) + len(self.quarantined)


def sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite:///`` URL names, or None (another database, or SQLite in memory)."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        return Path(url.removeprefix("sqlite:///"))
    return None


class TelemetryStore:
    """Append-only telemetry table.

    Args:
        url: SQLAlchemy URL; default ``sqlite:///data/telemetry.db``. SQLite gets WAL journaling.
        busy_timeout_s: how long a write waits for a locked SQLite database before
            :class:`memfit.errors.StoreBusy`.
        physics: further rules a record must obey before it is stored, after :func:`implausibility`: the
            reason it breaks one, or None (quarantined like an implausible record). Every writer opens the store
            through :func:`model.plausibility.telemetry_store`, which passes the physics rules; None here
            (readers) checks only the rules of :func:`implausibility`.

    Raises:
        OSError / sqlalchemy.exc.OperationalError: the database cannot be created or opened for writing.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        busy_timeout_s: float = 2.0,
        physics: Callable[[TelemetryRecord], str | None] | None = None,
    ) -> None:
        self.url = url or DEFAULT_URL
        self.physics = physics
        self.busy_timeout_s = busy_timeout_s
        path = sqlite_file(self.url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = sa.create_engine(self.url)
        if self.engine.dialect.name == "sqlite":
            ms = int(busy_timeout_s * 1000)
            sa.event.listen(self.engine, "connect", lambda conn, _rec: _sqlite_pragmas(conn, ms))
        self.metadata = sa.MetaData()
        self.table = _table(self.metadata)
        self.quarantine = _quarantine_table(self.metadata)
        for attempt in range(3):  # replicas starting together race to create the tables: the loser retries
            try:
                with _busy(busy_timeout_s):
                    self.metadata.create_all(self.engine)
                break
            except (sa.exc.IntegrityError, sa.exc.ProgrammingError):
                if attempt == 2:
                    raise
        self._add_new_columns()

    def _add_new_columns(self) -> None:
        """Add the nullable columns of fields added to the schema since an existing database was created
        (``ALTER TABLE ... ADD COLUMN``): its rows read them as missing, so their defaults apply."""
        for table in (self.table, self.quarantine):
            have = {c["name"] for c in sa.inspect(self.engine).get_columns(table.name)}
            for col in table.columns:
                if col.name in have:
                    continue
                if not col.nullable:
                    raise RuntimeError(
                        f"table {table.name!r} lacks the required column {col.name!r}; migrate it by hand"
                    )
                kind = col.type.compile(dialect=self.engine.dialect)
                with _busy(self.busy_timeout_s), self.engine.begin() as conn:
                    conn.execute(sa.text(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {kind}'))

    def add(self, records: Iterable[TelemetryRecord | dict[str, Any]]) -> IngestReport:
        """Validate and insert records (objects, nested dicts or flat rows) in one transaction.

        Concurrent writers (several service processes on one PostgreSQL database) may insert the same
        new ``record_id`` at once; the loser's transaction is rolled back and run again, and then sees
        the winner's row (a duplicate, or a conflict for the quarantine). Nothing is lost or doubled.

        Raises:
            memfit.errors.StoreBusy: the database stayed locked for ``busy_timeout_s``; nothing was written.
        """
        records = list(records)
        for attempt in range(5):
            try:
                return self._add(records)
            except sa.exc.IntegrityError:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _add(self, records: list[TelemetryRecord | dict[str, Any]]) -> IngestReport:
        report = IngestReport()
        rows: list[dict[str, Any]] = []
        held: list[tuple[int, TelemetryRecord, str]] = []  # (index, record, reason) for the quarantine
        batch: dict[str, tuple[str, TelemetryRecord]] = {}
        for index, item in enumerate(records):
            try:
                rec = item if isinstance(item, TelemetryRecord) else _parse(item)
            except (ValidationError, ValueError, TypeError) as err:
                rid = item.get("record_id") if isinstance(item, dict) else None
                report.rejected.append({"index": index, "record_id": rid, "reason": _reason(err)})
                continue
            why = implausibility(rec) or (self.physics(rec) if self.physics is not None else None)
            if why is not None:
                held.append((index, rec, why))
                continue
            h = rec.content_hash()
            if rec.record_id in batch:
                if batch[rec.record_id][0] == h:
                    report.duplicates.append(rec.record_id)
                else:
                    held.append((index, rec, CONFLICT))
                continue
            batch[rec.record_id] = (h, rec)
            rows.append({**rec.to_row(), "created_at": _utc(rec.created_at), "content_hash": h, "_index": index})
        with _busy(self.busy_timeout_s), self.engine.begin() as conn:
            existing: dict[str, str] = {}
            ids = [r["record_id"] for r in rows]
            for chunk in range(0, len(ids), 500):
                q = sa.select(self.table.c.record_id, self.table.c.content_hash).where(
                    self.table.c.record_id.in_(ids[chunk : chunk + 500])
                )
                existing.update(dict(conn.execute(q).all()))
            fresh = []
            for r in rows:
                index = r.pop("_index")
                rid = r["record_id"]
                if rid not in existing:
                    fresh.append(r)
                    report.stored.append(rid)
                elif existing[rid] == r["content_hash"]:
                    report.duplicates.append(rid)
                else:
                    held.append((index, batch[rid][1], CONFLICT))
            if fresh:
                conn.execute(self.table.insert(), fresh)
            if held:
                now = datetime.now(UTC)
                conn.execute(
                    self.quarantine.insert(),
                    [
                        {
                            "record_id": rec.record_id,
                            "received_at": now,
                            "reason": why,
                            "record_json": rec.model_dump_json(),
                        }
                        for _i, rec, why in held
                    ],
                )
        report.quarantined = [
            {"index": i, "record_id": rec.record_id, "reason": why} for i, rec, why in sorted(held, key=lambda h: h[0])
        ]
        return report

    def quarantined(self) -> list[dict[str, Any]]:
        """Quarantined records: ``{record_id, received_at, reason, record}`` (record as a dict)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(self.quarantine).order_by(self.quarantine.c.id)).mappings().all()
        return [
            {
                "record_id": r["record_id"],
                "received_at": r["received_at"],
                "reason": r["reason"],
                "record": json.loads(r["record_json"]),
            }
            for r in rows
        ]

    def lookup(self, record_id: str) -> tuple[TelemetryRecord | None, list[dict[str, Any]]]:
        """What the store keeps under ``record_id``: the stored record (None when none is) and every
        quarantined copy, oldest first (``{record_id, received_at, reason, record}``, as :meth:`quarantined`).

        A record id that was never received, or only rejected, gives ``(None, [])``.
        """
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(self.table).where(self.table.c.record_id == record_id)).mappings().first()
            held = (
                conn.execute(
                    sa.select(self.quarantine)
                    .where(self.quarantine.c.record_id == record_id)
                    .order_by(self.quarantine.c.id)
                )
                .mappings()
                .all()
            )
        stored = TelemetryRecord.from_row({**row, "created_at": _utc(row["created_at"])}) if row is not None else None
        return stored, [
            {
                "record_id": r["record_id"],
                "received_at": _utc(r["received_at"]),
                "reason": r["reason"],
                "record": json.loads(r["record_json"]),
            }
            for r in held
        ]

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
        """Write all rows to ``.parquet`` or ``.csv``, or ``.jsonl`` (one :class:`TelemetryRecord` JSON per
        line, the format of ``data/telemetry/incoming/``); returns the row count."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".jsonl":
            records = self.records()
            path.write_text("".join(r.model_dump_json() + "\n" for r in records))
            return len(records)
        df = self.dataframe().drop(columns=["content_hash"])
        if path.suffix == ".parquet":
            df.to_parquet(path, index=False)
        elif path.suffix == ".csv":
            df.to_csv(path, index=False)
        else:
            raise ValueError(f"path must end in .parquet, .csv or .jsonl, got {path.name!r}")
        return len(df)

    def import_file(self, path: str | Path) -> IngestReport:
        """Ingest a ``.parquet``, ``.csv`` or ``.jsonl`` file written by :meth:`export` (or by hand, same
        columns / fields)."""
        return self.add(read_rows(path))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a telemetry ``.parquet``/``.csv`` file (flat dicts, NaN -> None) or ``.jsonl`` file (one
    nested :class:`TelemetryRecord` JSON per line, blank lines skipped).

    Raises:
        ValueError: another suffix, or a ``.jsonl`` line that is not JSON (names the line).
    """
    import pandas as pd

    path = Path(path)
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path.name} line {number}: not JSON ({err.msg})") from None
        return rows
    if path.suffix == ".parquet":
        df = pd.read_parquet(path)
    elif path.suffix == ".csv":
        df = pd.read_csv(path)
    else:
        raise ValueError(f"path must end in .parquet, .csv or .jsonl, got {path.name!r}")
    df = df.astype(object).where(df.notna(), None)
    return df.to_dict("records")


#: the telemetry shipped with memfit: every merged collection (``python -m training.merge_telemetry``)
SHIPPED_TELEMETRY = Path(__file__).resolve().parent / "telemetry" / "telemetry.parquet"


def read_records(path: str | Path = SHIPPED_TELEMETRY, keep: Callable[[TelemetryRecord], bool] | None = None):
    """The :class:`TelemetryRecord` of every row of a telemetry file (:func:`read_rows`; default the shipped
    telemetry) for which ``keep`` is true (all when None), in file order.

    Raises:
        ValueError / pydantic.ValidationError: as :func:`read_rows`; a row that is not a valid record (names it).
    """
    out = []
    for row in read_rows(path):
        rec = TelemetryRecord.model_validate(row) if "model" in row else TelemetryRecord.from_row(row)
        if keep is None or keep(rec):
            out.append(rec)
    return out


def _utc(moment: datetime) -> datetime:
    """``moment`` in UTC. Timestamps are written in UTC, because SQLite keeps no offset; a naive value
    (written by SQLite, or sent without an offset) is therefore UTC."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _parse(item: Any) -> TelemetryRecord:
    if not isinstance(item, dict):
        raise TypeError(f"record must be an object, got {type(item).__name__}")
    if "model" in item:  # posted JSON, checked as JSON and strictly: an integer field refuses "4", 4.0 and true
        return TelemetryRecord.model_validate_json(json.dumps(item), strict=True)
    row = dict(item)
    if isinstance(row.get("created_at"), str):
        row["created_at"] = datetime.fromisoformat(row["created_at"])
    return TelemetryRecord.from_row(row)


def _reason(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'record'}: {e['msg']}" for e in err.errors())
    return str(err)


CONFLICT = "record_id exists with different content (records are never overwritten)"


class _busy:
    """Turn SQLite's "database is locked" (after the busy timeout) into :class:`StoreBusy`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, _tb) -> bool:
        if isinstance(err, sa.exc.OperationalError) and "locked" in str(err.orig).lower():
            raise StoreBusy(
                f"the telemetry store stayed locked for {self.timeout_s:g} s; retry later",
                retry_after_s=max(1, round(self.timeout_s)),
            ) from err
        return False


def _sqlite_pragmas(dbapi_conn, busy_timeout_ms: int) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()
