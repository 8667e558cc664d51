"""A deep model's allocation stream composed from a small template's (:mod:`model.stream_compose`) is the stream
of the deep model traced itself, event by event (frees in a row in allocation order, as the recorder writes
them), and replays to the same reserved peak; configurations it cannot compose raise, and the stream source
falls back to tracing the full model."""

from __future__ import annotations

import json

import pytest

from memfit.hf import small_config
from memfit.schema import TrainingConfig
from model.allocator import AllocatorSettings, replay
from model.stream_compose import CompositionError, compose, layer_templates, template_shape

#: narrow versions of catalog architectures: the events do not depend on the widths, the trace time does
NARROW = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "vocab_size": 1024}


def _config(name: str, **extra) -> dict:
    from data.catalog import get

    hf = dict(get(name)["hf_config"])
    if "n_embd" in hf:  # GPT-2
        hf.update(n_embd=256, n_head=4, vocab_size=1024, **extra)
    else:
        hf.update(NARROW, num_key_value_heads=2, head_dim=64, **extra)
    return hf


def _record(hf: dict, layers: int, k: int, **training):
    from tracer.allocation import cuda_trace_policy, step_allocations

    _, factory = cuda_trace_policy()
    t = TrainingConfig(micro_batch_size=2, seq_len=128, checkpoint_layers=list(range(k)), **training)
    return step_allocations(small_config(hf, layers), t, step_context=factory, layered=True)


def test_template_shape_keeps_edges_and_one_period():
    assert template_shape(32, 16, 1) == (10, 5)
    assert template_shape(32, 2, 1) == (7, 2)
    assert template_shape(32, 32, 1) == (5, 5)
    assert template_shape(8, 4, 1) == (8, 4)  # parts of at most period + 4 layers are kept whole
    assert template_shape(26, 13, 2) == (14, 7)  # each part: 6 + (13 - 6) % 2, its last layer keeps its type
    t = layer_templates(32, 16, 1)
    assert t[:3] == [0, 1, 2] and t[13:19] == [2, 3, 4, 5, 6, 7] and t[-2:] == [8, 9]
    t2 = layer_templates(26, 13, 2)
    assert all(t2[i] % 2 == i % 2 for i in range(26))  # every layer copies one of its own type
    with pytest.raises(ValueError, match="k must be in"):
        template_shape(8, 9, 1)


@pytest.mark.parametrize(
    ("name", "training", "layers", "ks"),
    [
        ("llama-3.2-1b", {"precision": "bf16", "optimizer": "adamw_fused"}, 12, [1, 6, 11]),  # k = 0, L: below
        ("gpt2", {"precision": "amp_bf16", "optimizer": "adamw_foreach"}, 12, [0, 5, 12]),  # dropout, autocast cache
        ("qwen2.5-0.5b", {"precision": "amp_fp16", "optimizer": "adafactor"}, 11, [3, 7]),  # tied embeddings
        (
            "llama-3.2-1b",
            {"precision": "bf16", "optimizer": "adamw_foreach", "finetune": "lora", "lora_rank": 8},
            12,
            [0, 6],
        ),
    ],
)
def test_composed_stream_is_the_traced_stream(name, training, layers, ks):
    hf = _config(name)
    for k in ks:
        n, kc = template_shape(layers, k, 1)
        composed = compose(_record(hf, n, kc, **training), kc, layers, k, 1)
        direct = _record(hf, layers, k, **training)
        assert (composed.handles, composed.sizes) == (direct.handles, direct.sizes), (name, k)
        assert composed.phases == direct.phases and composed.measured_from == direct.measured_from
        assert composed.layer_labels == direct.layer_labels
        for settings in (AllocatorSettings(), AllocatorSettings.from_conf("expandable_segments:True")):
            a, b = replay(composed, settings), replay(direct, settings)
            assert (a.peak_reserved_bytes, a.peak_allocated_bytes) == (b.peak_reserved_bytes, b.peak_allocated_bytes)


def test_a_template_of_another_shape_or_unlabelled_is_refused():
    hf = _config("llama-3.2-1b")
    template = _record(hf, 10, 5, precision="bf16", optimizer="adamw_fused")
    with pytest.raises(CompositionError, match="template of 10 layers"):
        compose(template, 5, 12, 2, 1)
    template.layer_labels = None
    with pytest.raises(CompositionError, match="no layer labels"):
        compose(template, 5, 12, 6, 1)


