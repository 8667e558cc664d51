import math
import sqlite3
import time
from pathlib import Path

import pandas as pd
import pytest

from data.store import CONFLICT, TelemetryStore
from memfit.errors import StoreBusy
from tests.helpers import record


@pytest.fixture
def store(tmp_path):
    return TelemetryStore(f"sqlite:///{tmp_path / 't.db'}")


def test_sqlite_uses_wal(store):
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_idempotent_never_overwrites_and_reports_everything(store):
    a, b = record(record_id="rec-aaaaaaaa"), record(record_id="rec-bbbbbbbb", seq_len=256)
    rep = store.add([a, b])
    assert rep.stored == ["rec-aaaaaaaa", "rec-bbbbbbbb"] and not rep.rejected
    conflict = record(record_id="rec-aaaaaaaa", peak_allocated_bytes=a.measurement.peak_allocated_bytes + 512)
    bad = a.model_dump(mode="json") | {"record_id": "rec-cccccccc"}
    bad["training"] = {**bad["training"], "checkpoint_layers": [0, 9]}
    rep = store.add([a, conflict, bad, "not a record", record(record_id="rec-dddddddd")])
    assert rep.duplicates == ["rec-aaaaaaaa"]
    assert rep.stored == ["rec-dddddddd"]
    reasons = {r["index"]: r["reason"] for r in rep.rejected}
    assert set(reasons) == {2, 3} and rep.total == 5
    assert rep.quarantined == [{"index": 1, "record_id": "rec-aaaaaaaa", "reason": CONFLICT}]
    assert "never overwritten" in CONFLICT
    assert store.quarantined()[0]["record"]["measurement"]["peak_allocated_bytes"] == (
        a.measurement.peak_allocated_bytes + 512
    )  # kept, not dropped
    assert "checkpoint_layers" in reasons[2] and "[0, 3]" in reasons[2]
    assert store.count() == 3
    stored_a = next(r for r in store.records() if r.record_id == "rec-aaaaaaaa")
    assert stored_a.measurement.peak_allocated_bytes == a.measurement.peak_allocated_bytes


def test_duplicate_within_one_batch(store):
    a = record(record_id="rec-aaaaaaaa")
    rep = store.add([a, a])
    assert rep.stored == ["rec-aaaaaaaa"] and rep.duplicates == ["rec-aaaaaaaa"]


def test_a_measurement_sent_twice_without_an_id_is_stored_once(store):
    """A helper's raw POST /telemetry of one body (no record_id) twice stored two rows under random ids: the id of a
    record without one is its content's, so a retry is a duplicate, and another measurement is another record."""
    body = record().model_dump(mode="json", exclude={"record_id", "created_at"})
    first, retry = store.add([body]), store.add([body])
    rid = first.stored[0]
    assert retry.duplicates == [rid] and not retry.stored and store.count() == 1
    assert rid == record().content_hash()[:32]
    other = {**body, "measurement": {**body["measurement"], "peak_allocated_bytes": 123_457_024}}
    assert store.add([other]).stored != [rid] and store.count() == 2


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_export_import_roundtrip(store, tmp_path, suffix):
    recs = [
        record(record_id=f"rec-{i:08d}", seq_len=128 * (i + 1), checkpoint_layers=list(range(i % 4))) for i in range(6)
    ]
    store.add(recs)
    path = tmp_path / f"out{suffix}"
    assert store.export(path) == 6
    other = TelemetryStore(f"sqlite:///{tmp_path / 'o.db'}")
    rep = other.import_file(path)
    assert len(rep.stored) == 6 and not rep.rejected
    assert sorted(r.record_id for r in other.records()) == sorted(r.record_id for r in recs)
    back = {r.record_id: r for r in other.records()}
    for r in recs:
        assert back[r.record_id].content_hash() == r.content_hash()
    assert len(other.import_file(path).duplicates) == 6


def test_import_reports_bad_rows(store, tmp_path):
    df = pd.DataFrame([record(record_id="rec-00000001").to_row(), record(record_id="rec-00000002").to_row()])
    df.loc[1, "micro_batch_size"] = 0
    df.to_csv(tmp_path / "bad.csv", index=False)
    rep = store.import_file(tmp_path / "bad.csv")
    assert rep.stored == ["rec-00000001"]
    assert rep.rejected[0]["index"] == 1 and "micro_batch_size" in rep.rejected[0]["reason"]


def test_bad_suffix(store, tmp_path):
    with pytest.raises(ValueError, match=r"\.parquet, \.csv or \.jsonl"):
        store.export(tmp_path / "x.json")


def test_jsonl_export_one_record_per_line(store, tmp_path):
    from memfit.schema import TelemetryRecord

    recs = [record(record_id=f"rec-jsonl{i:04d}", seq_len=128 * (i + 1)) for i in range(3)]
    store.add([r.model_dump(mode="json") for r in recs])
    path = tmp_path / "incoming" / "x.jsonl"
    assert store.export(path) == 3
    back = [TelemetryRecord.model_validate_json(line) for line in path.read_text().splitlines()]
    assert {r.record_id: r.content_hash() for r in back} == {r.record_id: r.content_hash() for r in recs}


