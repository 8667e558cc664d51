"""bitsandbytes in the collector: 8-bit and Lion optimizers, the optimizer step fused into backward, and
quantized (QLoRA) base weights, all run by the real library code under fake tensors.

bitsandbytes >= 0.45 registers its kernels as ``torch.library`` custom ops with fake implementations
(``bitsandbytes/_ops.py``), so its optimizers and 4-bit matmuls run under ``FakeTensorMode`` and on CPU.
What a fake kernel returns is what the CUDA kernel allocates (its output, no temporaries), which is what
:class:`tracer.tracker.LiveStorageTracker` counts. Three things differ from a CUDA run and are handled
here:

* **Paged optimizer states.** ``PagedAdamW8bit`` allocates the states of parameters with >= 1e5
  elements with ``F.get_paged`` (``cudaMallocManaged``: unified memory outside PyTorch's caching
  allocator, so never in ``torch.cuda.max_memory_allocated``). Off CUDA, :func:`make_bnb_optimizer`
  allocates them as ordinary tensors and tells the tracker not to count them (:meth:`untrack`).
* **Quantized weights under fake tensors.** ``Params4bit``/``Int8Params`` cannot wrap a fake tensor
  (``_make_subclass``), so :func:`quantize_base_linears` calls the real quantizer
  (``bitsandbytes.functional.quantize_4bit`` / ``int8_vectorwise_quant``) and puts its outputs into
  ``bnb.nn.Linear4bit`` / ``bnb.nn.Linear8bitLt`` modules whose weight is a plain frozen Parameter
  carrying the same attributes (``quant_state``, ``quant_type``, ``CB``/``SCB``). Their ``forward`` is
  bitsandbytes' own; PEFT wraps them with its bitsandbytes LoRA layers as for a model loaded with
  ``BitsAndBytesConfig``.
* **The dequantize-per-linear transient.** For a training-sized matmul (more than 1536 rows) the CUDA
  ``gemm_4bit`` dispatch dequantizes the whole weight and calls ``F.linear``
  (``backends/cuda/ops.py``: ``_dequant_linear_fallback``); its fake kernel returns only the output.
  :func:`cuda_kernel_choices` replaces the op by that decomposition (``_gemm_4bit_default_impl``: the
  double-quantized absmax dequantized to fp32, the weight dequantized to the input's dtype, the
  linear), so the transient is traced. Backward dequantizes again (``MatMul4Bit.backward``), which runs
  as is. LLM.int8 matmuls take the CUDA path (``MatMul8bitLt``) instead of the CPU one.

Layouts (bitsandbytes 0.50.2, checked against the installed library in ``tests/test_optim_qlora.py``):
``AdamW8bit`` state per parameter with >= 4096 elements: ``state1``/``state2`` uint8 of the parameter's
shape, ``absmax1``/``absmax2`` fp32 of ceil(n/256) blocks (``Optimizer2State.init_state``), smaller
parameters two fp32 states; ``Lion`` (32-bit) one fp32 state; ``quantize_4bit``: ceil(n/2) bytes of
packed codes and an fp32 absmax per 64 weights, or with ``compress_statistics`` uint8 absmax values,
an fp32 absmax per 256 of them and an fp32 offset (Dettmers et al. 2023, QLoRA, arXiv 2305.14314,
Sec. 3); ``Int8Params``: int8 weights and an fp32 scale per output row (LLM.int8, arXiv 2208.07339).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from memfit.schema import Optimizer, Quantization

#: PagedAdamW8bit pages the states of parameters with at least this many elements (``get_state_buffer``)
PAGED_MIN_NUMEL = 100_000
#: the CUDA gemm_4bit dispatch dequantizes and calls F.linear above this many rows (``_gemm_4bit_custom_max_m``)
GEMM_4BIT_CUSTOM_MAX_ROWS = 1536
#: block sizes of bitsandbytes' defaults: Linear4bit weights, the double-quantized absmax, 8-bit optimizer states
NF4_BLOCK, NF4_ABSMAX_BLOCK, OPTIM_8BIT_BLOCK = 64, 256, 256
#: AdamW8bit keeps fp32 states for parameters with fewer elements (``min_8bit_size``)
OPTIM_8BIT_MIN_NUMEL = 4096

BNB_OPTIMIZERS = frozenset({Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.LION})


def _bnb():
    """Import bitsandbytes without its chatter about optional kernels."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
        import bitsandbytes

    return bitsandbytes


