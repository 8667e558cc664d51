"""HF transformers glue: build a causal LM from a ``config.json`` dict and describe it as a :class:`ModelSpec`.

torch and transformers are optional dependencies of the client; they are imported here, lazily.
Models are always built from config with random weights (nothing is downloaded).

Fallback: a ``model_type`` that the installed transformers does not know is built as the Llama
architecture with the same layer count, widths, heads and vocabulary (``LlamaConfig``), which keeps
the memory-relevant shapes; the record's ``architecture`` keeps the original family name.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.errors import InvalidConfiguration
from memfit.schema import (
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_VOCAB,
    Attention,
    FineTune,
    ModelSpec,
    Precision,
    Quantization,
    TrainingConfig,
)

if TYPE_CHECKING:
    import torch

#: HF config keys holding the decoder-layer count, across families (Llama's, GPT-2's, ...), in the order read
NUM_LAYERS_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# HF config key aliases across families -> our field name
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": NUM_LAYERS_KEYS,
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab_size": ("vocab_size",),
}


_MAX = {
    "num_layers": MAX_LAYERS,
    "hidden_size": MAX_HIDDEN,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 4096,
    "intermediate_size": MAX_HIDDEN * 8,
    "vocab_size": MAX_VOCAB,
    "num_experts": 4096,
    "num_experts_per_token": 4096,
}
#: ``torch_dtype`` / ``dtype`` values a config may carry (transformers' names)
DTYPES = frozenset(
    {"float32", "float16", "bfloat16", "float64", "float", "half", "double", "auto", "float8_e4m3fn", "float8_e5m2"}
)


#: families with learned absolute position embeddings, and the config key of the table's size: a sequence longer
#: than the table cannot be embedded (the lookup raises IndexError); rotary and ALiBi families have no such limit
LEARNED_POSITIONS = {"gpt2": "n_positions", "opt": "max_position_embeddings", "gpt_neo": "max_position_embeddings"}


def max_seq_len(hf_config: dict[str, Any]) -> int | None:
    """Longest sequence the model can embed (tokens) for families with learned position embeddings
    (:data:`LEARNED_POSITIONS`), else None. Source: transformers' ``GPT2Model.wpe = nn.Embedding(n_positions, ...)``,
    ``OPTLearnedPositionalEmbedding`` (max_position_embeddings, offset 2), ``GPTNeoModel.wpe``."""
    key = LEARNED_POSITIONS.get(hf_config.get("model_type", ""))
    if key is None:
        return None
    return int(hf_config.get(key) or hf_config.get("max_position_embeddings") or 1024)


def _int(cfg: dict[str, Any], key: str, field: str, lo: int = 1) -> int:
    """``cfg[key]`` as a strict integer in ``[lo, max]`` (JSON ``true``, ``4.5``, ``"4"`` and ``[4]`` are refused)."""
    value = cfg[key]
    if type(value) is not int or not lo <= value <= _MAX[field]:
        raise InvalidConfiguration(key, f"an integer in [{lo}, {_MAX[field]}]", value)
    return value


def _get(cfg: dict[str, Any], field: str) -> int | None:
    for key in _ALIASES[field]:
        if cfg.get(key) is not None:
            return _int(cfg, key, field)
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
        if cfg.get("new_decoder_architecture", False) or not cfg.get("multi_query", True):
            return _int(cfg, "num_kv_heads", "num_key_value_heads") if cfg.get("num_kv_heads") is not None else heads
        return 1
    if cfg.get("model_type") == "gpt_bigcode":  # GPTBigCodeConfig: multi_query=True by default
        return 1 if cfg.get("multi_query", True) else heads
    if cfg.get("num_key_value_heads") is not None:
        return _int(cfg, "num_key_value_heads", "num_key_value_heads")
    return heads


def spec_fields_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Architecture fields of :class:`ModelSpec` from a HF ``config.json`` dict (parameter counts excluded).

    Every value read must be a strict integer (booleans, fractions and strings are refused) inside
    :class:`ModelSpec`'s range; ``torch_dtype``/``dtype``, when present, one of :data:`DTYPES`.

    Raises:
        InvalidConfiguration: a missing or invalid field; ``field`` is the config key.
    """
    if not isinstance(cfg, dict):
        raise InvalidConfiguration("hf_config", "a config.json object with a 'model_type'", type(cfg).__name__)
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not 1 <= len(mt) <= 64:
        raise InvalidConfiguration("model_type", "a string of 1 to 64 characters (HF model_type)", mt)
    for key in ("torch_dtype", "dtype"):
        if cfg.get(key) is not None and (not isinstance(cfg[key], str) or cfg[key] not in DTYPES):
            raise InvalidConfiguration(key, f"one of {sorted(DTYPES)}", cfg[key])
    out: dict[str, Any] = {"architecture": mt}
    for field in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        value = _get(cfg, field)
        if value is None:
            key, allowed = _ALIASES[field][0], f"an integer in [1, {_MAX[field]}]"
            raise InvalidConfiguration(
                key, allowed, message=f"{key}: missing; give {allowed} under one of the keys {list(_ALIASES[field])}"
            )
        out[field] = value
    heads = out["num_attention_heads"]
    out["num_key_value_heads"] = _kv_heads(cfg, heads)
    ffn = _get(cfg, "intermediate_size")
    out["intermediate_size"] = ffn or 4 * out["hidden_size"]  # GPT-2/GPT-J/Falcon/BLOOM: 4h when unset
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", "head_dim")
        if head_dim * heads != out["hidden_size"]:
            out["head_dim"] = head_dim
    tie = cfg.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise InvalidConfiguration("tie_word_embeddings", "true or false", tie)
    out["tie_word_embeddings"] = True if tie is None else tie  # HF PretrainedConfig default is True
    # routed experts: Mixtral's num_local_experts, Qwen-MoE/OLMoE's num_experts, DeepSeek's n_routed_experts
    key = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k)), None)
    if key is not None:
        out["num_experts"] = _int(cfg, key, "num_experts")
        out["num_experts_per_token"] = (
            _int(cfg, "num_experts_per_tok", "num_experts_per_token")
            if cfg.get("num_experts_per_tok") is not None
            else 1
        )
        # Qwen-MoE / Qwen3-MoE / DeepSeek give each routed expert its own width (``moe_intermediate_size``);
        # their ``intermediate_size`` is that of dense or shared MLPs (Mixtral and OLMoE use it for the experts)
        if cfg.get("moe_intermediate_size") is not None:
            out["intermediate_size"] = _int(cfg, "moe_intermediate_size", "intermediate_size")
    return out


