import pandas as pd
import pytest

from data.store import TelemetryStore
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
    conflict = record(record_id="rec-aaaaaaaa", peak_allocated_bytes=1)
    bad = a.model_dump(mode="json") | {"record_id": "rec-cccccccc"}
    bad["training"] = {**bad["training"], "checkpoint_layers": [0, 9]}
    rep = store.add([a, conflict, bad, "not a record", record(record_id="rec-dddddddd")])
    assert rep.duplicates == ["rec-aaaaaaaa"]
    assert rep.stored == ["rec-dddddddd"]
    reasons = {r["index"]: r["reason"] for r in rep.rejected}
    assert set(reasons) == {1, 2, 3} and rep.total == 5
    assert "never overwritten" in reasons[1]
    assert "checkpoint_layers" in reasons[2] and "[0, 3]" in reasons[2]
    assert store.count() == 3
    stored_a = next(r for r in store.records() if r.record_id == "rec-aaaaaaaa")
    assert stored_a.measurement.peak_allocated_bytes == a.measurement.peak_allocated_bytes


def test_duplicate_within_one_batch(store):
    a = record(record_id="rec-aaaaaaaa")
    rep = store.add([a, a])
    assert rep.stored == ["rec-aaaaaaaa"] and rep.duplicates == ["rec-aaaaaaaa"]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_export_import_roundtrip(store, tmp_path, suffix):
    recs = [record(record_id=f"rec-{i:08d}", seq_len=128 * (i + 1), checkpoint_layers=list(range(i % 4)))
            for i in range(6)]
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
    with pytest.raises(ValueError, match=".parquet or .csv"):
        store.export(tmp_path / "x.json")