# -- issue 10, fault 7: implausible telemetry is quarantined with the reason, never trained on ------------
def test_implausible_telemetry_is_quarantined_not_stored(store):
    h100 = {"device_name": "NVIDIA H100 80GB HBM3", "device_memory_bytes": 80 * 10**9, "method": "cuda"}
    huge = record(record_id="rec-huge0001", peak_allocated_bytes=10**15, oom=False, **h100)
    inf_step = record(record_id="rec-inf00001", step_time_s=math.inf, peak_allocated_bytes=10**9, **h100)
    oom = record(record_id="rec-oom00001", peak_allocated_bytes=81 * 10**9, oom=True, **h100)
    fake = record(record_id="rec-fake0001", peak_allocated_bytes=1 << 35)  # fake tracker: no real device
    params = record(record_id="rec-parm0001", total_params=10**12, trainable_params=10**12)  # 4 layers of width 64
    rep = store.add([huge, inf_step, oom, fake, params])
    assert rep.stored == ["rec-oom00001", "rec-fake0001"]
    assert [q["index"] for q in rep.quarantined] == [0, 1, 4]
    assert "total_params=1000000000000 disagrees with the shapes (between 131072 and" in rep.quarantined[2]["reason"]
    assert "exceeds device_memory_bytes=80000000000 without oom" in rep.quarantined[0]["reason"]
    assert "step_time_s=inf is not a finite number" in rep.quarantined[1]["reason"]
    training_ids = set(store.dataframe()["record_id"])  # what the retraining job reads
    assert training_ids == {"rec-oom00001", "rec-fake0001"}
    assert [q["record_id"] for q in store.quarantined()] == ["rec-huge0001", "rec-inf00001", "rec-parm0001"]


def test_shipped_telemetry_is_all_plausible(store):
    shipped = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "telemetry.parquet"
    rep = store.import_file(shipped)
    assert len(rep.stored) == len(pd.read_parquet(shipped)) > 5000 and not rep.quarantined and not rep.rejected


# -- issue 10, fault 5: a locked database answers StoreBusy within the busy timeout, not after 30 s -------
def test_locked_database_raises_store_busy_quickly(tmp_path):
    store = TelemetryStore(f"sqlite:///{tmp_path / 't.db'}", busy_timeout_s=0.5)
    locker = sqlite3.connect(tmp_path / "t.db", timeout=0)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        t0 = time.perf_counter()
        with pytest.raises(StoreBusy) as info:
            store.add([record(record_id="rec-locked01")])
        assert time.perf_counter() - t0 < 3
        assert info.value.retry_after_s >= 1
    finally:
        locker.rollback()
        locker.close()
    assert store.add([record(record_id="rec-locked01")]).stored == ["rec-locked01"]  # nothing was lost


def test_lookup_keeps_the_instant_of_timestamps(store):
    """SQLite keeps no UTC offset: a record sent at +02:00 and the quarantine time must come back as
    the same instants, with an offset (found by schemathesis' stateful run: 'not a date-time')."""
    from datetime import UTC, datetime, timedelta, timezone

    sent_at = datetime(2026, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    store.add(
        [
            record(record_id="tz-000001", created_at=sent_at),
            record(record_id="tz-000002", method="cuda", peak_allocated_bytes=(1 << 34) + 4096),
        ]
    )
    stored, held = store.lookup("tz-000001")
    assert held == [] and stored.created_at == sent_at and stored.created_at.utcoffset() is not None
    stored, held = store.lookup("tz-000002")
    assert stored is None and len(held) == 1 and held[0]["received_at"].utcoffset() is not None
    assert abs((datetime.now(UTC) - held[0]["received_at"]).total_seconds()) < 60
    assert store.lookup("tz-999999") == (None, [])


def test_posted_records_are_checked_strictly_and_not_dated_in_the_future(store):
    """A posted record's integers are strict, as every request body's are (the README's promise): "4" and 4.0
    were coerced and stored. A created_at in the year 2999 was stored too."""
    good = record(record_id="rec-eeeeeeee").model_dump(mode="json")
    as_text = good | {"record_id": "rec-ffffffff"}
    as_text["measurement"] = {
        **good["measurement"],
        "peak_allocated_bytes": str(good["measurement"]["peak_allocated_bytes"]),
    }
    as_float = good | {"record_id": "rec-gggggggg"}
    as_float["training"] = {**good["training"], "micro_batch_size": 2.0}
    future = good | {"record_id": "rec-hhhhhhhh", "created_at": "2999-01-01T00:00:00"}
    rep = store.add([good, as_text, as_float, future])
    assert rep.stored == ["rec-eeeeeeee"]
    reasons = {r["index"]: r["reason"] for r in rep.rejected}
    assert "peak_allocated_bytes" in reasons[1] and "micro_batch_size" in reasons[2]
    assert "created_at=2999-01-01T00:00:00 is in the future" in reasons[3]


def test_a_store_made_before_a_field_existed_gains_its_column_and_keeps_its_records(tmp_path):
    """A database created before ``pipeline_stage`` existed: reopening adds the column (nullable), its rows read
    as not staged, a resent old record is a duplicate (same content hash), and a staged record is kept whole."""
    db = tmp_path / "old.db"
    TelemetryStore(f"sqlite:///{db}").add([record(record_id="old-00000001")])
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE telemetry DROP COLUMN pipeline_stage")  # as the older schema made it
        assert "pipeline_stage" not in {row[1] for row in conn.execute("PRAGMA table_info(telemetry)")}
    store = TelemetryStore(f"sqlite:///{db}")
    with sqlite3.connect(db) as conn:
        assert "pipeline_stage" in {row[1] for row in conn.execute("PRAGMA table_info(telemetry)")}
    (old,) = store.records()
    assert old.measurement.pipeline_stage is None
    assert store.add([record(record_id="old-00000001")]).duplicates == ["old-00000001"]
    staged = record(record_id="staged-00000001", pipeline_parallel_size=2, gpu_count=2, pipeline_stage=1)
    assert store.add([staged]).stored == ["staged-00000001"]
    assert {r.record_id: r.measurement.pipeline_stage for r in store.records()} == {
        "old-00000001": None,
        "staged-00000001": 1,
    }
