"""8-bit / paged / Lion optimizers, the optimizer step in backward, and QLoRA bases (issue 9, items 1-2).

What is checked here:

* the layouts memfit counts (:mod:`model.analytic`) against the installed bitsandbytes, run for real on CPU;
* the collector's fake-tensor trace against a real CPU run of the same step (both through the tracker);
* what the step in backward and paged states change, to the byte;
* schema, service, CLI and ``describe()`` errors and pick-up.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from memfit.schema import Optimizer, Quantization, TrainingConfig
from model.analytic import (
    decoder_linear_shapes,
    model_state_bytes,
    optimizer_state_bytes_per_param,
    quantized_linear_bytes,
)
from tracer.bnb import _bnb
from tracer.collect import _prime_optimizer, measure, measure_family, prepared_model
from tracer.phases import _traced_step

bnb = _bnb()

# a small Llama wide enough that AdamW8bit quantizes its matrices (>= 4096 elements) and PagedAdamW8bit
# pages the MLP ones (>= 1e5 elements: 256 x 512), while q/k/v/o (256 x 256 = 65536) stay on the device
HF = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 320,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def r512(n: float) -> int:
    return math.ceil(n / 512) * 512


def cfg(**kw) -> TrainingConfig:
    return TrainingConfig(**{"micro_batch_size": 2, "seq_len": 64, "precision": "bf16", **kw})


# ------------------------------------------------------------------------------------------------
# 1. Layouts against the real library
# ------------------------------------------------------------------------------------------------
def test_adamw8bit_state_layout_matches_bitsandbytes():
    """bitsandbytes 0.50.2 ``Optimizer2State.init_state``: uint8 state1/state2 of the parameter's shape and
    an fp32 absmax per 256-element block each for >= 4096 elements; two fp32 states below."""
    big, small = torch.nn.Parameter(torch.randn(300, 4096)), torch.nn.Parameter(torch.randn(4095))
    opt = bnb.optim.AdamW8bit([big, small])
    for p in (big, small):
        p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[big]
    assert (st["state1"].dtype, st["state2"].dtype, st["state1"].shape) == (torch.uint8, torch.uint8, big.shape)
    assert st["absmax1"].dtype == torch.float32 and st["absmax1"].numel() == math.ceil(big.numel() / 256)
    assert {k: v.dtype for k, v in opt.state[small].items() if torch.is_tensor(v)} == {
        "state1": torch.float32,
        "state2": torch.float32,
    }
    # memfit's per-parameter figure is exact for the large tensor (2 B + 2 x 4 B per 256 elements)
    per_param, paged = optimizer_state_bytes_per_param(cfg(optimizer="adamw_8bit"))
    real = sum(st[k].numel() * st[k].element_size() for k in ("state1", "state2", "absmax1", "absmax2"))
    assert paged == 0 and real == big.numel() * per_param


def test_lion_keeps_one_fp32_state_whatever_the_parameter_dtype():
    p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    opt = bnb.optim.Lion([p])
    p.grad = torch.randn_like(p)
    opt.step()
    states = {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)}
    assert {k: (v.dtype, v.numel()) for k, v in states.items()} == {"state1": (torch.float32, p.numel())}
    assert optimizer_state_bytes_per_param(cfg(optimizer="lion")) == (4.0, 0.0)


@pytest.mark.parametrize("quantization", [Quantization.NF4, Quantization.NF4_DOUBLE_QUANT])
def test_4bit_layout_matches_bitsandbytes(quantization):
    """A real ``bnb.nn.Linear4bit`` quantized on CPU holds what :func:`quantized_linear_bytes` counts."""
    out_f, in_f = 384, 320  # 122880 weights: 1920 absmax blocks, 8 double-quant blocks (the last one partial)
    lin = bnb.nn.Linear4bit(
        in_f, out_f, bias=False, quant_type="nf4", compress_statistics=quantization is Quantization.NF4_DOUBLE_QUANT
    )
    lin = lin.to("cpu")
    qs = lin.weight.quant_state
    tensors = [lin.weight.data, qs.absmax, qs.code]
    if qs.nested:
        tensors += [qs.state2.absmax, qs.offset, qs.state2.code]
    assert lin.weight.numel() == out_f * in_f // 2
    assert qs.absmax.numel() == out_f * in_f // 64
    assert sum(r512(t.numel() * t.element_size()) for t in tensors) == quantized_linear_bytes(out_f, in_f, quantization)


def test_int8_layout_matches_bitsandbytes():
    out_f, in_f = 384, 320
    lin = bnb.nn.Linear8bitLt(in_f, out_f, bias=False, has_fp16_weights=False).to("cpu")
    w = lin.weight
    assert (w.dtype, w.SCB.dtype, w.SCB.numel()) == (torch.int8, torch.float32, out_f)
    assert r512(w.numel()) + r512(4 * w.SCB.numel()) == quantized_linear_bytes(out_f, in_f, Quantization.INT8)


# ------------------------------------------------------------------------------------------------
# 2. The trace under fake tensors equals a real CPU run
# ------------------------------------------------------------------------------------------------
CASES = [
    pytest.param({"optimizer": "adamw_8bit"}, id="adamw_8bit"),
    pytest.param({"optimizer": "paged_adamw_8bit"}, id="paged_adamw_8bit"),
    pytest.param({"optimizer": "lion"}, id="lion"),
    pytest.param({"optimizer": "adamw_8bit", "optimizer_in_backward": True}, id="adamw_8bit-in-backward"),
    pytest.param(
        {"optimizer": "adamw_foreach", "optimizer_in_backward": True, "precision": "amp_bf16"},
        id="adamw-in-backward-amp",
    ),
    pytest.param({"finetune": "lora", "lora_rank": 8, "quantization": "nf4"}, id="qlora-nf4"),
    pytest.param(
        {
            "finetune": "lora",
            "lora_rank": 8,
            "quantization": "nf4_double_quant",
            "precision": "amp_bf16",
            "checkpoint_layers": [1],
        },
        id="qlora-nf4-dq-amp-ckpt",
    ),
    pytest.param({"finetune": "lora", "lora_rank": 8, "quantization": "int8"}, id="qlora-int8"),
]


@pytest.mark.parametrize("over", CASES)
def test_fake_trace_matches_real_cpu_run(over):
    """The same bitsandbytes code runs on fake and on real CPU tensors; the tracker counts the same.
    Observed: equal, or within 2 KiB (a quantization code table made once per process)."""
    training = cfg(**over)
    fake = measure(HF, training).measurement
    cpu = measure(HF, training, device="cpu").measurement
    assert abs(fake.peak_allocated_bytes - cpu.peak_allocated_bytes) <= 4096, (fake, cpu)
    assert fake.peak_phase == cpu.peak_phase


def test_state_floor_never_above_a_measured_peak():
    """The curve's floor (:func:`model_state_bytes`) stays under every traced peak of the new settings."""
    for p in CASES:
        training = cfg(**p.values[0])
        rec = measure(HF, training)
        floor = model_state_bytes(rec.model, training).total_bytes
        assert floor <= rec.measurement.peak_allocated_bytes, (p.id, floor, rec.measurement.peak_allocated_bytes)


