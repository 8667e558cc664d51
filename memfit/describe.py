"""Describe a live training job as a :class:`memfit.api.RecommendRequest`.

:func:`describe` reads what the running process already knows — the model's HF config, its
parameter counts (LoRA/frozen aware), the GPU, the world size, and the DeepSpeed config or HF
``TrainingArguments`` — so a training script needs only the sequence length::

    req = memfit.describe(model, seq_len=4096, training_args=args)
    rec = memfit.Client(url).recommend(req)

torch is imported lazily (the model is a ``torch.nn.Module``); transformers, peft and deepspeed are
never required.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memfit.alloc_conf import alloc_conf_from_env
from memfit.api import GPUS, ArchitectureIn, ClusterIn, RecommendRequest
from memfit.checkpointing import MemfitWarning
from memfit.errors import InvalidConfiguration, invalid_from_validation
from memfit.hf import logical_numel, quantization_from_hf
from memfit.schema import (
    Attention,
    CheckpointImpl,
    FineTune,
    Offload,
    Optimizer,
    Precision,
    Quantization,
    Sharding,
    default_data_parallel_size,
)

log = logging.getLogger("memfit")

#: HF config keys that say nothing about memory and only bloat the request.
_DROP_KEYS = {
    "architectures",
    "transformers_version",
    "_name_or_path",
    "id2label",
    "label2id",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "auto_map",
    "task_specific_params",
    "_commit_hash",
}
#: HF ``TrainingArguments.optim`` names memfit models; any other name is refused (never taken as AdamW)
_HF_OPTIM = {
    "adamw_torch": Optimizer.ADAMW_FOREACH,
    "adamw_hf": Optimizer.ADAMW_FOREACH,
    "adamw_torch_fused": Optimizer.ADAMW_FUSED,
    "adafactor": Optimizer.ADAFACTOR,
    "sgd": Optimizer.SGD_MOMENTUM,
    "adamw_bnb_8bit": Optimizer.ADAMW_8BIT,
    "adamw_8bit": Optimizer.ADAMW_8BIT,
    "paged_adamw_8bit": Optimizer.PAGED_ADAMW_8BIT,
    "lion_32bit": Optimizer.LION,
}
_DS_OPTIM = {"adam": Optimizer.ADAMW_FOREACH, "adamw": Optimizer.ADAMW_FOREACH, "sgd": Optimizer.SGD_MOMENTUM}
_ATTN = {
    "sdpa": Attention.SDPA,
    "eager": Attention.EAGER,
    "flash_attention_2": Attention.FLASH,
    "flash_attention_3": Attention.FLASH,
    "flex_attention": Attention.FLASH,
}


def unwrap(model):
    """The innermost ``nn.Module``: through ``torch.compile`` (``_orig_mod``), DDP/DeepSpeed engines
    (``module``) and PEFT (``get_base_model()``)."""
    for _ in range(8):
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine", "DataParallel") and hasattr(
            model, "module"
        ):
            model = model.module
        else:
            break
    return model


def clean_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A HF config dict without the keys that say nothing about memory (names, labels, dtype, ...)."""
    return {k: v for k, v in cfg.items() if k not in _DROP_KEYS}


def hf_config_dict(model) -> dict[str, Any] | None:
    """The model's HF config as a JSON-safe dict (memory-irrelevant keys dropped), or None."""
    config = getattr(unwrap(model), "config", None)
    if config is None or not hasattr(config, "to_dict") or not getattr(config, "model_type", None):
        return None
    return clean_hf_config(json.loads(json.dumps(config.to_dict(), default=str)))