_TRANSFORMERS_IMPORT = threading.Lock()
_transformers_imported = threading.Event()


def import_transformers() -> None:
    """Import transformers once, under a lock, before any of its names is read in a process with threads.

    transformers 5 puts a lazy module in ``sys.modules`` while its package initialises, so a second thread importing
    it meanwhile sees a half-built module (``cannot import name 'AutoConfig' from 'transformers'``, or a partially
    initialised ``transformers.utils``): the service's warm-up and a first request did (HTTP 500, 2 of 3 tries with
    two threads, transformers 5.24). Every reader of transformers that a service request reaches calls this first.

    Raises:
        ImportError: transformers is not installed.
    """
    if _transformers_imported.is_set():
        return
    with _TRANSFORMERS_IMPORT:
        if not _transformers_imported.is_set():
            import transformers
            from transformers import AutoConfig, LlamaConfig  # noqa: F401 - the lazy module's names loaded once
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # noqa: F401

            del transformers
            _transformers_imported.set()


def _hf_config(cfg: dict[str, Any]):
    """A ``transformers.PretrainedConfig`` for the dict, falling back to Llama for unknown families."""
    import copy

    import_transformers()
    from transformers import AutoConfig, LlamaConfig

    # deep copy: transformers normalises nested values (rope_scaling) in place, which would change the
    # caller's dict (the catalog's cached entries, cache keys computed from it)
    kwargs = {
        k: copy.deepcopy(v) for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")
    }
    if cfg.get("model_type") == "gemma" and kwargs.get("hidden_act") == "gelu":
        # what transformers' GemmaConfig.__post_init__ does itself (the official configs' legacy value means the tanh
        # approximation), without the warning it logs on every build (transformers/models/gemma/configuration_gemma.py)
        kwargs["hidden_act"] = "gelu_pytorch_tanh"
    try:
        return AutoConfig.for_model(cfg["model_type"], **kwargs)
    except (KeyError, ValueError):
        f = spec_fields_from_hf_config(cfg)
        return LlamaConfig(
            num_hidden_layers=f["num_layers"],
            hidden_size=f["hidden_size"],
            num_attention_heads=f["num_attention_heads"],
            num_key_value_heads=f["num_key_value_heads"],
            intermediate_size=f["intermediate_size"],
            vocab_size=f["vocab_size"],
            tie_word_embeddings=f["tie_word_embeddings"],
            head_dim=f.get("head_dim"),
        )


