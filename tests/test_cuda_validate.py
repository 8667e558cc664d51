"""The prepared GPU command of issue 26 (training.cuda_validate): its CPU-side parts."""

from __future__ import annotations

import json

import pytest

from training import cuda_validate as cv
from training.sweep import Family

SMALL = [(Family("gpt2", 1, 64), [0, 12], "dropout: flash on sm90")]


def test_plan_covers_the_issue_families_and_the_cases():
    p = cv.plan()
    models = {e["model"] for e in p}
    assert {"falcon-7b", "gpt2", "gpt2-large", "phi-3-mini-4k", "gemma-3-1b"} <= models  # the issue's families
    assert any(e["precision"] == "fp32" for e in p) and any(e["attention"] == "eager" for e in p)
    assert {"llama-3.2-1b", "gemma-3-1b", "falcon-7b"} <= models  # GQA 32/8, MQA with and without enable_gqa
    assert sum(len(e["ks"]) for e in p) == 20
    assert [e["model"] for e in cv.plan(2)] == ["gpt2", "gpt2-large"]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        cv.plan(0)


def test_arguments_are_checked():
    a = cv.parse_args(["--out", "x", "--limit", "3", "--generation", "sm80", "--dry-run"])
    assert (a.limit, a.generation, a.dry_run, a.budget_s) == (3, "sm80", True, 270.0)
    for bad in (["--out", "x", "--limit", "0"], ["--out", "x", "--generation", "sm70"], ["--limit", "2"]):
        with pytest.raises(SystemExit) as exc:
            cv.parse_args(bad)
        assert exc.value.code == 2


def test_dry_run_traces_with_cuda_semantics_and_writes_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr(cv, "CONFIGS", SMALL)
    assert cv.main(["--out", str(tmp_path), "--dry-run"]) == 0
    summary = json.loads((tmp_path / "cuda_validation.json").read_text())
    assert summary["generation"] == "sm90" and summary["device"] == "dry run" and not summary["errors"]
    traced = [json.loads(x) for x in (tmp_path / "traced_records.jsonl").read_text().splitlines()]
    assert [len(r["training"]["checkpoint_layers"]) for r in traced] == [0, 12]
    assert {r["measurement"]["method"] for r in traced} == {"fake_tracker"}
    assert (tmp_path / "gpu_records.jsonl").read_text() == ""
    assert summary["traced_bytes"] == [r["measurement"]["peak_allocated_bytes"] for r in traced]


def test_rows_pair_measured_and_traced_steps(tmp_path, monkeypatch):
    """With a stand-in measurement 64 MiB (the sm90 workspaces) above the trace, every error is 0."""
    monkeypatch.setattr(cv, "CONFIGS", SMALL)

    def measure(hf_config, training, plans, model_name, device):
        recs = cv._measure(hf_config, training, plans, model_name, "fake")
        if device == "fake":
            return recs
        return [
            r.model_copy(
                update={
                    "measurement": r.measurement.model_copy(
                        update={
                            "method": type(r.measurement.method)("cuda"),
                            "peak_allocated_bytes": r.measurement.peak_allocated_bytes + (64 << 20),
                        }
                    )
                }
            )
            for r in recs
        ]

    s = cv.run(tmp_path, device="stand-in", generation="sm90", measure=measure)
    assert [r["k"] for r in s["rows"]] == [0, 12] and s["within_0_5_percent"] == 2
    assert s["worst_error"] == 0.0
    gpu = [json.loads(x) for x in (tmp_path / "gpu_records.jsonl").read_text().splitlines()]
    assert {r["measurement"]["method"] for r in gpu} == {"cuda"}


def test_without_a_gpu_it_exits_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cv.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
