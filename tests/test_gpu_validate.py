"""The GPU validation pipeline, run on real CPU tensors (the CUDA path needs a GPU)."""

import json

import pytest

from data.store import TelemetryStore
from training import gpu_validate as gv
from training.sweep import Family


def test_cpu_smoke_pairs_real_and_fake(tmp_path, monkeypatch):
    # eager attention: CPU SDPA with dropout takes the math path while fake runs emulate CUDA kernels
    monkeypatch.setattr(gv, "CONFIGS", [(Family("gpt2", 1, 64, attention="eager"), [0, 12])])
    assert gv.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert summary["measured"] == 2
    for row in summary["rows"]:
        # real CPU tensors and fake tensors run the same ops: the trackers agree within 1 %
        assert 0.99 < row["allocated_over_tracker"] < 1.01, row
    real = [json.loads(x) for x in (tmp_path / "gpu_records.jsonl").read_text().splitlines()]
    assert {r["measurement"]["method"] for r in real} == {"cpu_tracker"}
    assert all(r["measurement"]["step_time_s"] > 0 for r in real)
    url = f"sqlite:///{tmp_path / 'g.db'}"
    assert gv.ingest(tmp_path, url) == {"stored": 2, "duplicates": 0, "rejected": 0, "quarantined": 0}
    assert TelemetryStore(url).count() == 2


def test_cuda_without_gpu_exits_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gv.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_ingest_reads_both_files_of_the_shipped_h200_rows(tmp_path):
    rows = gv.Path(__file__).resolve().parent.parent / "data" / "telemetry" / "gpu_validation"
    url = f"sqlite:///{tmp_path / 'h200.db'}"
    # 28 rows of the built-in configs + 60 catalog rows (two of them out of memory at k = 0)
    assert gv.ingest(rows / "h200-2026-12-04", url) == {"stored": 88, "duplicates": 0, "rejected": 0, "quarantined": 0}
    store = TelemetryStore(url)
    assert set(store.dataframe()["method"]) == {"cuda"}
    # the 2026-11-30 run measured the same built-in configs: same record ids, other figures -> quarantined
    assert gv.ingest(rows / "h200-2026-11-30", url) == {"stored": 0, "duplicates": 0, "rejected": 0, "quarantined": 26}
    assert store.count() == 88