#: HF config keys that never change a training step's memory: provenance, labels, dtype (the training precision
#: decides it), token ids, and ``use_cache``, which memfit takes as False (:func:`memfit.checkpointing.apply` sets
#: it, and transformers 5.24 turns it off itself whenever gradient checkpointing is on:
#: ``GradientCheckpointingLayer`` in transformers/modeling_layers.py, ``merge_with_config_defaults`` in
#: transformers/utils/generic.py); every shipped term was traced with it off (:func:`build_causal_lm`)
IGNORED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "architectures",
        "torch_dtype",
        "dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "auto_map",
        "quantization_config",
        "_commit_hash",
        "output_attentions",
        "output_hidden_states",
        "id2label",
        "label2id",
        "task_specific_params",
    }
)


def canonical_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """One dict per model: what sets the model ``cfg`` builds apart from its config class's defaults.

    transformers builds the config (:func:`_hf_config`, which also normalises aliases such as GPT-2's
    ``hidden_size``/``n_embd`` and ``rope_theta`` into ``rope_parameters``), it is serialised in full
    (``to_json_string(use_diff=False)``), and :data:`IGNORED_CONFIG_KEYS` and every value equal to the config
    class's default are dropped (not for a family transformers does not know, built as Llama from its shapes);
    ``model_type`` is kept as given (such a family keeps its name). So a
    model's published ``config.json`` fields and its full serialisation (what :func:`memfit.describe` sends)
    give the same dict. Dropout probabilities stay as given: they change what a training step saves.

    Returns:
        A new dict, keys sorted, JSON values. A config transformers cannot build is returned as given, less
        :data:`IGNORED_CONFIG_KEYS` (it cannot be traced either).
    """
    text = json.dumps(cfg, sort_keys=True, default=str)
    hit = _canonical_snapshot().get(_config_sha(text))
    return dict(hit["config"]) if hit is not None else json.loads(_canonical_hf_config_json(text))


#: :func:`canonical_hf_config` and :func:`config_assumptions` of every catalog architecture and reduced MoE model
#: under the pinned transformers, by the SHA-256 of the config's JSON (``scripts/rekey_canonical.py`` writes it;
#: ``tests/test_config_key.py`` checks it): building a config imports transformers, seconds of a command-line answer
CANONICAL_CONFIGS_PATH = Path(__file__).with_name("canonical_configs.json")


def _config_sha(cfg_json: str) -> str:
    import hashlib

    return hashlib.sha256(cfg_json.encode()).hexdigest()


@functools.cache
def _canonical_snapshot() -> dict[str, Any]:
    """The snapshot's entries, or none when it was written with another transformers than the installed one."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        snapshot = json.loads(CANONICAL_CONFIGS_PATH.read_text())
        installed = version("transformers")
    except (OSError, ValueError, PackageNotFoundError):
        return {}
    return snapshot["entries"] if snapshot.get("transformers_version") == installed else {}


def canonical_snapshot_entry(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(key, entry) of ``cfg`` for :data:`CANONICAL_CONFIGS_PATH`, computed by building the config."""
    text = json.dumps(cfg, sort_keys=True, default=str)
    return _config_sha(text), {
        "config": json.loads(_canonical_hf_config_json(text)),
        "assumptions": _config_assumptions(text),
    }


@functools.lru_cache(maxsize=1024)
def _canonical_hf_config_json(cfg_json: str) -> str:
    cfg = json.loads(cfg_json)
    try:
        with quiet_transformers():
            conf = _hf_config(cfg)
            full = json.loads(conf.to_json_string(use_diff=False))
            defaults = _class_defaults_json(type(conf))
    except Exception:  # noqa: BLE001 - transformers refused it: the given keys are all there is to key on
        out = {k: v for k, v in cfg.items() if k not in IGNORED_CONFIG_KEYS}
        return json.dumps(out, sort_keys=True, default=str)
    # a family transformers does not know is built as Llama from its shapes: keep them all (dropping Llama's
    # defaults would lose the layer count of a 32-layer model)
    default = json.loads(defaults) if conf.model_type == cfg.get("model_type") else {}
    out = {k: v for k, v in full.items() if k not in IGNORED_CONFIG_KEYS and (k not in default or default[k] != v)}
    out["model_type"] = cfg.get("model_type")
    return json.dumps(out, sort_keys=True)