def parameter_counts(model) -> tuple[int, int]:
    """(total, trainable) parameters; DeepSpeed ZeRO-3 partitioned parameters count their full size
    (``ds_numel``), DTensors their global size, shared tensors once."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = int(getattr(p, "ds_numel", 0) or logical_numel(p))
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def _load_ds_config(ds: Any) -> dict[str, Any] | None:
    if ds is None or ds is False:
        return None
    if isinstance(ds, dict):
        return ds
    if isinstance(ds, (str, Path)):
        text = str(ds).strip()
        try:
            loaded = json.loads(text) if text.startswith("{") else json.loads(Path(text).read_text())
        except OSError as err:
            raise ValueError(f"deepspeed_config: cannot read {text!r}: {err.strerror or err}") from None
        except ValueError as err:
            raise ValueError(f"deepspeed_config: {text[:80]!r} is not a JSON object: {err}") from None
        if not isinstance(loaded, dict):  # the file's content is wrong, not the argument's type
            raise ValueError(f"deepspeed_config: {text[:80]!r} holds a JSON {type(loaded).__name__}, not an object")  # noqa: TRY004
        return loaded
    cfg = getattr(ds, "config", None)  # HfDeepSpeedConfig / DeepSpeedEngine
    if not isinstance(cfg, dict):
        raise TypeError(
            "deepspeed_config: a dict, a JSON file path or text, or an object with a .config dict (HfDeepSpeedConfig, "
            f"a DeepSpeed engine), got {type(ds).__name__}"
        )
    return cfg


def _choice(enum: type, value: Any, field: str):
    """``enum(value)``, or an :class:`InvalidConfiguration` naming ``field`` and the allowed values."""
    try:
        return enum(getattr(value, "value", value))
    except ValueError:
        raise InvalidConfiguration(field, f"one of {[x.value for x in enum]}", value) from None


def _enabled(block: Any, auto: bool) -> bool:
    if not isinstance(block, dict):
        return False
    v = block.get("enabled", False)
    return auto if v == "auto" else bool(v)


def ds_offload(ds: dict[str, Any] | None) -> tuple[Offload | None, Offload | None]:
    """(offload_optimizer, offload_parameters) of a DeepSpeed config: ``zero_optimization.offload_optimizer.device``
    and ``zero_optimization.offload_param.device`` (``"none"`` or ``"cpu"``; the legacy ``cpu_offload: true``
    is ``offload_optimizer.device: cpu``). None where the config says nothing.

    Raises:
        ValueError: a device memfit does not model (``nvme``), naming the config key and the allowed values.
    """
    zero = (ds or {}).get("zero_optimization") or {}
    out: list[Offload | None] = []
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        device = block.get("device") if isinstance(block, dict) else None
        if device is None and key == "offload_optimizer" and zero.get("cpu_offload") is True:
            device = "cpu"
        if device is None:
            out.append(None)
            continue
        try:
            out.append(Offload(str(device).lower()))
        except ValueError:
            raise ValueError(
                f"zero_optimization.{key}.device={device!r} is not modelled; allowed: {[o.value for o in Offload]}"
            ) from None
    return out[0], out[1]


def fsdp2_offloads_parameters(model) -> bool:
    """True when an FSDP2 module of ``model`` has ``offload_policy=CPUOffloadPolicy()`` (parameters,
    gradients and the optimizer step on the host)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None and isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
                return True
    return False


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _frozen_leading_layers(model) -> int:
    from memfit.hf import decoder_layers

    layers = decoder_layers(model)
    n = 0
    for layer in layers or []:
        params = list(layer.parameters())
        if params and not any(p.requires_grad for p in params):
            n += 1
        else:
            break
    return n


def _active_lora_config(model) -> Any:
    """The active adapter's PEFT config (``model.peft_config[model.active_adapter]``), or None."""
    cfgs = getattr(model, "peft_config", None)
    if not isinstance(cfgs, dict) or not cfgs:
        return None
    active = getattr(model, "active_adapter", "default")
    active = active[0] if isinstance(active, (list, tuple)) and active else active
    return cfgs.get(active) or next(iter(cfgs.values()))


def _lora(model) -> tuple[int, list[str] | None] | None:
    """(rank, target module names) of the active LoRA adapter, or None when the model has none."""
    cfg = _active_lora_config(model)
    r = getattr(cfg, "r", None)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        return None
    targets = getattr(cfg, "target_modules", None)
    if isinstance(targets, str):  # a regex in PEFT: name the modules it matched instead
        targets = [name for name, m in model.named_modules() if hasattr(m, "lora_A")]
    # module names as PEFT's list form matches them (by suffix): "all-linear" resolves to full paths
    leaves = sorted({str(t).rsplit(".", 1)[-1] for t in targets or ()})
    return r, leaves or None


