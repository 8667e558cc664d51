"""Frozen fine-tuning composed from the traced full fine-tune of the layers above the frozen ones (model.frozen).

The composed curve of a tiny model with the embeddings and the first N decoder layers frozen is checked
against the collector's measurement of that model (fake tensors) at every k, k <= N and k > N, with tied and
untied embeddings; a GPT-2-shaped model (learned position embeddings stay trainable, so backward runs
through the frozen layers) is refused with its reason and stays provisional.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from data import catalog
from memfit.hf import model_spec
from memfit.schema import FineTune, TrainingConfig
from model.compose import PEAK_PHASES
from model.curve import PROVISIONAL, TRACED, MemoryPredictor
from model.terms import TermsCache, not_traceable_reason, terms_key

LAYERS = 5
N = 2


def tiny(name: str, **over) -> dict:
    cfg = dict(catalog.get(name)["hf_config"])
    if cfg["model_type"] == "gpt2":
        cfg.update(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=256, n_positions=1024, n_ctx=1024)
    else:
        cfg.update(
            num_hidden_layers=LAYERS,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
        )
    cfg.update(over)
    return cfg


LLAMA_TIED = tiny("llama-3.2-1b")  # tied embeddings: freezing them freezes the LM head
LLAMA_UNTIED = tiny("llama-3.2-1b", tie_word_embeddings=False)
GPT2 = tiny("gpt2")  # tied, and its learned position table wpe stays trainable


def _measured(hf: dict, training: TrainingConfig) -> list[int]:
    from tracer.collect import measure_family

    plans = [list(range(k)) for k in range(LAYERS + 1)]
    return [r.measurement.peak_allocated_bytes for r in measure_family(hf, training, plans, prime=True)]


def _predictor(hf: dict, training: TrainingConfig) -> MemoryPredictor:
    from model.frozen import base_training
    from tracer.phases import trace_terms

    cache = TermsCache(shipped_dir=None)
    base = base_training(training)
    cache.put(terms_key(hf, base), trace_terms(hf, base).to_json())
    return MemoryPredictor(terms=cache)


@pytest.mark.parametrize(
    "hf,training",
    [
        pytest.param(
            LLAMA_TIED,
            TrainingConfig(micro_batch_size=2, seq_len=64, precision="fp32", optimizer="adamw_foreach"),
            id="llama-tied-fp32-foreach",
        ),
        pytest.param(
            LLAMA_UNTIED,
            TrainingConfig(micro_batch_size=2, seq_len=64, precision="amp_bf16", optimizer="adamw_fused"),
            id="llama-untied-amp-fused",
        ),
        pytest.param(
            LLAMA_TIED,
            TrainingConfig(micro_batch_size=4, seq_len=32, precision="bf16", optimizer="adafactor", attention="eager"),
            id="llama-tied-bf16-adafactor",
        ),
        pytest.param(  # tied under sharding: the frozen step computes no gradient for the tied table
            LLAMA_TIED,
            TrainingConfig(
                micro_batch_size=2,
                seq_len=64,
                precision="amp_bf16",
                optimizer="adamw_fused",
                sharding="fsdp_full_shard",
                data_parallel_size=4,
            ),
            id="llama-tied-fsdp4-amp-fused",
        ),
    ],
)
def test_composed_curve_matches_the_measured_frozen_model(hf, training):
    training = training.model_copy(update={"finetune": FineTune.FROZEN, "frozen_layers": N})
    measured = _measured(hf, training)
    spec = model_spec(hf).model_copy(update={"trainable_params": _trainable(hf, training)})
    curve = _predictor(hf, training).curve(spec, training, hf)
    assert curve.path == TRACED and any("model.frozen" in n for n in curve.notes)
    got = [p.predicted_bytes for p in curve.points]
    # checkpointing a frozen layer changes nothing: the measured peak is flat for k <= N, and so is the curve
    assert len(set(measured[: N + 1])) == 1 and len(set(got[: N + 1])) == 1
    for k, (p, m) in enumerate(zip(got, measured)):
        # the frozen weights are counted without the allocator's 512-byte rounding per tensor (a few KiB at this
        # width); above by at most the transients the docstring keeps (the first trainable layer's input gradient)
        assert m - 4096 <= p <= m * 1.03 + 64 * 1024, (k, p, m)
    for pt in curve.points:
        assert sum(pt.breakdown.values()) == pt.predicted_bytes
        shards = training.data_parallel_size if training.sharding.value != "none" else 1
        weight_bytes = 2 if training.precision.value == "bf16" else 4
        assert pt.breakdown["parameters_bytes"] == weight_bytes * spec.total_params // shards  # stored shard


def _trainable(hf: dict, training: TrainingConfig) -> int:
    from tracer.collect import prepared_model

    with prepared_model(hf, training) as run:
        return run.spec.trainable_params


def test_device_phases_shift_k_and_remove_the_embedding_states():
    """The mapping itself: row k is the base's row max(0, k - N); frozen layers' weights added everywhere;
    the embeddings' optimizer states removed everywhere, their gradient and step temporaries where live."""
    from model.frozen import device_phases

    spec = model_spec(LLAMA_UNTIED)
    training = TrainingConfig(
        micro_batch_size=1, seq_len=8, precision="fp32", optimizer="adamw_foreach", finetune="frozen", frozen_layers=N
    )
    emb, layer = 256 * 64, (spec.total_params - 2 * 256 * 64 - 64) // LAYERS
    spec = spec.model_copy(update={"trainable_params": spec.total_params - emb - N * layer})
    base = np.arange((LAYERS - N + 1) * len(PEAK_PHASES), dtype=np.float64).reshape(LAYERS - N + 1, -1) * 1e6
    out = device_phases(base, list(PEAK_PHASES), spec, training)
    assert out.shape == (LAYERS + 1, len(PEAK_PHASES))
    delta = N * layer * 4 - emb * 8  # + frozen weights, - AdamW's two fp32 states of the embeddings
    for k in range(LAYERS + 1):
        row = base[max(0, k - N)] + delta
        for i, p in enumerate(PEAK_PHASES):
            want = row[i] - (emb * 4 if p in ("bwd.emb", "opt") else 0) - (emb * 4 if p == "opt" else 0)
            if p == "bwd.emb":  # capped by the layers' backward: no embedding backward follows it
                want = min(want, row[PEAK_PHASES.index("bwd.layers")])
            assert out[k, i] == pytest.approx(want, abs=1)