def config_assumptions(cfg: dict[str, Any]) -> str | None:
    """What an answer for ``cfg`` assumes of the config keys that change a training step, in words (None when the
    config does not build): ``use_cache`` off (the traced terms ran without a KV cache: :func:`memfit.checkpointing.apply`
    sets ``use_cache=False``, and transformers 5.24 turns it off whenever gradient checkpointing is on,
    ``GradientCheckpointingLayer`` in transformers/modeling_layers.py), and the dropout probabilities above zero,
    as the config gives them (their masks are saved for backward; keys with ``dropout`` or ``pdrop`` in their name,
    GPT-2's unused sequence-summary head aside)."""
    text = json.dumps(cfg, sort_keys=True, default=str)
    hit = _canonical_snapshot().get(_config_sha(text))
    return hit["assumptions"] if hit is not None else _config_assumptions(text)


@functools.lru_cache(maxsize=1024)
def _config_assumptions(cfg_json: str) -> str | None:
    cfg = json.loads(cfg_json)
    try:
        with quiet_transformers():
            full = json.loads(_hf_config(cfg).to_json_string(use_diff=False))
    except Exception:  # noqa: BLE001 - a config transformers refuses has no assumptions to state
        return None
    drop = {
        k: v
        for k, v in sorted(full.items())
        if ("dropout" in k or "pdrop" in k)
        and not k.startswith("summary_")
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and v > 0
    }
    parts = []
    if full.get("use_cache"):
        parts.append("use_cache=False (memfit.apply sets it; transformers turns it off under gradient checkpointing)")
    if drop:
        parts.append(
            "dropout as configured: "
            + ", ".join(f"{k}={v:g}" for k, v in drop.items())
            + " (the masks are saved for backward)"
        )
    return "model config as traced: " + "; ".join(parts) if parts else None


@functools.lru_cache(maxsize=256)
def _class_defaults_json(config_class) -> str:
    """A config class's defaults, serialised in full (``to_json_string(use_diff=False)``)."""
    return config_class().to_json_string(use_diff=False)


#: model types whose causal-LM class lacks SDPA in the transformers it was written with, a snapshot
#: (``scripts/sdpa_support.py`` writes it; ``tests/test_catalog.py`` checks it against the installed transformers)
SDPA_SUPPORT_PATH = Path(__file__).with_name("sdpa_support.json")