def _quantization(model) -> Quantization | str:
    """How the base weights are stored: a :class:`Quantization` read from the HF ``quantization_config``
    (:func:`memfit.hf.quantization_from_hf`) or, without one, from bitsandbytes' weights themselves
    (a ``quant_state`` on a 4-bit weight, nested with double quantization; ``SCB`` scales on an int8
    one); or the name of a quantization memfit does not model (GPTQ, AWQ, ...)."""
    base = unwrap(model)
    q = getattr(getattr(base, "config", None), "quantization_config", None)
    if q is not None:
        try:
            return quantization_from_hf(q)
        except InvalidConfiguration:
            method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
            return str(getattr(method, "value", method) or "unknown")
    for m in base.modules():
        w = getattr(m, "weight", None)
        state = getattr(w, "quant_state", None)
        if state is not None:
            return Quantization.NF4_DOUBLE_QUANT if getattr(state, "nested", False) else Quantization.NF4
        if getattr(w, "SCB", None) is not None:
            return Quantization.INT8
    return Quantization.NONE


def _find_int_attr(modules, names: tuple[str, ...]) -> int | None:
    for m in modules:
        for name in names:
            v = getattr(m, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def detect_architecture(model, layers=None) -> ArchitectureIn:
    """:class:`ArchitectureIn` of a model without a HF config, from its modules.

    Layers: the block list (``layers`` or the model's ``nn.ModuleList``); vocabulary and hidden size:
    the largest ``nn.Embedding``; heads: ``nn.MultiheadAttention.num_heads`` or an ``int`` attribute
    ``num_heads``/``n_heads``/``n_head``/``num_attention_heads`` in a block; FFN width: the
    ``nn.Linear`` of a block that maps a wider input back to the hidden size. ``architecture`` is
    ``llama`` (a pre-norm decoder); parameters are counted from the live model.

    Raises:
        ValueError: naming each field that could not be detected (pass ``architecture=`` to describe).
    """
    from torch import nn

    from memfit.hf import decoder_layers

    base = unwrap(model)
    layers = layers if layers is not None else decoder_layers(base)
    if layers is None:
        raise ValueError(
            "model: no HF config and no nn.ModuleList of blocks found; pass architecture="
            "ArchitectureIn(...) (or a catalog name / HF config dict)"
        )
    embeds = [m for m in base.modules() if isinstance(m, nn.Embedding)]
    emb = max(embeds, key=lambda m: m.num_embeddings) if embeds else None
    block = list(layers[0].modules())
    hidden = emb.embedding_dim if emb is not None else None
    mha = next((m for m in block if isinstance(m, nn.MultiheadAttention)), None)
    heads = (
        mha.num_heads
        if mha is not None
        else _find_int_attr(block, ("num_heads", "n_heads", "n_head", "num_attention_heads"))
    )
    kv = _find_int_attr(block, ("num_key_value_heads", "n_kv_heads", "num_kv_heads"))
    linears = [m for m in block if isinstance(m, nn.Linear)]
    if hidden is None and linears:
        hidden = linears[0].in_features
    down = [m.in_features for m in linears if hidden and m.out_features == hidden and m.in_features > hidden]
    if mha is not None and hidden:
        down = down or [m.out_features for m in linears if m.in_features == hidden and m.out_features > hidden]
    ffn = max(down) if down else None
    values = {
        "num_layers": len(layers),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "intermediate_size": ffn,
        "vocab_size": emb.num_embeddings if emb is not None else None,
    }
    missing = [k for k, v in values.items() if not v]
    if missing:
        raise ValueError(
            f"could not detect {', '.join(missing)} from the model's modules; pass architecture="
            "ArchitectureIn(num_layers=..., hidden_size=..., num_attention_heads=..., "
            "intermediate_size=..., vocab_size=...)"
        )
    total, _ = parameter_counts(base)
    return ArchitectureIn(architecture="llama", **values, num_key_value_heads=kv, total_params=total)


def _gpu_memory(gpu: str | None, gpu_memory_gib: float | None, gpu_memory_bytes: int | None) -> dict[str, Any]:
    given = {
        k: v
        for k, v in (("gpu", gpu), ("gpu_memory_gib", gpu_memory_gib), ("gpu_memory_bytes", gpu_memory_bytes))
        if v is not None
    }
    if given:
        return given
    import torch

    if torch.cuda.is_available():
        return {"gpu_memory_bytes": int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)}
    raise ValueError(
        "gpu: no CUDA device is visible, so give the GPU to plan for: gpu=<name> "
        f"(known: {', '.join(GPUS)}) or gpu_memory_gib=<GiB> or gpu_memory_bytes=<bytes>"
    )