def test_learned_position_embeddings_keep_the_provisional_path():
    """GPT-2 freezes only wte: wpe is trainable, the frozen layers' input needs a gradient and backward runs
    through them, so the composition does not hold (measured: checkpointing a frozen layer lowers the peak)."""
    training = TrainingConfig(micro_batch_size=2, seq_len=64, precision="fp32", finetune="frozen", frozen_layers=N)
    spec = model_spec(GPT2)
    reason = not_traceable_reason(spec, training, GPT2)
    assert reason is not None and "wpe" in reason
    measured = _measured(GPT2, training)
    assert measured[1] < measured[0]  # the frozen layer 0 saves activations for backward unless checkpointed
    with pytest.raises(ValueError, match="no provisional model"):
        MemoryPredictor(terms=TermsCache(shipped_dir=None)).curve(spec, training, GPT2)


def test_frozen_row_counts_as_traced_when_its_base_is():
    import pandas as pd

    from model.evaluate import row_paths
    from model.frozen import base_training

    training = TrainingConfig(micro_batch_size=2, seq_len=64, finetune="frozen", frozen_layers=3)
    hf = catalog.get("pythia-70m")["hf_config"]
    spec = model_spec(hf)
    row = {
        **spec.model_dump(),
        **training.model_dump(mode="json"),
        "model_name": "pythia-70m",
        "num_checkpointed_layers": 0,
        "checkpoint_layers": [],
    }
    df = pd.DataFrame([row])
    cache = TermsCache(shipped_dir=None)
    assert list(row_paths(df, cache)) == [PROVISIONAL]
    cache.put(terms_key(hf, base_training(training)), {"coef": {}})
    assert list(row_paths(df, cache)) == [TRACED]


@pytest.mark.parametrize("hf", [LLAMA_TIED, LLAMA_UNTIED], ids=["tied", "untied"])
def test_trainable_params_as_the_collector_freezes_them(hf):
    """The service's count of a frozen request's trainable parameters (embeddings and N layers frozen) equals the
    collector's, on a meta build; from the shapes alone it is exact here too (no bias, one final norm aside)."""
    from model.frozen import trainable_params

    training = TrainingConfig(micro_batch_size=1, seq_len=8, finetune="frozen", frozen_layers=N)
    spec = model_spec(hf)
    measured = _trainable(hf, training)
    assert trainable_params(spec, N, hf) == measured
    assert abs(trainable_params(spec, N) - measured) <= 64 * N // LAYERS + 64  # the final norm spread over layers


