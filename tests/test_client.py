"""Client (retries, fallback, strict), describe() on live models, the reporter and its spool, the examples.

The service is stood in by ``httpx.MockTransport`` handlers; the real server is in test_client_e2e.py.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch
from pydantic import ValidationError

from memfit.api import ArchitectureIn, Recommendation, RecommendRequest
from memfit.checkpointing import MemfitWarning, apply
from memfit.client import Client, FallbackRecommendation, NotFinal, RequestRejected, ServiceError, is_fallback
from memfit.describe import describe, detect_architecture
from memfit.hf import build_causal_lm, quiet_transformers
from memfit.reporter import flush_spool, report_peak
from memfit.schema import TelemetryRecord
from tests.helpers import TINY_LLAMA, answer, run_example

REQ = {"model": "llama-3-8b", "training": {"micro_batch_size": 2, "seq_len": 8192}, "cluster": {"gpu": "H100-80GB"}}
HF_REQ = {**REQ, "model": {**TINY_LLAMA, "num_hidden_layers": 6}}


def mock_client(handler, **kw) -> Client:
    return Client("http://memfit.test", transport=httpx.MockTransport(handler), backoff_s=0.0, **kw)


# -- client ---------------------------------------------------------------------------------------------
def test_recommend_returns_a_typed_answer_and_sends_the_request_body():
    seen = []

    def handler(request: httpx.Request):
        seen.append((request.method, request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=answer())

    rec = mock_client(handler).recommend(**REQ)
    assert isinstance(rec, Recommendation) and not is_fallback(rec)
    assert rec.k == 2 and rec.layers == [0, 1] and rec.total_upper_bytes == 74 << 30
    method, path, body = seen[0]
    assert (method, path) == ("POST", "/recommend")
    assert body["model"] == "llama-3-8b" and body["training"]["seq_len"] == 8192 and body["headroom_fraction"] == 0.05
    # the same through a RecommendRequest
    assert mock_client(handler).recommend(RecommendRequest.model_validate(REQ)).k == 2


def test_retries_5xx_and_connection_errors_then_succeeds():
    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"detail": "no model loaded yet"})
        return httpx.Response(200, json=answer(k=5, layers=list(range(5))))

    assert mock_client(handler, retries=2).recommend(**REQ).k == 5 and len(calls) == 3


def test_unreachable_gives_the_fallback_with_one_warning(caplog):
    calls = []

    def handler(request):
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    with caplog.at_level(logging.WARNING, logger="memfit"):
        rec = mock_client(handler, retries=2).recommend(**HF_REQ)
    assert len(calls) == 3
    assert (
        isinstance(rec, FallbackRecommendation)
        and rec.model_version == "fallback"
        and is_fallback(rec)
        and rec.path == "fallback"
        and rec.fit_method == "fallback"
    )
    assert rec.k == 6 and rec.layers == list(range(6)) and rec.num_layers == 6  # layer count from the HF config
    assert "checkpoint every layer" in rec.warnings[0] and "unreachable" in rec.warnings[0]
    warnings_logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_logged) == 1 and "checkpoint every layer" in warnings_logged[0].getMessage()
    assert warnings_logged[0].getMessage().startswith("memfit: the service gave no answer (POST ")  # "memfit" once
    # a catalog name: the layer count comes from the installed catalog (llama-3-8b: 32 layers)
    rec = mock_client(handler, retries=0).recommend(**REQ)
    assert rec.num_layers == 32 and rec.layers == list(range(32)) and rec.k == 32
    # a name memfit does not know: layer count unknown, every consumer reads it as "every layer"
    rec = mock_client(handler, retries=0).recommend(**{**REQ, "model": "my-private-model"})
    assert rec.num_layers == 0 and rec.layers == [] and rec.k is None


def test_slow_service_falls_back_and_strict_raises():
    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)

    rec = mock_client(slow, retries=1, timeout_s=0.2).recommend(**REQ)
    assert is_fallback(rec) and "timed out after 0.2s" in rec.reason
    with pytest.raises(ServiceError, match="timed out"):
        mock_client(slow, retries=0, strict=True).recommend(**REQ)


def test_rejected_request_raises_with_the_detail_strict_or_not():
    # a new user's misspelt model came back as fits=True, k=None (the fallback) with one log line saying the
    # service "gave no answer": a rejected request is an answer, and every later call would be rejected the same way
    def reject(request):
        return httpx.Response(
            422,
            json={
                "detail": "model: unknown model 'llama-9'",
                "errors": [{"field": "model", "message": "unknown model 'llama-9'", "allowed": "a catalog name"}],
            },
        )

    for strict in (False, True):
        with pytest.raises(RequestRejected, match="HTTP 422.*unknown model 'llama-9'") as caught:
            mock_client(reject, strict=strict).recommend(**REQ)
        assert caught.value.status_code == 422 and caught.value.errors[0]["field"] == "model"
    with pytest.raises(TypeError, match="needs request"):
        mock_client(reject).recommend(model="gpt2")


def test_invalid_request_raises_before_any_io_strict_or_not():
    def never(request):
        raise AssertionError("no request may be sent")

    bad = {**HF_REQ, "training": {"micro_batch_size": 0, "seq_len": 128}}
    for strict in (False, True):
        with pytest.raises(ValidationError, match="micro_batch_size"):
            mock_client(never, strict=strict).recommend(bad)
        with pytest.raises(ValidationError, match="micro_batch_size"):
            mock_client(never, strict=strict).recommend(**bad)


def test_an_unreadable_answer_falls_back_unless_strict():
    def garbled(request):
        return httpx.Response(200, json={"k": "three"})

    rec = mock_client(garbled).recommend(**REQ)
    assert is_fallback(rec) and "/recommend: unreadable answer" in rec.reason
    with pytest.raises(ServiceError, match="unreadable answer"):
        mock_client(garbled, strict=True).recommend(**REQ)


def test_telemetry_sends_the_bearer_token():
    auth = []

    def handler(request):
        auth.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"stored": ["x"], "duplicates": [], "rejected": []})

    assert mock_client(handler, token="s3cret").send_telemetry([{"a": 1}])["stored"] == ["x"]
    assert auth == ["Bearer s3cret"]


# -- describe -------------------------------------------------------------------------------------------
def llama(layers: int = 4):
    torch.manual_seed(0)
    with quiet_transformers():
        return build_causal_lm({**TINY_LLAMA, "num_hidden_layers": layers})


def test_describe_hf_model_with_deepspeed_config():
    model = llama()
    total = sum(p.numel() for p in model.parameters())
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW"},
    }
    req = describe(model, seq_len=2048, deepspeed_config=ds, gpu="H100-80GB", gpu_count=8)
    assert req.model["model_type"] == "llama" and req.model["num_hidden_layers"] == 4
    assert req.model["hidden_size"] == 64 and "id2label" not in req.model
    t = req.training
    assert (t.micro_batch_size, t.seq_len, t.sharding.value, t.precision.value) == (
        4,
        2048,
        "zero3",
        "bf16_fp32_master",
    )
    assert t.trainable_params == total and t.finetune.value == "full" and t.optimizer.value == "adamw_foreach"
    assert req.cluster.gpu == "H100-80GB" and req.cluster.gpu_count == 8
    json.dumps(req.model_dump(mode="json"))  # the body is JSON


def test_describe_from_training_arguments(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        bf16=True,
        use_cpu=True,
        report_to=[],
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )
    req = describe(llama(), seq_len=512, training_args=args, gpu_memory_gib=24)
    t = req.training
    assert (t.micro_batch_size, t.precision.value, t.optimizer.value, t.checkpoint_impl.value) == (
        3,
        "amp_bf16",
        "adamw_fused",
        "reentrant",
    )
    assert req.cluster.memory_bytes == 24 << 30
    # a DeepSpeed config inside the TrainingArguments, "auto" resolved from them
    args.deepspeed = {
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
    }
    req = describe(llama(), seq_len=512, training_args=args, gpu_memory_gib=24, gpu_count=2)
    assert (req.training.micro_batch_size, req.training.precision.value, req.training.sharding.value) == (
        3,
        "bf16_fp32_master",
        "zero2",
    )


def test_describe_lora_and_frozen_counts():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    req = describe(model, micro_batch_size=1, seq_len=128, gpu="A100-80GB")
    assert req.training.finetune.value == "lora" and req.training.lora_rank == 4
    assert req.training.trainable_params == trainable and 0 < trainable < total // 10
    assert req.model["num_hidden_layers"] == 4  # the base model's config through the PEFT wrapper
    frozen = llama()
    for p in [
        *frozen.model.embed_tokens.parameters(),
        *frozen.model.layers[0].parameters(),
        *frozen.model.layers[1].parameters(),
    ]:
        p.requires_grad_(False)
    req = describe(frozen, micro_batch_size=1, seq_len=128, gpu="A100-80GB")
    assert req.training.finetune.value == "frozen" and req.training.frozen_layers == 2


def test_describe_names_missing_essentials():
    model = llama(2)
    with pytest.raises(ValueError, match="seq_len is required"):
        describe(model, micro_batch_size=1, gpu="L4")
    with pytest.raises(ValueError, match="micro_batch_size is required"):
        describe(model, seq_len=128, gpu="L4")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^gpu: no CUDA device.*gpu_memory_gib"):
            describe(model, micro_batch_size=1, seq_len=128)
    req = describe(model, micro_batch_size=1, seq_len=128, gpu="L4", sharding="zero3")  # one GPU: nothing to shard
    assert req.training.sharding.value == "none"


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(1000, 64)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, batch_first=True) for _ in range(3)
        )


def test_describe_plain_model_detects_the_architecture():
    arch = detect_architecture(Plain())
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.intermediate_size, arch.vocab_size) == (
        3,
        64,
        4,
        256,
        1000,
    )
    assert arch.total_params == sum(p.numel() for p in Plain().parameters())
    # a module without a HF config is predicted as a Llama-style decoder of its shape, and describe says so
    with pytest.warns(MemfitWarning, match=r"no HF config; its shape was read from its modules \(3 layers, hidden 64"):
        req = describe(Plain(), micro_batch_size=2, seq_len=64, gpu="L4")
    assert isinstance(req.model, ArchitectureIn) and req.model.num_layers == 3
    with pytest.raises(ValueError, match="could not detect num_attention_heads, intermediate_size, vocab_size"):
        detect_architecture(
            torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8)])),
            layers=torch.nn.ModuleList([torch.nn.Linear(8, 8)]),
        )


# -- reporter -------------------------------------------------------------------------------------------
class FakeService:
    """POST /telemetry: validates like the store, answers stored/duplicates."""

    def __init__(self, up: bool = True):
        self.up, self.records = up, {}

    def __call__(self, request):
        if not self.up:
            raise httpx.ConnectError("refused", request=request)
        body = json.loads(request.content)
        stored, dup = [], []
        for r in body:
            rec = TelemetryRecord.model_validate(r)
            (dup if rec.record_id in self.records else stored).append(rec.record_id)
            self.records[rec.record_id] = rec
        return httpx.Response(200, json={"stored": stored, "duplicates": dup, "rejected": []})


def _trained_plan(model, layers):
    plan = apply(model, layers)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    return plan


def test_report_peak_sends_a_user_job_record():
    svc = FakeService()
    model = llama()
    plan = _trained_plan(model, [0, 1])
    res = report_peak(
        mock_client(svc),
        model,
        plan,
        micro_batch_size=2,
        seq_len=16,
        gpu_memory_gib=16,
        peak_allocated_bytes=12_345_678,
        step_time_s=0.5,
    )
    assert res.status == "sent"
    rec = svc.records[res.record.record_id]
    assert rec.measurement.source.value == "user_job" and rec.measurement.method.value == "cpu_tracker"
    assert rec.measurement.peak_allocated_bytes == 12_345_678 and rec.measurement.recomputed_layers == 2
    assert rec.training.checkpoint_layers == [0, 1] and rec.training.micro_batch_size == 2
    assert rec.model.num_layers == 4 and rec.model.total_params == sum(p.numel() for p in model.parameters())
    assert rec.cluster.device_name == "cpu" and rec.cluster.torch_version == torch.__version__


def _report_l4(client, model, plan, peak_allocated_bytes, spool):
    """report_peak of a micro-batch 2, 16-token job planned for an L4, spooling to ``spool``."""
    return report_peak(
        client,
        model,
        plan,
        micro_batch_size=2,
        seq_len=16,
        gpu="L4",
        peak_allocated_bytes=peak_allocated_bytes,
        spool_path=spool,
    )


def test_report_peak_spools_when_down_and_flush_sends_later(tmp_path, caplog):
    spool = tmp_path / "spool.jsonl"
    model = llama(2)
    plan = _trained_plan(model, [1])
    down = FakeService(up=False)
    with caplog.at_level(logging.WARNING, logger="memfit"):
        results = [_report_l4(mock_client(down, retries=0), model, plan, 1000 + i, spool) for i in range(2)]
    assert [r.status for r in results] == ["spooled", "spooled"]
    assert len(spool.read_text().splitlines()) == 2
    assert len([r for r in caplog.records if "spooled" in r.getMessage()]) <= 1  # logged once per process
    assert flush_spool(mock_client(down, retries=0), spool) == 0 and len(spool.read_text().splitlines()) == 2
    up = FakeService()
    assert flush_spool(mock_client(up), spool) == 2
    assert not spool.exists() or spool.read_text().strip() == ""
    assert sorted(r.measurement.peak_allocated_bytes for r in up.records.values()) == [1000, 1001]


def test_report_peak_never_raises():
    model = llama(2)
    svc = FakeService()
    # CPU without a measured value: skipped, not guessed from RSS
    res = report_peak(mock_client(svc), model, [0], micro_batch_size=1, seq_len=8, gpu="L4")
    if not torch.cuda.is_available():
        assert res.status == "skipped" and not svc.records
    # a broken input (no seq_len) is an error result, not an exception
    res = report_peak(mock_client(svc), model, [0], micro_batch_size=1, gpu="L4", peak_allocated_bytes=1)
    assert res.status == "error" and "seq_len" in res.detail


def test_report_peak_spools_whatever_has_no_verdict_and_says_quarantined(tmp_path):
    """A new-user trial: a wrong URL path (404), a 413, a proxy's HTML page and an answer naming no verdict
    returned "error" or "rejected" and dropped the record; a quarantined record came back as "rejected: []". Only
    the service's verdict on the record ends its trip; everything else is spooled and sent by the next flush."""
    model = llama(2)
    plan = _trained_plan(model, [1])
    spool = tmp_path / "spool.jsonl"

    def report(handler, peak_allocated_bytes=4096):
        return _report_l4(mock_client(handler, retries=0), model, plan, peak_allocated_bytes, spool)

    answers = [
        httpx.Response(404, json={"detail": "Not Found"}),
        httpx.Response(413, json={"detail": "too large"}),
        httpx.Response(200, text="<html>sign in</html>"),
        httpx.Response(200, json={"ok": True}),
        httpx.Response(200, json=["stored"]),
    ]
    for i, response in enumerate(answers):  # five measurements (one measurement's id is its content's)
        res = report(lambda request, a=response: a, 4096 + 512 * i)
        assert res.status == "spooled", (response.status_code, res)
    assert len(spool.read_text().splitlines()) == len(answers)

    why = "peak_allocated_bytes below the 1019904 bytes of weights"

    def quarantining(request):
        rid = json.loads(request.content)[0]["record_id"]
        body = {
            "stored": [],
            "duplicates": [],
            "rejected": [],
            "quarantined": [{"index": 0, "record_id": rid, "reason": why}],
        }
        return httpx.Response(200, json=body)

    res = report(quarantining)
    assert res.status == "quarantined" and res.detail == why
    invalid = report(lambda request: httpx.Response(422, json={"detail": "invalid", "errors": []}))
    assert invalid.status == "rejected" and "HTTP 422" in invalid.detail
    assert len(spool.read_text().splitlines()) == len(answers)  # neither spooled

    # a flush whose answer names no verdict for some records keeps them for the next flush
    def half(request):
        body = json.loads(request.content)
        return httpx.Response(200, json={"stored": [body[0]["record_id"]], "duplicates": [], "rejected": []})

    assert flush_spool(mock_client(half), spool) == 1
    assert len(spool.read_text().splitlines()) == len(answers) - 1
    up = FakeService()
    assert flush_spool(mock_client(up), spool) == len(answers) - 1
    assert not spool.exists() or not spool.read_text().strip()


