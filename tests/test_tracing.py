"""Tracing never-seen configurations: a time limit per trace, failures remembered and said in the answer."""

from __future__ import annotations

import json
import time

import pytest

from data import catalog
from memfit.schema import TrainingConfig
from model.curve import MemoryPredictor
from model.terms import TermsCache, terms_key
from service.tracing import BackgroundTracer, InlineTracer, TracingProcess, trace_in_subprocess

SMALL = {
    **catalog.get("llama-3-8b")["hf_config"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "num_hidden_layers": 4,
}
TRAINING = TrainingConfig(micro_batch_size=1, seq_len=512)


def test_a_trace_over_its_time_limit_is_abandoned():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="longer than"):
        trace_in_subprocess(SMALL, TRAINING, timeout_s=0.2)
    assert time.perf_counter() - t0 < 10


def test_one_tracing_process_traces_one_configuration_after_another():
    from tracer.phases import trace_terms

    wider = {**SMALL, "intermediate_size": 768}
    process = TracingProcess()
    try:
        first = process.trace(SMALL, TRAINING)
        pid = process.pid
        second = process.trace(wider, TRAINING)
        assert pid is not None and process.pid == pid  # imported once, kept for the next trace
        with pytest.raises(RuntimeError, match="longer than"):
            process.trace(SMALL, TRAINING, timeout_s=0.01)
        assert process.pid is None  # killed past its time limit
        again = process.trace(SMALL, TRAINING)
        assert process.pid not in (None, pid)  # a fresh process
    finally:
        process.close()
    assert process.pid is None
    here = json.loads(json.dumps(trace_terms(SMALL, TRAINING).to_json()))  # as it comes through the pipe
    for terms in (first, again):
        assert {k: v for k, v in terms.items() if k != "trace_s"} == {k: v for k, v in here.items() if k != "trace_s"}
    assert second["coef"] != first["coef"]


def test_background_tracer_reports_failure_and_does_not_retry():
    cache = TermsCache(shipped_dir=None)
    tracer = BackgroundTracer(cache, timeout_s=0.2)
    key = terms_key(SMALL, TRAINING)
    assert "tracing it now" in tracer(key, SMALL, TRAINING)
    assert "queued or running" in tracer(key, SMALL, TRAINING)
    other = TrainingConfig(micro_batch_size=1, seq_len=512, precision="fp32")  # a second key waits behind the first
    assert "behind 1 other configuration" in tracer(terms_key(SMALL, other), SMALL, other)
    for _ in range(100):
        if key in tracer.failed:
            break
        time.sleep(0.1)
    assert "longer than" in tracer.failed[key]
    assert "failed" in tracer(key, SMALL, TRAINING) and cache.get(key) is None
    tracer.shutdown()


def test_inline_tracer_answers_on_the_traced_path():
    cache = TermsCache(shipped_dir=None)
    said = []
    p = MemoryPredictor(None, cache, tracer=InlineTracer(cache, announce=said.append))
    spec = catalog.spec(SMALL)
    c = p.curve(spec, TRAINING, SMALL)
    assert c.path == "traced" and said and cache.get(terms_key(SMALL, TRAINING)) is not None


def test_reentrant_checkpointing_behind_frozen_embeddings_is_traced_as_memfit_apply_runs_it():
    # issue 28.7: LoRA (frozen embeddings) + reentrant checkpointing failed the trace ("element 0 of tensors does not
    # require grad") and the answer fell back to the learned path without naming the cause
    training = TrainingConfig(
        micro_batch_size=1, seq_len=512, finetune="lora", lora_rank=8, checkpoint_impl="reentrant"
    )
    cache = TermsCache(shipped_dir=None)
    p = MemoryPredictor(None, cache, tracer=InlineTracer(cache))
    spec = catalog.spec(SMALL)
    c = p.curve(spec.model_copy(update={"trainable_params": 200_000}), training, SMALL)
    assert c.path == "traced" and cache.get(terms_key(SMALL, training)) is not None
    note = next(n for n in c.notes if n.startswith("reentrant checkpointing behind frozen embeddings"))
    assert "enable_input_require_grads()" in note and "use_reentrant=False" in note
    assert c.points[0].predicted_bytes > c.points[-1].predicted_bytes  # checkpointing still saves memory