def test_stream_source_composes_and_falls_back(tmp_path, monkeypatch):
    from tracer.stream_source import stream_source, template_path

    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))
    hf = _config("llama-3.2-1b")
    hf["num_hidden_layers"] = 14
    t = TrainingConfig(micro_batch_size=2, seq_len=128, precision="bf16", optimizer="adamw_fused")
    source = stream_source(hf, t, 14)
    stream = source(7)
    assert source.composed == [7] and template_path(hf, t, 14, 7).exists()
    direct = _record(hf, 14, 7, precision="bf16", optimizer="adamw_fused")
    assert (stream.handles, stream.sizes, stream.phases) == (direct.handles, direct.sizes, direct.phases)
    asked = []
    cached = stream_source(hf, t, 14, record=False, request=lambda *a: asked.append(a[3]))
    assert cached(6) is not None and cached(1) is None and asked == cached.requested == [1]  # (10, 5) kept; (6, 1) not
    frozen = TrainingConfig(**{**t.model_dump(), "finetune": "frozen", "frozen_layers": 3})
    assert template_path(hf, frozen, 14, 7) is None  # the first layers differ from the others by index: traced whole
    assert template_path(hf, TrainingConfig(**{**t.model_dump(), "finetune": "lora", "lora_rank": 8}), 14, 7)


def test_templates_near_k_cover_the_search_in_one_request(tmp_path, monkeypatch):
    """The service's tracing process records, with the asked k's template, those of the k within 4 of it: the
    search from a guess of 0 on a 12-layer model (every k of its own template) then finds 0..4 composed after one
    request instead of asking for one more template per visited k; in a deep model's middle the neighbours share
    the asked template and nothing more is recorded."""
    from tracer.stream_source import record_templates_near, stream_source, template_path

    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))
    hf = _config("llama-3.2-1b")
    t = TrainingConfig(micro_batch_size=2, seq_len=128, precision="bf16", optimizer="adamw_fused")
    assert record_templates_near(hf, t, 12, 0) == [0, 1, 2, 3, 4]
    assert all(template_path(hf, t, 12, j).exists() for j in range(5)) and not template_path(hf, t, 12, 5).exists()
    asked = []
    cached = stream_source(hf, t, 12, record=False, request=lambda *a: asked.append(a[3]))
    assert all(cached(j) is not None for j in range(5)) and cached(5) is None and asked == [5]
    before = len(list(tmp_path.glob("*.npz")))
    assert record_templates_near(hf, t, 20, 10) == [10]  # 6..14 all keep the (10, 5) template
    assert len(list(tmp_path.glob("*.npz"))) == before + 1


def test_composition_period_is_the_layer_type_cycle_and_kept(tmp_path, monkeypatch):
    from data.catalog import get
    from tracer.stream_source import composition_period

    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))
    gemma3 = get("gemma-3-1b")["hf_config"]  # 5 sliding-window layers, then a global one (derived by transformers)
    assert composition_period(gemma3, 26) == 6
    assert len(list((tmp_path / "periods").glob("*.json"))) == 1  # the next command line reads it, not transformers
    assert composition_period(gemma3, 26) == 6
    assert composition_period(get("llama-3-8b")["hf_config"], 32) == 1
    assert composition_period(get("mixtral-8x7b")["hf_config"], 32) is None  # experts: traced whole


def test_a_models_streams_are_found_whichever_way_its_config_is_written(tmp_path, monkeypatch):
    """The command line sends a model's ``config.json`` fields, :func:`memfit.describe` transformers' full
    serialisation (``config.to_dict()``, every default written out): the streams and templates one records are
    the other's (keyed by :func:`model.snapshot.config_key`), so both decide the fit from the same streams; a
    config that builds another model is keyed apart."""
    from memfit.describe import clean_hf_config
    from memfit.hf import _hf_config
    from tracer.stream_source import composition_period, stream_path, stream_source, template_path

    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))
    given = _config("llama-3.2-1b")
    given["num_hidden_layers"] = 14
    full = clean_hf_config(json.loads(json.dumps(_hf_config(given).to_dict(), default=str)))
    assert full != given and len(full) > len(given)
    t = TrainingConfig(micro_batch_size=2, seq_len=128, precision="bf16", optimizer="adamw_fused")
    recorded = stream_source(given, t, 14)
    assert recorded(7) is not None and recorded(14) is not None and recorded.composed == [7, 14]
    asked = []
    cached = stream_source(full, t, 14, record=False, request=lambda *a: asked.append(a[3]))
    assert cached(7) is not None and cached(14) is not None and asked == [] and cached.failed is None
    assert template_path(full, t, 14, 7) == template_path(given, t, 14, 7)
    t3 = t.model_copy(update={"checkpoint_layers": [0, 1, 2]})
    assert stream_path(full, t3, context_name="p") == stream_path(given, t3, context_name="p") != stream_path(given, t3)
    assert composition_period(full, 14) == composition_period(given, 14) == 1
    assert len(list((tmp_path / "periods").glob("*.json"))) == 1
    wider = {**given, "intermediate_size": 768}
    assert stream_path(wider, t) != stream_path(given, t)
    assert template_path(wider, t, 14, 7) != template_path(given, t, 14, 7)