def test_a_url_without_scheme_or_host_is_refused_when_the_client_is_made():
    for url in ("127.0.0.1:8000", "localhost:8000", "http://", "ftp://memfit.test", None, 8000):
        with pytest.raises(ValueError, match=r"url=.* must be an http:// or https:// URL with a host"):
            Client(url)
    with pytest.raises(ValueError, match=r"url='http://127.0.0.1:99999': port 99999 must be in \[1, 65535\]"):
        Client("http://127.0.0.1:99999")
    assert Client("https://memfit.test/").url == "https://memfit.test"


def test_request_timeout_and_rate_limit_are_asked_again_then_fall_back():
    calls = []

    def busy(request):
        calls.append(1)
        return httpx.Response(429 if len(calls) % 2 else 408, json={"detail": "busy"})

    rec = mock_client(busy, retries=2).recommend(
        model="llama-3-8b", training={"micro_batch_size": 1, "seq_len": 512}, cluster={"gpu": "H100-80GB"}
    )
    assert len(calls) == 3 and rec.path == "fallback" and "HTTP 429" in rec.reason
    calls.clear()
    ok = [httpx.Response(429, json={"detail": "busy"}), httpx.Response(200, json=answer())]
    rec = mock_client(lambda request: ok.pop(0), retries=2).recommend(
        model="llama-3-8b", training={"micro_batch_size": 1, "seq_len": 512}, cluster={"gpu": "H100-80GB"}
    )
    assert rec.path != "fallback" and not ok


