"""The SDPA backend table per GPU generation, the bytes each backend keeps, CUDA's autocast and dropout rules."""

from __future__ import annotations

import pytest

from model import cuda_semantics as cs
from model.cuda_semantics import SdpaCall, can_use_cudnn, generation_of, priority_order, saved_bytes, select_backend

G, B = cs.GpuGeneration, cs.SdpaBackend
SM80, SM89, SM90 = G.SM80, G.SM89, G.SM90


def call(**kw) -> SdpaCall:
    base = {
        "batch": 4,
        "num_heads": 12,
        "num_kv_heads": 12,
        "seq_q": 1024,
        "seq_k": 1024,
        "head_dim": 64,
        "dtype": "bf16",
        "is_causal": True,
    }
    return SdpaCall(**(base | kw))


@pytest.mark.parametrize(
    "name,gen",
    [
        ("NVIDIA H200", SM90),
        ("H100 80GB HBM3", SM90),
        ("NVIDIA A100-SXM4-80GB", SM80),
        ("NVIDIA L40S", SM89),
        ("NVIDIA GeForce RTX 4090", SM89),
        ("NVIDIA GeForce RTX 3090", G.SM86),
        ("Tesla T4", G.SM75),
        ("T4", G.SM75),
        ("NVIDIA GeForce RTX 2080 Ti", G.SM75),
        ("Tesla V100-SXM2-16GB", G.SM70),
        ("V100-32GB", G.SM70),
    ],
)
def test_generation_of_device_names(name, gen):
    assert generation_of(name) is gen


def test_unknown_device_names_the_field():
    with pytest.raises(ValueError, match="device_name 'TPU v5'"):
        generation_of("TPU v5")


def test_priority_order_puts_cudnn_first_only_on_sm90_with_new_cudnn():
    assert priority_order(SM90, 91600)[0] is B.CUDNN
    assert priority_order(SM90, 91500)[0] is B.FLASH  # check_prefer_cudnn_attention: strictly newer than 9.15.0
    assert priority_order(SM80, 92000) == (B.FLASH, B.EFFICIENT, B.MATH, B.CUDNN)
    assert priority_order(SM89, None)[-1] is B.CUDNN


