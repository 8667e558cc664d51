"""The telemetry store's scale path on a real PostgreSQL server (started by the test with pgserver):
two writer processes posting the same records concurrently, idempotent on record id, nothing lost,
and the retraining job's reader takes its training set from it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pgserver = pytest.importorskip("pgserver")
pytest.importorskip("psycopg")

from data.store import TelemetryStore
from tests.helpers import record

ROOT = Path(__file__).resolve().parent.parent
WRITER = """
import sys, time
from data.store import TelemetryStore
from tests.helpers import record
url, n, batch, start_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
store = TelemetryStore(url)
store.count()
time.sleep(max(0.0, start_at - time.time()))  # both writers start at the same instant
stored = dup = 0
for start in range(0, n, batch):  # both writers post the same ids: each must land exactly once
    rep = store.add([record(record_id=f"pg-{i:06d}", seq_len=64 * (1 + i % 8)) for i in range(start, start + batch)])
    assert not rep.rejected and not rep.quarantined, (rep.rejected, rep.quarantined)
    stored, dup = stored + len(rep.stored), dup + len(rep.duplicates)
print(stored, dup)
"""


@pytest.fixture(scope="module")
def pg_url(tmp_path_factory):
    srv = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    try:
        yield srv.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        srv.cleanup()


def test_two_writers_are_idempotent_and_lose_nothing(pg_url):
    n, batch, start_at = 1000, 10, time.time() + 8
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, pg_url, str(n), str(batch), str(start_at)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [w.communicate(timeout=300) for w in writers]
    assert all(w.returncode == 0 for w in writers), [err[-2000:] for _out, err in outs]
    stored, dups = zip(*(map(int, out.split()) for out, _err in outs))
    assert sum(stored) == n and sum(dups) == n  # every id stored by exactly one writer
    store = TelemetryStore(pg_url)
    assert store.count() == n and store.record_ids() == {f"pg-{i:06d}" for i in range(n)}
    conflict = record(record_id="pg-000007", seq_len=4096, peak_allocated_bytes=1)
    assert store.add([conflict]).quarantined[0]["record_id"] == "pg-000007"  # never overwritten
    assert store.count() == n


def test_retraining_reads_its_training_set_from_postgres(pg_url):
    from model.evaluate import load_rows

    store = TelemetryStore(pg_url)
    store.add([record(record_id=f"pg-train-{i:04d}", seq_len=128 * (1 + i % 4)) for i in range(10)])
    df, rejected = load_rows(pg_url)
    assert not rejected and set(df["record_id"]) == store.record_ids()
    assert json.loads(df.loc[df.record_id == "pg-train-0003", "checkpoint_layers"].iloc[0]) == [0, 1]
