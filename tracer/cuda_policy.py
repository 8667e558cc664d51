"""Trace a step on fake CPU tensors as a CUDA GPU runs it: CUDA autocast lists, fused dropout, the SDPA backend.

A fake-tensor trace runs on device ``cpu`` and so follows the CPU's choices (:mod:`model.cuda_semantics`
lists them). :func:`cuda_step_semantics` makes the traced step follow CUDA's instead, for one GPU generation:

* **autocast** — while CPU autocast is on, the Python entry points of CUDA's ``fp32`` ops (``torch.pow``,
  ``Tensor.pow``/``__pow__``, ``exp``, ``log``, ``rsqrt``, ``reciprocal``, ``F.layer_norm``, ``F.group_norm``,
  ``F.softplus``, ``logsumexp``, ...) get their 16-bit tensor arguments cast to fp32 first, and CUDA's
  ``fp32_set_opt_dtype`` ops (``softmax``, ``log_softmax``, ``sum``, ``cumsum``, ``prod``) get ``dtype=float32``
  when none is given, which is what ``AutocastCUDA`` does below the Python layer
  (``aten/src/ATen/autocast_mode.cpp``). The casts happen above autograd, so the tensors saved for backward
  have CUDA's dtypes.
* **dropout** — ``F.dropout`` in training runs ``torch.native_dropout``, the fused kernel CUDA takes
  (``Dropout.cpp``, ``is_fused_kernel_acceptable``), which saves a 1-byte bool mask instead of the CPU's
  noise tensor in the input's dtype.
* **SDPA inputs** — :func:`autocast_sdpa_args` casts q, k, v and a float mask to the autocast dtype, as autocast
  does for ``scaled_dot_product_attention`` (the stand-in kernels are called below autocast).
* **SDPA** — :func:`sdpa_backend` answers which backend the generation would run
  (:func:`model.cuda_semantics.select_backend`); :func:`tracer.collect._cuda_sdpa_kernels` runs
  :func:`math_sdpa`, PyTorch's ``_scaled_dot_product_attention_math`` composite as CUDA runs it, where that is
  math (e.g. Falcon's one key head without ``enable_gqa``: fp32 probabilities saved per layer).
* **flash backward scratch** — where the generation runs FlashAttention-2 and the CPU stand-in is the
  memory-efficient kernel (attention dropout), :class:`FlashAttentionScratch` adds ``mha_bwd``'s fp32 scratch
  (``flash_api.cpp``) to the attention backward: 12 MiB per layer for GPT-2 at mb 4 / seq 1024.
* **softmax backward** — CUDA's ``softmax_backward_cuda_out`` (``aten/src/ATen/native/cuda/SoftMax.cu``) first
  computes ``Tensor tmp = grad * output`` and then writes the gradient from it, so a softmax backward holds one
  temporary the size of the gradient (in the promoted dtype of gradient and output) next to the gradient it
  returns; the CPU kernel has no such temporary. Softmax calls that need a gradient (eager attention, the math
  backend's ``_safe_softmax``) go through :class:`CudaSoftmax`, whose backward allocates it. Falcon-7B's math
  attention keeps (B, 71, S, S) fp32 per layer, so this temporary is 2.2 GiB at mb 2 / seq 2048.

It works by replacing those Python attributes for the duration of the ``with`` block (restored on exit), so it
also holds in processes forked inside the block (``tracer.phases.trace_terms``' parallel trace) and in
activation checkpointing's recomputation. A ``TorchFunctionMode`` would be cleaner but is popped while its
handler runs, so ``loss.backward()`` (and the recomputation inside it) would escape it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from model.cuda_semantics import GpuGeneration, SdpaBackend, SdpaCall, select_backend

_LOW = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

#: (owner, attribute) of CUDA autocast ``fp32`` ops a decoder step calls from Python
FP32_ENTRY_POINTS = (
    (torch, "pow"),
    (torch.Tensor, "pow"),
    (torch.Tensor, "__pow__"),
    (torch, "exp"),
    (torch.Tensor, "exp"),
    (torch, "log"),
    (torch.Tensor, "log"),
    (torch, "log1p"),
    (torch, "expm1"),
    (torch, "rsqrt"),
    (torch.Tensor, "rsqrt"),
    (torch, "reciprocal"),
    (torch.Tensor, "reciprocal"),
    (F, "layer_norm"),
    (F, "group_norm"),
    (F, "softplus"),
    (torch, "logsumexp"),
    (torch.Tensor, "logsumexp"),
)
#: (owner, attribute) of CUDA autocast ``fp32_set_opt_dtype`` ops
FP32_SET_OPT_DTYPE_ENTRY_POINTS = (
    (F, "softmax"),
    (torch, "softmax"),
    (torch.Tensor, "softmax"),
    (F, "log_softmax"),
    (torch, "log_softmax"),
    (torch.Tensor, "log_softmax"),
    (torch, "sum"),
    (torch.Tensor, "sum"),
    (torch, "cumsum"),
    (torch.Tensor, "cumsum"),
    (torch, "prod"),
    (torch.Tensor, "prod"),
)

#: cuDNN version the 2026-12-04 H200 rows imply (torch 2.11 + CUDA 13; inferred, not read on the machine): newer than
#: 9.15.0, since Phi-3's masked attention (head dim 96) keeps cuDNN's (B, H, S, D) output plus its transposed copy,
#: and at most 9.22, since Gemma-3's head dim 256 stays on the memory-efficient kernel
ROWS_CUDNN_VERSION = 91900

_state: dict[str, Any] = {"generation": None, "cudnn_version": None, "mqa_broadcast": False}


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW else x


def _fp32(orig):
    @functools.wraps(orig)
    def run(*args, **kwargs):
        if torch.is_autocast_enabled("cpu"):
            args = tuple(_up(a) for a in args)
            kwargs = {k: _up(v) for k, v in kwargs.items()}
        return orig(*args, **kwargs)

    return run


def _fp32_set_opt_dtype(orig):
    @functools.wraps(orig)
    def run(*args, **kwargs):
        x = args[0] if args else kwargs.get("input")
        dtype_given = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args[1:])
        if (
            torch.is_autocast_enabled("cpu")
            and not dtype_given
            and isinstance(x, torch.Tensor)
            and x.is_floating_point()
        ):
            kwargs = {**kwargs, "dtype": torch.float32}
        return orig(*args, **kwargs)

    return run


class CudaSoftmax(torch.autograd.Function):
    """Softmax over ``dim`` whose backward allocates what CUDA's does (``SoftMax.cu``, ``softmax_backward_cuda_out``):
    ``tmp = grad * output`` (alive while the gradient is written) and the gradient in the input's dtype.

    ``half_to_float``: fp16 input, fp32 output (``at::_softmax(x, dim, true)``, CUDA's path for ``softmax(fp16,
    dtype=float32)``). ``safe``: ``at::_safe_softmax`` (rows of -inf give 0; the math SDPA backend), whose derivative
    is the same ``_softmax_backward_data`` (``tools/autograd/derivatives.yaml``)."""

    @staticmethod
    def forward(ctx, x, dim: int, half_to_float: bool = False, safe: bool = False):
        out = torch.ops.aten._safe_softmax(x, dim) if safe else torch.ops.aten._softmax(x, dim, half_to_float)
        ctx.save_for_backward(out)
        ctx.dim, ctx.input_dtype = dim, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        tmp = grad * out  # CUDA's temporary, freed when the kernel returns
        grad_input = torch.ops.aten._softmax_backward_data(grad, out, ctx.dim, ctx.input_dtype)
        del tmp
        return grad_input, None, None, None


def _cuda_softmax(orig):
    """``F.softmax``/``torch.softmax``/``Tensor.softmax`` through :class:`CudaSoftmax` when a gradient is needed.

    With ``dtype`` given, CUDA's ``softmax`` (``aten/src/ATen/native/SoftMax.cpp``) runs fp16 -> fp32 as one
    ``_softmax(x, dim, half_to_float=true)`` and converts other inputs first (``input.toType(dtype)``)."""

    @functools.wraps(orig)
    def run(*args, **kwargs):
        x = args[0] if args else kwargs.get("input", kwargs.get("self"))
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dtype = kwargs.get("dtype")
        if dtype is None:
            dtype = next((a for a in args[2:] if isinstance(a, torch.dtype)), None)
        if (
            not isinstance(x, torch.Tensor)
            or not isinstance(dim, int)
            or not (torch.is_grad_enabled() and x.requires_grad)
            or not x.is_floating_point()
        ):
            return orig(*args, **kwargs)
        if dtype is not None and dtype != x.dtype:
            if x.dtype == torch.float16 and dtype == torch.float32 and isinstance(x, FakeTensor):  # CPU kernels lack it
                return CudaSoftmax.apply(x, dim, True, False)
            x = x.to(dtype)
        return CudaSoftmax.apply(x, dim, False, False)

    return run


#: (owner, attribute) of the softmax entry points :func:`_cuda_softmax` wraps
SOFTMAX_ENTRY_POINTS = ((F, "softmax"), (torch, "softmax"), (torch.Tensor, "softmax"))


def math_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale=None,
    enable_gqa: bool = False,
):
    """PyTorch's math SDPA backend as a CUDA run executes it: ``_scaled_dot_product_attention_math``
    (``aten/src/ATen/native/transformers/attention.cpp``) with real (not subclass) tensors.

    q, k, v (B, H, S, D) are upcast to fp32 when 16-bit; q and k^T are each scaled by sqrt(scale); GQA with
    ``enable_gqa`` repeats k, v per query head (``pre_process_group_query_attention_input``); the additive mask is
    added in place (``attn.add_``: only tensor subclasses such as fake tensors take the out-of-place ``add``);
    ``_safe_softmax`` through :class:`CudaSoftmax`; dropout is CUDA's fused ``native_dropout`` (bool mask); the
    output and the (discarded) probabilities are cast back to the query's dtype. Returns the output
    (B, H, S_q, D) in the query's dtype. ``attn_mask``: None or an additive float mask broadcastable to
    (B, H, S_q, S_k)."""
    origin = query.dtype
    if origin in _LOW:
        query, key, value = query.float(), key.float(), value.float()
    s_q, s_k = query.shape[-2], key.shape[-2]
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    if is_causal:
        causal = torch.ones(s_q, s_k, dtype=torch.bool, device=query.device).tril()
        attn_mask = torch.zeros(causal.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~causal, float("-inf")
        )
    q = query * factor
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    attn = torch.matmul(q, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = CudaSoftmax.apply(attn, -1, False, True)
    if dropout_p > 0.0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    out = torch.matmul(attn, value).to(origin)
    probs = attn.to(origin)  # the op's second output, dropped by scaled_dot_product_attention
    del probs
    return out


class FlashAttentionScratch(torch.autograd.Function):
    """Fused SDPA for a call the generation runs on FlashAttention-2 (:func:`sdpa_backend` is flash): the
    memory-efficient kernel's forward (the CPU fake kernels have no CUDA flash forward; it saves the same output,
    an fp32 log-sum-exp (B, H, S) for S a multiple of 32, and the RNG seed and offset), and a backward that, after
    the gradients, allocates and frees the scratch of FlashAttention-2's ``mha_bwd``
    (:func:`model.cuda_semantics.flash_backward_scratch`: fp32 ``softmax_d`` and ``dq_accum``; ``dk/dv_expanded``
    for GQA) while grad_out, the saved tensors and dq, dk, dv are alive, as on the GPU.

    Args (forward): q, k, v (B, H, S, D) with equal head counts, ``bias`` None or an additive mask in q's dtype,
    ``dropout_p``, ``is_causal``, ``scale``. Returns the output (B, H, S_q, D)."""

    @staticmethod
    def forward(ctx, query, key, value, bias, dropout_p: float, is_causal: bool, scale):
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )
        ctx.save_for_backward(query, key, value, bias, out, lse, seed, offset)
        ctx.args = (dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from model.cuda_semantics import flash_backward_scratch

        query, key, value, bias, out, lse, seed, offset = ctx.saved_tensors
        dropout_p, is_causal, scale = ctx.args
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out,
            query,
            key,
            value,
            bias,
            out,
            lse,
            seed,
            offset,
            dropout_p,
            [True, True, True, False],
            is_causal,
            scale=scale,
        )
        scratch = [
            torch.empty(n, dtype=torch.uint8, device=query.device)
            for n in flash_backward_scratch(query.shape, key.shape, query.element_size())
        ]
        del scratch
        return dq, dk, dv, None, None, None, None


def _fused_dropout(orig):
    @functools.wraps(orig)
    def run(input, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and not inplace and input.is_floating_point():
            return torch.native_dropout(input, p, True)[0]
        return orig(input, p, training, inplace)

    return run


@contextlib.contextmanager
def cuda_step_semantics(
    generation: GpuGeneration | str = GpuGeneration.SM90,
    *,
    autocast: bool = True,
    dropout: bool = True,
    cudnn_version: int | None = ROWS_CUDNN_VERSION,
    mqa_broadcast: bool = False,
):
    """Within the block, traced steps follow CUDA's autocast lists, fused dropout and ``generation``'s SDPA
    backend choice (see the module docstring). Not reentrant.

    ``cudnn_version`` (cuDNN's integer form, 91900 = 9.19): decides whether sm90 prefers cuDNN attention and its
    head-dim limit (:func:`model.cuda_semantics.priority_order`); None: cuDNN not preferred.

    Raises:
        ValueError: ``generation`` is not a :class:`~model.cuda_semantics.GpuGeneration` value.
        RuntimeError: already inside a ``cuda_step_semantics`` block.
    """
    gen = GpuGeneration(generation)
    if _state["generation"] is not None:
        raise RuntimeError("cuda_step_semantics is already active")
    patches = [(o, n, _cuda_softmax) for o, n in SOFTMAX_ENTRY_POINTS]  # inner: autocast's dtype comes first
    if autocast:
        patches += [(o, n, _fp32) for o, n in FP32_ENTRY_POINTS]
        patches += [(o, n, _fp32_set_opt_dtype) for o, n in FP32_SET_OPT_DTYPE_ENTRY_POINTS]
    if dropout:
        patches.append((F, "dropout", _fused_dropout))
    saved = []
    try:
        for owner, name, wrap in patches:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, wrap(getattr(owner, name)))
        _state.update(generation=gen, cudnn_version=cudnn_version, mqa_broadcast=mqa_broadcast)
        yield gen
    finally:
        _state.update(generation=None, cudnn_version=None, mqa_broadcast=False)
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def autocast_sdpa_args(query, key, value, attn_mask):
    """``(query, key, value, attn_mask)`` as autocast hands them to the SDPA kernel inside
    :func:`cuda_step_semantics`: ``scaled_dot_product_attention`` is on the lower-precision list of CUDA (and CPU)
    autocast, so floating inputs are cast to the autocast dtype. The stand-in kernels
    :func:`tracer.collect._cuda_sdpa_kernels` calls directly are on no list; without this, a model whose rotary
    embedding leaves q and k in fp32 (Phi-3, Gemma-3) keeps fp32 q, k, output and mask bias per layer.
    Unchanged outside the block or with autocast off."""
    if _state["generation"] is None or not torch.is_autocast_enabled("cpu"):
        return query, key, value, attn_mask
    low = torch.get_autocast_dtype("cpu")

    def cast(t):
        return t.to(low) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != low else t

    return cast(query), cast(key), cast(value), cast(attn_mask)


def active_generation() -> GpuGeneration | None:
    """The generation of the enclosing :func:`cuda_step_semantics` block, or None outside one."""
    return _state["generation"]


def sdpa_backend(query, key, attn_mask, dropout_p: float, is_causal: bool, enable_gqa: bool) -> SdpaBackend | None:
    """The backend the active generation runs for this ``F.scaled_dot_product_attention`` call (4-D q, k, v of
    shape (batch, heads, seq, head_dim)); None outside :func:`cuda_step_semantics` or for other layouts."""
    gen = _state["generation"]
    if gen is None or query.dim() != 4 or key.dim() != 4 or query.dtype not in _DTYPE_NAMES:
        return None
    call = SdpaCall(
        batch=query.shape[0],
        num_heads=query.shape[1],
        num_kv_heads=key.shape[1],
        seq_q=query.shape[2],
        seq_k=key.shape[2],
        head_dim=query.shape[3],
        dtype=_DTYPE_NAMES[query.dtype],
        has_mask=attn_mask is not None,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        requires_grad=torch.is_grad_enabled() and query.requires_grad,
    )
    return select_backend(call, gen, _state["cudnn_version"], _state["mqa_broadcast"])