@functools.cache
def _without_sdpa_snapshot() -> frozenset[str] | None:
    """The snapshot's model types without SDPA, or None when it was written with another transformers."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        snapshot = json.loads(SDPA_SUPPORT_PATH.read_text())
        installed = version("transformers")
    except (OSError, ValueError, PackageNotFoundError):
        return None
    return frozenset(snapshot["without_sdpa"]) if snapshot.get("transformers_version") == installed else None


@functools.lru_cache(maxsize=256)
def _supports_sdpa(model_type: str) -> bool:
    """Whether transformers builds ``model_type``'s causal LM with SDPA attention when asked (its class's
    ``_supports_sdpa``): from the snapshot, else from the class itself; True for a type transformers does not
    know (it is built as Llama, :func:`_hf_config`)."""
    snapshot = _without_sdpa_snapshot()
    if snapshot is not None:
        return model_type not in snapshot
    try:
        import_transformers()
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        with quiet_transformers():
            cls = getattr(transformers, names[0] if isinstance(names, (list, tuple)) else names)
    except (ImportError, KeyError, AttributeError):
        return True
    return bool(getattr(cls, "_supports_sdpa", False))


def attention_that_runs(model_type: str | None, attention: Attention) -> Attention:
    """The attention a step of ``model_type`` runs when ``attention`` is asked: eager for a family whose
    transformers class has no SDPA (BLOOM, Gemma-2, GPT-Neo: :func:`build_causal_lm` falls back to it, and the
    collector records such runs as eager, ``tracer/collect.py``), else ``attention``. Its (b, heads, s, s) scores
    are what the analytic formula and the learned coefficients must count."""
    if attention is Attention.EAGER or model_type is None or _supports_sdpa(model_type):
        return attention
    return Attention.EAGER


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

    import_transformers()
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
    """(total, trainable) parameter counts of a module; shared (tied) tensors are counted once, and a
    bitsandbytes 4-bit weight (packed two codes per byte) as the weights it holds (its ``quant_state.shape``)."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():  # nn.Module.parameters() already de-duplicates shared Parameters
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = logical_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def logical_numel(p) -> int:
    """Weights a parameter holds: ``numel()``, or for a bitsandbytes 4-bit weight (``Params4bit``, two
    codes per byte) the product of its ``quant_state.shape``."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    if shape is not None and p.dtype.itemsize == 1 and len(shape) == 2:
        return int(shape[0]) * int(shape[1])
    return p.numel()


def count_params_from_config(cfg: dict[str, Any]) -> int:
    """Total parameters of the model a config dict describes, built on the ``meta`` device (no memory)."""
    import torch

    with torch.device("meta"):
        model = build_causal_lm(cfg)
    return count_params(model)[0]


#: PEFT's default LoRA target modules per ``model_type``, a snapshot (``scripts/peft_lora_targets.py`` writes it;
#: ``tests/test_catalog.py`` checks it against the installed PEFT): importing ``peft`` for the dict takes 8-9 s on a
#: 2-core machine, most of a command-line answer
PEFT_LORA_TARGETS_PATH = Path(__file__).with_name("peft_lora_targets.json")


@functools.cache
def _peft_lora_targets_snapshot() -> dict[str, list[str]]:
    return json.loads(PEFT_LORA_TARGETS_PATH.read_text())["lora_target_modules"]


def peft_default_lora_targets(model_type: str | None) -> list[str] | None:
    """PEFT's default LoRA ``target_modules`` for ``model_type`` (None: PEFT has none), as
    ``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` gives them: read from the
    shipped snapshot (:data:`PEFT_LORA_TARGETS_PATH`), and from PEFT itself for a type the snapshot lacks (a
    newer PEFT may know it)."""
    snapshot = _peft_lora_targets_snapshot()
    if model_type in snapshot:
        return list(snapshot[model_type])
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    except ImportError:
        return None
    found = defaults.get(model_type)
    return list(found) if found is not None else None


#: the output of :func:`lora_target_shapes` for PEFT's default targets of every catalog architecture, a snapshot
#: (``scripts/lora_target_shapes.py`` writes it; ``tests/test_catalog.py`` checks it against meta builds): the meta
#: build imports transformers' model code, about 4 s of a 16 s command-line answer that offers a LoRA alternative
LORA_SHAPES_PATH = Path(__file__).with_name("lora_target_shapes.json")


def lora_shapes_key(cfg: dict[str, Any], target_modules: list[str]) -> str:
    """SHA-256 (hex) of a config dict and the resolved LoRA target names: the key of :data:`LORA_SHAPES_PATH`."""
    import hashlib

    text = json.dumps({"config": cfg, "targets": list(target_modules)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _lora_shapes_snapshot() -> dict[str, Any]:
    """The snapshot's entries, or none when it was written with another transformers than the installed one
    (a module layout may have changed: the meta build answers)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        snapshot = json.loads(LORA_SHAPES_PATH.read_text())
        installed = version("transformers")
    except (OSError, ValueError, PackageNotFoundError):
        return {}
    return snapshot["entries"] if snapshot.get("transformers_version") == installed else {}


def lora_target_shapes(
    cfg: dict[str, Any], target_modules: list[str] | None
) -> tuple[dict[str, list[tuple[int, int]]], list[str]]:
    """The ``(in_features, out_features)`` of every matrix LoRA adapts, per target name, and the names of all
    adaptable matrices in the decoder layers, from a ``meta``-device build of ``cfg`` (no memory); a config and
    targets in the shipped snapshot (:data:`LORA_SHAPES_PATH`, the catalog's architectures with PEFT's default
    targets, written by this function under the installed transformers) are read from it, with no build.

    Matching follows PEFT (``peft.tuners.tuners_utils.check_target_module_exists``): a module matches a
    target when its name equals it or ends with ``"." + target``; ``target_modules=None`` means PEFT's
    default for the ``model_type`` (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``).
    ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2 family: weight of shape ``(in, out)``) are adaptable.

    Raises:
        InvalidConfiguration: no default exists for this ``model_type`` (field ``lora_target_modules``).
    """
    if target_modules is None:
        target_modules = peft_default_lora_targets(cfg.get("model_type"))
        if target_modules is None:
            raise InvalidConfiguration(
                "lora_target_modules",
                f"a list of module names (PEFT has no default for model_type {cfg.get('model_type')!r})",
                None,
            )
    hit = _lora_shapes_snapshot().get(lora_shapes_key(cfg, target_modules))
    if hit is not None:  # run-length: [in, out, count] per target, in layer order
        return (
            {t: [(i, o) for i, o, n in runs for _ in range(n)] for t, runs in hit["shapes"].items()},
            list(hit["names"]),
        )
    return _built_lora_target_shapes(cfg, target_modules)


def _built_lora_target_shapes(
    cfg: dict[str, Any], target_modules: list[str]
) -> tuple[dict[str, list[tuple[int, int]]], list[str]]:
    """:func:`lora_target_shapes` from a ``meta``-device build of ``cfg`` (the snapshot's source)."""
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        Conv1D = ()
    with torch.device("meta"):
        model = build_causal_lm(cfg)
    layers = decoder_layers(model)
    shapes: dict[str, list[tuple[int, int]]] = {t: [] for t in target_modules}
    names: set[str] = set()
    for layer in layers if layers is not None else []:
        for name, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                io = (mod.in_features, mod.out_features)
            elif Conv1D and isinstance(mod, Conv1D):
                io = (mod.weight.shape[0], mod.weight.shape[1])
            else:
                continue
            names.add(name.rsplit(".", 1)[-1])
            for t in target_modules:
                if name == t or name.endswith("." + t):
                    shapes[t].append(io)
    return shapes, sorted(names)


def model_spec(
    cfg: dict[str, Any], model=None, *, name: str | None = None, total_params: int | None = None
) -> ModelSpec:
    """:class:`ModelSpec` for a config dict; parameter counts from ``model`` if given, else ``total_params`` (a count
    known already, all trainable), else from a meta build."""
    fields = spec_fields_from_hf_config(cfg)
    if model is None:
        total = count_params_from_config(cfg) if total_params is None else total_params
        trainable = total
    else:
        total, trainable = count_params(model)
    return ModelSpec(**fields, model_name=name, total_params=total, trainable_params=trainable)


def decoder_layers(model):
    """The ``nn.ModuleList`` of decoder layers of a HF causal LM (or PEFT-wrapped one), else None.

    A list of transformers' ``GradientCheckpointingLayer`` wins; else a list named ``layers``, ``h``, ``blocks`` or
    ``layer``, the outermost first (a block's own inner ``layers`` are not the model's decoder layers), then the
    longest."""
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
                candidates.append((is_gc, -name.count("."), len(mod), mod))
    return max(candidates, key=lambda c: c[:3])[3] if candidates else None


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' logger for sweeps (warnings about random init etc.)."""
    import_transformers()
    from transformers.utils import logging as hf_logging

    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(prev)


def quantization_from_hf(quantization_config: Any, *, field: str = "quantization_config") -> Quantization:
    """The :class:`~memfit.schema.Quantization` a HF ``quantization_config`` (dict or
    ``transformers.BitsAndBytesConfig``) describes: ``load_in_4bit`` with ``bnb_4bit_use_double_quant`` ->
    ``nf4_double_quant``, without -> ``nf4`` (``bnb_4bit_quant_type`` ``nf4`` or ``fp4``: the same bytes),
    ``load_in_8bit`` -> ``int8``, neither -> ``none``.

    Raises:
        InvalidConfiguration: another quantization method (GPTQ, AWQ, ...) or a 4-bit type other than
            nf4/fp4; the error names ``field`` and the allowed values.
    """

    def get(key: str, default: Any = None) -> Any:
        if isinstance(quantization_config, dict):
            return quantization_config.get(key, default)
        return getattr(quantization_config, key, default)

    method = get("quant_method", "bitsandbytes")
    method = str(getattr(method, "value", method))
    if method != "bitsandbytes":
        raise InvalidConfiguration(f"{field}.quant_method", "'bitsandbytes' (load_in_4bit / load_in_8bit)", method)
    if get("load_in_4bit", False):
        kind = str(get("bnb_4bit_quant_type", "fp4") or "fp4")
        if kind not in ("nf4", "fp4"):
            raise InvalidConfiguration(f"{field}.bnb_4bit_quant_type", "one of 'nf4', 'fp4'", kind)
        return Quantization.NF4_DOUBLE_QUANT if get("bnb_4bit_use_double_quant", False) else Quantization.NF4
    if get("load_in_8bit", False):
        return Quantization.INT8
    return Quantization.NONE


def small_config(hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The same config with ``num_layers`` decoder layers: per-layer lists such as ``layer_types`` cut, or
    repeated cyclically where the small model is deeper than the model itself (a 2-layer model traced at 3)."""
    L = spec_fields_from_hf_config(hf_config)["num_layers"]
    out = copy.deepcopy(hf_config)
    for key in NUM_LAYERS_KEYS:
        if key in out:
            out[key] = num_layers
    for key, value in hf_config.items():
        if isinstance(value, list) and len(value) == L and key != "architectures":
            out[key] = [value[i % L] for i in range(num_layers)]
    if isinstance(hf_config.get("attention_types"), list):  # GPT-Neo: [[pattern, repeats], ...]
        per_layer = [t for pattern, repeats in hf_config["attention_types"] for _ in range(repeats) for t in pattern]
        out["attention_types"] = [[[per_layer[i % len(per_layer)]], 1] for i in range(num_layers)]
    return out


def layer_period(hf_config: dict[str, Any]) -> int:
    """Length of the repeating pattern of decoder-layer types (1 when all layers are alike).

    Read from the built HF config's ``layer_types`` (Gemma-2/3, Qwen2 sliding-window, ...) or
    ``attention_layers`` (GPT-Neo); capped at 4.
    """
    return layer_type_cycle(hf_config, 4) or 4


def layer_type_cycle(hf_config: dict[str, Any], max_period: int) -> int | None:
    """The shortest cycle of the built HF config's decoder-layer types (``layer_types`` or GPT-Neo's
    ``attention_layers``; 1 without them), or None when there is none of at most ``max_period`` layers. Memoised
    per config (building the transformers config takes ~15 ms)."""
    return _layer_type_cycle(json.dumps(hf_config, sort_keys=True), max_period)


@functools.lru_cache(maxsize=1024)
def _layer_type_cycle(hf_config_json: str, max_period: int) -> int | None:
    conf = _hf_config(json.loads(hf_config_json))
    types = getattr(conf, "layer_types", None) or getattr(conf, "attention_layers", None)
    if not types or len(set(types)) == 1:
        return 1
    for p in range(1, max_period + 1):
        if all(t == types[i % p] for i, t in enumerate(types)):
            return p
    return None


#: HF config keys holding the number of routed experts, per family (Mixtral; Qwen-MoE/OLMoE; DeepSeek)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def num_routed_experts(hf_config: dict[str, Any]) -> int | None:
    """Routed experts per MoE layer from a HF config dict (None for a dense model)."""
    for key in EXPERT_COUNT_KEYS:
        v = hf_config.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def local_expert_config(hf_config: dict[str, Any], expert_parallel_size: int) -> dict[str, Any]:
    """The config of one expert-parallel rank's shard: ``num_experts / expert_parallel_size`` experts.

    Raises:
        ValueError: a dense config, or ``expert_parallel_size`` not dividing the experts, or a local shard
            with fewer experts than the top-k.
    """
    E = num_routed_experts(hf_config)
    if E is None:
        raise ValueError("expert_parallel_size > 1 needs an MoE model (num_experts)")
    if E % expert_parallel_size:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} must divide num_experts={E}")
    out = copy.deepcopy(hf_config)
    for key in EXPERT_COUNT_KEYS:
        if key in out:
            out[key] = E // expert_parallel_size
    return out


def param_dtype(precision: Precision) -> torch.dtype:
    """dtype the model's parameters are stored in."""
    import torch

    return torch.bfloat16 if precision in (Precision.BF16, Precision.BF16_FP32_MASTER) else torch.float32


def _targets_conv1d(model, targets) -> bool:
    """Whether the LoRA target modules (names matched as PEFT matches a list: the module name or its last part)
    are transformers' ``Conv1D`` (GPT-2's weight layout, (in, out))."""
    from transformers.pytorch_utils import Conv1D

    names = {targets} if isinstance(targets, str) else set(targets or ())
    return any(
        isinstance(m, Conv1D) and (n in names or n.rsplit(".", 1)[-1] in names) for n, m in model.named_modules()
    )


def apply_finetune(model, training: TrainingConfig, layers) -> Any:
    if training.finetune is FineTune.LORA:
        from peft import LoraConfig, get_peft_model

        # PEFT's default targets, passed explicitly: PEFT 0.21 under transformers 5 leaves them an empty set for
        # Mixtral (NoMatchingPeftModuleError) though its mapping has q_proj, v_proj; for the other families the
        # explicit list adapts the same modules
        targets = training.lora_target_modules or peft_default_lora_targets(model.config.model_type)
        cfg = LoraConfig(
            r=training.lora_rank,
            lora_alpha=2 * training.lora_rank,
            lora_dropout=0.0,
            target_modules=targets,
            task_type="CAUSAL_LM",
            # GPT-2-style Conv1D projections store (in, out): PEFT sets this itself for them, with a warning
            fan_in_fan_out=_targets_conv1d(model, targets),
        )
        # PEFT reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning per model built)
        with _module_to_via_set_data(), warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            return get_peft_model(model, cfg)
    if training.finetune is FineTune.FROZEN:
        model.get_input_embeddings().requires_grad_(False)
        for layer in list(layers)[: training.frozen_layers]:
            layer.requires_grad_(False)
    return model


@contextlib.contextmanager
def _module_to_via_set_data():
    """Make ``nn.Module.to`` convert parameters through ``.data`` assignment.

    ``Module._apply`` swaps fake parameters with ``torch.utils.swap_tensors``, which refuses tensors
    that have weak references (the fake mode keeps some), so PEFT's ``module.to(device, dtype)`` of new
    adapters fails under ``FakeTensorMode``. Assigning ``.data`` keeps the same Parameter objects and
    allocates what the real conversion would.
    """
    import torch

    orig = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
        with torch.no_grad():
            for t in [*self.parameters(), *self.buffers()]:
                want = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
                if (device is not None and t.device != device) or want != t.dtype:
                    t.data = t.data.to(device or t.device, want)
        return self

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = orig


def catalog_name_key(name: str) -> str:
    """The form catalog names and aliases are looked up by: lower case, ``_`` and spaces as ``-``."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


#: decoder layers of every catalog model by :func:`catalog_name_key` of its name and aliases, a snapshot of
#: ``data/architectures`` (``scripts/catalog_layers.py`` writes it; ``tests/test_catalog.py`` checks it against the
#: catalog): the client answers its fallback plan without the server-side ``data`` package
CATALOG_LAYERS_PATH = Path(__file__).with_name("catalog_layers.json")


@functools.cache
def _catalog_layers_snapshot() -> dict[str, int]:
    return json.loads(CATALOG_LAYERS_PATH.read_text())["num_layers"]


def catalog_num_layers(name: str) -> int | None:
    """Decoder layers of the catalog model ``name`` (a name or alias, any case), None when the catalog has none."""
    return _catalog_layers_snapshot().get(catalog_name_key(name))


@functools.lru_cache(maxsize=256)
def _lora_shapes(cfg_json: str, targets: tuple[str, ...] | None):
    try:
        return lora_target_shapes(json.loads(cfg_json), list(targets) if targets else None)
    except InvalidConfiguration as err:
        raise err.within("training") from err


def lora_trainable_params(
    spec: ModelSpec, rank: int, target_modules: list[str] | None = None, hf_config: dict[str, Any] | None = None
) -> int:
    """Trainable parameters of LoRA: ``rank × (in + out)`` per adapted matrix (Hu et al. 2021,
    arXiv 2106.09685, Sec. 4).

    With ``hf_config`` the adapted matrices are those of the real model that PEFT would match
    (:func:`memfit.hf.lora_target_shapes`; ``None`` targets mean PEFT's default for the family). Without
    it, ``target_modules`` are Llama-style projection names (None: query and value projections).

    Raises:
        InvalidConfiguration: a target name matches no linear module of the model's decoder layers
            (field ``training.lora_target_modules``, allowed: the model's module names).
    """
    if hf_config is not None:
        shapes, names = _lora_shapes(json.dumps(hf_config, sort_keys=True), tuple(target_modules or ()) or None)
        missing = [t for t, found in shapes.items() if not found]
        if missing:
            raise InvalidConfiguration(
                "training.lora_target_modules",
                f"names of linear modules in this model's decoder layers: {names}",
                missing,
            )
        return rank * sum(i + o for found in shapes.values() for i, o in found)
    h, f = spec.hidden_size, spec.intermediate_size
    d = spec.head_dim or h // spec.num_attention_heads
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    dims = {
        "q_proj": (h, q_out),
        "k_proj": (h, kv_out),
        "v_proj": (h, kv_out),
        "o_proj": (q_out, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }
    targets = target_modules or ["q_proj", "v_proj"]
    return spec.num_layers * rank * sum(sum(dims.get(t, (h, h))) for t in targets)