def test_a_stream_request_beyond_the_queues_bounds_is_refused_for_now_and_a_failed_one_for_good(tmp_path):
    """The fit decision's stream requests share the trace queue's bounds: beyond them the answer is a refusal for
    now (the fit decision says the queue is full and asks again), not the silence that read as "being recorded"; a
    recording that failed is refused for good with its reason. Nothing is queued or started either way."""
    from tracer.stream_source import Refusal

    tracer = BackgroundTracer(TermsCache(shipped_dir=None), max_pending=2)
    tracer.pending.update({"streams:/a.npz", "streams:/b.npz"})
    path = str(tmp_path / "c.npz")
    assert tracer.streams(SMALL, TRAINING, 2, 1, path, "sm90") == Refusal(
        "2 allocation-stream recordings are queued (at most 2)", final=False
    )
    assert tracer.streams(SMALL, TRAINING, 2, 1, "/a.npz", "sm90") is None  # queued before: being recorded
    tracer.failed[f"streams:{path}"] = "RuntimeError: the recorder gave up"
    assert tracer.streams(SMALL, TRAINING, 2, 1, path, "sm90") == Refusal("RuntimeError: the recorder gave up", True)
    assert tracer._thread is None and tracer._queue.empty()


def test_a_full_client_queue_says_what_it_holds():
    """Helper 39: one new T4 configuration (its trace and its allocation-stream recording) was reported as "this
    client has 2 configurations queued" after one question."""
    tracer = BackgroundTracer(TermsCache(shipped_dir=None))  # 2 per client
    tracer.pending.update({"trace-key", "streams:/a.npz"})
    tracer._owner.update({"trace-key": None, "streams:/a.npz": None})
    said = tracer("other-key", SMALL, TRAINING)
    assert "tracing deferred: this client has 1 trace and 1 allocation-stream recording queued (at most 2)" in said
    assert tracer._thread is None and tracer._queue.empty()


def test_background_tracer_records_stream_templates_in_its_started_process(tmp_path, monkeypatch):
    """The service's warm-up starts the tracing process; a missing allocation-stream template asked for by the fit
    decision is recorded there once (queued once however often asked) with its layer labels, as the asked GPU
    generation runs the step (an A100's: its cuBLAS workspaces, not the H100's)."""
    from model.allocator import AllocationStream
    from model.cuda_semantics import GpuGeneration, step_workspaces
    from tracer.stream_source import template_path

    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))  # the spawned process inherits it
    deep = {**SMALL, "num_hidden_layers": 16}
    path = template_path(deep, TRAINING, 16, 8, generation="sm80")
    assert path != template_path(deep, TRAINING, 16, 8)  # the H100/H200's is another stream
    tracer = BackgroundTracer(TermsCache(shipped_dir=None))
    try:
        tracer.start()
        assert tracer.streams(deep, TRAINING, 16, 8, str(path), "sm80") is None
        assert tracer.streams(deep, TRAINING, 16, 8, str(path), "sm80") is None
        assert len(tracer.pending) == 1
        for _ in range(600):
            if path.exists() and not tracer.pending:
                break
            time.sleep(0.1)
        stream = AllocationStream.load(path)
        assert stream.layer_labels is not None and max(stream.layer_labels) + 1 == 10  # the (10, 5) template
        assert stream.meta["workspaces"] == step_workspaces(GpuGeneration.SM80)
        assert step_workspaces(GpuGeneration.SM80) != step_workspaces(GpuGeneration.SM90)
        assert not tracer.failed
    finally:
        tracer.shutdown()
