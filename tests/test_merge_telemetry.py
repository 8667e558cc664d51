"""Merging collected telemetry into the shipped dataset (training.merge_telemetry) through the store."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from data import catalog
from data.store import TelemetryStore, read_rows
from tests.helpers import record
from training.merge_telemetry import main, merge


def _jsonl(path, recs) -> None:
    path.write_text("".join(r.model_dump_json() + "\n" for r in recs))


def _target(tmp_path, recs):
    store = TelemetryStore(f"sqlite:///{tmp_path / 'seed.db'}")
    store.add(recs)
    target = tmp_path / "shipped.parquet"
    store.export(target)
    return target


def test_merge_adds_new_rows_and_keeps_the_old_ones(tmp_path):
    target = _target(tmp_path, [record(record_id="old-row-1"), record(record_id="old-row-2", seq_len=256)])
    incoming = tmp_path / "in.jsonl"
    _jsonl(incoming, [record(record_id="new-row-1", micro_batch_size=4), record(record_id="old-row-1")])
    out = merge(target, [incoming])
    assert (out["before"], out["after"], out["written"], out["held"]) == (2, 3, True, False)
    assert out["files"][str(incoming)] | {"held": None} == {
        "stored": 1,
        "duplicates": 1,
        "rejected": 0,
        "quarantined": 0,
        "held": None,
    }
    df = pd.read_parquet(target).set_index("record_id")
    assert set(df.index) == {"old-row-1", "old-row-2", "new-row-1"}
    assert df.at["new-row-1", "micro_batch_size"] == 4 and df.at["old-row-2", "seq_len"] == 256


def test_a_conflicting_or_implausible_row_leaves_the_target_unchanged(tmp_path, capsys):
    target = _target(tmp_path, [record(record_id="old-row-1")])
    before = target.read_bytes()
    incoming = tmp_path / "in.jsonl"
    # same id, other peak: a conflict, never an overwrite; and a parameter count the shapes cannot hold
    _jsonl(
        incoming,
        [
            record(record_id="old-row-1", peak_allocated_bytes=999_999_488),
            record(record_id="new-row-1"),
            record(record_id="bad-row-1", total_params=10**12),
        ],
    )
    assert main([str(incoming), "--into", str(target)]) == 1
    err = capsys.readouterr().err
    assert "old-row-1" in err and "bad-row-1" in err and "disagrees with the shapes" in err
    assert target.read_bytes() == before
    # --allow-held writes the valid row; the old row keeps its peak
    assert main([str(incoming), "--into", str(target), "--allow-held"]) == 1
    df = pd.read_parquet(target).set_index("record_id")
    assert set(df.index) == {"old-row-1", "new-row-1"} and df.at["old-row-1", "peak_allocated_bytes"] == 123_456_512


def test_dry_run_writes_nothing_and_bad_arguments_exit_2(tmp_path, capsys):
    target = _target(tmp_path, [record(record_id="old-row-1")])
    before = target.read_bytes()
    incoming = tmp_path / "in.jsonl"
    _jsonl(incoming, [record(record_id="new-row-1")])
    assert main([str(incoming), "--into", str(target), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["after"] == 2 and target.read_bytes() == before
    assert main([str(tmp_path / "missing.jsonl"), "--into", str(target)]) == 2
    assert main([str(incoming), "--into", str(tmp_path / "x.csv")]) == 2
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"record_id": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        read_rows(broken)
    assert main([str(broken), "--into", str(target)]) == 2


def test_moe_expert_width_comes_from_moe_intermediate_size():
    # Qwen-MoE's intermediate_size is the dense/shared MLP's; each routed expert is moe_intermediate_size wide
    assert catalog.spec("qwen1.5-moe-a2.7b").intermediate_size == 1408
    assert catalog.spec("qwen3-30b-a3b").intermediate_size == 768
    assert catalog.spec("mixtral-8x7b").intermediate_size == 14336  # Mixtral's experts use intermediate_size
