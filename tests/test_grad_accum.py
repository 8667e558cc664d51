"""Gradient accumulation: measured by the collector, traced, composed, posed and described.

From the second micro-batch of an accumulating step on, the summed gradients are live through forward and
backward, so the step's peak rises by up to the gradient buffer. The collector runs two micro-batches (the
third and later repeat the second: checked below), the tracer traces a later micro-batch, and the
composition must match a full-depth measurement to the byte, as it does without accumulation.
"""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from memfit.schema import Offload, TrainingConfig
from model.terms import terms_key

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
PLANS = [[], [0, 1], [0, 1, 2, 3]]


def _peaks(training: TrainingConfig, device: str = "fake") -> list[int]:
    from tracer.collect import measure_family

    return [
        r.measurement.peak_allocated_bytes for r in measure_family(TINY, training, PLANS, device=device, prime=True)
    ]


@pytest.fixture(scope="module")
def fp32_ga2() -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=64, precision="fp32", gradient_accumulation_steps=2)


@pytest.fixture(scope="module")
def fake_ga2(fp32_ga2) -> list[int]:
    return _peaks(fp32_ga2)


def test_fake_measurement_equals_a_real_cpu_run(fp32_ga2, fake_ga2):
    assert _peaks(fp32_ga2, device="cpu") == fake_ga2


def test_accumulation_raises_the_peak_by_at_most_the_gradient_buffer(fp32_ga2, fake_ga2):
    one = _peaks(fp32_ga2.model_copy(update={"gradient_accumulation_steps": 1}))
    grads = 4 * _tiny_params()
    # autograd adds each new gradient into .grad in place: one new gradient (at most the embedding's) is extra
    summed_in = 4 * TINY["vocab_size"] * TINY["hidden_size"]
    for with_acc, without in zip(fake_ga2, one):
        assert without < with_acc <= without + grads + summed_in
    # without checkpointing the first micro-batch's activations are freed as its gradients arrive; the second
    # holds all gradients on top of its full activations: most of the buffer shows up at k = 0
    assert fake_ga2[0] - one[0] > 0.5 * grads


def _tiny_params() -> int:
    from memfit.hf import model_spec

    return model_spec(TINY).total_params


def test_later_micro_batches_repeat_the_second(fp32_ga2, fake_ga2, monkeypatch):
    from tracer import collect

    monkeypatch.setattr(collect, "accumulation_micro_batches", lambda training: 4)
    assert _peaks(fp32_ga2) == fake_ga2


def test_composed_curve_matches_the_full_depth_measurement(fp32_ga2, fake_ga2):
    from memfit.hf import model_spec
    from model.curve import MemoryPredictor
    from model.terms import TermsCache
    from tracer.phases import trace_terms

    cache = TermsCache(shipped_dir=None)
    cache.put(terms_key(TINY, fp32_ga2), trace_terms(TINY, fp32_ga2).to_json())
    spec = model_spec(TINY)
    curve = MemoryPredictor(None, cache).curve(spec, fp32_ga2, TINY)
    assert curve.path == "traced"
    assert [curve.points[len(p)].predicted_bytes for p in PLANS] == fake_ga2
    assert any("gradient accumulation over 2 micro-batches traced" in n for n in curve.notes)
    # the summed gradients are live in every phase: the breakdown counts them at every k
    grads = 4 * spec.trainable_params
    assert all(p.breakdown["gradients_bytes"] == grads for p in curve.points)
    assert all(sum(p.breakdown.values()) == p.predicted_bytes for p in curve.points)


def test_terms_key_depends_on_accumulation_only_where_gradients_stay_on_the_device():
    base = TrainingConfig(micro_batch_size=1, seq_len=128)
    ga = [base.model_copy(update={"gradient_accumulation_steps": n}) for n in (1, 2, 8)]
    keys = [terms_key(TINY, t) for t in ga]
    assert keys[1] == keys[2] != keys[0]
    off = TrainingConfig(micro_batch_size=1, seq_len=128, offload_optimizer=Offload.CPU)
    off8 = off.model_copy(update={"gradient_accumulation_steps": 8})
    assert not off8.accumulates_gradients and terms_key(TINY, off8) == terms_key(TINY, off)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 4, "optimizer_in_backward": True}, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 4, "pipeline_parallel_size": 2}, "gradient_accumulation_steps"),
    ],
)
def test_bad_accumulation_names_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        TrainingConfig(micro_batch_size=1, seq_len=128, **fields)


