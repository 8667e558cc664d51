"""Analytic memory terms against the published formulas they cite."""

import json

import numpy as np
import pandas as pd
import pytest

from memfit.schema import ModelSpec, TrainingConfig
from model.analytic import activation_bytes_per_layer, analytic_estimate, model_state_bytes
from model.overhead import (
    CUDA_CONTEXT_BYTES,
    DEFAULT_ALLOWANCE_RATIO,
    NCCL_BYTES,
    PRESSURE_FILES,
    VALIDATION_FILES,
    OverheadModel,
    allocated_residuals,
    pressure_ratios,
)
from model.recommend import layer_indices

GB = 10**9


def spec(params=7_500_000_000, **kw):
    base = {
        "architecture": "gpt2",
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 16384,
        "vocab_size": 50257,
        "total_params": params,
        "trainable_params": params,
    }
    return ModelSpec(**{**base, **kw})


@pytest.mark.parametrize("sharding, expected_gb", [("none", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_figure1(sharding, expected_gb):
    # ZeRO (arXiv 1910.02054) Fig. 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam)
    t = TrainingConfig(
        micro_batch_size=1,
        seq_len=1,
        precision="bf16_fp32_master",
        sharding=sharding,
        data_parallel_size=64 if sharding != "none" else 1,
    )
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
    # Sec. 4.2: tensor parallel size t with sequence parallelism divides everything by t; without it 10*sbh
    # (LayerNorm inputs, QKV and first-MLP inputs, dropout masks) stay whole: s*b*h*(10 + 24/t + 5*a*s/(h*t))
    sp = TrainingConfig(
        micro_batch_size=b,
        seq_len=s,
        precision="amp_fp16",
        attention="eager",
        tensor_parallel_size=8,
        sequence_parallel=True,
    )
    assert activation_bytes_per_layer(m, sp) == s * b * h * (34 + 5 * a * s // h) // 8
    tp = sp.model_copy(update={"sequence_parallel": False})
    assert activation_bytes_per_layer(m, tp) == s * b * h * 10 + s * b * h * (24 + 5 * a * s // h) // 8


def test_checkpointing_trades_layers_for_inputs():
    m = spec(architecture="llama", intermediate_size=11008)
    e0 = analytic_estimate(m, TrainingConfig(micro_batch_size=2, seq_len=4096))
    e_all = analytic_estimate(m, TrainingConfig(micro_batch_size=2, seq_len=4096, checkpoint_layers=list(range(32))))
    assert e_all.activations_bytes == 0 and e_all.checkpoint_inputs_bytes == 32 * 2 * 4096 * 4096 * 2
    assert e_all.backward_peak_bytes < e0.backward_peak_bytes


def test_layer_indices():
    assert layer_indices(3, 8) == [0, 1, 2]
    assert layer_indices(3, 8, pipeline_parallel_size=2) == [0, 1, 4]
    # 30 layers over 4 stages are 7, 7, 8, 8 (model.parallel.stage_layer_counts): k layers are k indices, in
    # the stages' own ranges, the last stages taking what the full first ones cannot
    assert layer_indices(30, 30, pipeline_parallel_size=4) == list(range(30))
    assert layer_indices(29, 30, pipeline_parallel_size=4) == list(range(29))  # stage 3 (22-29) is the one short
    assert layer_indices(5, 30, pipeline_parallel_size=4) == [0, 1, 7, 14, 22]
    assert layer_indices(4, 32, method="even") == [0, 10, 21, 31]
    assert layer_indices(0, 8) == []
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        layer_indices(9, 8)


def test_overhead_defaults_and_learning(tmp_path):
    om = OverheadModel()
    outside, source = om.outside_pytorch("NVIDIA H100 80GB HBM3", gpu_count=8)
    assert outside == CUDA_CONTEXT_BYTES + NCCL_BYTES
    assert source.startswith("1343 MiB from HF transformers' model memory anatomy guide")
    assert om.allowance_ratio(False) == (DEFAULT_ALLOWANCE_RATIO, "default 5 % (no GPU pressure run with this setting)")
    rows = pd.DataFrame(
        {
            "method": ["cuda"] * 3 + ["fake_tracker"],
            "device_name": ["H200"] * 3 + ["fake-cpu"],
            "peak_allocated_bytes": [100, 200, 400, 100],
            "peak_reserved_bytes": [110, 250, 420, None],
            "outside_torch_bytes": [600, 700, 800, None],
            "oom": [False] * 4,
        }
    )
    # two default-allocator pressure runs (unconstrained reserved / allocated 1.02, 1.30, 1.10) and one with
    # expandable segments (1.01); the needed-under-pressure figures are not the allowance
    (tmp_path / "a.json").write_text(
        json.dumps(
            {
                "alloc_conf": None,
                "rows": [
                    {"reserved_over_allocated": 1.02, "needed_over_allocated": 1.5},
                    {"reserved_over_allocated": 1.30},
                    {"error": "does not run"},
                ],
            }
        )
    )
    (tmp_path / "b.json").write_text(
        json.dumps({"alloc_conf": "expandable_segments:True", "rows": [{"reserved_over_allocated": 1.01}]})
    )
    (tmp_path / "c.json").write_text(json.dumps({"alloc_conf": None, "rows": [{"reserved_over_allocated": 1.10}]}))
    (tmp_path / "v.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"allocated_bytes": 1100, "tracker_bytes": 1000},
                    {"allocated_bytes": 2064, "tracker_bytes": 2000},
                    {"allocated_bytes": 9000, "tracker_bytes": 1000},
                    {"error": "failed"},
                ]
            }
        )
    )
    om.fit(rows, pressure_files=sorted(tmp_path.glob("[abc].json")), validation_files=[tmp_path / "v.json"])
    assert om.rows_by_device == {"H200": 3} and om.outside_pytorch("H200", 1)[0] == 700  # median of the cuda rows
    assert om.allowance_by_setting == {"default": pytest.approx(1.10), "expandable_segments:True": pytest.approx(1.01)}
    assert om.allowance_ratio(True)[0] == pytest.approx(1.01)
    assert om.cublas_workspace_bytes == 100  # median of the CUDA-minus-tracker residuals (64, 100, 8000)
    assert OverheadModel.from_dict(om.to_dict()) == om
    # an unseen device keeps the guide's context (the measured 700 B is below it), NCCL added on several GPUs
    assert om.outside_pytorch("NVIDIA A100-SXM4-80GB", gpu_count=2)[0] == CUDA_CONTEXT_BYTES + NCCL_BYTES


def test_shipped_pressure_measurements():
    """The shipped H200 measurements: the default allocator needs more than expandable segments."""
    ratios = pressure_ratios(PRESSURE_FILES)
    default, expandable = ratios["default"], ratios["expandable_segments:True"]
    assert len(default) >= 20 and len(expandable) >= 15
    assert 1.0 <= min(default) and max(default) < 1.35 and 1.05 < float(np.median(default)) < 1.10
    assert max(expandable) < 1.07 and float(np.median(expandable)) < float(np.median(default))
    # CUDA allocated = fake tracker + the cuBLAS workspaces (66 MiB on H200) in all but GPT-2's dropout pairs
    residual_mib = np.array(allocated_residuals(VALIDATION_FILES)) / 2**20
    assert len(residual_mib) >= 20 and 60 < np.median(residual_mib) < 70
    assert np.mean((residual_mib > 50) & (residual_mib < 120)) > 0.8


def test_a_family_without_sdpa_is_counted_with_the_eager_scores_it_runs():
    """BLOOM asked for SDPA runs eager attention (transformers has no SDPA for it; the collector records its rows as
    eager): the analytic layer activations and the largest request count its (b, heads, s, s) scores either way."""
    from data import catalog
    from model.analytic import largest_request_bytes

    bloom, llama = catalog.spec("bloom-7b1"), catalog.spec("llama-3-8b")
    sdpa, eager = (
        TrainingConfig(micro_batch_size=2, seq_len=4096),
        TrainingConfig(micro_batch_size=2, seq_len=4096, attention="eager"),
    )
    assert activation_bytes_per_layer(bloom, sdpa) == activation_bytes_per_layer(bloom, eager)
    long_sdpa, long_eager = (t.model_copy(update={"seq_len": 16384}) for t in (sdpa, eager))  # scores over logits
    assert largest_request_bytes(bloom, long_sdpa) == largest_request_bytes(bloom, long_eager) == 4 * 2 * 32 * 16384**2
    assert activation_bytes_per_layer(llama, sdpa) < activation_bytes_per_layer(llama, eager)


@pytest.mark.parametrize("sharding", ["zero2", "fsdp_shard_grad_op"])
def test_a_4bit_base_under_shard_grad_op_gathers_its_packed_codes_not_a_16bit_copy(sharding):
    """QLoRA under ZeRO-2 / FSDP shard-grad-op with autocast counted the gathered copy as 2 bytes for every
    parameter, the 4-bit base's too: Llama-2-13B r64 on 8 GPUs held 25.35 GiB of weights, above the 24.34 of
    the same job on a 16-bit base (8.06 without sharding). The packed codes are gathered as stored: the gathered
    copy is the 16-bit unquantized weights and adapters plus the codes, besides the fp32 shard."""
    from data import catalog
    from memfit.api import RecommendRequest
    from model.analytic import quantized_base_bytes
    from model.job import resolve

    def weights(**training):
        req = RecommendRequest.model_validate(
            {
                "model": "llama-2-13b",
                "training": {"micro_batch_size": 1, "seq_len": 512, "finetune": "lora", "lora_rank": 64, **training},
                "cluster": {"gpu": "A100-80GB", "gpu_count": 8},
            }
        )
        job = resolve(req.model, req.training, req.cluster)
        return job.spec, job.training, model_state_bytes(job.spec, job.training).weights_bytes

    spec, t, w = weights(quantization="nf4", sharding=sharding)
    _, _, bf16_base = weights(sharding=sharding)
    _, _, unsharded = weights(quantization="nf4")
    n_q, q_bytes = quantized_base_bytes(catalog.spec("llama-2-13b"), t.quantization)
    frozen, trainable = spec.total_params - spec.trainable_params, spec.trainable_params
    fp32 = (frozen - n_q) * 4 + q_bytes + trainable * 4  # what the ranks shard
    assert w == (frozen - n_q) * 2 + q_bytes + trainable * 2 + fp32 // 8
    assert w < bf16_base / 2 and w < 1.05 * unsharded