def test_a_frozen_request_asks_the_tracer_for_its_base_then_composes_from_it():
    """The service's tracer is asked for the full fine-tune base's key (the recursion through curve); once those
    terms exist the frozen curve is on the traced path, and its breakdown adds up."""
    from model.frozen import base_training, trainable_params

    hf = catalog.get("pythia-70m")["hf_config"]
    training = TrainingConfig(micro_batch_size=1, seq_len=512, finetune="frozen", frozen_layers=2)
    spec = model_spec(hf)
    spec = spec.model_copy(update={"trainable_params": trainable_params(spec, 2, hf)})
    calls = []
    cache = TermsCache(shipped_dir=None)
    predictor = MemoryPredictor(None, cache, tracer=lambda key, cfg, t: calls.append((key, t)) or "queued")
    with pytest.raises(ValueError, match="no provisional model"):
        predictor.curve(spec, training, hf)
    key = terms_key(hf, base_training(training))
    assert [k for k, _ in calls] == [key] and calls[0][1].finetune is FineTune.FULL
    cache.put(key, TermsCache().get(key))  # shipped with memfit
    c = predictor.curve(spec, training, hf)
    assert c.path == TRACED and c.terms_key == key
    pts = [p.predicted_bytes for p in c.points]
    assert len(set(pts[:3])) == 1 and all(b <= a for a, b in itertools.pairwise(pts))
    assert all(sum(p.breakdown.values()) == p.predicted_bytes for p in c.points)
    assert min(pts) >= c.floor_bytes


def test_tied_embeddings_under_sharding_compose_but_in_bf16_with_fp32_masters():
    from model.frozen import not_composable_reason

    spec = model_spec(LLAMA_TIED)
    amp = TrainingConfig(
        micro_batch_size=1,
        seq_len=128,
        precision="amp_fp16",
        sharding="fsdp_full_shard",
        data_parallel_size=64,
        finetune="frozen",
        frozen_layers=N,
    )
    assert not_composable_reason(spec, amp, LLAMA_TIED) is None
    masters = TrainingConfig(**{**amp.model_dump(), "precision": "bf16_fp32_master"})
    assert "fp32 master weights" in not_composable_reason(spec, masters, LLAMA_TIED)
    untied = model_spec(LLAMA_UNTIED)
    assert not_composable_reason(untied, masters, LLAMA_UNTIED) is None  # untied: composed, as before


def test_tensor_and_pipeline_parallel_frozen_jobs_are_answered_per_rank():
    """Two fuzz finds. Mistral-7B with 12 frozen layers over 4 tensor-parallel ranks was composed from the base's
    curve with one whole model's frozen-layer and state bytes (77.2 GiB at every tensor-parallel size, 2.3 times
    the full fine-tune's 33.9 GiB); Pythia-70M with 3 of 6 layers frozen over 4 pipeline stages raised a
    ValueError (a 500) building 4 stages of the 3-layer base. Neither is composed now (their own path answers)."""
    from memfit.api import RecommendRequest
    from model.frozen import not_composable_reason
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry().load()
    rec = Recommender(loaded.estimator, loaded.version, coefficients=loaded.coefficients)

    def answer(model: str, gpus: int, **training):
        req = {"model": model, "training": {"micro_batch_size": 1, "seq_len": 512, **training}}
        return rec.recommend(
            RecommendRequest.model_validate({**req, "cluster": {"gpu": "H100-80GB", "gpu_count": gpus}})
        )

    for tp in (2, 4):
        full = answer("mistral-7b-v0.1", tp, tensor_parallel_size=tp)
        frozen = answer("mistral-7b-v0.1", tp, tensor_parallel_size=tp, finetune="frozen", frozen_layers=12)
        assert all(f.predicted_bytes < a.predicted_bytes for f, a in zip(frozen.curve, full.curve))
        assert any("tensor or pipeline parallelism is not composed" in w for w in frozen.warnings)
    piped = answer("pythia-70m", 4, finetune="frozen", frozen_layers=3, pipeline_parallel_size=4)
    assert len(piped.curve) == 7 and piped.fits
    hf = catalog.get("pythia-70m")["hf_config"]
    t = TrainingConfig(micro_batch_size=1, seq_len=512, finetune="frozen", frozen_layers=2)
    assert not_composable_reason(model_spec(hf), t, hf) is None  # one rank holding every layer: composed
