"""Traced phase terms: which configurations the traced path covers, their cache key, and the cache.

A configuration's terms (:class:`tracer.phases.PhaseTerms`, stored as JSON) depend on the
architecture's HF config and on everything in the training configuration except micro-batch size,
sequence length and which layers are checkpointed: those three are composed
(:mod:`model.compose`). :func:`terms_key` hashes exactly those inputs.

:class:`TermsCache` holds terms by key: the terms shipped with memfit (``data/terms/*.jsonl``, traced
for the catalog architectures by ``python -m training.terms``) plus an optional SQLAlchemy table for
terms traced at run time (``phase_terms``, in the telemetry store's database). Entries are never
overwritten: a key is traced once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from memfit.schema import Attention, FineTune, ModelSpec, Optimizer, Quantization, Sharding, TrainingConfig
from model.frozen import base_training, frozen
from model.frozen import not_composable_reason as frozen_not_composable_reason

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "terms"
#: ``{"keys": {stored key: terms_key}}`` for the shipped lines keyed before the config was canonicalised
#: (:func:`canonical_config`); written by ``scripts/rekey_canonical.py``, which recomputes each line's key from its
#: model's config and its training fields. Read with :func:`shipped_keys`; a line not in it is keyed canonically.
CANONICAL_KEYS_NAME = "canonical_keys.json"


#: bitsandbytes optimizers (tracer/bnb.py): traced and measured without sharding only
_BITSANDBYTES_OPTIMIZERS = frozenset({Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.LION})


def _mixes_dense_and_moe_layers(hf_config: dict[str, Any]) -> bool:
    """Whether some decoder layers of an MoE model are dense (DeepSeek's ``first_k_dense_replace``,
    Qwen-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``): the one- and two-layer traced models would
    not hold both kinds. Read from the built HF config (its defaults included:
    DeepSeek-V3's ``first_k_dense_replace`` defaults to 3)."""
    from memfit.hf import _hf_config

    conf = _hf_config(hf_config)
    dense_first = getattr(conf, "first_k_dense_replace", 0) or 0
    step = getattr(conf, "decoder_sparse_step", 1) or 1
    freq = getattr(conf, "moe_layer_freq", 1) or 1
    return bool(dense_first or getattr(conf, "mlp_only_layers", None) or step != 1 or freq != 1)


def _long_rope(hf_config: dict[str, Any]) -> bool:
    """Whether the config asks for long-RoPE scaling (Phi-3.5: ``rope_scaling.type`` or, transformers 5,
    ``rope_parameters.rope_type`` equal to ``longrope``)."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf_config.get(key)
        if isinstance(rope, dict) and "longrope" in (rope.get("rope_type"), rope.get("type")):
            return True
    return False


def not_traceable_reason(
    model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None = None
) -> str | None:
    """Why the traced path can't answer this configuration (None when it can).

    Not covered: MoE models that mix dense and MoE decoder layers (``hf_config`` keys
    ``first_k_dense_replace``, ``mlp_only_layers``, ``decoder_sparse_step``), expert parallelism with
    sharded parameters or with fewer local experts than the top-k, ``frozen`` fine-tuning (its layers
    are not alike: :meth:`model.curve.MemoryPredictor.curve` composes it from its full fine-tune base,
    :mod:`model.frozen`, where that applies; the reason says why not), ZeRO-1 (``ZeroRedundancyOptimizer`` assigns
    whole parameters to ranks greedily, so rank 0's share of a 1- or 2-layer model does not compose: its curve is
    composed instead from the traced terms of the same configuration without sharding, :mod:`model.zero1`),
    tensor parallelism outside the
    Llama-style families or combined with adapters. Pipeline and context parallelism are
    composed on top of the traced terms (:mod:`model.parallel`), so they do not block the traced path.
    MoE routing itself is traced with a balanced deterministic router (:func:`tracer.moe.balanced_routing`).
    """
    if hf_config is not None and _long_rope(hf_config):
        return (
            "long-RoPE model (rope_type=longrope, e.g. Phi-3.5): the traced token points build different "
            "rotary caches, so their timelines differ and do not compose (tracer/phases.py); not traced"
        )
    if model.num_experts is not None:
        if hf_config is not None and _mixes_dense_and_moe_layers(hf_config):
            return (
                "MoE model with dense and MoE decoder layers mixed (only uniform layers are traced): the saving "
                "per checkpointed layer is approximate (a dense and an MoE layer save different amounts)"
            )
        ep = training.expert_parallel_size
        if ep > 1 and training.sharding is not Sharding.NONE:
            return "expert parallelism is traced with sharding=none only"
        if ep > 1 and model.num_experts // ep < (model.num_experts_per_token or 1):
            return "expert parallelism with fewer local experts than the top-k is not traced"
    if training.finetune is FineTune.FROZEN:  # not traced itself: composed from its full fine-tune base
        return frozen_not_composable_reason(model, training, hf_config) or (
            "frozen fine-tuning is composed from the traced full fine-tune of its trainable layers "
            "(model.frozen), which has no composed phases here (not traced yet)"
        )
    if training.sharding is Sharding.ZERO1:
        from model.zero1 import not_composable_reason

        return not_composable_reason(training) or (
            "ZeRO-1 partitions whole parameters greedily per rank: it is "
            "composed from the unsharded configuration's traced terms"
        )
    if training.optimizer_in_backward and training.sharding is not Sharding.NONE:
        return "an optimizer step in backward is traced without sharding only"
    if training.quantization is not Quantization.NONE and training.sharding is not Sharding.NONE:
        return "a quantized base is traced without sharding only"
    if training.optimizer in _BITSANDBYTES_OPTIMIZERS and training.sharding is not Sharding.NONE:
        # its update kernel refuses FSDP2's DTensor parameters ("got mixed torch.Tensor and DTensor")
        return f"{training.optimizer.value} (bitsandbytes) is traced without sharding only"
    if training.tensor_parallel_size > 1:
        from model.parallel import TENSOR_PARALLEL_FAMILIES

        if model.architecture not in TENSOR_PARALLEL_FAMILIES:
            return (
                f"tensor parallelism is traced for {sorted(TENSOR_PARALLEL_FAMILIES)} only "
                f"(Llama-style projections), not {model.architecture}"
            )
        if model.num_key_value_heads % training.tensor_parallel_size:
            return (
                f"tensor parallelism is traced when it divides the key/value heads "
                f"({model.num_key_value_heads}); Megatron replicates them beyond"
            )
        if training.finetune is not FineTune.FULL:
            return "tensor parallelism is traced for full fine-tuning only"
        if training.optimizer_in_backward:
            return "tensor parallelism is traced with the optimizer step after backward only"
    return None


def canonical_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The config part of every key (:func:`terms_key`, :func:`model.snapshot.config_key`): one dict
    per model, whether it is given as its published ``config.json`` fields or serialised in full
    (:func:`memfit.hf.canonical_hf_config`: built by transformers, provenance, ``use_cache`` and class defaults
    dropped)."""
    from memfit.hf import canonical_hf_config

    return canonical_hf_config(hf_config)


def training_key_fields(training: TrainingConfig) -> dict[str, Any]:
    """Training fields the traced terms depend on (micro-batch, sequence length, k are composed).

    ``zero2`` and ``fsdp_shard_grad_op`` share one key: the tracer runs both as FSDP2
    ``fully_shard(reshard_after_forward=False)`` (``tracer/collect.py``), and DeepSpeed's stage 2 is composed
    on that trace (:mod:`model.deepspeed_zero`); shipped lines traced as ``zero2`` are found under it through
    :data:`CANONICAL_KEYS_NAME`."""
    attention = Attention.SDPA if training.attention is Attention.FLASH else training.attention
    sharding = Sharding.FSDP_SHARD_GRAD_OP if training.sharding is Sharding.ZERO2 else training.sharding
    return {
        "precision": training.precision.value,
        "optimizer": training.optimizer.value,
        "sharding": sharding.value,
        # the ranks the states are sharded over: context-parallel ranks join them (TrainingConfig.sharding_group_size)
        "data_parallel_size": training.sharding_group_size if training.sharding is not Sharding.NONE else 1,
        "attention": attention.value,
        "finetune": training.finetune.value,
        "lora_rank": training.lora_rank,
        "lora_target_modules": sorted(training.lora_target_modules) if training.lora_target_modules else None,
        "frozen_layers": training.frozen_layers,
        "checkpoint_impl": training.checkpoint_impl.value,
        # settings added later join the key only when set, so the keys of shipped terms stay valid
        **({"optimizer_in_backward": True} if training.optimizer_in_backward else {}),
        **({"quantization": training.quantization.value} if training.quantization is not Quantization.NONE else {}),
        # gradient accumulation: every micro-batch after the first holds the gradients, whatever their count
        **({"gradient_accumulation": True} if training.accumulates_gradients else {}),
        **(
            {"tensor_parallel_size": training.tensor_parallel_size, "sequence_parallel": training.sequence_parallel}
            if training.tensor_parallel_size > 1
            else {}
        ),
    } | _moe_key_fields(training)


def key_training_fields(key_fields: dict[str, Any]) -> dict[str, Any]:
    """:class:`TrainingConfig` fields of a terms entry's ``training`` (the inverse of :func:`training_key_fields`
    where they differ): ``"gradient_accumulation": true`` becomes ``gradient_accumulation_steps=2`` (every
    count above one traces the same), and null values and ``cuda_generation`` (not a training field:
    :func:`key_generation`) are left out."""
    out = {
        k: v for k, v in key_fields.items() if v is not None and k not in ("gradient_accumulation", "cuda_generation")
    }
    if key_fields.get("gradient_accumulation"):
        out["gradient_accumulation_steps"] = 2
    return out


def _moe_key_fields(training: TrainingConfig) -> dict[str, Any]:
    """MoE settings in the key only where they change the traced footprint (dense keys stay as they were).

    Without expert parallelism the imbalance factor is left out: under ``grouped_mm`` a rank's footprint
    does not depend on how its T·k rows spread over the experts (``tests/test_moe.py`` checks this).
    """
    if training.expert_parallel_size == 1:
        return {}
    return {
        "expert_parallel_size": training.expert_parallel_size,
        "moe_imbalance_factor": training.moe_imbalance_factor,
    }


_CONTEXT = object()


def key_generation(hf_config: dict[str, Any], training: TrainingConfig, generation: Any = _CONTEXT) -> str | None:
    """The GPU generation a configuration's terms key holds (``"sm90"``, ...), or None for CPU-semantics terms.

    ``generation`` (default: the request's, :data:`model.cuda_semantics.TARGET_GENERATION`) is kept only where a
    CUDA trace of that generation differs from the CPU trace (:func:`model.cuda_semantics.cuda_trace_reasons`);
    elsewhere the CPU-semantics terms (every shipped line without ``cuda_generation``) answer every generation."""
    from model.cuda_semantics import TARGET_GENERATION, GpuGeneration, cuda_trace_reasons

    gen = TARGET_GENERATION.get() if generation is _CONTEXT else generation
    if gen is None:
        return None
    gen = GpuGeneration(gen)
    return gen.value if cuda_trace_reasons(hf_config, training, gen) else None


def terms_key(hf_config: dict[str, Any], training: TrainingConfig, generation: Any = _CONTEXT) -> str:
    """SHA-256 (hex) of the canonical config (:func:`canonical_config`) and :func:`training_key_fields`, plus
    ``cuda_generation`` where the terms depend on the GPU generation (:func:`key_generation`; ``generation``
    defaults to the request's).

    Shipped entries keyed before the config was canonicalised are found through :data:`CANONICAL_KEYS_PATH`."""
    fields = training_key_fields(training)
    gen = key_generation(hf_config, training, generation)
    if gen is not None:
        fields["cuda_generation"] = gen
    body = json.dumps(
        {"config": canonical_config(hf_config), "training": fields},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(body.encode()).hexdigest()


def shipped_keys(folder: Path | None = SHIPPED_DIR) -> dict[str, str]:
    """The stored key -> :func:`terms_key` map of a terms folder (:data:`CANONICAL_KEYS_NAME`; empty when none)."""
    path = Path(folder) / CANONICAL_KEYS_NAME if folder else None
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text())["keys"]


def entry_key(entry: dict[str, Any], keys: dict[str, str]) -> str:
    """The :func:`terms_key` of a shipped line: its stored ``key`` through ``keys`` (:func:`shipped_keys`)."""
    return keys.get(entry["key"], entry["key"])


def shipped_entries(folder: Path | None = SHIPPED_DIR) -> list[dict[str, Any]]:
    """Every line of the shipped terms files (``folder/*.jsonl``: ``key``, ``model_name``, ``training``,
    ``terms``), files in name order, each line once; ``key`` is read through :func:`shipped_keys`.

    A file's name says what it holds; no file takes precedence over another, so a key must not be shipped twice
    with different terms.

    Raises:
        ValueError: two lines share a key and disagree on the terms (names both files).
    """
    if not folder or not Path(folder).is_dir():
        return []
    keys, seen, out = shipped_keys(folder), {}, []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            key = entry["key"] = entry_key(entry, keys)
            if key in seen:
                first_path, first_terms = seen[key]
                if first_terms != entry["terms"]:
                    raise ValueError(
                        f"terms key {key} is shipped twice with different terms: {first_path.name} and {path.name}"
                    )
                continue
            seen[key] = (path, entry["terms"])
            out.append(entry)
    return out


#: :func:`_shipped_terms` by folder state, oldest first (a few folders: the shipped one, and tests' own)
_SHIPPED_TERMS: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
_SHIPPED_TERMS_MAX = 8


def _shipped_terms(folder: Path | None) -> dict[str, dict[str, Any]]:
    """``key -> terms`` of :func:`shipped_entries`, parsed once per folder state (its files' names, sizes and
    modification times): every :class:`TermsCache` of the process shares the parsed terms dicts, which are never
    mutated (reading the shipped files takes ~0.35 s)."""
    if not folder or not Path(folder).is_dir():
        return {}
    files = [*sorted(Path(folder).glob("*.jsonl")), Path(folder) / CANONICAL_KEYS_NAME]
    state = (
        str(Path(folder).resolve()),
        *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()),
    )
    hit = _SHIPPED_TERMS.get(state)
    if hit is None:
        hit = {entry["key"]: entry["terms"] for entry in shipped_entries(folder)}
        if len(_SHIPPED_TERMS) >= _SHIPPED_TERMS_MAX:
            del _SHIPPED_TERMS[next(iter(_SHIPPED_TERMS))]
        _SHIPPED_TERMS[state] = hit
    return hit