def test_reporter_callback_with_the_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    from memfit.integrations.hf import MemfitReporterCallback, MemfitTrainerCallback
    from tests.test_checkpointing import _Tokens

    svc = FakeService()
    model = llama()
    plan_cb = MemfitTrainerCallback([1, 3])
    report_cb = MemfitReporterCallback(
        mock_client(svc), plan_cb, steps=2, seq_len=32, gpu="L4", peak_fn=lambda: 7_654_321
    )
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    with quiet_transformers():
        Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[plan_cb, report_cb]).train()
    assert report_cb.result.status == "sent" and len(svc.records) == 1  # once, after step 2
    rec = next(iter(svc.records.values()))
    assert rec.training.checkpoint_layers == [1, 3] and rec.measurement.recomputed_layers == 2
    assert rec.training.micro_batch_size == 2 and rec.training.seq_len == 32
    assert rec.measurement.peak_allocated_bytes == 7_654_321 and rec.measurement.step_time_s > 0


# -- examples -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script, k", [("hf_trainer.py", 2), ("fsdp2.py", 2), ("deepspeed_style.py", 3)])
def test_examples_run_on_cpu(script, k):
    out = run_example(script, "--k", str(k))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"applied plan: k={k}" in out.stdout and "verified=True" in out.stdout, out.stdout
    assert "warn" not in (out.stdout + out.stderr).lower(), out.stderr[-3000:]  # e.g. FSDP2's view-output warning
    line = next(x for x in out.stdout.splitlines() if x.startswith(f"peak at k={k}: measured"))
    measured = float(line.split("measured ")[1].split(" MiB")[0])
    assert measured > 1.0  # MiB: at least the tiny model's weights, gradients and Adam states
    assert "predicted" in line