# ------------------------------------------------------------------------------------------------
# 3. What the settings change, to the byte
# ------------------------------------------------------------------------------------------------
def test_paged_states_are_outside_the_allocator():
    """Primed, before any step: PagedAdamW8bit holds on the device what AdamW8bit holds minus the uint8
    states of parameters with >= 1e5 elements (cudaMallocManaged, not PyTorch memory)."""
    init = {}
    for kind in ("adamw_8bit", "paged_adamw_8bit"):
        rec = next(iter(measure_family(HF, cfg(optimizer=kind), [[]], prime=True)))
        init[kind] = rec.measurement.memory_after_init_bytes
    with prepared_model(HF, cfg()) as run:
        paged = sum(2 * r512(p.numel()) for p in run.model.parameters() if p.numel() >= 100_000)
    assert paged == 2 * 2 * 3 * r512(256 * 512)  # two layers x three MLP matrices x two uint8 states
    assert init["adamw_8bit"] - init["paged_adamw_8bit"] == paged


def test_step_in_backward_leaves_no_gradient_for_the_optimizer_phase():
    """Entering the optimizer phase, a step fused into backward has freed every gradient: live bytes are
    back to the step's start. The plain optimizer enters it with every gradient alive."""
    live_at = {}
    for fused in (False, True):
        with prepared_model(HF, cfg(optimizer="adamw_8bit", optimizer_in_backward=fused)) as run:
            opt = run.make_optimizer()
            _prime_optimizer(run.model, opt)
            timeline = _traced_step(run, opt, run.input_ids(2, 64))
            grads = sum(r512(p.numel() * p.element_size()) for p in run.model.parameters() if p.requires_grad)
            getattr(opt, "close", lambda: None)()
        marks = {phase: live for phase, live in reversed(timeline)}  # first entry of each phase
        live_at[fused] = marks["opt"] - marks["rest"]
    assert live_at[True] == 0
    assert live_at[False] == grads


