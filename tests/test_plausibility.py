"""Issue 30 item 1: implausible measurements are quarantined with the reason (never stored, never dropped),
and the shipped telemetry still passes."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from data.store import implausibility
from memfit.schema import TelemetryRecord
from model.plausibility import physics_violation, telemetry_store

PARQUET = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "telemetry.parquet"
GB = 10**9


def _rows(df: pd.DataFrame) -> list[dict]:
    return [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
        for r in df.to_dict("records")
    ]


@pytest.fixture(scope="module")
def shipped() -> pd.DataFrame:
    return pd.read_parquet(PARQUET)


@pytest.fixture(scope="module")
def real_1b(shipped) -> dict:
    """A real H200 row: Llama-3.2-1B (1.24 B parameters, 16 layers), peak 47.08 GB, after init 14.90 GB."""
    row = _rows(
        shipped[
            (shipped.method == "cuda") & (shipped.model_name == "llama-3.2-1b") & (shipped.recomputed_layers == 0)
        ].head(1)
    )[0]
    assert row["peak_allocated_bytes"] == 47_077_871_104 and row["memory_after_init_bytes"] == 14_899_120_640
    return row


CASES = {  # the 15 implausible method=cuda records of issue 30: changes to a real row -> a word of the reason
    "peak 0 B": ({"peak_allocated_bytes": 0}, "weights"),
    "peak 1 B": ({"peak_allocated_bytes": 1}, "weights"),
    "peak 1 MB": ({"peak_allocated_bytes": 10**6}, "weights"),
    "peak 1 MB, no snapshots": (
        {"peak_allocated_bytes": 10**6, "memory_after_init_bytes": None, "memory_after_forward_bytes": None},
        "weights",
    ),
    "peak 1 GB, no snapshots": (
        {"peak_allocated_bytes": GB, "memory_after_init_bytes": None, "memory_after_forward_bytes": None},
        "weights",
    ),
    "peak below after init": ({"peak_allocated_bytes": 14 * GB}, "memory_after_init_bytes"),
    "peak below after forward": ({"peak_allocated_bytes": 30 * GB}, "memory_after_forward_bytes"),
    "recomputed 1e9": ({"recomputed_layers": 10**9}, "recomputed_layers"),
    "recomputed 17 of 16": ({"recomputed_layers": 17}, "recomputed_layers"),
    "step time 0": ({"step_time_s": 0.0}, "step_time_s"),
    "step time infinite": ({"step_time_s": math.inf}, "finite"),
    "peak above device": ({"peak_allocated_bytes": 151 * GB, "peak_reserved_bytes": 152 * GB}, "device"),
    "reserved above device": ({"peak_reserved_bytes": 151 * GB}, "device"),
    "reserved below allocated": ({"peak_reserved_bytes": 40 * GB}, "reserves"),
    "params 10x": ({"total_params": 12_358_144_000, "trainable_params": 12_358_144_000}, "total_params"),
}


def test_fifteen_implausible_cuda_records_are_quarantined_with_reasons(real_1b, tmp_path):
    store = telemetry_store(f"sqlite:///{tmp_path}/t.db")
    bad = [{**real_1b, **change, "record_id": f"bad{i:02d}xxx"} for i, (change, _) in enumerate(CASES.values())]
    rep = store.add([real_1b, *bad])
    assert rep.stored == [real_1b["record_id"]] and not rep.rejected
    assert len(rep.quarantined) == 15
    for q, (name, (_, word)) in zip(rep.quarantined, CASES.items(), strict=True):
        assert word in q["reason"], (name, q["reason"])
    assert {q["record_id"] for q in store.quarantined()} == {b["record_id"] for b in bad}  # kept, not dropped


def test_oom_row_may_exceed_nothing_but_is_exempt_from_the_floor(real_1b):
    rec = TelemetryRecord.from_row(
        {
            **real_1b,
            "peak_allocated_bytes": 10**6,
            "peak_reserved_bytes": 10**6,
            "memory_after_init_bytes": None,
            "memory_after_forward_bytes": None,
            "oom": True,
        }
    )
    assert implausibility(rec) is None and physics_violation(rec) is None


def test_shipped_telemetry_passes(shipped):
    """All 15,168 shipped rows (about 1.5 s)."""
    for row in _rows(shipped):
        rec = TelemetryRecord.from_row(row)
        assert implausibility(rec) is None and physics_violation(rec) is None, row["record_id"]


def test_long_rope_models_say_why_they_are_not_traced():
    """Issue 30 item 8: Phi-3.5's long-RoPE config gets a reason, not "timelines of the traced token points differ"."""
    from data import catalog
    from memfit.schema import TrainingConfig
    from model.terms import not_traceable_reason

    cfg = {
        "model_type": "phi3",
        "vocab_size": 1000,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 512,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8},
    }
    t = TrainingConfig(micro_batch_size=1, seq_len=128)
    assert "long-RoPE" in not_traceable_reason(catalog.spec(cfg), t, cfg)
    plain = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    assert not_traceable_reason(catalog.spec(plain), t, plain) is None


def test_a_cpu_run_above_the_host_memory_is_quarantined(real_1b):
    """A new-user trial stored a cpu_tracker peak of 1 TiB for a 255k-parameter model reported from a 25 GB host:
    real CPU tensors cannot hold more than the host's memory, which the reporter records as device_memory_bytes.
    The fake tracker (no allocation) may still go past it."""
    row = {**real_1b, "method": "cpu_tracker", "peak_reserved_bytes": None, "device_memory_bytes": 25 * GB}
    assert implausibility(TelemetryRecord.from_row({**row, "peak_allocated_bytes": 24 * GB})) is None
    too_much = TelemetryRecord.from_row({**row, "peak_allocated_bytes": 2**40})
    assert "cannot hold more than the host's memory" in implausibility(too_much)
    assert implausibility(TelemetryRecord.from_row({**row, "peak_allocated_bytes": 2**40, "oom": True})) is None
    fake = {**row, "method": "fake_tracker", "peak_allocated_bytes": 2**40}
    assert implausibility(TelemetryRecord.from_row(fake)) is None