def test_an_example_pointed_at_no_service_says_so_without_a_traceback():
    """``--url`` of a port nothing listens on, or not an http URL: one line naming the URL and the error."""
    down = run_example("hf_trainer.py", "--url", "http://127.0.0.1:9")
    assert down.returncode == 1 and "Traceback" not in down.stderr, down.stderr[-3000:]
    assert down.stderr.startswith("memfit service at http://127.0.0.1:9: POST http://127.0.0.1:9/recommend")
    wrong = run_example("fsdp2.py", "--url", "127.0.0.1:8000")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert wrong.stderr.startswith("--url: url='127.0.0.1:8000' must be an http:// or https:// URL")


def test_a_closed_client_says_so():
    """After close(), a call raised httpx's bare "Cannot send a request, as the client has been closed"."""
    client = mock_client(lambda request: httpx.Response(200, json=answer()))
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"Client\('http://memfit.test', strict=False\) is closed: make a new"):
        client.models()
    with pytest.raises(RuntimeError, match="is closed"):  # not the fallback plan: the script's own fault
        client.recommend(REQ)


def test_a_retry_after_is_waited_up_to_its_cap(monkeypatch):
    """Helper 32: a 429's Retry-After was ignored (the next attempt came after the 0.25 s backoff)."""
    import memfit.client as client_module

    slept = []
    monkeypatch.setattr(client_module.time, "sleep", slept.append)
    answers = [
        httpx.Response(429, headers={"Retry-After": "3"}, json={"detail": "busy"}),
        httpx.Response(503, headers={"Retry-After": "120"}, json={"detail": "restarting"}),
        httpx.Response(200, json=answer()),
    ]
    client = Client("http://memfit.test", transport=httpx.MockTransport(lambda r: answers.pop(0)), retries=2)
    client.recommend(model="llama-3-8b", training={"micro_batch_size": 1, "seq_len": 512}, cluster={"gpu": "H100-80GB"})
    assert slept == [3.0, client_module.MAX_RETRY_WAIT_S] and not answers