def _world_size() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None


#: DeviceMesh dimension names (torchtitan's ``ParallelDims``) -> our parallel size
_MESH_DIMS = {"tp": "tp", "pp": "pp", "cp": "cp"}


def parallel_sizes_from_model(model, device_mesh: Any = None) -> dict[str, int]:
    """Tensor / pipeline / context parallel sizes the user's objects reveal.

    * ``device_mesh``: each named dimension ``tp``, ``pp`` or ``cp`` gives its size.
    * else the model's DTensor parameters: a mesh dimension named ``tp`` gives the TP size; on an
      unnamed 1-D mesh, parameters both sharded and replicated over it mean tensor parallelism (FSDP2
      shards every parameter, TP replicates the norms). Sequence parallelism leaves no trace on the
      parameters: pass ``sequence_parallel=`` to :func:`describe`.

    Returns a dict with any of ``tp``, ``pp``, ``cp``.
    """
    out: dict[str, int] = {}
    mesh = device_mesh
    if mesh is not None:
        for name, size in zip(getattr(mesh, "mesh_dim_names", None) or (), tuple(mesh.shape)):
            if name in _MESH_DIMS:
                out[_MESH_DIMS[name]] = int(size)
        return out
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without distributed
        return out
    seen_shard = seen_rep = False
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        m = p.device_mesh
        names = getattr(m, "mesh_dim_names", None)
        if names and "tp" in names:
            out["tp"] = int(m.shape[names.index("tp")])
        elif m.ndim == 1:
            seen_shard |= isinstance(p.placements[0], Shard)
            seen_rep |= isinstance(p.placements[0], Replicate)
            if seen_shard and seen_rep:
                out["tp"] = int(m.shape[0])
    return out


def _zero_stage(stage: Any) -> int:
    """``zero_optimization.stage`` as DeepSpeed reads it (``DeepSpeedZeroConfig``: an int, ``"3"`` too).

    Raises:
        InvalidConfiguration: a value DeepSpeed refuses (not 0-3).
    """
    try:
        value = int(stage)
    except (TypeError, ValueError):
        value = -1
    if isinstance(stage, bool) or value not in (0, 1, 2, 3) or (isinstance(stage, float) and stage != value):
        raise InvalidConfiguration("deepspeed_config.zero_optimization.stage", "one of 0, 1, 2, 3", stage)
    return value


