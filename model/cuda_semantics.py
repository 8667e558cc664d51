"""What a CUDA run does differently from the CPU trace: the SDPA backend, what it saves, CUDA's autocast lists.

A fake-tensor trace runs on device ``cpu``: it dispatches the CPU kernels and the CPU autocast policy. This
module states, as data and small pure functions, what the CUDA run of the same step would do, so the tracer
(:mod:`tracer.cuda_policy`) can follow it and the answer can name it.

**SDPA backend choice** (PyTorch ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``):
the first backend of ``priority_order`` whose ``can_use_*`` checks all pass runs.

* ``priority_order``: the global order is flash, memory-efficient, math, cuDNN (``Context::sDPPriorityOrder``),
  so cuDNN never runs unless ``check_prefer_cudnn_attention`` moves it first: on sm90/sm100 with a runtime cuDNN
  newer than 9.15.0 (``cudnn_version > 91500``).
* ``can_use_flash_attention``: no ``attn_mask`` (``check_for_attn_mask``); q, k, v head dims equal and <= 256
  (``check_head_dim_size_flash``); sm80..sm121 (``check_flash_attention_hardware_support``); fp16/bf16
  (``check_dtypes_low_precision``); on sm86..sm89 training with head dim in (192, 224], or in (224, 256] with dropout,
  refused (``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``); ``is_causal`` needs
  seq_q == seq_k (``check_flash_causal_non_square_seqlens``); equal head counts, or GQA with ``enable_gqa``
  (``check_batch_size_and_num_heads_dense``). Dropout is fine.
* ``can_use_mem_efficient_attention``: masks and dropout fine; sm50..sm121; fp32/fp16/bf16 on sm80+, fp16/fp32
  before (``less_than_sm80_mem_efficient_dtypes``: bf16 on a V100 or T4 takes math); head dims divisible by the
  GEMM alignment (``check_head_dim_size_mem_efficient``, ``minimum_gemm_alignment``: 8 for 16-bit, 4 for fp32 on
  sm80+, 1 for fp32 before); equal head counts or GQA with ``enable_gqa``.
* ``can_use_cudnn_attention``: fp16/bf16; dropout a multiple of 1/16 (``check_cudnn_dropout``; 0.1 is refused); head
  dim a multiple of 8 and <= 128 (256 on sm90 with cuDNN > 9.22, ``check_cudnn_tensor_shapes``); sm80..sm121.
* ``math`` always accepts. Head counts: the torch 2.11 checks need equal head counts unless ``enable_gqa`` (a key
  with one head and no ``enable_gqa``, Falcon's multi-query layout, takes **math**); PyTorch's main branch since
  added a ``supports_mqa`` template argument that lets one key head broadcast (``mqa_broadcast=True`` here).

**Bytes saved for backward per call** (beyond q, k, v and the output, which every backend keeps):

* flash (``_scaled_dot_product_flash_attention``): log-sum-exp fp32 (B, H, S_q) + RNG seed and offset (2 x int64);
* memory-efficient (``_scaled_dot_product_efficient_attention``): log-sum-exp fp32 (B, H, ceil(S_q / 32) * 32) +
  seed and offset; the additive bias, when a mask is given, in the query's dtype;
* cuDNN (``_scaled_dot_product_cudnn_attention``): log-sum-exp fp32 (B, H, S_q, 1) + seed and offset; the bias;
* math (``_scaled_dot_product_attention_math``): the probabilities (B, H, S_q, S_k) in fp32 for 16-bit inputs
  (the composite upcasts q, k, v unless ``allow_fp16_bf16_reduction_math_sdp``), the scaled fp32 query, and with
  dropout a dropout mask the size of the probabilities.

**Autocast** (``aten/src/ATen/autocast_mode.h``/``.cpp``): CUDA runs ``AT_FORALL_FP32`` ops (``pow``, ``exp``,
``rsqrt``, ``layer_norm``, losses, ...) in fp32 and ``AT_FORALL_FP32_SET_OPT_DTYPE`` ops (``softmax``,
``log_softmax``, ``sum``, ``cumsum``, ``prod``, ...) with an fp32 output; the ``AutocastCPU`` lists contain none of
those elementwise ops, so a CPU trace keeps them in 16 bits. Dropout (``aten/src/ATen/native/Dropout.cpp``,
``is_fused_kernel_acceptable``) takes the fused ``native_dropout`` on CUDA, which keeps a 1-byte bool mask; on the
CPU it multiplies by a noise tensor of the input's dtype (2 or 4 bytes per element).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memfit.hf import attention_that_runs
from memfit.schema import Attention


class GpuGeneration(StrEnum):
    """CUDA compute capability families the backend table distinguishes."""

    SM70 = "sm70"  # V100
    SM75 = "sm75"  # T4, RTX 20xx, Titan RTX, Quadro RTX
    SM80 = "sm80"  # A100, A800, A30
    SM86 = "sm86"  # RTX 3090, A40, A10
    SM89 = "sm89"  # L40S, L4, RTX 4090
    SM90 = "sm90"  # H100, H200, H800, GH200


#: device-name fragments (case-insensitive, first match wins) -> generation
DEVICE_GENERATIONS: tuple[tuple[str, GpuGeneration], ...] = (
    ("h100", GpuGeneration.SM90),
    ("h200", GpuGeneration.SM90),
    ("h800", GpuGeneration.SM90),
    ("gh200", GpuGeneration.SM90),
    ("a100", GpuGeneration.SM80),
    ("a800", GpuGeneration.SM80),
    ("a30", GpuGeneration.SM80),
    ("l40", GpuGeneration.SM89),
    ("l4", GpuGeneration.SM89),
    ("4090", GpuGeneration.SM89),
    ("4080", GpuGeneration.SM89),
    ("3090", GpuGeneration.SM86),
    ("a40", GpuGeneration.SM86),
    ("a10", GpuGeneration.SM86),
    ("v100", GpuGeneration.SM70),
    ("titan rtx", GpuGeneration.SM75),
    ("quadro rtx", GpuGeneration.SM75),
    ("2080", GpuGeneration.SM75),
    ("2070", GpuGeneration.SM75),
    ("t4", GpuGeneration.SM75),
)
#: generations before Ampere: no FlashAttention-2 or cuDNN attention (both sm80..sm121), memory-efficient attention
#: in fp16/fp32 only (``less_than_sm80_mem_efficient_dtypes``), and no bfloat16 tensor cores (NVIDIA's Ampere
#: whitepaper introduced them; ``torch.cuda.is_bf16_supported(including_emulation=False)`` needs major >= 8): bf16 runs
#: emulated there
PRE_AMPERE = frozenset({GpuGeneration.SM70, GpuGeneration.SM75})


def generation_of(device_name: str) -> GpuGeneration:
    """The compute-capability family of a GPU by name (e.g. ``"NVIDIA H200"`` -> sm90).

    Raises:
        ValueError: the name matches no known GPU (the message lists the known fragments).
    """
    low = device_name.lower()
    for fragment, gen in DEVICE_GENERATIONS:
        if fragment in low:
            return gen
    raise ValueError(
        f"device_name {device_name!r}: unknown GPU generation; known: {', '.join(f for f, _ in DEVICE_GENERATIONS)}"
    )


class SdpaBackend(StrEnum):
    """``torch.nn.attention.SDPBackend`` members that run on CUDA."""

    CUDNN = "cudnn"
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class SdpaCall:
    """One ``F.scaled_dot_product_attention`` call as the backend checks see it.

    Shapes: query (batch, num_heads, seq_q, head_dim), key/value (batch, num_kv_heads, seq_k, head_dim).
    ``dtype`` is the query's dtype name (``fp32``/``fp16``/``bf16``).

    Raises:
        ValueError: a field out of range (named in the message).
    """

    batch: int
    num_heads: int
    num_kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str = "bf16"
    has_mask: bool = False
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = True

    def __post_init__(self) -> None:
        for name in ("batch", "num_heads", "num_kv_heads", "seq_q", "seq_k", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {self.dropout_p}")


def priority_order(gen: GpuGeneration, cudnn_version: int | None = None) -> tuple[SdpaBackend, ...]:
    """Backends in the order ``select_sdp_backend`` tries them (``priority_order`` /
    ``check_prefer_cudnn_attention``): cuDNN first on sm90 when the runtime cuDNN is newer than 9.15.0
    (``cudnn_version`` as cuDNN reports it, e.g. 91500), else flash, memory-efficient, math, cuDNN."""
    if gen is GpuGeneration.SM90 and cudnn_version is not None and cudnn_version > 91500:
        return SdpaBackend.CUDNN, SdpaBackend.FLASH, SdpaBackend.EFFICIENT, SdpaBackend.MATH
    return SdpaBackend.FLASH, SdpaBackend.EFFICIENT, SdpaBackend.MATH, SdpaBackend.CUDNN


def _heads_ok(c: SdpaCall, mqa_broadcast: bool) -> bool:
    """``check_batch_size_and_num_heads_dense``: equal heads, GQA with ``enable_gqa``, or one broadcast key head."""
    if c.num_heads == c.num_kv_heads:
        return True
    if c.enable_gqa:
        return c.num_heads % c.num_kv_heads == 0
    return mqa_broadcast and c.num_kv_heads == 1


def can_use_flash(c: SdpaCall, gen: GpuGeneration, mqa_broadcast: bool = False) -> bool:
    """``can_use_flash_attention`` for dense inputs on ``gen``."""
    if gen in PRE_AMPERE:  # check_flash_attention_hardware_support: sm80..sm121
        return False
    if c.has_mask or c.head_dim > 256 or c.dtype == "fp32":
        return False
    if c.is_causal and c.seq_q != c.seq_k:
        return False
    sm86_89 = gen in (GpuGeneration.SM86, GpuGeneration.SM89)
    if sm86_89 and c.requires_grad and not (c.head_dim <= 192 or (c.dropout_p == 0.0 and c.head_dim > 224)):
        return False
    return _heads_ok(c, mqa_broadcast)


def can_use_efficient(c: SdpaCall, gen: GpuGeneration, mqa_broadcast: bool = False) -> bool:
    """``can_use_mem_efficient_attention`` for dense inputs on ``gen``: fp32/fp16/bf16 on sm80 or newer, fp16/fp32
    before; head dims a multiple of ``minimum_gemm_alignment`` (16-bit: 8 on tensor cores, sm70 on; fp32: 4 on
    sm80+, 1 before)."""
    if gen in PRE_AMPERE and c.dtype == "bf16":
        return False
    if c.dtype in ("fp16", "bf16"):
        alignment = 8
    else:
        alignment = 1 if gen in PRE_AMPERE else 4
    if c.head_dim % alignment:
        return False
    return _heads_ok(c, mqa_broadcast)


def can_use_cudnn(
    c: SdpaCall, gen: GpuGeneration, cudnn_version: int | None = None, mqa_broadcast: bool = False
) -> bool:
    """``can_use_cudnn_attention`` for dense inputs on ``gen`` (cuDNN 9 or newer assumed)."""
    if gen in PRE_AMPERE:  # check_cudnn_hardware_support: sm80..sm121
        return False
    if c.dtype == "fp32" or c.dropout_p * 16.0 != math.floor(c.dropout_p * 16.0):
        return False
    if c.dropout_p > 0.0 and cudnn_version is not None and 91100 < cudnn_version < 91400:
        return False
    limit = 256 if gen is GpuGeneration.SM90 and cudnn_version is not None and cudnn_version > 92200 else 128
    if c.head_dim > limit or c.head_dim % 8 or c.seq_k == 1:
        return False
    return _heads_ok(c, mqa_broadcast)


def select_backend(
    c: SdpaCall, gen: GpuGeneration, cudnn_version: int | None = None, mqa_broadcast: bool = False
) -> SdpaBackend:
    """The backend ``select_sdp_backend`` runs for ``c`` on ``gen``: the first of :func:`priority_order` whose
    checks pass (math always passes)."""
    checks = {
        SdpaBackend.CUDNN: lambda: can_use_cudnn(c, gen, cudnn_version, mqa_broadcast),
        SdpaBackend.FLASH: lambda: can_use_flash(c, gen, mqa_broadcast),
        SdpaBackend.EFFICIENT: lambda: can_use_efficient(c, gen, mqa_broadcast),
        SdpaBackend.MATH: lambda: True,
    }
    for backend in priority_order(gen, cudnn_version):
        if checks[backend]():
            return backend
    raise AssertionError("unreachable: math always accepts")


def saved_bytes(c: SdpaCall, backend: SdpaBackend) -> int:
    """Bytes one call keeps for backward beyond q, k, v and the output (see the module docstring), in bytes.

    The mask, when a fused backend gets one, is counted once per call in the query's dtype (B, 1, S_q, S_k):
    the boolean mask is converted to an additive bias on every call (``convert_boolean_attn_mask``).
    """
    b, h, sq, sk = c.batch, c.num_heads, c.seq_q, c.seq_k
    rng = 2 * 8  # philox seed and offset, int64 each
    bias = b * sq * sk * _DTYPE_BYTES[c.dtype] if c.has_mask else 0
    if backend is SdpaBackend.FLASH:
        return b * h * sq * 4 + rng
    if backend is SdpaBackend.EFFICIENT:
        return b * h * (-(-sq // 32) * 32) * 4 + rng + bias
    if backend is SdpaBackend.CUDNN:
        return b * h * sq * 4 + rng + bias
    acc = 4 if c.dtype in ("fp16", "bf16") else _DTYPE_BYTES[c.dtype]  # math upcasts 16-bit inputs
    probs = b * h * sq * sk * acc
    dropout_mask = b * h * sq * sk if c.dropout_p > 0.0 else 0
    return probs + b * h * sq * c.head_dim * acc + dropout_mask


#: CUDA autocast ``fp32`` policy (``AT_FORALL_FP32``), ops a transformer step can meet
CUDA_AUTOCAST_FP32_OPS = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
    }
)
#: CUDA autocast ``fp32_set_opt_dtype`` policy (``AT_FORALL_FP32_SET_OPT_DTYPE``): output dtype set to fp32
CUDA_AUTOCAST_FP32_SET_OPT_DTYPE_OPS = frozenset(
    {
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "sum",
    }
)
#: ``AutocastCPU`` fp32 policy ops among the two CUDA sets above (the rest stay in the lower precision on the CPU)
CPU_AUTOCAST_FP32_OPS = frozenset(
    {
        "prod",
        "cdist",
        "mse_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "poisson_nll_loss",
        "smooth_l1_loss",
        "l1_loss",
        "huber_loss",
        "margin_ranking_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "kl_div",
        "multilabel_margin_loss",
        "binary_cross_entropy_with_logits",
    }
)


def fp32_on_cuda_only(op: str) -> bool:
    """True when CUDA autocast runs ``op`` in fp32 (or with an fp32 output) and CPU autocast does not."""
    return (
        op in CUDA_AUTOCAST_FP32_OPS or op in CUDA_AUTOCAST_FP32_SET_OPT_DTYPE_OPS
    ) and op not in CPU_AUTOCAST_FP32_OPS


def dropout_mask_bytes_per_element(device: str, dtype_bytes: int) -> int:
    """Bytes per element dropout keeps for backward: 1 (bool mask of the fused ``native_dropout``) on CUDA, the
    input's element size (``input * noise``) on the CPU (``Dropout.cpp``, ``is_fused_kernel_acceptable``).

    Raises:
        ValueError: ``device`` not ``cuda``/``cpu`` or ``dtype_bytes`` not 2 or 4.
    """
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 or 4, got {dtype_bytes}")
    if device == "cuda":
        return 1
    if device == "cpu":
        return dtype_bytes
    raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")


# --- the target GPU of a request: which terms answer it -------------------------------------------------------------

#: the GPU generation the answer being computed is for (set by the service from the request's cluster,
#: :func:`target_generation`); None: no GPU named, the CPU-semantics terms answer
TARGET_GENERATION: contextvars.ContextVar[GpuGeneration | None] = contextvars.ContextVar(
    "memfit_target_generation", default=None
)


#: the generation assumed for a request that gives its GPU's memory but not its name: the H100/H200's, whose
#: kernels the shipped CUDA rows measured. Any CUDA GPU runs CUDA's autocast lists and fused dropout, which the
#: CPU-semantics terms do not (GPT-2-medium amp_fp16 mb 4 / seq 1024: 12.97 GiB on CPU semantics, 15.09 measured)
UNNAMED_GPU_GENERATION = GpuGeneration.SM90


@contextlib.contextmanager
def target_generation(device_name: str | GpuGeneration | None):
    """Within the block, :func:`model.terms.terms_key` keys configurations whose CUDA trace differs from the CPU
    trace (:func:`cuda_trace_reasons`) by the generation of ``device_name`` (e.g. ``"H100-80GB"`` -> sm90), and the
    tracer traces them with that generation's semantics. A name of no known generation (or None) leaves the CPU
    keys; yields the generation or None."""
    gen: GpuGeneration | None
    if device_name is None or isinstance(device_name, GpuGeneration):
        gen = device_name
    else:
        try:
            gen = generation_of(device_name)
        except ValueError:
            gen = None
    token = TARGET_GENERATION.set(gen)
    try:
        yield gen
    finally:
        TARGET_GENERATION.reset(token)


#: models whose attention calls ``F.scaled_dot_product_attention`` itself with fewer key heads and no
#: ``enable_gqa`` (transformers 5.24 ``modeling_falcon.py``, ``modeling_gpt_bigcode.py``)
OWN_SDPA_WITHOUT_GQA = frozenset({"falcon", "gpt_bigcode"})
#: models under autocast whose rotary embedding hands SDPA fp32 q and k with a mask (sliding window): CUDA autocast
#: casts them to 16 bits and, on sm90, cuDNN returns a head-major output (rows: phi-3-mini, gemma-3-1b)
FP32_ROTARY_MASKED_SDPA = frozenset({"phi3", "gemma3", "gemma3_text"})
#: HF config attributes that hold a dropout probability used in training
DROPOUT_FIELDS = (
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "activation_dropout",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
)


#: dropout defaults of the HF config classes that default to nonzero dropout (transformers 5.24
#: ``configuration_gpt2.py``, ``configuration_opt.py``, ``configuration_gpt_bigcode.py``); every other decoder family
#: of the catalog defaults to 0. Read here so that answering never builds a transformers config (the service keeps
#: transformers out of the request path: ``memfit/canonical_configs.json``)
DEFAULT_DROPOUTS: dict[str, dict[str, float]] = {
    "gpt2": {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1},
    "gpt_bigcode": {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1},
    "opt": {"dropout": 0.1},
}


def _dropouts(cfg: dict[str, Any]) -> dict[str, float]:
    out = {}
    defaults = DEFAULT_DROPOUTS.get(cfg.get("model_type", ""), {})
    for name in DROPOUT_FIELDS:
        p = cfg.get(name, defaults.get(name))
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0.0:
            out[name] = float(p)
    return out


def cuda_trace_reasons(hf_config: dict[str, Any], training: Any, gen: GpuGeneration | None) -> tuple[str, ...]:
    """Why a step of this model and training, traced with ``gen``'s CUDA semantics
    (:func:`tracer.cuda_policy.cuda_step_semantics`), differs from its CPU-semantics trace; empty when the two
    traces are the same, so that the shipped CPU terms answer for ``gen`` too.

    The table (each line a kernel or dtype choice that differs, from the sources in the module docstring):

    * attention ``eager``: CUDA's softmax backward keeps a ``grad * output`` temporary (``SoftMax.cu``);
    * a model in :data:`OWN_SDPA_WITHOUT_GQA` with fewer key heads: the math backend (fp32 probabilities);
    * a dropout probability > 0 (the config's, else :data:`DEFAULT_DROPOUTS`): CUDA's fused dropout keeps 1-byte
      masks, and attention dropout runs in flash on sm80+ where the CPU falls back to math;
    * autocast precision with LayerNorm (``layer_norm_eps``/``layer_norm_epsilon`` in the config, or OPT) or a
      model in :data:`FP32_ROTARY_MASKED_SDPA`: CUDA autocast's fp32 lists and SDPA input casts.

    Models with RMSNorm, no dropout, SDPA with equal heads or GQA (Llama, Qwen, Mistral, Gemma, OLMo-2, Granite,
    SmolLM3) under any precision trace the same: the H200 rows of those families traced both ways gave the same
    bytes (``benchmarks/results/cuda_rows_traced.txt``). Reads the config dict only (no transformers import).
    ``training``: a :class:`memfit.schema.TrainingConfig` (its ``precision`` and ``attention`` are read)."""
    if gen is None:
        return ()
    gen = GpuGeneration(gen)
    mtype = hf_config.get("model_type", "")
    precision = str(getattr(training.precision, "value", training.precision))
    # the attention that runs: a family without SDPA runs eager whatever is asked (memfit.hf.attention_that_runs)
    attention = attention_that_runs(
        mtype or None, Attention(getattr(training.attention, "value", training.attention))
    ).value
    reasons = []
    if attention == "eager":
        reasons.append("attention eager: CUDA's softmax backward holds a grad*output temporary the size of the scores")
    heads = hf_config.get("num_attention_heads") or hf_config.get("n_head") or 0
    kv = hf_config.get("num_key_value_heads")
    if mtype == "falcon":  # FalconConfig defaults: multi_query=True, new_decoder_architecture=False
        if hf_config.get("new_decoder_architecture", False):
            kv = hf_config.get("num_kv_heads") or heads
        else:
            kv = 1 if hf_config.get("multi_query", True) else heads
    if attention != "eager" and mtype in OWN_SDPA_WITHOUT_GQA and kv and kv < heads:
        reasons.append(
            f"attention: math backend on {gen.value} ({kv} key head(s), {heads} query heads, no enable_gqa: the "
            "fused kernels need equal head counts in PyTorch 2.11), fp32 probabilities saved per layer; the CPU "
            "trace runs a fused kernel"
        )
    sdpa_dtype = "bf16" if "bf16" in precision else "fp16" if "fp16" in precision else "fp32"
    math_already = any(r.startswith("attention: math") for r in reasons)
    if attention != "eager" and gen in PRE_AMPERE and sdpa_dtype == "bf16" and not math_already:
        reasons.append(
            f"attention: math backend on {gen.value} (no FlashAttention before sm80, and memory-efficient attention "
            "takes fp16/fp32 only there), fp32 probabilities saved per layer; the CPU trace runs a fused kernel"
        )
    drops = _dropouts(hf_config)
    if drops:
        names = ", ".join(f"{k}={v:g}" for k, v in sorted(drops.items()))
        attn_note = ""
        if attention != "eager" and any("att" in k for k in drops):
            p = max(v for k, v in drops.items() if "att" in k)
            hidden = hf_config.get("hidden_size") or hf_config.get("n_embd") or 0
            head_dim = hf_config.get("head_dim") or (hidden // heads if heads else 64)
            c = SdpaCall(1, max(heads, 1), max(heads, 1), 128, 128, max(head_dim, 1), sdpa_dtype, dropout_p=p)
            backend = select_backend(c, gen)
            name = "memory-efficient" if backend is SdpaBackend.EFFICIENT else backend.value
            attn_note = f"; attention dropout: math fallback on CPU, {name} on {gen.value}"
        reasons.append(f"dropout ({names}): CUDA's fused dropout keeps a 1-byte mask{attn_note}")
    if precision.startswith("amp"):
        layer_norm = any(hf_config.get(n) is not None for n in ("layer_norm_eps", "layer_norm_epsilon"))
        if layer_norm or mtype == "opt":
            reasons.append("autocast: CUDA runs layer_norm, pow, softmax in fp32 (CPU autocast keeps 16 bits)")
        if mtype in FP32_ROTARY_MASKED_SDPA and attention != "eager":
            backend = "cuDNN" if gen is GpuGeneration.SM90 else "memory-efficient"
            reasons.append(
                f"autocast: SDPA gets 16-bit q, k (fp32 after rotary) and runs {backend} on {gen.value} with the mask"
            )
    return tuple(reasons)


def cuda_notes(hf_config: dict[str, Any] | None, training: Any, gen: GpuGeneration | None = None) -> list[str]:
    """The answer's notes naming the CUDA choices assumed for ``gen`` (default: :data:`TARGET_GENERATION`) where
    they change the traced step (:func:`cuda_trace_reasons`); empty without a GPU or when nothing changes."""
    gen = TARGET_GENERATION.get() if gen is None else GpuGeneration(gen)
    if gen is None or hf_config is None:
        return []
    try:
        reasons = cuda_trace_reasons(hf_config, training, gen)
    except Exception:  # noqa: BLE001 - a config transformers can't build has no notes here (its error is elsewhere)
        return []
    return [f"traced with {gen.value} CUDA semantics: {r}" for r in reasons]


#: cuBLAS workspace per (handle, stream), bytes: PyTorch's default ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8``
#: (32 MiB) on sm90 and ``:4096:2:16:8`` (8 MiB + 128 KiB) before (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
#: ``getChosenWorkspaceSize``); cuBLASLt shares it.
CUBLAS_WORKSPACE_BYTES = {
    GpuGeneration.SM70: 4096 * 1024 * 2 + 16 * 1024 * 8,
    GpuGeneration.SM75: 4096 * 1024 * 2 + 16 * 1024 * 8,
    GpuGeneration.SM80: 4096 * 1024 * 2 + 16 * 1024 * 8,
    GpuGeneration.SM86: 4096 * 1024 * 2 + 16 * 1024 * 8,
    GpuGeneration.SM89: 4096 * 1024 * 2 + 16 * 1024 * 8,
    GpuGeneration.SM90: 4096 * 1024 * 8,
}


def step_workspaces(gen: GpuGeneration) -> dict[str, int]:
    """cuBLAS workspace bytes a training step allocates through the caching allocator at the first matmul of each
    phase, never freed, which no trace sees: one per thread that runs matmuls (the forward's and the autograd
    engine's backward thread each get their own handle), keyed by phase (``"forward"``, ``"backward"``)."""
    ws = CUBLAS_WORKSPACE_BYTES[GpuGeneration(gen)]
    return {"forward": ws, "backward": ws}


def step_workspace_bytes(gen: GpuGeneration) -> int:
    """Bytes of cuBLAS workspace a training step holds (:func:`step_workspaces`, summed)."""
    return sum(step_workspaces(gen).values())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def flash_backward_scratch(query_shape, key_shape, itemsize: int) -> list[int]:
    """Bytes of the scratch tensors FlashAttention-2's backward allocates besides its outputs (``mha_bwd``).

    Args:
        query_shape / key_shape: ``(B, H_q, S_q, D)`` and ``(B, H_k, S_k, D)`` as SDPA takes them.
        itemsize: bytes per element of q, k, v.

    Returns:
        ``[softmax_d, dq_accum]`` plus ``[dk_expanded, dv_expanded]`` when ``H_k != H_q``.
    """
    b, h, s_q, d = (int(x) for x in query_shape)
    h_k, s_k = int(key_shape[1]), int(key_shape[2])
    s_round = _round_up(s_q, 128)
    d_round = _round_up(d, 32 if d <= 128 else 64)
    out = [b * h * s_round * 4, b * s_round * h * d_round * 4]
    if h_k != h:
        out += [b * s_k * h * d * itemsize] * 2
    return out
