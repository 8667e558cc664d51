"""Tracing with CUDA semantics on the CPU (tracer.cuda_policy): autocast lists, fused dropout, SDPA backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data import catalog
from model.cuda_semantics import SdpaBackend
from tracer import collect
from tracer.collect import measure_family
from tracer.cuda_policy import active_generation, cuda_step_semantics, sdpa_backend
from training.sweep import Family

ROWS = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "gpu_validation" / "h200-2026-12-04"


def _saved(fn) -> list[torch.Tensor]:
    out = []

    def pack(t):
        out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return out


def test_cuda_autocast_lists_apply_only_inside_the_block():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.pow(x, 3.0).dtype == torch.bfloat16  # CPU autocast keeps pow in 16 bits
        with cuda_step_semantics("sm90") as gen:
            assert gen.value == "sm90" and active_generation() is gen
            assert torch.pow(x, 3.0).dtype == torch.float32
            assert (x**3).dtype == torch.float32
            assert F.softmax(x, dim=-1).dtype == torch.float32
            assert F.layer_norm(x, (8,)).dtype == torch.float32
            assert torch.rsqrt(x.abs() + 1).dtype == torch.float32
            assert F.softmax(x, dim=-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype stays
        assert F.softmax(x, dim=-1).dtype == torch.bfloat16
    with cuda_step_semantics():
        assert torch.pow(x, 3.0).dtype == torch.bfloat16  # autocast off: nothing changes
    assert active_generation() is None


def test_dropout_saves_a_bool_mask_as_cuda_does():
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    cpu = _saved(lambda: F.dropout(x, 0.1, training=True))
    assert [t.dtype for t in cpu] == [torch.bfloat16]  # CPU: input * noise, noise in the input's dtype
    with cuda_step_semantics():
        cuda = _saved(lambda: F.dropout(x, 0.1, training=True))
        assert F.dropout(x, 0.1, training=False) is x
    assert [t.dtype for t in cuda] == [torch.bool]


def test_not_reentrant_and_generation_checked():
    with cuda_step_semantics(), pytest.raises(RuntimeError, match="already active"), cuda_step_semantics():
        pass
    with pytest.raises(ValueError, match="sm60"), cuda_step_semantics("sm60"):
        pass


def test_falcon_style_multi_query_with_mask_runs_math_and_saves_fp32_probabilities():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), collect._cuda_sdpa_kernels():  # the fused kernels' CPU stand-ins exist for fake tensors
        q = torch.randn(1, 4, 32, 16, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 1, 32, 16, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(1, 1, 32, 32, dtype=torch.bool).tril()
        fused = _saved(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask))
        with cuda_step_semantics("sm90"):
            assert sdpa_backend(q, k, mask, 0.0, False, False) is SdpaBackend.MATH
            assert sdpa_backend(q, k, None, 0.0, True, True) is SdpaBackend.CUDNN  # sm90 prefers cuDNN (9.19)
            math = _saved(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask))
    assert not any(t.shape[-2:] == (32, 32) and t.dtype == torch.float32 for t in fused)
    assert any(t.shape[-2:] == (32, 32) and t.dtype == torch.float32 and t.numel() >= 4 * 32 * 32 for t in math)


def test_sdpa_inputs_are_autocast_and_cudnn_output_is_head_major():
    """Phi-3's rotary embedding leaves q and k in fp32; autocast hands SDPA 16-bit q, k, v, and cuDNN (sm90, cuDNN
    9.19: Phi-3's masked head dim 96) returns a (B, H, S, D)-contiguous output."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), collect._cuda_sdpa_kernels(), torch.autocast("cpu", dtype=torch.bfloat16):
        q = torch.randn(2, 4, 64, 96, requires_grad=True)  # fp32, as after Phi-3's rotary embedding
        v = torch.randn(2, 4, 64, 96, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
        before = F.scaled_dot_product_attention(q, q, v, attn_mask=mask)
        with cuda_step_semantics("sm90"):
            assert sdpa_backend(v, v, mask, 0.0, False, False) is SdpaBackend.CUDNN  # sees the autocast 16-bit q
            after = F.scaled_dot_product_attention(q, q, v, attn_mask=mask)
        with cuda_step_semantics("sm90", cudnn_version=None):
            assert sdpa_backend(v, v, mask, 0.0, False, False) is SdpaBackend.EFFICIENT
            efficient = F.scaled_dot_product_attention(q, q, v, attn_mask=mask)
    assert before.dtype == torch.float32 and after.dtype == torch.bfloat16
    assert after.is_contiguous() and not efficient.is_contiguous()  # efficient: (B, S, H, D) storage


def _cuda_row(model: str, attention: str, k: int) -> int:
    for line in (ROWS / "gpu_records.jsonl").read_text().splitlines():
        r = json.loads(line)
        t = r["training"]
        if r["model"]["model_name"] == model and t["attention"] == attention and len(t["checkpoint_layers"]) == k:
            return r["measurement"]["peak_allocated_bytes"]
    raise LookupError(model)


def test_gpt2_under_autocast_traced_as_cuda_runs_it():
    """Issue 26: gpt2 amp_bf16 sdpa mb 4 s 1024 k = 0 was traced 12.0 % under the H200's 7.05 GiB: CUDA runs GELU's
    pow in fp32 (its output, tanh and the product stay fp32 into c_proj) and keeps 1-byte dropout masks."""
    fam = Family("gpt2", 4, 1024)
    cuda = _cuda_row("gpt2", "sdpa", 0)
    cfg = catalog.get("gpt2")["hf_config"]

    def trace():
        return next(
            iter(measure_family(cfg, fam.training(), [[]], model_name="gpt2", device="fake", steps=1, prime=True))
        ).measurement.peak_allocated_bytes

    before = trace()
    with cuda_step_semantics("sm90"):
        after = trace()
    assert (before - cuda) / cuda == pytest.approx(-0.1203, abs=0.001)
    assert (after - cuda) / cuda == pytest.approx(-0.0119, abs=0.001)  # the cuBLAS workspace and others: ~75 MiB


def test_generations_before_ampere_trace_memory_efficient_or_math_attention():
    """A T4 (sm75) has no FlashAttention-2: GPT-2's dropout attention in fp16 traces the memory-efficient kernel,
    and bf16 (which that kernel refuses before sm80) the math composite; an A100 takes flash for both."""
    from model.cuda_semantics import SdpaBackend
    from tracer.cuda_policy import sdpa_backend

    def backend(gen, dtype):
        q = torch.empty(2, 4, 128, 64, dtype=dtype)
        with cuda_step_semantics(gen):
            return sdpa_backend(q, q, None, 0.1, True, False)

    assert backend("sm75", torch.float16) is SdpaBackend.EFFICIENT
    assert backend("sm75", torch.bfloat16) is SdpaBackend.MATH
    assert backend("sm70", torch.float16) is SdpaBackend.EFFICIENT
    assert backend("sm80", torch.float16) is backend("sm80", torch.bfloat16) is SdpaBackend.FLASH