class TermsCache:
    """Traced terms by :func:`terms_key`: shipped JSONL files plus an optional database table.

    Args:
        url: SQLAlchemy URL of the database holding the ``phase_terms`` table; None keeps run-time
            entries in memory only.
        shipped_dir: folder of shipped ``*.jsonl`` files (one JSON object per line with ``key`` and
            ``terms``); a stored key listed in its :data:`CANONICAL_KEYS_NAME` is read as the key it maps to.
    """

    def __init__(self, url: str | None = None, shipped_dir: Path | None = SHIPPED_DIR) -> None:
        self._mem: dict[str, dict[str, Any]] = dict(_shipped_terms(shipped_dir))
        self._engine = self._table = None
        if url is not None:
            import sqlalchemy as sa

            # a locked SQLite file must not hold a request for SQLite's default 5 s: wait 2 s like the store
            args = {"timeout": 2} if url.startswith("sqlite") else {}
            self._engine = sa.create_engine(url, connect_args=args)
            meta = sa.MetaData()
            self._table = sa.Table(
                "phase_terms",
                meta,
                sa.Column("key", sa.String(64), primary_key=True),
                sa.Column("model_name", sa.String(128)),
                sa.Column("terms_json", sa.Text),
            )
            meta.create_all(self._engine)

    def __len__(self) -> int:
        return len(self._mem)

    def get(self, key: str) -> dict[str, Any] | None:
        """Terms JSON for ``key``, or None when not traced yet."""
        hit = self._mem.get(key)
        if hit is None and self._engine is not None:
            import sqlalchemy as sa

            with self._engine.connect() as conn:
                row = conn.execute(sa.select(self._table.c.terms_json).where(self._table.c.key == key)).first()
            if row is not None:
                hit = self._mem[key] = json.loads(row[0])
        return hit

    def put(self, key: str, terms: dict[str, Any], model_name: str | None = None) -> bool:
        """Store terms once; returns False (and keeps the stored entry) when ``key`` exists."""
        if self.get(key) is not None:
            return False
        self._mem[key] = terms
        if self._engine is not None:
            import sqlalchemy as sa

            with self._engine.begin() as conn:
                try:
                    conn.execute(
                        self._table.insert().values(key=key, model_name=model_name, terms_json=json.dumps(terms))
                    )
                except sa.exc.IntegrityError:
                    return False
        return True


def base_terms_key(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None) -> str | None:
    """The traced-terms key (:func:`model.terms.terms_key`) a frozen configuration is composed from: the full
    fine-tune of the same HF config (its terms compose any depth); None when not frozen or not composable."""
    if not frozen(training) or frozen_not_composable_reason(model, training, hf_config) is not None:
        return None
    return terms_key(hf_config, base_training(training))
