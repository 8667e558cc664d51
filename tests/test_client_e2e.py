"""The client on real input, end to end, against the real service in a uvicorn subprocess.

A 6-layer random Llama (hidden 128) asks for a recommendation at a capacity between two points of
the served curve, so that 0 < k < L; memfit.apply checkpoints exactly those layers; two real CPU
training steps give the same loss and gradients as the un-checkpointed model; the measured peak
(LiveStorageTracker, test-side only) goes to /telemetry through the reporter; the retraining job
learns from it and the service swaps in the new version without a restart.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest
import torch

import memfit
from memfit.hf import decoder_layers, quiet_transformers
from memfit.reporter import report_peak
from tests.helpers import HTTP_TIMEOUT_S, free_port, run_example, running_service

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "data" / "telemetry" / "telemetry.parquet"
LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 6,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
MICRO_BATCH, SEQ = 2, 128
TOKEN = "e2e-token"


@pytest.fixture(scope="module")
def service(small_registry, tmp_path_factory):
    """The real service on a copy of the registry (the retraining job writes into it)."""
    tmp = tmp_path_factory.mktemp("client-e2e")
    registry = tmp / "registry"
    shutil.copytree(small_registry.root, registry)
    db_url = f"sqlite:///{tmp / 'telemetry.db'}"
    with running_service(registry, db_url, MEMFIT_TOKEN=TOKEN) as base:
        yield {"url": base, "registry": registry, "db_url": db_url, "tmp": tmp}


def build_llama(seed: int = 0):
    from memfit.hf import build_causal_lm

    torch.manual_seed(seed)
    with quiet_transformers():
        return build_causal_lm(LLAMA)


def capacity_forcing_middle_k(curve: list, L: int) -> tuple[int, int]:
    """(k, capacity bytes): a k in (0, L) whose bound is below every smaller k's, nearest L // 2, and a
    capacity between curve[k] and the smallest bound of the k's before it (headroom 0)."""
    totals = [c.total_upper_bytes for c in curve]
    candidates = [k for k in range(1, L) if totals[k] < min(totals[:k])]
    assert candidates, f"the served curve does not decrease anywhere inside (0, {L}): {totals}"
    k = min(candidates, key=lambda c: abs(c - L // 2))
    return k, totals[k] + (min(totals[:k]) - totals[k]) // 2


def train(model, steps: int = 2, tracker=None) -> list[dict]:
    """Real CPU steps (AdamW, fixed data); per step: loss, gradients, parameters after the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, LLAMA["vocab_size"], (MICRO_BATCH, SEQ), generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(
            {
                "loss": loss.detach(),
                "grads": grads,
                "seconds": time.perf_counter() - t0,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
        )
        del loss
    return out


def measured_peak(model, steps: int = 2) -> tuple[int, list[dict]]:
    """Peak live tensor bytes of real CPU steps (test-side measurement with tracer.tracker)."""
    from tracer.tracker import LiveStorageTracker

    tracker = LiveStorageTracker()
    with tracker:
        tracker.track_tensors(list(model.parameters()))
        tracker.reset_peak()
        result = train(model, steps)
    return tracker.peak_bytes, result


def _synthetic_parquet(path: Path) -> Path:
    """Telemetry rows for three more catalog architectures (analytic peaks, as in tests/test_retrain.py)."""
    from data import catalog
    from data.store import TelemetryStore
    from memfit.schema import GIB, ClusterSpec, Measurement, TelemetryRecord, TrainingConfig
    from model.analytic import analytic_estimate

    recs = []
    for name in ("gpt-neo-125m", "qwen2.5-0.5b", "tinyllama-1.1b"):
        spec = catalog.spec(name)
        for fam in ({"micro_batch_size": 1, "seq_len": 256}, {"micro_batch_size": 2, "seq_len": 512}):
            for k in sorted({0, spec.num_layers // 4, spec.num_layers // 2, spec.num_layers}):
                training = TrainingConfig(**fam, checkpoint_layers=list(range(k)))
                peak = analytic_estimate(spec, training).peak_bytes * (1.08 - 0.05 * k / spec.num_layers)
                recs.append(
                    TelemetryRecord(
                        record_id=f"e2e-syn-{name}-{fam['seq_len']}-{k}",
                        model=spec,
                        training=training,
                        cluster=ClusterSpec(device_name="synthetic", device_memory_bytes=80 * GIB),
                        measurement=Measurement(peak_allocated_bytes=int(peak), method="fake_tracker"),
                    )
                )
    store = TelemetryStore(f"sqlite:///{path.with_suffix('.db')}")
    assert not store.add(recs).rejected
    store.export(path)
    return path


def _retrain_cli_usable() -> str | None:
    """None when training.retrain has the CLI this test drives, else why not."""
    try:
        from training import retrain
    except Exception as err:  # noqa: BLE001 - another engineer's work in progress
        return f"training.retrain does not import: {type(err).__name__}: {err}"
    if not callable(getattr(retrain, "main", None)):
        return "training.retrain has no main()"
    help_text = retrain._parser().format_help() if hasattr(retrain, "_parser") else ""
    missing = [
        f for f in ("--db", "--files", "--registry", "--n-estimators", "--params", "--min-rows") if f not in help_text
    ]
    return f"training.retrain CLI lacks {missing}" if missing else None


# -----------------------------------------------------------------------------------------------------
def test_recommend_apply_train_report_retrain(service):
    client = memfit.Client(service["url"], token=TOKEN, timeout_s=30, strict=True)
    L = LLAMA["num_hidden_layers"]
    model = build_llama()
    reference = copy.deepcopy(model)  # same weights, no checkpointing

    # 1. the curve at a huge capacity, then a capacity that forces 0 < k < L
    probe = client.recommend(
        memfit.describe(
            model, micro_batch_size=MICRO_BATCH, seq_len=SEQ, gpu_memory_bytes=1 << 40, headroom_fraction=0.0
        )
    )
    assert probe.num_layers == L and len(probe.curve) == L + 1 and probe.k == 0
    k_expected, capacity = capacity_forcing_middle_k(probe.curve, L)
    request = memfit.describe(
        model, micro_batch_size=MICRO_BATCH, seq_len=SEQ, gpu_memory_bytes=capacity, headroom_fraction=0.0
    )
    assert request.training.precision.value == "fp32" and request.training.trainable_params == sum(
        p.numel() for p in model.parameters()
    )
    rec = client.recommend(request)
    assert not memfit.is_fallback(rec) and rec.fits
    assert rec.k == k_expected and 0 < rec.k < L and rec.layers == list(range(rec.k))
    assert rec.total_upper_bytes <= rec.usable_bytes == capacity < rec.curve[rec.k - 1].total_upper_bytes

    # 2. apply exactly rec.layers
    plan = memfit.apply(model, rec)
    assert plan.layer_indices == rec.layers and plan.source == rec.model_version
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [i < rec.k for i in range(L)]

    # 3. two real training steps: same losses, gradients and updated weights as without checkpointing
    peak_ref, ref_steps = measured_peak(reference)
    peak, steps = measured_peak(model)
    for s, r in zip(steps, ref_steps):
        assert torch.allclose(s["loss"], r["loss"], rtol=0, atol=1e-6)
        for name, g in r["grads"].items():
            assert torch.allclose(s["grads"][name], g, rtol=1e-5, atol=1e-7), name
        for name, p in r["params"].items():
            assert torch.allclose(s["params"][name], p, rtol=1e-5, atol=1e-7), name
    assert plan.recomputed == set(rec.layers) and memfit.verify(plan, strict=True)
    assert 0 < peak < peak_ref  # checkpointing k layers really lowered the measured peak

    # 4. report the measured peak; it lands in the service's store
    result = report_peak(
        client,
        model,
        plan,
        request=request,
        peak_allocated_bytes=peak,
        step_time_s=min(s["seconds"] for s in steps),
        spool_path=service["tmp"] / "spool.jsonl",
    )
    assert result.status == "sent", result.detail
    from data.store import TelemetryStore

    df = TelemetryStore(service["db_url"]).dataframe()
    row = df[df.record_id == result.record.record_id]
    assert len(row) == 1
    row = row.iloc[0]
    assert (row.source, row.method, int(row.peak_allocated_bytes)) == ("user_job", "cpu_tracker", peak)
    assert json.loads(row.checkpoint_layers) == rec.layers and int(row.recomputed_layers) == rec.k
    assert (int(row.num_layers), int(row.hidden_size), int(row.seq_len)) == (L, 128, SEQ)

    # 5. the retraining job learns from it and the service serves the new version
    why = _retrain_cli_usable()
    if why:
        pytest.skip(f"retraining step skipped: {why}")
    before = httpx.get(service["url"] + "/models", timeout=HTTP_TIMEOUT_S).json()
    syn = _synthetic_parquet(service["tmp"] / "synthetic.parquet")
    # 1,000 of the shipped rows: the job cross-evaluates the curve of every family it is given, which for all the
    # shipped rows costs a minute of this test and checks nothing the retraining tests do not
    shipped = service["tmp"] / "shipped.parquet"
    pd.read_parquet(SHIPPED).sample(1000, random_state=0).to_parquet(shipped)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.retrain",
            "--db",
            service["db_url"],
            "--files",
            str(shipped),
            str(syn),
            "--registry",
            str(service["registry"]),
            "--n-estimators",
            "80",
            "--params",
            '{"n_jobs": 1}',
            "--min-rows",
            "20",
            "--quiet",
            "--no-coefficients",
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=500,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, proc.stderr[-3000:]
    summary = json.loads(lines[-1])
    # promotion is gated on the held-out rows (tests/test_retrain.py tests that rule); when the gate keeps
    # the fixture model, an operator promotes the registered version, which the service must pick up
    assert proc.returncode in (0, 3) and summary["status"] in ("promoted", "not_promoted"), (
        summary,
        proc.stderr[-3000:],
    )
    if summary["status"] == "not_promoted":
        from model.registry import Registry

        Registry(service["registry"]).promote(summary["version"])
    assert summary["rows"] >= 1 + 24  # our user-job row + the synthetic rows (+ the shipped ones)
    after = httpx.get(service["url"] + "/models", timeout=HTTP_TIMEOUT_S).json()  # it loads the new version first
    assert summary["version"] not in [v["version"] for v in before["versions"]]
    assert after["current"] == summary["version"] and after["serving"] == summary["version"]
    again = client.recommend(request)
    assert again.model_version == summary["version"] and again.num_layers == L


def test_fallback_against_a_dead_port_still_trains(caplog):
    """No service listening: the plan is "checkpoint every layer", training goes on."""
    model = build_llama(seed=1)
    dead = f"http://127.0.0.1:{free_port()}"
    request = memfit.describe(model, micro_batch_size=1, seq_len=32, gpu="L4")
    with caplog.at_level("WARNING", logger="memfit"):
        rec = memfit.Client(dead, timeout_s=0.5, retries=1, backoff_s=0.05).recommend(request)
    assert memfit.is_fallback(rec) and rec.layers == list(range(6))
    assert len([r for r in caplog.records if r.name == "memfit"]) == 1
    plan = memfit.apply(model, rec)
    ids = torch.randint(0, 512, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    assert plan.verify() and plan.recomputed == set(range(6))
    with pytest.raises(memfit.ServiceError, match="unreachable"):
        memfit.Client(dead, timeout_s=0.5, retries=0, strict=True).recommend(request)


def test_service_rejection_reaches_the_user(service):
    bad = {"model": "no-such-model", "training": {"micro_batch_size": 1, "seq_len": 128}, "cluster": {"gpu": "L4"}}
    for strict in (False, True):  # a rejection is the service's answer: raised, not a fallback plan
        with pytest.raises(ValueError, match="HTTP 422.*unknown model"):
            memfit.Client(service["url"], timeout_s=30, strict=strict).recommend(bad)


def test_a_client_never_closed_closes_its_connections_when_collected(service):
    """``memfit.Client(url).models()`` left the keep-alive socket to the garbage collector (ResourceWarning)."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert memfit.Client(service["url"], timeout_s=30).models()
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_an_example_asks_the_service_for_about_half_the_layers(service):
    # the README's `--url` examples read a capacity off the served curve's allocated totals; the fit is decided on
    # reserved memory with the largest request kept free, so every one got k=None and checkpointed every layer
    out = run_example("deepspeed_style.py", "--url", service["url"])
    assert out.returncode == 0, out.stderr[-3000:]
    answer = next(x for x in out.stdout.splitlines() if x.startswith("service answer: k="))
    k = int(answer.split("k=")[1].split(" ")[0])
    assert 0 < k <= 3 and answer.endswith("MiB") and " of 6," in answer, out.stdout
    assert f"applied plan: k={k}" in out.stdout and "verified=True" in out.stdout, out.stdout


def test_the_hf_trainer_example_reports_its_cpu_peak_to_the_service(service):
    """A new-user trial: `examples/hf_trainer.py --url` on CPU sent no telemetry (the tensor tracker measured the peak
    but the reporter callback was not given it, so it skipped at INFO). The callback now reads the tracker's peak."""
    from data.store import TelemetryStore

    out = run_example("hf_trainer.py", "--url", service["url"], "--token", TOKEN, "--verbose")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    line = next((x for x in text.splitlines() if "memfit: telemetry" in x and "stored (peak" in x), None)
    assert line is not None, text[-3000:]
    rid = line.split("memfit: telemetry ")[1].split(" ")[0]
    peak = int(line.split("stored (peak ")[1].split(" ")[0])
    stored, _held = TelemetryStore(service["db_url"]).lookup(rid)
    assert stored is not None and stored.measurement.method.value == "cpu_tracker"
    assert stored.measurement.peak_allocated_bytes == peak > 0 and stored.model.num_layers == 4
