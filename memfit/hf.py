"""HF transformers glue: build a causal LM from a ``config.json`` dict and describe it as a :class:`ModelSpec`.

torch and transformers are optional dependencies of the client; they are imported here, lazily.
Models are always built from config with random weights (nothing is downloaded).

Fallback: a ``model_type`` that the installed transformers does not know is built as the Llama
architecture with the same layer count, widths, heads and vocabulary (``LlamaConfig``), which keeps
the memory-relevant shapes; the record's ``architecture`` keeps the original family name.
"""

from __future__ import annotations

import contextlib
from typing import Any

from memfit.schema import ModelSpec

# HF config key aliases across families -> our field name
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab_size": ("vocab_size",),
}


def _get(cfg: dict[str, Any], field: str) -> Any:
    for key in _ALIASES[field]:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _kv_heads(cfg: dict[str, Any], heads: int) -> int:
    """Key/value heads the way transformers builds the attention.

    Falcon (``FalconAttention``): ``num_kv_heads`` when ``new_decoder_architecture`` (Falcon-40B/180B)
    or when not ``multi_query`` (Falcon-RW), else 1 (Falcon-7B); ``FalconConfig`` defaults are
    ``multi_query=True``, ``new_decoder_architecture=False``, ``num_kv_heads=num_attention_heads``. So
    ``new_decoder_architecture`` wins over ``multi_query``, which a full config dict sets to True.
    GPT-BigCode: 1 when ``multi_query`` (its default). Every other family: ``num_key_value_heads``, else ``num_attention_heads``.
    """
    if cfg.get("model_type") == "falcon":
        kv = cfg.get("num_kv_heads")
        if cfg.get("new_decoder_architecture", False) or not cfg.get("multi_query", True):
            return int(kv or heads)
        return 1
    if cfg.get("model_type") == "gpt_bigcode":  # GPTBigCodeConfig: multi_query=True by default
        return 1 if cfg.get("multi_query", True) else heads
    return int(cfg.get("num_key_value_heads") or heads)


def spec_fields_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Architecture fields of :class:`ModelSpec` from a HF ``config.json`` dict (parameter counts excluded).

    Raises:
        ValueError: when a required field (``model_type``, layers, hidden size, heads, vocab) is missing.
    """
    if not isinstance(cfg, dict) or not cfg.get("model_type"):
        raise ValueError("hf_config must be a config.json dict with a 'model_type'")
    out: dict[str, Any] = {"architecture": str(cfg["model_type"])}
    for field in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        value = _get(cfg, field)
        if value is None:
            raise ValueError(f"hf_config lacks {field} (one of {list(_ALIASES[field])})")
        out[field] = int(value)
    heads = out["num_attention_heads"]
    out["num_key_value_heads"] = _kv_heads(cfg, heads)
    ffn = _get(cfg, "intermediate_size")
    out["intermediate_size"] = int(ffn or 4 * out["hidden_size"])  # GPT-2/GPT-J/Falcon/BLOOM: 4h when unset
    head_dim = cfg.get("head_dim")
    if head_dim and int(head_dim) * heads != out["hidden_size"]:
        out["head_dim"] = int(head_dim)
    tie = cfg.get("tie_word_embeddings")
    out["tie_word_embeddings"] = bool(True if tie is None else tie)  # HF PretrainedConfig default is True
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        out["num_experts"] = int(experts)
        out["num_experts_per_token"] = int(cfg.get("num_experts_per_tok") or 1)
    return out


def _hf_config(cfg: dict[str, Any]):
    """A ``transformers.PretrainedConfig`` for the dict, falling back to Llama for unknown families."""
    import copy

    from transformers import AutoConfig, LlamaConfig

    # deep copy: transformers normalises nested values (rope_scaling) in place, which would change the
    # caller's dict (the catalog's cached entries, cache keys computed from it)
    kwargs = {k: copy.deepcopy(v) for k, v in cfg.items()
              if k not in ("model_type", "architectures", "transformers_version")}
    try:
        return AutoConfig.for_model(cfg["model_type"], **kwargs)
    except (KeyError, ValueError):
        f = spec_fields_from_hf_config(cfg)
        return LlamaConfig(
            num_hidden_layers=f["num_layers"], hidden_size=f["hidden_size"],
            num_attention_heads=f["num_attention_heads"], num_key_value_heads=f["num_key_value_heads"],
            intermediate_size=f["intermediate_size"], vocab_size=f["vocab_size"],
            tie_word_embeddings=f["tie_word_embeddings"], head_dim=f.get("head_dim"),
        )


def build_causal_lm(cfg: dict[str, Any], *, dtype=None, attention: str = "sdpa"):
    """Build ``AutoModelForCausalLM`` from a config dict with random weights on the current device/mode.

    Args:
        cfg: HF ``config.json`` dict (must hold ``model_type``).
        dtype: parameter dtype (``torch.float32`` when None).
        attention: HF ``attn_implementation`` (``sdpa`` or ``eager``; ``flash`` maps to ``sdpa``). Families
            that do not support SDPA in the installed transformers (BLOOM; Gemma-2 with logit
            soft-capping) are built with ``eager``; check ``model.config._attn_implementation``.

    Returns:
        ``torch.nn.Module``, in training mode.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = _hf_config(cfg)
    config.use_cache = False
    impl = "sdpa" if attention in ("sdpa", "flash") else "eager"
    dtype = dtype or torch.float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=dtype)
        except ValueError as err:  # families without SDPA support (BLOOM) or that refuse it (Gemma-2)
            if impl == "eager" or "attn_implementation" not in str(err) and "sdpa" not in str(err).lower():
                raise
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    finally:
        torch.set_default_dtype(prev)
    return model.train()


def count_params(model) -> tuple[int, int]:
    """(total, trainable) parameter counts of a module; shared (tied) tensors are counted once."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():  # nn.Module.parameters() already de-duplicates shared Parameters
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def count_params_from_config(cfg: dict[str, Any]) -> int:
    """Total parameters of the model a config dict describes, built on the ``meta`` device (no memory)."""
    import torch

    with torch.device("meta"):
        model = build_causal_lm(cfg)
    return count_params(model)[0]


def model_spec(cfg: dict[str, Any], model=None, *, name: str | None = None) -> ModelSpec:
    """:class:`ModelSpec` for a config dict; parameter counts from ``model`` if given, else from a meta build."""
    fields = spec_fields_from_hf_config(cfg)
    if model is None:
        total = count_params_from_config(cfg)
        trainable = total
    else:
        total, trainable = count_params(model)
    return ModelSpec(**fields, model_name=name, total_params=total, trainable_params=trainable)


def decoder_layers(model):
    """The ``nn.ModuleList`` of decoder layers of a HF causal LM (or PEFT-wrapped one), else None."""
    import torch

    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52
        GradientCheckpointingLayer = ()
    candidates = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            is_gc = bool(GradientCheckpointingLayer) and isinstance(mod[0], GradientCheckpointingLayer)
            by_name = name.rsplit(".", 1)[-1] in ("layers", "h", "blocks", "layer")
            if is_gc or by_name:
                candidates.append((is_gc, len(mod), mod))
    return max(candidates, key=lambda c: (c[0], c[1]))[2] if candidates else None


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' logger for sweeps (warnings about random init etc.)."""
    from transformers.utils import logging as hf_logging

    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(prev)