def make_bnb_optimizer(kind: Optimizer, params, *, lr: float, tracker=None):
    """A bitsandbytes optimizer of ``kind`` over ``params``.

    With a ``tracker`` (fake or CPU runs), paged states are allocated as ordinary tensors and untracked:
    on CUDA they are unified memory outside PyTorch's allocator.

    Raises:
        ValueError: ``kind`` is not a bitsandbytes optimizer.
    """
    bnb = _bnb()
    if kind is Optimizer.ADAMW_8BIT:
        return bnb.optim.AdamW8bit(params, lr=lr)
    if kind is Optimizer.LION:
        return bnb.optim.Lion(params, lr=lr)
    if kind is not Optimizer.PAGED_ADAMW_8BIT:
        raise ValueError(
            f"optimizer={kind.value} is not a bitsandbytes optimizer (allowed: "
            f"{', '.join(sorted(o.value for o in BNB_OPTIMIZERS))})"
        )
    if tracker is None:
        return bnb.optim.PagedAdamW8bit(params, lr=lr)

    class HostPagedAdamW8bit(bnb.optim.PagedAdamW8bit):
        """``PagedAdamW8bit`` whose paged buffers are plain tensors the tracker does not count."""

        def get_state_buffer(self, p, dtype=torch.float32):
            buf = torch.zeros_like(p, dtype=dtype)
            if p.numel() >= PAGED_MIN_NUMEL:
                tracker.untrack(buf)
            return buf

    return HostPagedAdamW8bit(params, lr=lr)