class _Clock:
    """Stands in for ``time`` in memfit.client: sleeping advances the monotonic clock."""

    def __init__(self):
        self.now_s, self.slept = 0.0, []

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now_s += seconds


def test_an_answer_still_pending_is_asked_for_again_until_final(monkeypatch):
    """Helper 36: a T4 request (gpt2-medium amp_fp16 micro-batch 4) was answered k = 7 while its sm75 trace ran and
    k = 10 once it was in; a training script applying the first answer would run out of memory."""
    import memfit.client as client_module

    clock = _Clock()
    monkeypatch.setattr(client_module, "time", clock)
    answers = [
        answer(k=7, layers=list(range(7)), pending=["terms", "allocation streams"]),
        answer(k=11, layers=list(range(11)), pending=["allocation streams"]),
        answer(k=10, layers=list(range(10)), pending=[]),
    ]
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=answers.pop(0))

    rec = mock_client(handler).recommend(**REQ)
    assert rec.k == 10 and rec.pending == [] and not is_fallback(rec) and not answers
    assert clock.slept == [0.5, 1.0] and len(seen) == 3 and seen[0] == seen[2]  # the same request asked again
    # final_wait_s=0: the first answer as it is, pending and all (the caller polls itself)
    answers[:] = [answer(k=7, pending=["terms"])]
    rec = mock_client(handler, final_wait_s=0).recommend(**REQ)
    assert rec.k == 7 and rec.pending == ["terms"] and clock.slept == [0.5, 1.0]