def test_quantized_weights_counted_exactly():
    """Model states of a QLoRA model built by the collector (bitsandbytes' own quantizer under fake
    tensors): the weights memfit counts (:func:`model_state_bytes`) plus the RoPE buffers are the live
    bytes after the build."""
    for q in (Quantization.NF4, Quantization.NF4_DOUBLE_QUANT, Quantization.INT8):
        training = cfg(finetune="lora", lora_rank=8, quantization=q)
        with prepared_model(HF, training) as run:
            live = run.tracker.live_bytes
            spec = run.spec
        head_dim = 256 // 4
        rotary = 2 * r512(4 * head_dim // 2)  # the two RoPE buffers, inv_freq and original_inv_freq (fp32)
        code = 1024 if q is Quantization.NF4_DOUBLE_QUANT else 0  # the shared 8-bit code of the absmax values
        weights = model_state_bytes(spec, training).weights_bytes
        # model_state_bytes counts unquantized parameters unrounded; here every one is a multiple of 512 B.
        # The first 4-bit build of a process also leaves two 512-byte tables in bitsandbytes' module caches.
        assert 0 <= live - (weights + rotary + code) <= 1024, (q, live, weights)
    assert len(decoder_linear_shapes(spec)) == 7


# ------------------------------------------------------------------------------------------------
# 4. Errors and pick-up
# ------------------------------------------------------------------------------------------------
def test_unknown_values_name_the_field_and_the_allowed_values():
    with pytest.raises(ValidationError, match="adamw_8bit.*paged_adamw_8bit.*lion"):
        cfg(optimizer="adam8")
    with pytest.raises(ValidationError, match="'none', 'nf4', 'nf4_double_quant' or 'int8'"):
        cfg(finetune="lora", lora_rank=8, quantization="nf3")
    with pytest.raises(ValidationError, match="quantization: must be 'none' unless finetune='lora'"):
        cfg(quantization="nf4")


def test_hf_quantization_config_read():
    from memfit.errors import InvalidConfiguration
    from memfit.hf import quantization_from_hf

    assert quantization_from_hf({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}) is Quantization.NF4
    assert (
        quantization_from_hf({"load_in_4bit": True, "bnb_4bit_use_double_quant": True}) is Quantization.NF4_DOUBLE_QUANT
    )
    assert quantization_from_hf({"load_in_8bit": True}) is Quantization.INT8
    assert quantization_from_hf({"quant_method": "bitsandbytes"}) is Quantization.NONE
    with pytest.raises(InvalidConfiguration, match="quantization_config.quant_method: must be 'bitsandbytes'"):
        quantization_from_hf({"quant_method": "gptq", "bits": 4})
    with pytest.raises(InvalidConfiguration, match="bnb_4bit_quant_type: must be one of 'nf4', 'fp4'"):
        quantization_from_hf({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"})
    from transformers import BitsAndBytesConfig

    real = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    assert quantization_from_hf(real) is Quantization.NF4_DOUBLE_QUANT
    assert quantization_from_hf(real.to_dict()) is Quantization.NF4_DOUBLE_QUANT


def test_service_takes_quantization_from_the_config_dict_and_refuses_contradictions():
    from memfit.api import TrainingIn
    from memfit.errors import InvalidConfiguration
    from memfit.hf import model_spec
    from model.job import training_config

    hf = {**HF, "quantization_config": {"load_in_4bit": True, "bnb_4bit_use_double_quant": True}}
    spec = model_spec(HF)
    lora = {"micro_batch_size": 1, "seq_len": 64, "finetune": "lora", "lora_rank": 8}
    training, _ = training_config(TrainingIn(**lora), spec, 1, hf)
    assert training.quantization is Quantization.NF4_DOUBLE_QUANT
    with pytest.raises(InvalidConfiguration) as err:
        training_config(TrainingIn(**lora, quantization="int8"), spec, 1, hf)
    assert err.value.field == "training.quantization" and "nf4_double_quant" in err.value.allowed
    with pytest.raises(InvalidConfiguration) as err:
        training_config(TrainingIn(micro_batch_size=1, seq_len=64), spec, 1, hf)
    assert err.value.field == "training.quantization" and "finetune='lora'" in err.value.allowed
    # the request gave no quantization: the message says where it came from (helper 40 was told of a flag never given)
    assert str(err.value).startswith(
        "training.quantization: nf4_double_quant, read from the model's quantization_config"
    )


def test_service_answers_422_naming_the_field(tmp_path, small_registry):
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 's.db'}", registry_dir=str(small_registry.root)))
    with TestClient(app) as client:
        body = {
            "model": "llama-3.2-1b",
            "training": {"micro_batch_size": 1, "seq_len": 512, "optimizer": "adamw_bnb"},
            "cluster": {"gpu": "A100-80GB"},
        }
        r = client.post("/recommend", json=body)
        assert r.status_code == 422, r.text
        assert "training.optimizer" in r.text and "paged_adamw_8bit" in r.text
        body["training"].update(optimizer="adamw_8bit", quantization="nf4")
        r = client.post("/recommend", json=body)
        assert r.status_code == 422, r.text
        assert "training.quantization" in r.text and "finetune='lora'" in r.text


def test_shipped_rows_answered_by_the_traced_curve():
    """The collected rows (the slices' 47 rows of the shipped telemetry, full-depth models) are answered by the
    one curve from the shipped terms (data/terms/optim_qlora.jsonl) to within 0.01 %
    (benchmarks/results/optim_qlora.txt: MAPE <= 0.001 % per slice)."""
    from benchmarks.optim_qlora import evaluate, load_records

    records = load_records()
    assert len(records) == 47
    res = evaluate(records)
    assert set(res) == {
        "adamw_8bit",
        "adamw_8bit in-backward",
        "adamw_foreach in-backward",
        "lion",
        "paged_adamw_8bit",
        "paged_adamw_8bit in-backward",
        "qlora int8",
        "qlora nf4",
        "qlora nf4_double_quant",
    }
    for name, m in res.items():
        assert m["paths"] == ["traced"] and m["max_err_pct"] < 0.01, (name, m)


def test_describe_picks_up_a_qlora_model_and_bitsandbytes_optim_names():
    """A real PEFT model over bitsandbytes 4-bit layers (quantized by bitsandbytes on CPU tensors)."""
    import types

    from peft import LoraConfig, get_peft_model

    import memfit
    from memfit.hf import build_causal_lm
    from tracer.bnb import quantize_base_linears

    model = build_causal_lm(HF, dtype=torch.bfloat16)
    quantize_base_linears(
        model, Quantization.NF4_DOUBLE_QUANT, storage_dtype=torch.bfloat16, compute_dtype=torch.bfloat16
    )
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    args = types.SimpleNamespace(per_device_train_batch_size=1, optim="paged_adamw_8bit", bf16=True)
    req = memfit.describe(model, seq_len=128, training_args=args, gpu="A100-80GB", optimizer_in_backward=True)
    t = req.training
    assert (t.quantization, t.optimizer, t.optimizer_in_backward, t.finetune.value, t.lora_rank) == (
        Quantization.NF4_DOUBLE_QUANT,
        Optimizer.PAGED_ADAMW_8BIT,
        True,
        "lora",
        8,
    )
    # the 4-bit weights count as the weights they hold, not as their packed bytes
    from memfit.describe import parameter_counts

    lora = 2 * 8 * (2 * 256 + 2 * 256)  # two layers, q and v: r x (in + out) each
    assert req.training.trainable_params == lora
    assert parameter_counts(model) == (parameter_counts(build_causal_lm(HF))[0] + lora, lora)
    model.get_base_model().config.quantization_config = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    assert (
        memfit.describe(model, seq_len=128, micro_batch_size=1, gpu="A100-80GB").training.quantization
        is Quantization.NF4
    )
    with pytest.raises(ValueError, match="training_args.optim='adamw_anyprecision' is not modelled"):
        memfit.describe(
            model,
            seq_len=128,
            gpu="A100-80GB",
            training_args=types.SimpleNamespace(per_device_train_batch_size=1, optim="adamw_anyprecision"),
        )


def test_cli_flags_reach_the_request():
    from service.cli import build_parser, request_from_args

    a = build_parser().parse_args(
        [
            "recommend",
            "--model",
            "llama-3.2-1b",
            "--micro-batch",
            "1",
            "--seq-len",
            "512",
            "--gpu",
            "A100-80GB",
            "--lora-rank",
            "8",
            "--quantization",
            "nf4",
            "--optimizer",
            "paged_adamw_8bit",
            "--optimizer-in-backward",
        ]
    )
    t = request_from_args(a).training
    assert (t.quantization, t.optimizer, t.optimizer_in_backward) == (
        Quantization.NF4,
        Optimizer.PAGED_ADAMW_8BIT,
        True,
    )