class OptimizerInBackward:
    """The optimizer step fused into backward: one optimizer per trainable parameter, stepped by that
    parameter's post-accumulate-grad hook, which then frees its gradient (torchtune's
    ``optimizer_in_bwd``; PyTorch tutorial "How to save memory by fusing the optimizer step into the
    backward pass"). No full gradient buffer ever exists: gradients are freed as backward produces them.

    :meth:`step` steps only parameters whose gradient is still set (e.g. zero gradients set to create
    the states before measuring); after a backward there are none. Call :meth:`close` to remove the hooks.
    """

    def __init__(self, params, make_one) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = {p: make_one([p]) for p in self.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def _hook(self, p) -> None:
        opt = self.optimizers[p]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                self._hook(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# -- quantized bases -------------------------------------------------------------------------------
def _frozen_weight(data: torch.Tensor, **attrs: Any) -> torch.nn.Parameter:
    w = torch.nn.Parameter(data, requires_grad=False)
    for k, v in attrs.items():
        setattr(w, k, v)
    return w


def _linear4bit(linear: torch.nn.Linear, double_quant: bool, storage_dtype, compute_dtype):
    bnb = _bnb()
    F = bnb.functional
    if double_quant:
        # the shared 8-bit code of the double-quantized absmax is cached in a module global on first use;
        # made under another (fake) mode it cannot mix with this one's tensors: let this mode make it
        F.name2qmap.pop("dynamic", None)
    with torch.no_grad():
        packed, state = F.quantize_4bit(
            linear.weight.detach().to(storage_dtype),
            blocksize=NF4_BLOCK,
            compress_statistics=double_quant,
            quant_type="nf4",
            quant_storage=torch.uint8,
        )
    mod = bnb.nn.Linear4bit.__new__(bnb.nn.Linear4bit)
    torch.nn.Module.__init__(mod)
    mod.in_features, mod.out_features = linear.in_features, linear.out_features
    mod.weight = _frozen_weight(
        packed,
        quant_state=state,
        quant_type="nf4",
        compress_statistics=double_quant,
        blocksize=NF4_BLOCK,
        quant_storage=torch.uint8,
        bnb_quantized=True,
        module=mod,
    )
    # Linear4bit.forward casts a bias to the compute dtype in place on the first call: do it now, so that
    # every measured step runs the same ops
    mod.bias = None if linear.bias is None else _frozen_weight(linear.bias.detach().to(compute_dtype))
    mod.compute_dtype, mod.compute_type_is_set = compute_dtype, True
    mod.quant_state, mod.quant_storage, mod.support_avx512bf16_for_cpu = state, torch.uint8, False
    return mod


def _linear8bit(linear: torch.nn.Linear, storage_dtype):
    bnb = _bnb()
    with torch.no_grad():
        CB, SCB, _ = bnb.functional.int8_vectorwise_quant(linear.weight.detach().to(storage_dtype))
    mod = bnb.nn.Linear8bitLt.__new__(bnb.nn.Linear8bitLt)
    torch.nn.Module.__init__(mod)
    mod.in_features, mod.out_features = linear.in_features, linear.out_features
    mod.weight = _frozen_weight(CB, CB=CB, SCB=SCB)
    mod.bias = None if linear.bias is None else _frozen_weight(linear.bias.detach())
    state = bnb.MatmulLtState()
    # HF's llm_int8_threshold is 6.0: input columns with a value above it go through an fp16 matmul. Which
    # columns is data-dependent (no fake-tensor size exists for it); the traced step has none, so the
    # fp16 sub-matrix of those columns (b*s x outliers, a small fraction of the input) is not counted.
    state.threshold, state.has_fp16_weights, state.is_training = 0.0, False, True
    state.CB, state.SCB = CB, SCB
    mod.state, mod.index = state, None
    mod.forward = lambda x, m=mod: _int8_forward(m, x)
    return mod


def _int8_forward(mod, x):
    """``Linear8bitLt.forward`` with the CUDA matmul (``MatMul8bitLt``) on every device."""
    from bitsandbytes.autograd._functions import MatMul8bitLt

    bias = mod.bias
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return MatMul8bitLt.apply(x, mod.weight, None, bias, mod.state)


def quantize_base_linears(model, quantization: Quantization, *, storage_dtype, compute_dtype) -> int:
    """Replace the ``nn.Linear`` layers inside the decoder (not ``lm_head``) by bitsandbytes' quantized
    layers, as ``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` does, and mark the
    model loaded in 4/8 bit so that PEFT wraps them with its bitsandbytes LoRA layers.

    ``storage_dtype`` is the dtype the weights were loaded in (the dequantized weight's dtype),
    ``compute_dtype`` ``bnb_4bit_compute_dtype``. Returns the number of layers replaced.

    Raises:
        ValueError: ``quantization`` is ``none``, or the decoder's matrices are not ``nn.Linear``
            (GPT-2's ``Conv1D``: not modelled).
    """
    if quantization is Quantization.NONE:
        raise ValueError("quantization='none' quantizes nothing")
    conv = [name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    if conv:
        raise ValueError(
            f"quantization={quantization.value} is modelled for decoders of nn.Linear layers; this "
            f"model's {conv[0]} is a Conv1D"
        )
    out_emb = model.get_output_embeddings()
    targets = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear and m is not out_emb]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if quantization is Quantization.INT8:
            new = _linear8bit(linear, storage_dtype)
        else:
            new = _linear4bit(linear, quantization is Quantization.NF4_DOUBLE_QUANT, storage_dtype, compute_dtype)
        setattr(parent, child, new)
    if quantization is Quantization.INT8:
        model.is_loaded_in_8bit = True
    else:
        model.is_loaded_in_4bit = True
    return len(targets)


class _CudaKernelChoices(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.bitsandbytes.gemm_4bit.default:
            from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

            return _gemm_4bit_default_impl(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_kernel_choices():
    """Run bitsandbytes' 4-bit matmul as CUDA runs it for training-sized inputs: dequantize the weight,
    then ``F.linear`` (see the module docstring). Entered inside the tracker, so the decomposed ops are
    counted. Inputs of at most 1536 rows take a fused kernel on some GPUs without the transient; the
    tracer counts it always (conservative, and one op sequence for every traced token count)."""
    _bnb()
    with _CudaKernelChoices():
        yield