def test_content_hash_of_records_without_accumulation_is_unchanged():
    """Records stored before the field existed keep their content hash (duplicate vs conflict on resend)."""
    from memfit.schema import TelemetryRecord

    rows = pd.read_parquet("data/telemetry/telemetry.parquet").head(3)
    for row in rows.to_dict("records"):
        rec = TelemetryRecord.from_row(row)
        body = rec.model_dump(mode="json", exclude={"record_id", "created_at"})
        assert body["training"].pop("gradient_accumulation_steps") == 1
        assert body["measurement"].pop("pipeline_stage") is None  # added later still: not hashed when unset
        import hashlib
        import json

        assert rec.content_hash() == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def test_provisional_curve_adds_the_gradient_buffer(small_registry):
    """Untraced, the learned answer (steps of one micro-batch) gets the whole gradient buffer on top."""
    from memfit.hf import model_spec
    from model.analytic import model_state_bytes
    from model.curve import MemoryPredictor
    from model.terms import TermsCache

    predictor = MemoryPredictor(small_registry.load().estimator, TermsCache(shipped_dir=None))
    spec = model_spec(TINY)
    one = TrainingConfig(micro_batch_size=2, seq_len=64)
    acc = one.model_copy(update={"gradient_accumulation_steps": 4})
    c1, c4 = predictor.curve(spec, one, TINY), predictor.curve(spec, acc, TINY)
    assert c1.path == c4.path == "provisional"
    grads = model_state_bytes(spec, acc).gradients_bytes
    assert grads > 0
    np.testing.assert_allclose(c4.raw_bytes, c1.raw_bytes + grads)
    assert any("plus the whole gradient buffer" in n for n in c4.notes)
    assert all(p.breakdown["gradients_bytes"] == grads for p in c4.points)


def test_store_adds_the_new_column_to_an_older_database(tmp_path):
    """A database created before ``gradient_accumulation_steps`` existed gets the column; its rows read as 1."""
    from data.store import TelemetryStore
    from memfit.schema import TelemetryRecord

    db = tmp_path / "old.db"
    store = TelemetryStore(f"sqlite:///{db}")
    row = pd.read_parquet("data/telemetry/telemetry.parquet").head(1).to_dict("records")[0]
    assert not store.add([TelemetryRecord.from_row(row)]).rejected
    store.engine.dispose()
    with sqlite3.connect(db) as conn:  # the table as an older memfit created it
        conn.execute("ALTER TABLE telemetry DROP COLUMN gradient_accumulation_steps")
    store = TelemetryStore(f"sqlite:///{db}")
    rec = TelemetryRecord.from_row(row)
    report = store.add([rec])
    assert report.duplicates == [rec.record_id]
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT gradient_accumulation_steps FROM telemetry").fetchall() == [(None,)]


def test_alternative_keeps_the_global_batch_with_the_users_accumulation():
    from memfit.hf import model_spec
    from model.recommend import candidate_changes

    training = TrainingConfig(micro_batch_size=4, seq_len=128, gradient_accumulation_steps=2)
    cands = [c for c in candidate_changes(training, model_spec(TINY), 1) if "micro_batch_size" in c.change]
    assert [(c.change["micro_batch_size"], c.change["gradient_accumulation_steps"]) for c in cands] == [(2, 4), (1, 8)]


def test_describe_reads_accumulation_from_trainer_and_deepspeed_configs():
    import torch

    from memfit.describe import describe

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    arch = {
        "architecture": "llama",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 320,
    }
    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=8, bf16=True)
    req = describe(model, seq_len=128, training_args=args, gpu="A100-80GB", architecture=arch)
    assert req.training.gradient_accumulation_steps == 8
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}
    req = describe(model, seq_len=128, training_args=args, deepspeed_config=ds, gpu="A100-80GB", architecture=arch)
    assert req.training.gradient_accumulation_steps == 8  # "auto" is the Trainer's value
    ds["gradient_accumulation_steps"] = 16
    req = describe(model, seq_len=128, training_args=args, deepspeed_config=ds, gpu="A100-80GB", architecture=arch)
    assert req.training.gradient_accumulation_steps == 16
    req = describe(model, seq_len=128, micro_batch_size=1, gpu="A100-80GB", architecture=arch)
    assert req.training.gradient_accumulation_steps == 1