def _batch_from_deepspeed(
    ds: dict[str, Any] | None, micro_batch_size: int | None, gradient_accumulation_steps: int | None, dp: int
) -> tuple[int, int | None]:
    """(micro-batch size, gradient accumulation steps) with what DeepSpeed derives from ``train_batch_size`` = micro
    x accumulation x data-parallel size filled in (``deepspeed/runtime/config.py``,
    ``DeepSpeedConfig._configure_train_batch_size``: a missing accumulation is 1 when the micro-batch is missing too).

    Raises:
        InvalidConfiguration: ``train_batch_size`` not a multiple of the other two.
        ValueError: no micro-batch size anywhere.
    """
    total = _int_or_none((ds or {}).get("train_batch_size"))
    if total is not None and micro_batch_size is not None and gradient_accumulation_steps is not None:
        per = micro_batch_size * gradient_accumulation_steps * dp
        if total != per:  # DeepSpeed refuses it too (DeepSpeedConfig._batch_assertion)
            raise InvalidConfiguration(
                "deepspeed_config.train_batch_size",
                f"micro-batch size x gradient_accumulation_steps x data-parallel size = {micro_batch_size} x "
                f"{gradient_accumulation_steps} x {dp} = {per}",
                total,
            )
    if total is not None and (micro_batch_size is None or gradient_accumulation_steps is None):
        if micro_batch_size is None:
            per = (gradient_accumulation_steps or 1) * dp
            what = f"gradient_accumulation_steps x data-parallel size = {per}"
        else:
            per = micro_batch_size * dp
            what = f"micro-batch size x data-parallel size = {per}"
        derived, rest = divmod(total, per)
        if rest or derived < 1:
            raise InvalidConfiguration("deepspeed_config.train_batch_size", f"a positive multiple of {what}", total)
        if micro_batch_size is None:
            micro_batch_size, gradient_accumulation_steps = derived, gradient_accumulation_steps or 1
        else:
            gradient_accumulation_steps = derived
    if micro_batch_size is None:
        auto = (ds or {}).get("train_micro_batch_size_per_gpu") == "auto"
        raise ValueError(
            "micro_batch_size is required: give micro_batch_size=, a DeepSpeed config with "
            "train_micro_batch_size_per_gpu or train_batch_size, or training_args with per_device_train_batch_size"
            + (' (the DeepSpeed config\'s "auto" is filled in from training_args)' if auto else "")
        )
    return micro_batch_size, gradient_accumulation_steps


