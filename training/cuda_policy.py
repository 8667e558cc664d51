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
  (:func:`model.cuda_semantics.select_backend`); :func:`training.collect._cuda_sdpa_kernels` runs the
  ``_scaled_dot_product_attention_math`` composite where that is math (e.g. Falcon's one key head without
  ``enable_gqa``: fp32 probabilities saved per layer).

It works by replacing those Python attributes for the duration of the ``with`` block (restored on exit), so it
also holds in processes forked inside the block (``training.phases.trace_terms``' parallel trace) and in
activation checkpointing's recomputation. A ``TorchFunctionMode`` would be cleaner but is popped while its
handler runs, so ``loss.backward()`` (and the recomputation inside it) would escape it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F

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
    patches = []
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
    :func:`training.collect._cuda_sdpa_kernels` calls directly are on no list; without this, a model whose rotary
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