def test_an_answer_never_final_falls_back_to_every_layer_or_raises_when_strict(monkeypatch, caplog):
    import memfit.client as client_module

    clock = _Clock()
    monkeypatch.setattr(client_module, "time", clock)
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(200, json=answer(k=7, layers=list(range(7)), pending=["terms"]))

    with caplog.at_level(logging.WARNING, logger="memfit"):
        rec = mock_client(handler, final_wait_s=10).recommend(**HF_REQ)
    assert is_fallback(rec) and rec.k == 6 and rec.layers == list(range(6))  # every layer of the 6-layer config
    assert "not final after 10 s (the service is still tracing this configuration" in rec.reason
    assert "interim k = 7 can be too small" in rec.reason and rec.reason.endswith("or raise final_wait_s")
    assert "safe fallback" in rec.warnings[0]
    # pauses 0.5, 1, 2, 2, 2, 2, then the 0.5 s left: the last ask at the 10 s deadline, eight asks in all (helper 37:
    # the client gave up a pause early, after 0.6 s of a 1 s wait)
    assert clock.slept == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5] and len(calls) == 8 and clock.now_s == 10.0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [f"memfit: {rec.warnings[0]}"]
    with pytest.raises(NotFinal, match=r"not final after 3 s \(the service is still tracing") as not_final:
        mock_client(handler, final_wait_s=3, strict=True).recommend(**REQ)
    assert isinstance(not_final.value, ServiceError) and not_final.value.interim.k == 7
    assert not_final.value.final_wait_s == 3
    for bad in (-1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match=r"final_wait_s=.* must be a finite number of seconds >= 0"):
            mock_client(handler, final_wait_s=bad)


def test_an_interim_answer_where_nothing_fits_is_not_called_safe(monkeypatch):
    """Helper 37: gpt2-large micro-batch 2 on a T4 fits at no k, interim or final; the client's fallback after the
    wait said "its interim k = None can be too small" and called checkpointing every layer safe."""
    import memfit.client as client_module

    clock = _Clock()
    monkeypatch.setattr(client_module, "time", clock)
    nothing = answer(fits=False, k=None, layers=[], pending=["terms"], shortfall_bytes=3 << 30)
    told = []
    rec = mock_client(lambda r: httpx.Response(200, json=nothing), final_wait_s=1).recommend(
        **HF_REQ, waiting=lambda interim, left_s: told.append((interim.k, interim.pending, left_s))
    )
    assert is_fallback(rec) and rec.k == 6 and not rec.fits  # a script reading fits is not told it fits
    assert "no k fits, so checkpointing every layer may not fit either" in rec.reason and "None" not in rec.reason
    assert "safe" not in rec.warnings[0] and "it may still run out of memory" in rec.warnings[0]
    assert told == [(None, ["terms"], 1.0), (None, ["terms"], 0.5)] and clock.slept == [0.5, 0.5]
