"""Analytic memory terms against the published formulas they cite."""

import pandas as pd
import pytest

from memfit.schema import ModelSpec, TrainingConfig
from model.analytic import activation_bytes_per_layer, analytic_estimate, model_state_bytes
from model.overhead import CUDA_CONTEXT_BYTES, NCCL_BYTES, OverheadModel
from model.recommend import layer_indices

GB = 10**9


def spec(params=7_500_000_000, **kw):
    base = dict(architecture="gpt2", num_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=16384, vocab_size=50257, total_params=params, trainable_params=params)
    return ModelSpec(**{**base, **kw})


@pytest.mark.parametrize("sharding, expected_gb", [("none", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_figure1(sharding, expected_gb):
    # ZeRO (arXiv 1910.02054) Fig. 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam)
    t = TrainingConfig(micro_batch_size=1, seq_len=1, precision="bf16_fp32_master", sharding=sharding,
                       data_parallel_size=64 if sharding != "none" else 1)
    got = model_state_bytes(spec(), t).total_bytes / GB
    assert got == pytest.approx(expected_gb, abs=0.06)


def test_lora_states_only_for_trainable():
    t = TrainingConfig(micro_batch_size=1, seq_len=1, precision="amp_bf16", finetune="lora", lora_rank=8)
    s = model_state_bytes(spec(trainable_params=10_000_000), t)
    assert s.weights_bytes == 4 * 7_500_000_000
    assert s.gradients_bytes == 4 * 10_000_000 and s.optimizer_bytes == 8 * 10_000_000


def test_korthikanti_gpt_layer():
    # arXiv 2205.05198 Sec. 4.1: s*b*h*(34 + 5*a*s/h) bytes per layer, 16-bit activations, no parallelism
    m = spec()
    s, b, h, a = 2048, 4, 4096, 32
    t = TrainingConfig(micro_batch_size=b, seq_len=s, precision="amp_fp16", attention="eager")
    assert activation_bytes_per_layer(m, t) == s * b * h * (34 + 5 * a * s // h)
    flash = TrainingConfig(micro_batch_size=b, seq_len=s, precision="amp_fp16", attention="sdpa")
    # flash/SDPA: no s^2 scores; an fp32 log-sum-exp (4*a*s*b) is saved instead
    assert activation_bytes_per_layer(m, flash) == s * b * h * 34 + 4 * a * s * b
    tp = TrainingConfig(micro_batch_size=b, seq_len=s, precision="amp_fp16", attention="eager",
                        tensor_parallel_size=8)
    assert activation_bytes_per_layer(m, tp) == s * b * h * (34 + 5 * a * s // h) // 8


def test_checkpointing_trades_layers_for_inputs():
    m = spec(architecture="llama", intermediate_size=11008)
    e0 = analytic_estimate(m, TrainingConfig(micro_batch_size=2, seq_len=4096))
    e_all = analytic_estimate(m, TrainingConfig(micro_batch_size=2, seq_len=4096, checkpoint_layers=list(range(32))))
    assert e_all.activations_bytes == 0 and e_all.checkpoint_inputs_bytes == 32 * 2 * 4096 * 4096 * 2
    assert e_all.backward_peak_bytes < e0.backward_peak_bytes


def test_layer_indices():
    assert layer_indices(3, 8) == [0, 1, 2]
    assert layer_indices(3, 8, pipeline_parallel_size=2) == [0, 1, 4]
    assert layer_indices(4, 32, method="even") == [0, 10, 21, 31]
    assert layer_indices(0, 8) == []
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        layer_indices(9, 8)


def test_overhead_defaults_and_learning():
    om = OverheadModel()
    ov = om.overhead(10 * GB, "NVIDIA H100 80GB HBM3", gpu_count=8)
    assert ov.cuda_context_bytes == CUDA_CONTEXT_BYTES and ov.nccl_bytes == NCCL_BYTES
    assert ov.fragmentation_bytes == pytest.approx(0.05 * 10 * GB, rel=1e-6) and ov.source == "default"
    rows = pd.DataFrame({
        "method": ["cuda"] * 3 + ["fake_tracker"], "device_name": ["H200"] * 3 + ["fake-cpu"],
        "peak_allocated_bytes": [100, 200, 400, 100], "peak_reserved_bytes": [110, 250, 420, None],
        "outside_torch_bytes": [600, 700, 800, None], "oom": [False] * 4})
    om.fit(rows)
    assert om.rows_by_device == {"H200": 3}
    learned = om.overhead(1000, "H200", gpu_count=1)
    # 95th percentile of reserved/allocated (1.10, 1.25, 1.05) = 1.235 -> 235 of 1000 bytes
    assert learned.fragmentation_bytes == 235 and learned.cuda_context_bytes == 700 and learned.nccl_bytes == 0
    assert OverheadModel.from_dict(om.to_dict()).overhead(1000, "H200", 1) == learned
