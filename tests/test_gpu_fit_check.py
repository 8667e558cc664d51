"""training.gpu_fit_check: the capped experiment of issue 27 (GPU command) and its simulation on the CPU."""

from __future__ import annotations

import json

import pytest

from model.cuda_semantics import flash_backward_scratch
from training import gpu_fit_check as fc


def test_jobs_are_the_issue_table():
    a, b = fc.JOBS
    assert (a.model, a.card, a.start_k, a.issue_cap_gib, a.measured) == (
        "llama-3-8b",
        "H100-80GB",
        26,
        78.59,
        {"default": 22, "expandable_segments": 19},
    )
    assert (b.model, b.card, b.start_k, b.issue_cap_gib, b.measured) == (
        "llama-3.2-3b",
        "RTX-4090",
        28,
        22.90,
        {"default": None, "expandable_segments": 25},
    )
    t = b.training_config(25)
    assert t.finetune.value == "lora" and t.lora_rank == 16 and t.checkpoint_layers == list(range(25))
    assert t.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"] and t.optimizer.value == "adamw_fused"


def test_smallest_k_that_ran_stops_at_the_first_oom():
    rows = [{"job": "j", "setting": "default", "k": k, "oom": k == 21} for k in (26, 25, 24, 23, 22, 21)]
    assert fc.smallest_k_that_ran(rows, "j", "default") == 22
    assert fc.smallest_k_that_ran([{"job": "j", "setting": "default", "k": 28, "oom": True}], "j", "default") is None


def test_oom_message_size_is_read():
    msg = "CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 139.81 GiB"
    assert fc._tried(msg) == 3.91
    assert fc._tried("Tried to allocate 512.00 MiB.") == 0.5


def test_unknown_job_is_refused(capsys):
    with pytest.raises(SystemExit):
        fc.main(["--simulate", "--jobs", "gpt-5"])
    assert "--jobs: unknown ['gpt-5']" in capsys.readouterr().err


def test_flash_backward_scratch_sizes():
    # Llama-3-8B, micro-batch 2, seq 4096, bf16: 32 query heads, 8 key heads of 128
    assert flash_backward_scratch((2, 32, 4096, 128), (2, 8, 4096, 128), 2) == [
        1_048_576,
        134_217_728,
        67_108_864,
        67_108_864,
    ]
    assert flash_backward_scratch((1, 12, 1000, 64), (1, 12, 1000, 64), 2) == [
        1 * 12 * 1024 * 4,
        1 * 1024 * 12 * 64 * 4,
    ]


def test_simulate_a_small_job(tmp_path, monkeypatch):
    """A Llama-3.2-1B step capped below its need: the search runs k down to the first simulated OOM and writes
    its rows and summaries."""
    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path / "cache"))
    job = fc.Job(
        "tiny",
        "llama-3.2-1b",
        "RTX-4090",
        16,
        {"micro_batch_size": 1, "seq_len": 512, "precision": "bf16", "optimizer": "adamw_fused"},
        3.3,
        {"default": None, "expandable_segments": None},
    )
    out = tmp_path / "sim.jsonl"
    rows = fc.simulate([job], out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(rows))
    summary = {r["setting"]: r for r in lines if r.get("summary")}
    assert set(summary) == {"default", "expandable_segments"}
    for setting, s in summary.items():
        steps = [r for r in lines if not r.get("summary") and r["setting"] == setting]
        assert [r["k"] for r in steps] == list(range(16, 16 - len(steps), -1))
        assert all(not r["oom"] for r in steps[:-1])
        assert s["smallest_k_that_ran"] == (
            min(r["k"] for r in steps if not r["oom"]) if any(not r["oom"] for r in steps) else None
        )
        assert all(r["reserved_bytes"] >= r["allocated_bytes"] for r in steps)


def test_cuda_trace_becomes_a_stream_and_replays(tmp_path):
    """An allocator trace as torch.cuda.memory._snapshot() gives it: the model replays the GPU's own allocations
    at the run's cap and fails where the GPU failed."""
    import gzip

    from model.allocator import MIB, replay, stream_from_cuda_trace

    entries = [
        ["segment_alloc", 0x1000, 100 * MIB],
        ["alloc", 0x1000, 100 * MIB],
        ["free_requested", 0x1000, 100 * MIB],
        ["free_completed", 0x1000, 100 * MIB],
        ["snapshot", 0, 0],
        ["alloc", 0x1000, 40 * MIB],
        ["oom", 0, 120 * MIB],
    ]
    stream = stream_from_cuda_trace(entries)
    assert (stream.sizes, stream.measured_from) == ([100 * MIB, 0, 40 * MIB, 120 * MIB], 2)
    assert stream.handles[0] == stream.handles[1] != stream.handles[2]
    assert stream.meta["oom_event"] == 3 and stream.meta["actions"]["alloc"] == 2
    with pytest.raises(ValueError, match="never allocated"):
        stream_from_cuda_trace([["free_requested", 0x2000, 512]])
    row = {"job": "j", "setting": "default", "k": 3, "oom": True, "cap_bytes": 200 * MIB}
    path = tmp_path / "trace_j_default_k3.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"row": row, "entries": entries}, f)
    (res,) = fc.replay_traces([path])
    assert res["gpu_oom"] and res["model_oom"] and res["model_oom_event"] == 3
    assert not replay(stream, "expandable_segments:True", 200 * MIB).oom