@pytest.mark.parametrize(("name", "layers", "k"), [("gemma-3-1b", 20, 0), ("gemma-2-2b", 13, 0)])
def test_a_periodic_models_composed_stream_is_the_traced_stream(name, layers, k):
    """Layer types repeating with a period (Gemma-2: 2, Gemma-3: 6): the template's middle is longer than one period
    (the part's length mod the period), every template layer is copied, and the repeated period holds no first
    layer of a type (Gemma-3's first global-attention layer frees in backward what the model computed once for
    every global layer: repeated, it was freed twice)."""
    from tracer.stream_source import composition_period

    hf = _config(name)
    hf["num_hidden_layers"] = layers
    period = composition_period(hf, layers)
    n, kc = template_shape(layers, k, period)
    assert (period, n) == ({"gemma-3-1b": 6, "gemma-2-2b": 2}[name], {"gemma-3-1b": 14, "gemma-2-2b": 7}[name])
    assert sorted(set(layer_templates(layers, k, period))) == list(range(n))
    assert template_shape(17, 0, 6) == (17, 0)  # a repeated period would start at the first global layer (5)
    training = {"precision": "bf16", "optimizer": "adamw_fused"}
    composed = compose(_record(hf, n, kc, **training), kc, layers, k, period)
    direct = _record(hf, layers, k, **training)
    assert (composed.handles, composed.sizes, composed.layer_labels) == (
        direct.handles,
        direct.sizes,
        direct.layer_labels,
    )
    assert composed.phases == direct.phases


def test_the_service_asks_for_the_full_models_stream_where_no_template_composes_it(tmp_path, monkeypatch):
    """Without recording (the serving process), a stream no template gives (frozen leading layers: traced whole) is
    asked of ``request`` at its full-model path; :func:`record_for_fit` (what the tracing process runs) records it,
    and the next source finds it. A request that failed before stops the asking and says why; one refused because
    the queue is full is asked again for the next stream looked for."""
    from tracer.stream_source import (
        Refusal,
        cached_source,
        record_for_fit,
        stream_path,
        stream_source,
        trace_policy_name,
    )

    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))
    hf = _config("llama-3.2-1b")
    hf["num_hidden_layers"] = 6
    t = TrainingConfig(
        micro_batch_size=2, seq_len=128, precision="bf16", optimizer="adamw_fused", finetune="frozen", frozen_layers=2
    )
    asked = []
    cached = stream_source(hf, t, 6, record=False, request=lambda *a: asked.append(a))
    assert cached(3) is None and cached.requested == [3]
    full = stream_path(hf, t.model_copy(update={"checkpoint_layers": [0, 1, 2]}), context_name=trace_policy_name())
    assert [(a[3], a[4]) for a in asked] == [(3, str(full))]
    alternative = cached_source(hf, t, 6, record=False, request=lambda *a: asked.append(a))  # an alternative's
    assert alternative(3) is None and alternative.requested == [] and len(asked) == 1  # asks nothing
    assert record_for_fit(hf, t, 6, 3) == [3] and full.exists()
    assert stream_source(hf, t, 6, record=False, request=lambda *a: asked.append(a))(3) is not None and len(asked) == 1
    failed = stream_source(hf, t, 6, record=False, request=lambda *a: Refusal("RuntimeError: gave up", final=True))
    assert failed(4) is None and failed.failed == "RuntimeError: gave up" and failed.requested == []
    refusals = []

    def full_queue(*a):
        refusals.append(a[3])
        return Refusal("8 configurations are queued (at most 8)", final=False)

    busy = stream_source(hf, t, 6, record=False, request=full_queue)
    assert busy(4) is None and busy.requested == [] and busy.failed is None
    assert busy.deferred == "8 configurations are queued (at most 8)" and refusals == [4]
    assert busy(5) is None and refusals == [4, 5]  # not given up: the next stream looked for is asked for again


def test_a_recording_is_announced_once_and_a_cached_one_not_at_all(tmp_path, monkeypatch):
    """Helper 37: the command line's first llama-3.2-1b answer took 23.6 s with nothing on stderr while it recorded
    the step's allocation streams."""
    from tracer.stream_source import stream_source

    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))
    hf = _config("llama-3.2-1b")
    t = TrainingConfig(micro_batch_size=2, seq_len=128, precision="bf16", optimizer="adamw_fused")
    told = []
    source = stream_source(hf, t, 12, model_name="llama-3.2-1b", announce=told.append)
    assert source(0) is not None and source(6) is not None and source.composed == [0, 6]
    said = (
        "recording the allocation stream of a small template model of llama-3.2-1b's training step with sm90 CUDA "
        "semantics (fake tensors on the CPU), for the fit decision: seconds to a minute, once per configuration (kept "
        f"in {tmp_path}, $MEMFIT_STREAM_CACHE)"
    )
    assert told == [said]
    again = stream_source(hf, t, 12, model_name="llama-3.2-1b", announce=told.append)
    assert again(0) is not None and len(told) == 1  # read from the cache: nothing to announce