def describe(
    model,
    *,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    training_args: Any = None,
    deepspeed_config: dict[str, Any] | str | Path | None = None,
    gpu: str | None = None,
    gpu_memory_gib: float | None = None,
    gpu_memory_bytes: int | None = None,
    gpu_count: int | None = None,
    precision: Precision | str | None = None,
    optimizer: Optimizer | str | None = None,
    sharding: Sharding | str | None = None,
    attention: Attention | str | None = None,
    checkpoint_impl: CheckpointImpl | str | None = None,
    optimizer_in_backward: bool = False,
    gradient_accumulation_steps: int | None = None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    context_parallel_size: int | None = None,
    sequence_parallel: bool | None = None,
    device_mesh: Any = None,
    offload_optimizer: Offload | str | None = None,
    offload_parameters: Offload | str | None = None,
    architecture: ArchitectureIn | dict[str, Any] | str | None = None,
    layers=None,
    headroom_fraction: float = 0.05,
    layout: str = "block",
    alloc_conf: str | None = None,
) -> RecommendRequest:
    """A :class:`RecommendRequest` for a live model and its training setup.

    Explicit keyword arguments win; then the DeepSpeed config (``deepspeed_config`` or
    ``training_args.deepspeed``: ``train_micro_batch_size_per_gpu`` (else derived from ``train_batch_size``, as
    DeepSpeed derives it), ``zero_optimization.stage``,
    ``bf16``/``fp16.enabled`` — ``"auto"`` resolved from ``training_args``); then HF
    ``TrainingArguments`` (``per_device_train_batch_size``, ``bf16``/``fp16``, ``optim``, ``fsdp``,
    ``activation_checkpointing_kwargs``/``gradient_checkpointing_kwargs``); then the model.

    * model: its HF config dict when it has one (``model.config``), else :func:`detect_architecture` (a
      Llama-style decoder of the detected shape; a :class:`MemfitWarning` says so), or ``architecture=`` to
      override (catalog name, HF config dict or :class:`ArchitectureIn`).
    * parameters: trainable count from ``requires_grad`` (LoRA adapters, frozen layers); PEFT LoRA
      sets ``finetune="lora"`` with the active adapter's rank and target modules; fully frozen
      leading layers set ``finetune="frozen"``. A bitsandbytes-quantized base under LoRA (QLoRA) sets
      ``quantization`` (from ``config.quantization_config``, else from the quantized weights); other
      quantization methods are not modelled: a :class:`MemfitWarning` says so.
    * optimizer: DeepSpeed's ``optimizer.type``, else ``TrainingArguments.optim`` (bitsandbytes names
      included: ``adamw_bnb_8bit``, ``paged_adamw_8bit``, ``lion_32bit``); an ``optim`` memfit does not
      model raises. ``optimizer_in_backward=True`` for a step fused into backward (torchtune).
    * precision: DeepSpeed bf16/fp16 -> ``bf16_fp32_master`` (half weights + fp32 master copy);
      TrainingArguments bf16/fp16 -> ``amp_bf16``/``amp_fp16`` (autocast over fp32 weights), but ``bf16`` when
      the model's weights are bf16 already (a LoRA base loaded with ``torch_dtype=torch.bfloat16``: autocast
      does not make them fp32, :func:`memfit.schema.default_precision`); otherwise half-precision parameters
      -> ``bf16``, fp32 parameters -> ``fp32``.
    * gradient accumulation: DeepSpeed's ``gradient_accumulation_steps`` (``"auto"`` resolved from
      ``training_args``), else ``TrainingArguments.gradient_accumulation_steps``, else 1.
    * model parallelism: tensor / pipeline / context parallel sizes from ``device_mesh`` (a torch
      ``DeviceMesh`` with named dimensions, torchtitan's ``tp``, ``pp``, ``cp``), else from the model's
      DTensor parameters (:func:`parallel_sizes_from_model`); 1 when neither reveals them.
    * offload: DeepSpeed ``zero_optimization.offload_optimizer.device`` / ``offload_param.device``
      (:func:`ds_offload`), an FSDP2 ``CPUOffloadPolicy`` on the model (:func:`fsdp2_offloads_parameters`:
      parameters and optimizer offloaded), or HF ``fsdp="... offload"``.
    * cluster: GPU memory from ``torch.cuda.get_device_properties`` when CUDA is available; GPU
      count from ``torch.distributed``'s world size when initialised, else 1. Sharding on one device
      is reported as ``none`` (nothing to shard over).
    * allocator settings: ``alloc_conf``, else this process's ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``
      (:func:`memfit.alloc_conf.alloc_conf_from_env`); the service decides the fit with them.

    Args:
        seq_len: tokens per sequence (required: the model cannot tell what the data loader yields).
        micro_batch_size: sequences per device per forward.
        gpu / gpu_memory_gib / gpu_memory_bytes: the device to plan for; one of them is required
            without CUDA.

    Raises:
        TypeError: ``model`` is not a module (a catalog name or config dict: build the request itself);
            ``deepspeed_config`` of another type than a dict, a path or JSON text, or an object with a ``.config`` dict.
        ValueError: a missing essential (names the field: ``seq_len``, ``micro_batch_size``, ``gpu``)
            or an architecture that cannot be detected. InvalidConfiguration (a ValueError): an unknown
            ``sharding``, ``offload_optimizer`` or ``offload_parameters`` value (names it and the allowed values).
    """
    if not hasattr(model, "parameters"):
        raise TypeError(
            f"model: describe() reads a live torch.nn.Module, got {type(model).__name__} {model!r:.60}; for a catalog "
            "name or an HF config dict without a model, build the request itself: memfit.RecommendRequest(model=..., "
            "training=..., cluster=...)"
        )
    if seq_len is None:
        raise ValueError("seq_len is required: tokens per training sequence (e.g. seq_len=4096)")
    args = training_args
    ds = _load_ds_config(deepspeed_config if deepspeed_config is not None else getattr(args, "deepspeed", None))
    hf_bf16, hf_fp16 = bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))

    if micro_batch_size is None and ds is not None:
        micro_batch_size = _int_or_none(ds.get("train_micro_batch_size_per_gpu"))
    if micro_batch_size is None and args is not None:
        micro_batch_size = _int_or_none(getattr(args, "per_device_train_batch_size", None))
    if gradient_accumulation_steps is None and ds is not None:
        gradient_accumulation_steps = _int_or_none(ds.get("gradient_accumulation_steps"))
    if gradient_accumulation_steps is None and args is not None:
        gradient_accumulation_steps = _int_or_none(getattr(args, "gradient_accumulation_steps", None))
    base = unwrap(model)
    params = list(base.parameters())
    half = bool(params) and params[0].dtype.is_floating_point and params[0].element_size() == 2
    if precision is None:
        if ds is not None and (_enabled(ds.get("bf16"), hf_bf16) or _enabled(ds.get("fp16"), hf_fp16)):
            precision = Precision.BF16_FP32_MASTER
        elif hf_bf16:
            precision = Precision.BF16 if half else Precision.AMP_BF16
        elif hf_fp16:
            precision = Precision.AMP_FP16
        else:
            precision = Precision.BF16 if half else Precision.FP32

    if optimizer is None:
        ds_opt = str(((ds or {}).get("optimizer") or {}).get("type", "")).lower()
        hf_opt = getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None))
        if not ds_opt and hf_opt is not None and str(hf_opt) not in _HF_OPTIM:
            raise ValueError(
                f"training_args.optim={hf_opt!r} is not modelled; allowed: {', '.join(_HF_OPTIM)} "
                f"(or pass optimizer=, one of {', '.join(o.value for o in Optimizer)})"
            )
        if ds_opt and ds_opt not in _DS_OPTIM:
            raise InvalidConfiguration(
                "deepspeed_config.optimizer.type",
                f"one of {', '.join(_DS_OPTIM)} (or pass optimizer=, one of {', '.join(o.value for o in Optimizer)})",
                ds_opt,
            )
        optimizer = _DS_OPTIM.get(ds_opt) or _HF_OPTIM.get(str(hf_opt)) or Optimizer.ADAMW_FOREACH

    if gpu_count is None:
        gpu_count = _world_size() or 1
    found = parallel_sizes_from_model(base, device_mesh)
    # an explicit 0 is refused below, not read as "not given"
    tensor_parallel_size = found.get("tp", 1) if tensor_parallel_size is None else tensor_parallel_size
    pipeline_parallel_size = found.get("pp", 1) if pipeline_parallel_size is None else pipeline_parallel_size
    context_parallel_size = found.get("cp", 1) if context_parallel_size is None else context_parallel_size
    for name, size in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("context_parallel_size", context_parallel_size),
        ("gpu_count", gpu_count),
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            section = "cluster" if name == "gpu_count" else "training"
            raise InvalidConfiguration(f"{section}.{name}", "an integer >= 1", size)
    sequence_parallel = bool(sequence_parallel) and tensor_parallel_size > 1
    dp = default_data_parallel_size(gpu_count, tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
    micro_batch_size, gradient_accumulation_steps = _batch_from_deepspeed(
        ds, micro_batch_size, gradient_accumulation_steps, dp
    )
    if sharding is None:
        stage = ((ds or {}).get("zero_optimization") or {}).get("stage", 0)
        fsdp = getattr(args, "fsdp", None) or ""
        fsdp = " ".join(str(getattr(x, "value", x)) for x in fsdp) if isinstance(fsdp, (list, tuple)) else str(fsdp)
        stage = _zero_stage(stage)
        if stage in (1, 2, 3):
            sharding = Sharding(f"zero{stage}")
        elif "shard_grad_op" in fsdp:
            sharding = Sharding.FSDP_SHARD_GRAD_OP
        elif "full_shard" in fsdp or "hybrid_shard" in fsdp:
            sharding = Sharding.FSDP_FULL_SHARD
        else:
            sharding = Sharding.NONE
    sharding = _choice(Sharding, sharding, "sharding")
    if offload_optimizer is not None:
        offload_optimizer = _choice(Offload, offload_optimizer, "offload_optimizer")
    if offload_parameters is not None:
        offload_parameters = _choice(Offload, offload_parameters, "offload_parameters")
    if sharding is not Sharding.NONE and dp * context_parallel_size < 2:  # shards over data x context ranks
        log.info(
            "memfit: sharding=%s over one data-parallel rank shards nothing; describing it as 'none'", sharding.value
        )
        sharding = Sharding.NONE

    ds_opt_off, ds_param_off = ds_offload(ds)
    fsdp_text = getattr(args, "fsdp", None) or ""
    fsdp_text = (
        " ".join(str(getattr(x, "value", x)) for x in fsdp_text)
        if isinstance(fsdp_text, (list, tuple))
        else str(fsdp_text)
    )
    fsdp_offload = fsdp2_offloads_parameters(base) or "offload" in fsdp_text
    if offload_parameters is None:
        offload_parameters = ds_param_off or (Offload.CPU if fsdp_offload else Offload.NONE)
    if offload_optimizer is None:
        offload_optimizer = ds_opt_off or (
            Offload.CPU if fsdp_offload or Offload(offload_parameters) is Offload.CPU else Offload.NONE
        )
    if Offload(offload_parameters) is Offload.CPU and sharding is Sharding.NONE and dp > 1:
        sharding = Sharding.FSDP_FULL_SHARD  # parameter offload gathers layer by layer: full sharding

    if attention is None:
        impl = getattr(getattr(base, "config", None), "_attn_implementation", None)
        attention = _ATTN.get(str(impl), Attention.SDPA)
    if checkpoint_impl is None:
        kw = (
            getattr(args, "activation_checkpointing_kwargs", None)
            or getattr(args, "gradient_checkpointing_kwargs", None)
            or {}
        )
        checkpoint_impl = (
            CheckpointImpl.REENTRANT
            if isinstance(kw, dict) and kw.get("use_reentrant")
            else CheckpointImpl.NON_REENTRANT
        )

    total, trainable = parameter_counts(model)
    training: dict[str, Any] = {
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "precision": precision,
        "optimizer": optimizer,
        "sharding": sharding,
        "attention": attention,
        "checkpoint_impl": checkpoint_impl,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "context_parallel_size": context_parallel_size,
        "sequence_parallel": sequence_parallel,
        "trainable_params": trainable,
        "offload_optimizer": Offload(offload_optimizer),
        "offload_parameters": Offload(offload_parameters),
        "gradient_accumulation_steps": 1 if gradient_accumulation_steps is None else gradient_accumulation_steps,
    }
    adapter = _lora(model)
    if adapter is not None:
        training.update(finetune=FineTune.LORA, lora_rank=adapter[0], lora_target_modules=adapter[1])
    elif trainable < total and (frozen := _frozen_leading_layers(base)):
        training.update(finetune=FineTune.FROZEN, frozen_layers=frozen)

    if optimizer_in_backward:
        training["optimizer_in_backward"] = True
    quantization = _quantization(model)
    if isinstance(quantization, Quantization) and quantization is not Quantization.NONE and adapter is not None:
        training["quantization"] = quantization
    elif quantization is not Quantization.NONE:
        warnings.warn(
            f"memfit: the base weights are quantized ({getattr(quantization, 'value', quantization)}) "
            "without LoRA adapters or by a method memfit does not model (it models bitsandbytes 4/8-bit "
            "under LoRA); the prediction counts them at the training precision (an over-estimate: the "
            "plan errs on the safe side)",
            MemfitWarning,
            stacklevel=2,
        )
    if architecture is None:
        architecture = hf_config_dict(model)
    if architecture is None:
        architecture = detect_architecture(model, layers)
        warnings.warn(
            f"memfit: the model has no HF config; its shape was read from its modules ({architecture.num_layers} "
            f"layers, hidden {architecture.hidden_size}, {architecture.num_attention_heads} heads, FFN "
            f"{architecture.intermediate_size}, vocabulary {architecture.vocab_size}) and is predicted as a "
            "Llama-style pre-norm decoder of that shape (memfit.describe.detect_architecture); pass architecture= "
            "(a catalog name, a HF config dict or ArchitectureIn) where it is another family",
            MemfitWarning,
            stacklevel=2,
        )
    try:
        return RecommendRequest(
            model=architecture,
            training=training,
            cluster=ClusterIn(**_gpu_memory(gpu, gpu_memory_gib, gpu_memory_bytes), gpu_count=gpu_count),
            headroom_fraction=headroom_fraction,
            layout=layout,
            alloc_conf=(alloc_conf_from_env() if alloc_conf is None else alloc_conf) or None,
        )
    except ValidationError as err:  # one line naming the argument, not pydantic's dump
        raise invalid_from_validation(err) from None