def test_accumulation_mask_marks_rows_with_gradients_on_the_device():
    from model.features import accumulation_mask

    rows = pd.DataFrame(
        {"gradient_accumulation_steps": [1, 4, np.nan, 4], "offload_optimizer": ["none", "none", "none", "cpu"]}
    )
    assert accumulation_mask(rows).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert accumulation_mask(rows.drop(columns="gradient_accumulation_steps")).tolist() == [0.0] * 4


def test_until_traced_accumulation_is_composed_from_one_micro_batch_phases(fp32_ga2, fake_ga2):
    """Only the terms of one micro-batch per step cached: an upper bound of the measured curve, composed per phase."""
    from memfit.hf import model_spec
    from model.curve import MemoryPredictor
    from model.terms import TermsCache
    from tracer.phases import trace_terms

    single = fp32_ga2.model_copy(update={"gradient_accumulation_steps": 1})
    cache = TermsCache(shipped_dir=None)
    cache.put(terms_key(TINY, single), trace_terms(TINY, single).to_json())
    curve = MemoryPredictor(None, cache).curve(model_spec(TINY), fp32_ga2, TINY)
    assert curve.path == "traced" and any("composed from the traced phases" in n for n in curve.notes)
    composed = [curve.points[len(p)].predicted_bytes for p in PLANS]
    for c, measured in zip(composed, fake_ga2):
        # in-place summing: one new gradient is extra at most; the double-counted done layers: loose at k = L
        assert 0.999 * measured <= c <= 1.15 * measured, (composed, fake_ga2)


def test_mistral_7b_micro_batch_one_with_accumulation_on_an_a100():
    """Mistral-7B, pure bf16, AdamW, seq 4096, micro-batch 1 on one A100-80GB: alone it fits with 2 layers
    checkpointed; with 4x gradient accumulation the 13.5 GiB gradient buffer is live through the head's backward
    (the peak phase), so it needs many more. Composed from the shipped terms of one micro-batch per step; a trace
    of the accumulating step gives the same curve (82.56 GiB at k = 0, measured here)."""
    from memfit.api import RecommendRequest
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry().load()
    rec = Recommender(loaded.estimator, loaded.version)
    plans = {}
    for ga in (1, 4):
        plans[ga] = rec.recommend(
            RecommendRequest.model_validate(
                {
                    "model": "mistral-7b-v0.1",
                    "training": {
                        "micro_batch_size": 1,
                        "seq_len": 4096,
                        "precision": "bf16",
                        "attention": "flash",
                        "gradient_accumulation_steps": ga,
                    },
                    "cluster": {"gpu": "A100-80GB"},
                }
            )
        )
    assert plans[1].fits and plans[4].fits
    # one micro-batch fits unchecked; accumulating four keeps the 13.5 GiB of bf16 gradients live: 14 layers
    assert plans[1].k == 0 and plans[4].k == 14
    at0 = [p.curve[0].predicted_bytes for p in plans.values()]
    assert at0[1] - at0[0] == pytest.approx(14_483_464_192, rel=0.01)  # the bf16 gradients of 7.24 B parameters


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--grad-accum", "0"],
            (
                "memfit: error: --grad-accum (training.gradient_accumulation_steps): must be an integer "
                "in [1, 65536] (got 0)"
            ),
        ),
        (
            ["--grad-accum", "4", "--optimizer-in-backward"],
            (
                "memfit: error: --grad-accum (training.gradient_accumulation_"
                "steps): must be 1 with optimizer_in_backward"
            ),
        ),
    ],
)
def test_cli_refuses_bad_accumulation_naming_the_flag(small_registry, capsys, argv, expected):
    from service.cli import main

    try:
        code = main(
            [
                "recommend",
                "--model",
                "llama-3-8b",
                "--gpu",
                "A100-80GB",
                "--micro-batch",
                "1",
                "--seq-len",
                "128",
                "--registry",
                str(small_registry.root),
                *argv,
            ]
        )
    except SystemExit as exit_:  # argparse refuses a value that is not an integer
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and expected in err, err


def test_http_refuses_bad_accumulation_with_a_422_naming_the_field(tmp_path, small_registry):
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 's.db'}", registry_dir=str(small_registry.root)))
    with TestClient(app) as client:
        r = client.post(
            "/recommend",
            json={
                "model": "llama-3-8b",
                "cluster": {"gpu": "A100-80GB"},
                "training": {"micro_batch_size": 1, "seq_len": 128, "gradient_accumulation_steps": 0},
            },
        )
    assert r.status_code == 422
    assert "training.gradient_accumulation_steps" in r.text
