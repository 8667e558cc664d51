"""Tensor-parallel answers (issue 28.1): one rank's Megatron shards, never negative weights, never a crash.

Before: ``tensor_parallel_rank_spec`` divided the parameter count by TP but ``quantized_base_bytes`` counted the
full layer shapes, so a 4-bit base under TP had negative unquantized weights; the learned path's ``math.log`` of a
negative analytic peak then raised "math domain error" (service 500, CLI exit 2) in every TP > 1 request whose
alternatives include QLoRA, and TP 2 + nf4 Llama-3-8B answered a negative ``parameters_bytes``.
"""

from __future__ import annotations

import pytest

from memfit.api import RecommendRequest
from memfit.schema import ModelSpec, Quantization, TrainingConfig
from model.analytic import (
    decoder_linear_shapes,
    quantized_base_bytes,
    quantized_linear_bytes,
    tensor_parallel_rank_spec,
)
from model.job import resolve_architecture
from model.registry import Registry
from service.recommender import Recommender

GIB = 1 << 30
#: four catalog models that every TP size in 1/2/4/8 splits (query and KV heads divisible)
SWEEP_MODELS = ["llama-3.2-1b", "llama-2-7b", "mistral-7b-v0.1", "qwen3-8b"]
QLORA = {"finetune": "lora", "lora_rank": 16, "quantization": "nf4"}


@pytest.fixture(scope="module")
def recommender() -> Recommender:
    loaded = Registry().load()
    return Recommender(
        loaded.estimator,
        loaded.version,
        telemetry_range=loaded.meta.get("telemetry_range"),
        margins=loaded.meta.get("bound_margins"),
        coefficients=loaded.coefficients,
    )


def _ask(recommender, model, gpu, gpus, **training):
    req = RecommendRequest.model_validate(
        {
            "model": model,
            "cluster": {"gpu": gpu, "gpu_count": gpus},
            "training": {"micro_batch_size": 1, "seq_len": 2048, **training},
        }
    )
    return recommender.recommend(req)