# (call fields, sm80, sm89, sm90 with cuDNN 9.16): the backend each generation runs
TABLE = [
    # Llama/Qwen-style causal GQA through HF sdpa (enable_gqa, no mask, no dropout): flash everywhere, cuDNN on sm90
    ({"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "enable_gqa": True}, B.FLASH, B.FLASH, B.CUDNN),
    # GPT-2 with attention dropout 0.1: cuDNN refuses dropout not a multiple of 1/16 -> flash on sm90 too
    ({"dropout_p": 0.1}, B.FLASH, B.FLASH, B.FLASH),
    ({"dropout_p": 0.125}, B.FLASH, B.FLASH, B.CUDNN),
    # a mask (sliding windows, padding): flash refuses masks; cuDNN takes it on sm90, memory-efficient elsewhere
    ({"has_mask": True, "is_causal": False, "head_dim": 96}, B.EFFICIENT, B.EFFICIENT, B.CUDNN),
    # Gemma-3 head dim 256 with a mask: over cuDNN's 128 limit on this cuDNN -> memory-efficient
    (
        {"has_mask": True, "is_causal": False, "head_dim": 256, "num_heads": 4, "num_kv_heads": 4},
        B.EFFICIENT,
        B.EFFICIENT,
        B.EFFICIENT,
    ),
    # head dim 256 with dropout while training: flash refused on sm89 ((224, 256] with dropout)
    ({"head_dim": 256, "dropout_p": 0.1}, B.FLASH, B.EFFICIENT, B.FLASH),
    # head dim 200 training: flash refused on sm86-sm89 ((192, 224]), memory-efficient takes it
    ({"head_dim": 200}, B.FLASH, B.EFFICIENT, B.FLASH),
    # fp32: flash and cuDNN take 16-bit only
    ({"dtype": "fp32"}, B.EFFICIENT, B.EFFICIENT, B.EFFICIENT),
    # Falcon-7B: 71 query heads, one key head, no enable_gqa, a materialised causal mask -> math (torch 2.11)
    ({"num_heads": 71, "num_kv_heads": 1, "has_mask": True, "is_causal": False}, B.MATH, B.MATH, B.MATH),
    # head dim 68 in bf16 is not 8-aligned for memory-efficient or cuDNN, and a mask keeps flash out
    ({"has_mask": True, "head_dim": 68, "is_causal": False}, B.MATH, B.MATH, B.MATH),
    # causal with seq_q != seq_k: flash refuses; memory-efficient takes it
    ({"seq_q": 512}, B.EFFICIENT, B.EFFICIENT, B.CUDNN),
]


@pytest.mark.parametrize("fields,sm80,sm89,sm90", TABLE)
def test_backend_table_per_generation(fields, sm80, sm89, sm90):
    c = call(**fields)
    assert select_backend(c, SM80) is sm80
    assert select_backend(c, SM89) is sm89
    assert select_backend(c, SM90, cudnn_version=91600) is sm90


# (call fields, sm70/sm75): before Ampere there is no FlashAttention-2 and no cuDNN attention (both sm80..sm121),
# and memory-efficient attention takes fp16/fp32 only, with fp32 head dims unaligned (no tensor cores)
PRE_AMPERE_TABLE = [
    ({"dtype": "fp16"}, B.EFFICIENT),  # causal, no mask: flash on sm80+
    ({"dtype": "fp16", "dropout_p": 0.1}, B.EFFICIENT),  # GPT-2 on a T4 under amp_fp16
    ({"dtype": "fp16", "dropout_p": 0.125}, B.EFFICIENT),  # cuDNN on sm90 with a new cuDNN; none here
    ({"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "enable_gqa": True}, B.MATH),  # bf16: math
    ({"dtype": "fp16", "has_mask": True, "is_causal": False, "head_dim": 96}, B.EFFICIENT),
    ({"dtype": "fp32", "head_dim": 66}, B.EFFICIENT),  # alignment 1 for fp32 before sm80 (4 on sm80+)
    ({"dtype": "fp16", "head_dim": 68}, B.MATH),  # 16-bit on tensor cores: alignment 8
]


@pytest.mark.parametrize("fields,backend", PRE_AMPERE_TABLE)
def test_backend_table_before_ampere(fields, backend):
    c = call(**fields)
    for gen in (G.SM70, G.SM75):
        assert select_backend(c, gen, cudnn_version=91600) is backend
        assert not cs.can_use_flash(c, gen) and not can_use_cudnn(c, gen, 92300)
    if fields == {"dtype": "fp32", "head_dim": 66}:
        assert select_backend(c, SM80) is B.MATH  # the same call on an A100: 66 is not a multiple of 4


def test_mqa_broadcast_of_newer_pytorch_lets_falcon_take_a_fused_kernel():
    c = call(num_heads=71, num_kv_heads=1, has_mask=True, is_causal=False)
    assert select_backend(c, SM90, mqa_broadcast=True) is B.EFFICIENT
    assert select_backend(c, SM90, 91600, mqa_broadcast=True) is B.CUDNN


def test_cudnn_head_dim_256_needs_sm90_and_cudnn_9_22():
    c = call(head_dim=256, num_heads=8, num_kv_heads=8)
    assert can_use_cudnn(c, SM90, 92300) and not can_use_cudnn(c, SM90, 91600) and not can_use_cudnn(c, SM80, 92300)
    assert not can_use_cudnn(call(dropout_p=0.125), SM90, 91200)  # cuDNN 9.11-9.13 cannot drop out


def test_saved_bytes_per_backend():
    c = call(batch=4, num_heads=12, seq_q=1024, seq_k=1024, head_dim=64)
    lse = 4 * 12 * 1024 * 4
    assert saved_bytes(c, B.FLASH) == lse + 16
    assert saved_bytes(c, B.CUDNN) == lse + 16
    assert saved_bytes(call(seq_q=1000, seq_k=1000), B.EFFICIENT) == 4 * 12 * 1024 * 4 + 16  # padded to 32
    # math: fp32 probabilities and the scaled fp32 query, plus a 1-byte dropout mask when dropping out
    assert saved_bytes(c, B.MATH) == 4 * 12 * 1024 * 1024 * 4 + 4 * 12 * 1024 * 64 * 4
    assert saved_bytes(call(dropout_p=0.1), B.MATH) - saved_bytes(c, B.MATH) == 4 * 12 * 1024 * 1024
    # Falcon-7B layer at micro-batch 2, seq 2048: the math fallback keeps 2.22 GiB of fp32 probabilities
    falcon = call(batch=2, num_heads=71, num_kv_heads=1, seq_q=2048, seq_k=2048, has_mask=True, is_causal=False)
    assert saved_bytes(falcon, B.MATH) == 2 * 71 * 2048 * 2048 * 4 + 2 * 71 * 2048 * 64 * 4
    assert saved_bytes(call(has_mask=True), B.EFFICIENT) - saved_bytes(c, B.EFFICIENT) == 4 * 1024 * 1024 * 2


@pytest.mark.parametrize("field,value", [("num_kv_heads", 0), ("dtype", "fp8"), ("dropout_p", 1.0)])
def test_bad_call_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        call(**{field: value})


def test_autocast_lists_cuda_vs_cpu():
    # GPT-2's gelu_new (pow), softmax, layer_norm, rsqrt: fp32 on CUDA only; the losses are fp32 on both
    for op in ("pow", "softmax", "log_softmax", "layer_norm", "rsqrt", "sum", "exp"):
        assert cs.fp32_on_cuda_only(op), op
    for op in ("nll_loss", "mse_loss", "mm", "linear", "gelu", "silu"):
        assert not cs.fp32_on_cuda_only(op), op


def test_dropout_mask_bytes():
    assert cs.dropout_mask_bytes_per_element("cuda", 2) == 1 and cs.dropout_mask_bytes_per_element("cpu", 2) == 2
    assert cs.dropout_mask_bytes_per_element("cpu", 4) == 4
    with pytest.raises(ValueError, match="device"):
        cs.dropout_mask_bytes_per_element("xla", 2)
