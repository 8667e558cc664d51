"""The collector (tracer/collect.py): measure / measure_family on tiny models built from catalog configs.

Tiny models keep each family's config (RoPE scaling, tying, ...) from ``data/architectures`` and shrink
the widths: 2-3 layers, hidden 64, 4 heads (2 KV heads for Llama), vocab 256.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from data import catalog
from memfit.schema import (
    FineTune,
    Method,
    Phase,
    Sharding,
    TelemetryRecord,
    TrainingConfig,
)
from tracer.collect import measure, measure_family


def r512(nbytes: int) -> int:
    return math.ceil(nbytes / 512) * 512


def tiny(name: str, layers: int = 2, **over) -> dict:
    cfg = dict(catalog.get(name)["hf_config"])
    if cfg["model_type"] == "gpt2":
        cfg.update(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, n_positions=1024, n_ctx=1024)
    else:
        cfg.update(
            num_hidden_layers=layers,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
        )
    cfg.update(over)
    return cfg


LLAMA = tiny("llama-3.2-1b")  # tied embeddings, GQA 4/2, llama3 RoPE scaling
GPT2 = tiny("gpt2")

# Hand count of the tiny Llama (tied): embed 256*64 = 16384; per layer q 64*64 + k 64*32 + v 64*32 + o 64*64
# = 12288, MLP 3 * 64*128 = 24576, two RMSNorms 2*64 = 128 -> 36992; final norm 64; lm_head tied (0).
LLAMA_EMBED = 256 * 64
LLAMA_LAYER = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128
LLAMA_TOTAL = LLAMA_EMBED + 2 * LLAMA_LAYER + 64
assert (LLAMA_LAYER, LLAMA_TOTAL) == (36992, 90432)


def cfg_(**kw) -> TrainingConfig:
    return TrainingConfig(**{"micro_batch_size": 2, "seq_len": 32, **kw})


# ------------------------------------------------------------------------------------------------
# 1. One primed step == max over two unprimed steps
# ------------------------------------------------------------------------------------------------
PRIME_CASES = [
    pytest.param(LLAMA, cfg_(precision="amp_bf16", optimizer="adamw_foreach"), 0, id="llama-amp_bf16-adamw_foreach"),
    pytest.param(GPT2, cfg_(precision="amp_bf16", optimizer="adamw_foreach"), 0, id="gpt2-amp_bf16-adamw_foreach"),
    pytest.param(LLAMA, cfg_(precision="bf16_fp32_master", optimizer="adamw_foreach"), 0, id="llama-bf16_fp32_master"),
    pytest.param(GPT2, cfg_(precision="fp32", optimizer="adafactor"), 0, id="gpt2-adafactor"),
    pytest.param(LLAMA, cfg_(precision="fp32", optimizer="adafactor"), 0, id="llama-adafactor"),
    pytest.param(LLAMA, cfg_(precision="fp32", optimizer="sgd_momentum"), 0, id="llama-sgd_momentum"),
    pytest.param(
        LLAMA,
        cfg_(precision="amp_bf16", sharding="fsdp_full_shard", data_parallel_size=2),
        0,
        id="llama-fsdp_full_shard-dp2",
    ),
    pytest.param(GPT2, cfg_(precision="fp32", sharding="zero1", data_parallel_size=2), 0, id="gpt2-zero1-dp2"),
    # Fused AdamW + LoRA: the primed run's step counters differ by a few tiny tensors (observed 1024 B).
    pytest.param(
        LLAMA,
        cfg_(precision="amp_bf16", optimizer="adamw_fused", finetune="lora", lora_rank=4),
        4096,
        id="llama-lora-adamw_fused",
    ),
]


@pytest.mark.parametrize("hf, training, tol", PRIME_CASES)
def test_primed_single_step_equals_two_unprimed_steps(hf, training, tol):
    primed = next(measure_family(hf, training, [[]], steps=1, prime=True)).measurement
    unprimed = next(measure_family(hf, training, [[]], steps=2, prime=False)).measurement
    assert primed.peak_allocated_bytes > 500_000
    assert abs(primed.peak_allocated_bytes - unprimed.peak_allocated_bytes) <= tol, (
        primed.peak_allocated_bytes,
        unprimed.peak_allocated_bytes,
    )
    assert primed.peak_phase is unprimed.peak_phase
    # Priming creates the optimizer states before the peak window: they are in the primed run's baseline.
    if training.optimizer.value.startswith("adamw") or training.optimizer.value == "sgd_momentum":
        assert primed.memory_after_init_bytes > unprimed.memory_after_init_bytes


# ------------------------------------------------------------------------------------------------
# 2. Activation checkpointing: peak non-increasing in k, exactly k layers recomputed
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama-3.2-1b", "gpt2"])
def test_peak_non_increasing_in_k_and_k_layers_recomputed(name):
    hf = tiny(name, layers=3)
    training = cfg_(seq_len=512, precision="amp_bf16")  # activations dominate (~10x the model states)
    plans = [[], [1], [0, 1], [0, 1, 2]]
    recs = list(measure_family(hf, training, plans, steps=1, prime=True))
    peaks = [r.measurement.peak_allocated_bytes for r in recs]
    assert [r.measurement.recomputed_layers for r in recs] == [0, 1, 2, 3]
    assert [r.training.checkpoint_layers for r in recs] == plans
    assert [r.training.num_checkpointed_layers for r in recs] == [0, 1, 2, 3]
    assert all(b <= a for a, b in itertools.pairwise(peaks)), peaks
    # Checkpointing the first layers frees their saved activations: strictly lower, and by a lot overall.
    assert peaks[1] < peaks[0] and peaks[2] < peaks[1], peaks
    assert peaks[3] < 0.6 * peaks[0], peaks  # observed 0.43 (llama) and 0.40 (gpt2)
    assert all(r.measurement.peak_phase is Phase.BACKWARD for r in recs)
    # The family re-uses one model; a plan measured alone gives the same figure (nothing leaks across plans).
    alone = measure(hf, training.model_copy(update={"checkpoint_layers": [0, 1]}), steps=2)
    assert alone.measurement.peak_allocated_bytes == peaks[2]
    assert alone.measurement.recomputed_layers == 2


# ------------------------------------------------------------------------------------------------
# 3. LoRA and frozen layers
# ------------------------------------------------------------------------------------------------
def test_lora_counts_and_lower_peak_than_full():
    full = measure(LLAMA, cfg_(precision="amp_bf16"))
    lora = measure(LLAMA, cfg_(precision="amp_bf16", finetune="lora", lora_rank=4))
    # PEFT's default Llama targets are q_proj (64 -> 64) and v_proj (64 -> 32): per layer
    # A_q 4*64 + B_q 64*4 + A_v 4*64 + B_v 32*4 = 896 adapter weights, 2 layers -> 1792.
    adapters = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    assert full.model.total_params == full.model.trainable_params == LLAMA_TOTAL
    assert lora.model.trainable_params == adapters == 1792
    assert lora.model.total_params == LLAMA_TOTAL + adapters
    assert lora.model.trainable_params < lora.model.total_params / 40
    assert lora.measurement.peak_allocated_bytes < 0.75 * full.measurement.peak_allocated_bytes, (
        lora.measurement.peak_allocated_bytes,
        full.measurement.peak_allocated_bytes,
    )  # observed 0.53


def test_frozen_counts_and_lower_peak_than_full():
    full = measure(LLAMA, cfg_(precision="fp32"))
    frozen = measure(LLAMA, cfg_(precision="fp32", finetune="frozen", frozen_layers=1))
    # Frozen: the (tied) embedding and layer 0.
    assert frozen.model.total_params == LLAMA_TOTAL
    assert frozen.model.trainable_params == LLAMA_TOTAL - LLAMA_EMBED - LLAMA_LAYER == 37056
    assert frozen.model.trainable_params < frozen.model.total_params
    assert frozen.measurement.peak_allocated_bytes < full.measurement.peak_allocated_bytes
    # Same model in memory before the step: freezing only changes what gets gradients and states.
    assert frozen.measurement.memory_after_init_bytes == full.measurement.memory_after_init_bytes


# ------------------------------------------------------------------------------------------------
# 4. The record validates and round-trips through to_row / from_row
# ------------------------------------------------------------------------------------------------
def test_record_valid_and_round_trips():
    training = cfg_(
        precision="fp32", finetune="lora", lora_rank=2, lora_target_modules=["q_proj", "o_proj"], checkpoint_layers=[1]
    )
    rec = measure(LLAMA, training, model_name="llama-3.2-1b")
    assert isinstance(rec, TelemetryRecord)
    m = rec.measurement
    assert m.method is Method.FAKE_TRACKER and m.step_time_s is None and m.peak_reserved_bytes is None
    assert m.recomputed_layers == 1 and rec.training.checkpoint_layers == [1]
    assert 0 < m.memory_after_init_bytes <= m.memory_after_forward_bytes <= m.peak_allocated_bytes
    assert rec.model.model_name == "llama-3.2-1b" and rec.model.architecture == "llama"
    assert rec.model.num_layers == 2 and rec.model.num_key_value_heads == 2 and rec.model.tie_word_embeddings
    assert rec.cluster.device_name == "fake-cpu" and rec.cluster.gpu_count == 1
    # rank 2 adapters on q_proj (64->64) and o_proj (64->64): 2 * (2*64 + 64*2) per layer, 2 layers
    assert rec.model.trainable_params == 2 * 2 * (2 * 64 + 64 * 2)

    row = rec.to_row()
    assert all(not isinstance(v, (dict, list)) for v in row.values())
    assert row["checkpoint_layers"] == "[1]" and json.loads(row["lora_target_modules"]) == ["q_proj", "o_proj"]
    assert row["num_checkpointed_layers"] == 1 and row["method"] == "fake_tracker" and row["finetune"] == "lora"
    back = TelemetryRecord.from_row(row)
    assert back == rec
    assert back.content_hash() == rec.content_hash()
    assert TelemetryRecord.model_validate_json(rec.model_dump_json()) == rec


def test_memory_after_init_hand_computed():
    """fp32 tiny Llama before the first step: weights, the two RoPE buffers and the input ids."""
    rec = measure(LLAMA, cfg_(precision="fp32"))
    weights = (
        r512(LLAMA_EMBED * 4)  # 65536 (tied lm_head shares it)
        + 2 * (2 * r512(64 * 64 * 4) + 2 * r512(64 * 32 * 4) + 3 * r512(64 * 128 * 4) + 2 * r512(64 * 4))
        + r512(64 * 4)
    )  # final norm: 256 B -> 512
    rope = 2 * r512(8 * 4)  # inv_freq and original_inv_freq: head_dim/2 = 8 floats each -> 512
    ids = r512(2 * 32 * 8)  # int64 2x32 = 512
    assert rec.measurement.memory_after_init_bytes == weights + rope + ids == 364544


# ------------------------------------------------------------------------------------------------
# 5. Real CPU tensors vs FakeTensorMode
# ------------------------------------------------------------------------------------------------
# Under FakeTensorMode transformers' ``is_tracing()`` is True for every fake tensor; the collector
# stops ``masking_utils`` from building a (b,1,s,s) mask that real runs without padding never build
# (tracer.collect._cuda_sdpa_kernels), so fake and real tensors run the same kernels.
def _fake_and_cpu(hf, training):
    fake = measure(hf, training)
    cpu = measure(hf, training, device="cpu")
    assert cpu.measurement.method is Method.CPU_TRACKER and cpu.cluster.device_name == "cpu"
    assert cpu.measurement.step_time_s is not None and cpu.measurement.step_time_s > 0
    assert fake.measurement.method is Method.FAKE_TRACKER and fake.measurement.step_time_s is None
    assert fake.cluster.device_name == "fake-cpu"
    assert cpu.model == fake.model
    assert fake.measurement.memory_after_init_bytes == cpu.measurement.memory_after_init_bytes
    return fake.measurement, cpu.measurement


@pytest.mark.parametrize(
    "hf, ckpt",
    [
        pytest.param(LLAMA, [], id="llama"),
        pytest.param(LLAMA, [1], id="llama-ckpt-1"),
        # attention dropout 0: with dropout > 0 CPU SDPA (real and fake alike) takes the math path, CUDA does not
        pytest.param({**GPT2, "attn_pdrop": 0.0}, [], id="gpt2-no-attn-dropout"),
    ],
)
def test_cpu_measurement_matches_fake(hf, ckpt):
    """Same kernels on both sides: the tracker over fake tensors counts what it counts over real ones.
    Observed: identical to the byte in all three cases."""
    fake, cpu = _fake_and_cpu(hf, cfg_(seq_len=128, precision="fp32", checkpoint_layers=ckpt))
    f, c = fake.peak_allocated_bytes, cpu.peak_allocated_bytes
    assert abs(f - c) <= 0.01 * c, f"fake {f} vs cpu {c} ({f / c - 1:+.2%})"
    assert fake.recomputed_layers == cpu.recomputed_layers == len(ckpt)


# ------------------------------------------------------------------------------------------------
# 6. Bad input
# ------------------------------------------------------------------------------------------------
def test_tensor_parallel_rejected_outside_the_plan():
    """GPT-2's fused Conv1D projections do not follow the Llama-style tensor-parallel plan."""
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported for this model"):
        measure(GPT2, cfg_(tensor_parallel_size=2))


def test_other_bad_input_rejected():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        measure(GPT2, cfg_(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="device"):
        measure(GPT2, cfg_(), device="tpu")
    with pytest.raises(ValueError, match="steps"):
        measure(GPT2, cfg_(), steps=0)
    with pytest.raises(ValueError, match="out of range"):
        measure(GPT2, cfg_(checkpoint_layers=[2]))  # 2 layers: index 2 does not exist
    with pytest.raises(ValueError, match="data_parallel_size"):
        cfg_(sharding=Sharding.FSDP_FULL_SHARD, data_parallel_size=1)
    with pytest.raises(ValueError, match="lora_rank"):
        cfg_(finetune=FineTune.LORA)