def _byte_counts(value, path=""):
    """Every (path, value) of an integer under a key ending in ``_bytes`` in an answer's JSON."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k.endswith("_bytes") and isinstance(v, int):
                yield f"{path}.{k}", v
            else:
                yield from _byte_counts(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _byte_counts(v, f"{path}[{i}]")


def test_decoder_linear_shapes_are_megatron_shards():
    spec = resolve_architecture("llama-3-8b").spec  # h 4096, 32 heads, 8 KV heads of 128, FFN 14336
    assert decoder_linear_shapes(spec) == [
        (4096, 4096),
        (1024, 4096),
        (1024, 4096),
        (4096, 4096),
        (14336, 4096),
        (14336, 4096),
        (4096, 14336),
    ]
    # q/k/v/gate/up split by output, o/down by input
    assert decoder_linear_shapes(spec, 2) == [
        (2048, 4096),
        (512, 4096),
        (512, 4096),
        (4096, 2048),
        (7168, 4096),
        (7168, 4096),
        (4096, 7168),
    ]
    # 16 ranks over 8 KV heads: each rank keeps one whole KV head (Megatron replicates them)
    assert decoder_linear_shapes(spec, 16)[1] == (128, 4096)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        decoder_linear_shapes(spec, 0)


def test_rank_spec_counts_replicated_kv_heads():
    spec = resolve_architecture("llama-3-8b").spec
    tp16 = tensor_parallel_rank_spec(
        spec, TrainingConfig(micro_batch_size=1, seq_len=16, tensor_parallel_size=16, data_parallel_size=1)
    )
    tp8 = tensor_parallel_rank_spec(spec, TrainingConfig(micro_batch_size=1, seq_len=16, tensor_parallel_size=8))
    # halving everything but the K and V projections, which stay one head (128 x 4096 each) per rank per layer
    kv = 2 * 128 * 4096 * 32
    assert tp16.total_params > (tp8.total_params - kv) // 2 + kv - 65 * 4096
    n_q, _ = quantized_base_bytes(spec, Quantization.NF4, 16)
    assert n_q < tp16.total_params


@pytest.mark.parametrize("model", SWEEP_MODELS)
def test_tensor_parallel_sweep_answers_with_per_rank_states(recommender, model):
    # issue 28.1: 4 catalog models x TP 1/2/4/8 on 8 x A100-40GB, full fine-tune and QLoRA (10 of 16 crashed)
    full = {tp: _ask(recommender, model, "A100-40GB", 8, tensor_parallel_size=tp) for tp in (1, 2, 4, 8)}
    qlora = {tp: _ask(recommender, model, "A100-40GB", 8, tensor_parallel_size=tp, **QLORA) for tp in (1, 2, 4, 8)}
    for rec in [*full.values(), *qlora.values()]:
        negative = [(p, v) for p, v in _byte_counts(rec.model_dump(mode="json")) if v < 0]
        assert not negative, negative
        assert rec.breakdown["parameters_bytes"] > 0
    # weights and optimizer states are in every phase's breakdown (gradients only in some)
    states = full[1].breakdown["optimizer_states_bytes"] + full[1].breakdown["parameters_bytes"]
    for tp in (2, 4, 8):
        per_rank = full[tp].breakdown["optimizer_states_bytes"] + full[tp].breakdown["parameters_bytes"]
        assert per_rank == pytest.approx(states / tp, rel=0.01), (model, tp)
        # 4-bit weights of one rank's shards: about 1/tp of the TP-1 ones (embedding split too, norms whole)
        assert qlora[tp].breakdown["parameters_bytes"] == pytest.approx(
            qlora[1].breakdown["parameters_bytes"] / tp, rel=0.02
        ), (model, tp)


def test_sweep_covers_answers_with_and_without_alternatives(recommender):
    # the crash was in the alternatives (the QLoRA candidate): both kinds of answer must be in the sweep
    small = _ask(recommender, "llama-3.2-1b", "A100-40GB", 8, tensor_parallel_size=8)
    big = _ask(recommender, "llama-2-7b", "A100-40GB", 8, tensor_parallel_size=2)
    assert small.fits and not small.alternatives
    assert big.alternatives and any(a.change.get("quantization") == "nf4" for a in big.alternatives)


def test_tp2_qlora_llama_3_8b_on_two_rtx_4090_counts_the_rank_shards(recommender):
    # issue 28.1: parameters_bytes was -1.85 GiB ("fits at k = 0"); a hand count of rank 0's weights
    rec = _ask(recommender, "llama-3-8b", "RTX-4090", 2, tensor_parallel_size=2, precision="bf16", **QLORA)
    L, h, vocab = 32, 4096, 128256
    shards = [(2048, h), (512, h), (512, h), (h, 2048), (7168, h), (7168, h), (h, 7168)]
    nf4 = L * sum(quantized_linear_bytes(o, i, Quantization.NF4) for o, i in shards)
    embedding_and_head = 2 * (vocab * h // 2) * 2  # split by vocabulary, bf16
    norms = (2 * L + 1) * h * 2  # whole on every rank, bf16
    adapters = L * 16 * ((h + h) + (h + 1024)) // 2 * 4  # r16 on q_proj, v_proj (PEFT's Llama default), fp32
    hand = nf4 + embedding_and_head + norms + adapters
    assert rec.breakdown["parameters_bytes"] > 0
    assert abs(rec.breakdown["parameters_bytes"] - hand) < 4096, (rec.breakdown["parameters_bytes"], hand)
    assert rec.breakdown["parameters_bytes"] / GIB == pytest.approx(2.82, abs=0.01)


def test_qwen2_5_72b_tp8_on_8_h100_answers_instead_of_a_math_domain_error(recommender):
    rec = _ask(recommender, "qwen2.5-72b", "H100-80GB", 8, tensor_parallel_size=8)
    assert rec.breakdown["parameters_bytes"] > 0
    assert not rec.fits and rec.alternatives  # 72B x 16 B of states over 8 ranks is 135 GiB per rank
    assert (
        rec.breakdown["parameters_bytes"] + rec.breakdown["gradients_bytes"] + rec.breakdown["optimizer_states_bytes"]
    ) / GIB == pytest.approx(135, rel=0.02)


def test_a_hand_written_spec_smaller_than_its_shapes_never_goes_negative():
    # a spec whose total_params is below its layer shapes (hand-written, or one pipeline stage's) keeps weights >= 0
    from model.analytic import model_state_bytes

    spec = ModelSpec(
        model_name="x",
        architecture="llama",
        num_layers=4,
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=4096,
        vocab_size=1000,
        total_params=1_000_000,
        trainable_params=1000,
    )
    t = TrainingConfig(micro_batch_size=1, seq_len=16, finetune="lora", lora_rank=8, quantization="nf4")
    assert model_state_bytes(spec, t).weights_bytes > 0
