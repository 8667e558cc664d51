"""Frozen fine-tuning (``finetune='frozen'``): the curve composed from the full fine-tune of the layers above.

``memfit.hf.apply_finetune`` freezes the input embeddings (``get_input_embeddings()``; with tied
embeddings that tensor is also the LM head, so the head is frozen too) and the first N =
``frozen_layers`` decoder layers; k checkpoints the first k decoder layers. Where nothing trainable runs
below layer N (the embedding output is the only input of the decoder stack), nothing below layer N needs
a gradient (PyTorch autograd records no graph for ops whose inputs do not require grad):

* the frozen layers' forward saves no activations, they have no gradients and no optimizer states,
  backward stops at layer N and runs no embedding backward;
* checkpointing a frozen layer (k <= N) changes nothing (``torch.utils.checkpoint`` with no input or
  parameter requiring grad saves nothing either way).

So the step of an L-layer model with N frozen holds what the traced **full** fine-tune of the same
architecture with L' = L − N layers holds (:func:`base_model`, :func:`base_training`: the full model's terms,
:func:`model.compose.compose_terms` composes any depth from them) at k' = max(0, k − N), with
(:func:`device_phases`, per rank):

* plus the N frozen layers' weights (:func:`frozen_layer_weight_bytes`): resident in every phase (their
  1/n shard under ZeRO-2/3 and FSDP), and under ZeRO-2 / FSDP ``shard_grad_op`` also their gathered copy
  from forward to the end of backward (never resharded by a backward of their own);
* minus the input embeddings' optimizer states (fp32 master copy included; the difference of
  :func:`model.analytic.model_state_bytes` between base and frozen model), in every phase of a primed step;
* minus the embeddings' step temporaries in ``opt`` (:func:`model.analytic.step_temporary_bytes_per_param`: one
  copy per parameter with foreach AdamW and Adafactor, none with fused AdamW, SGD, bitsandbytes; measured here:
  removing the embeddings of pythia-70m, 25.8 M parameters, lowers the opt phase by exactly 4 B per parameter
  under amp with foreach AdamW and with Adafactor, by 0 with fused AdamW and SGD);
* minus the embeddings' gradient where the base certainly holds it: ``bwd.emb`` and ``opt`` (untied);
  ``bwd.layers`` on too with tied embeddings (the LM head's backward produced it). Not in ``bwd.head``:
  the base's head-backward peak comes before that gradient is allocated (subtracting it there is 3.4 %
  low on gemma-2b, 4.4 % on qwen2.5-0.5b);
* the frozen step has no embedding backward (the base's ``embedding_dense_backward`` transient: 1 GB on
  llama-3.2-1b in pure bf16, its fp32 accumulation buffer) and allocates nothing after its last layer's
  backward, so its ``bwd.emb`` column is capped by its ``bwd.layers`` column;
* the first trainable layer's input needs no gradient, so its backward computes no input gradient: a
  smaller transient than the base's, not subtracted (conservative).

Where it does not hold (:func:`not_composable_reason`): a trainable parameter runs before the first
trainable layer — learned position embeddings (GPT-2, GPT-Neo, OPT: ``get_input_embeddings`` is the token
table only) or an embedding LayerNorm (BLOOM) — so the frozen layers' input requires grad and backward runs
through them (found on a meta build: a trainable parameter registered before the first decoder layer);
every layer frozen; ZeRO-1 (its base is not traced); tied embeddings under sharding in ``bf16_fp32_master``
(composed from traced bases, llama-3.2-1b FSDP over 64 ranks and ZeRO-2 over 4 at micro-batch 1, sequence 128 are
+22 % and +26 % over, smollm2-135m ZeRO-2 over 4 +15 %, llama-3.2-1b FSDP shard_grad_op over 32 at b = 2, s = 1,024
+0.17 %: the base's head backward holds more than the frozen one's, by more than the tied gradient); MoE; layer-type patterns that N does not keep in phase. Those keep the
provisional answer (the ratio model), as does a frozen request whose base is answered by the ratio model.

Measured agreement (``/work/notes/s6/frozen/validate.py``: every frozen family of
``data/telemetry/telemetry.parquet`` that composes, each base traced by :func:`tracer.phases.trace_terms`,
every measured k; fake-tensor collector measurements):

* unsharded: 360 rows, 30 families, 10 architectures (pythia-70m/160m/410m, llama-3.2-1b, llama-3-8b,
  qwen2.5-0.5b, gemma-2b, olmo-2-1b, smollm3-3b, tinyllama-1.1b; tied and untied; fp32, AMP bf16/fp16, pure
  bf16, bf16 + fp32 master; foreach/fused AdamW, SGD, Adafactor; SDPA and eager): MAPE 0.040 %, worst +0.39 %
  (llama-3.2-1b, pure bf16, b = 4, s = 4096, k = 0: the tied head's kept backward transient), none below the
  measurement, 302 within 0.1 %;
* sharded, untied (FSDP full-shard over 4 to 64 ranks, FSDP shard_grad_op, ZeRO-2, ZeRO-3: pythia-70m/160m/410m,
  tinyllama-1.1b, olmo-2-1b, phi-3-mini): 200 rows, 20 families, MAPE 0.034 %, worst +0.41 %; one row
  below, -3.75 % (pythia-70m, ZeRO-3 over 8 ranks, AMP bf16, b = 2, s = 2048, k = 2), a stored measurement
  the collector no longer reproduces: measured again (``tracer.collect.measure_family``) it is 2,974,092,800
  B, 1,280 B above the composed value.

* sharded, tied, composed from traced bases (``data/telemetry/telemetry.parquet``; the tied table is frozen with the
  head, so the frozen step computes no gradient for it): falcon-7b FSDP shard_grad_op over 32 in bf16, gemma-2-2b
  FSDP over 4 in AMP fp16, gemma-2b shard_grad_op over 8 and ZeRO-3 over 64, llama-3.2-1b ZeRO-3 over 64 in AMP
  bf16, qwen2.5-0.5b FSDP over 32 (AMP bf16) and 64 (AMP fp16): 7 families, 91 rows, each family's mean
  +0.06 to +0.33 %, worst +0.85 %, none below.

Before the rules above were refined the same check found what they now handle: the embeddings' foreach
step temporaries (pythia-70m +10.9 %), the tied gradient in ``bwd.head`` (gemma-2b -3.4 %), the embedding
backward's transient (llama-3.2-1b pure bf16 +15 %), the gathered frozen layers under shard_grad_op
(pythia-160m -2.5 %). ``tests/test_frozen.py`` checks the composition against the collector's measurement
of tiny Llama-shaped models (tied and untied) at every k.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from memfit.hf import build_causal_lm, count_params, decoder_layers, layer_period, quiet_transformers
from memfit.schema import FineTune, ModelSpec, Precision, Sharding, TrainingConfig
from model.analytic import model_state_bytes, step_temporary_bytes_per_param, weight_dtype_bytes
from model.compose import PEAK_PHASES
from model.derivation import PROVISIONAL, Draft, Request, peak_phases

#: phases from which the base holds the (tied) input embeddings' gradient (model.compose.PEAK_PHASES names)
_GRAD_PHASES_UNTIED = ("bwd.emb", "opt")
_GRAD_PHASES_TIED = ("bwd.layers", "bwd.emb", "opt")


def frozen(training: TrainingConfig) -> bool:
    """True for ``finetune='frozen'``."""
    return training.finetune is FineTune.FROZEN


def base_training(training: TrainingConfig) -> TrainingConfig:
    """The base configuration: the same training as a full fine-tune (``frozen_layers`` 0)."""
    return training.model_copy(update={"finetune": FineTune.FULL, "frozen_layers": 0, "checkpoint_layers": []})


def embedding_params(model: ModelSpec) -> int:
    """Parameters of the input token embeddings (``vocab_size × hidden_size``)."""
    return model.vocab_size * model.hidden_size


def base_model(model: ModelSpec, training: TrainingConfig) -> ModelSpec:
    """The base architecture: L − N decoder layers, every parameter trainable.

    The frozen model's frozen parameters are the embeddings plus N layers, so the base (the frozen model
    without its N frozen layers) holds ``trainable + vocab × hidden`` parameters.

    Raises:
        ValueError: ``frozen_layers`` >= ``num_layers`` (no trainable decoder layer).
    """
    n = training.frozen_layers
    if n >= model.num_layers:
        raise ValueError(f"frozen_layers={n} leaves no trainable decoder layer of {model.num_layers}")
    total = min(model.total_params, model.trainable_params + embedding_params(model))
    return model.model_copy(
        update={"num_layers": model.num_layers - n, "total_params": total, "trainable_params": total}
    )


def frozen_layer_params(model: ModelSpec) -> int:
    """Parameters of the N frozen decoder layers: total − trainable − the input embeddings."""
    return max(0, model.total_params - model.trainable_params - embedding_params(model))


def trainable_params(model: ModelSpec, frozen_layers: int, hf_config: dict[str, Any] | None = None) -> int:
    """Trainable parameters with the input embeddings and the first ``frozen_layers`` decoder layers frozen
    (as ``memfit.hf.apply_finetune`` freezes them): counted on a meta build of ``hf_config`` when
    given, else from the shapes (a decoder layer = (total − embeddings − untied head) / layers)."""
    if hf_config is not None:
        try:
            return _trainable_on_meta(json.dumps(hf_config, sort_keys=True), frozen_layers)
        except Exception:  # noqa: BLE001, S110 - a config transformers cannot build: count from the shapes
            pass
    emb = embedding_params(model)
    layer = max(0, model.total_params - emb * (1 if model.tie_word_embeddings else 2)) // model.num_layers
    return max(0, model.total_params - emb - frozen_layers * layer)


@functools.lru_cache(maxsize=256)
def _trainable_on_meta(hf_config_json: str, frozen_layers: int) -> int:
    import torch

    with torch.device("meta"), quiet_transformers():
        model = build_causal_lm(json.loads(hf_config_json))
    model.get_input_embeddings().requires_grad_(False)
    for layer in list(decoder_layers(model))[:frozen_layers]:
        layer.requires_grad_(False)
    return count_params(model)[1]


@functools.lru_cache(maxsize=256)
def _runs_trainable_before_layers(hf_config_json: str) -> str | None:
    """Name of the first trainable parameter registered before the first decoder layer once the input
    embeddings are frozen (HF decoders register modules in data-flow order), or None. Meta build."""
    import torch

    with torch.device("meta"), quiet_transformers():
        model = build_causal_lm(json.loads(hf_config_json))
    model.get_input_embeddings().requires_grad_(False)
    first = next(iter(decoder_layers(model)[0].parameters()))
    for name, p in model.named_parameters():
        if p is first:
            return None
        if p.requires_grad:
            return name
    return None


def not_composable_reason(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None) -> str | None:
    """Why a frozen configuration can't be composed from its full fine-tune base (None when it can)."""
    if hf_config is None:
        return "no HF config to compose frozen fine-tuning from"
    if training.frozen_layers >= model.num_layers:
        return "every decoder layer frozen: no layer to compose the base from"
    if training.sharding is Sharding.ZERO1:
        return "frozen fine-tuning under ZeRO-1 (its full fine-tune base is not traced either)"
    if (
        training.sharding is not Sharding.NONE
        and model.tie_word_embeddings
        and training.precision is Precision.BF16_FP32_MASTER
    ):
        return (
            "frozen fine-tuning with tied embeddings under sharding in bf16 with fp32 master weights: composed from "
            "the traced base, 3 of 4 measured families are 14-26 % over (the base's head backward holds more than the "
            "frozen step's), so it is not composed"
        )
    if model.num_experts is not None:
        return "frozen fine-tuning of MoE models is not composed"
    if training.tensor_parallel_size > 1 or training.pipeline_parallel_size > 1:
        # the frozen layers sit on the first stages, and a tensor-parallel rank holds a shard of each: the states
        # added and removed here (device_phases) are those of one rank holding the whole model
        return "frozen fine-tuning with tensor or pipeline parallelism is not composed"
    if training.frozen_layers % layer_period(hf_config):
        return "frozen layers do not keep the layer-type pattern of the trainable layers in phase"
    name = _runs_trainable_before_layers(json.dumps(hf_config, sort_keys=True))
    if name is not None:
        return (
            f"frozen fine-tuning where {name} stays trainable below the decoder layers: backward runs "
            "through the frozen layers"
        )
    return None


def frozen_layer_weight_bytes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """(resident, gathered) bytes of the N frozen layers' weights on one rank.

    Resident in every phase: all of them without sharding, their 1/n shard under any ZeRO-2/3 or FSDP sharding.
    Gathered from their forward to the end of backward (not in the optimizer step): under ZeRO-2 /
    FSDP ``shard_grad_op`` (no reshard after forward, ``tracer.collect``: FSDP2 ``reshard_after_forward=False``)
    the whole unsharded copy, in the mixed-precision policy's 16-bit dtype under autocast precisions, and
    no backward of theirs ever reshards it (the root's post-backward does); with resharding after forward
    only one layer at a time, as in every layer of the base (0 here). Measured: pythia-160m, FSDP
    shard_grad_op over 2 ranks, fp32: the frozen step holds the shard and the gathered copy (85 MB + 42.5 MB),
    where :func:`model.analytic.model_state_bytes` counts the gathered copy only.
    """
    params = frozen_layer_params(model)
    w = weight_dtype_bytes(training.precision)
    if training.sharding is Sharding.NONE:
        return params * w, 0
    resident = params * w // training.sharding_group_size
    if training.sharding in (Sharding.ZERO2, Sharding.FSDP_SHARD_GRAD_OP):
        half = 2 if training.precision in (Precision.AMP_BF16, Precision.AMP_FP16) else w
        return resident, params * half
    return resident, 0


def device_phases(base_phase_bytes, phase_names: list[str], model: ModelSpec, training: TrainingConfig):
    """The frozen configuration's live bytes per phase from its base's composed phases.

    Args:
        base_phase_bytes: float array (L'+1, phases), L' = L − N: the base's
            :attr:`model.compose.ComposedCurve.phase_bytes` (:func:`base_model`, :func:`base_training`).
        phase_names: its column names (:data:`model.compose.PEAK_PHASES`).
        model, training: the frozen configuration (L layers, N = ``frozen_layers``).

    Returns:
        float array (L+1, phases): row k is the base's row max(0, k − N) with the rules of the module
        docstring applied (bytes).
    """
    base = np.asarray(base_phase_bytes, dtype=np.float64)
    n, L = training.frozen_layers, model.num_layers
    if base.shape[0] != L - n + 1:
        raise ValueError(f"base phases have {base.shape[0]} rows, expected L - N + 1 = {L - n + 1}")
    # what the frozen model holds beyond / short of its base, as model_state_bytes counts it (per rank: sharded
    # or gathered as the sharding keeps them): the frozen layers' weights, the embeddings' gradient and states
    mine, theirs = (
        model_state_bytes(model, training),
        model_state_bytes(base_model(model, training), base_training(training)),
    )
    shards = training.sharding_group_size if training.sharding is not Sharding.NONE else 1
    out = base[np.maximum(np.arange(L + 1) - n, 0)].copy()
    resident, gathered = frozen_layer_weight_bytes(model, training)
    out += resident
    out[:, [phase_names.index(p) for p in phase_names if p != "opt"]] += gathered
    out -= theirs.optimizer_bytes - mine.optimizer_bytes
    out[:, phase_names.index("opt")] -= embedding_params(model) * step_temporary_bytes_per_param(training) // shards
    cols = _GRAD_PHASES_TIED if model.tie_word_embeddings else _GRAD_PHASES_UNTIED
    out[:, [phase_names.index(p) for p in cols]] -= theirs.gradients_bytes - mine.gradients_bytes
    # the end of the frozen step's backward (its bwd.emb phase: no embedding backward follows the layers')
    # holds no more than the layers' backward did (it allocates nothing after the last trainable layer's)
    emb_col, layers_col = phase_names.index("bwd.emb"), phase_names.index("bwd.layers")
    out[:, emb_col] = np.minimum(out[:, emb_col], out[:, layers_col])
    return out


class FrozenLayersDerivation:
    """The :class:`model.derivation.Derivation` of frozen fine-tunes that compose (:func:`not_composable_reason`):
    the curve from the phases of the full fine-tune of the layers above (:func:`base_model`, :func:`base_training`,
    :func:`device_phases`) on the base's path; no answer (the next step answers) when the base has no phases."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        model, training, hf_config = request.model, request.training, request.hf_config
        if draft is not None or not frozen(training) or not_composable_reason(model, training, hf_config) is not None:
            return draft
        base = predictor.curve(base_model(model, training), base_training(training), hf_config)
        if base.phase_bytes is None:
            return None
        dev = device_phases(base.phase_bytes, list(PEAK_PHASES), model, training)
        raw, phases = peak_phases(dev, PEAK_PHASES)
        composed = (
            f"frozen fine-tuning composed from the full fine-tune of the {base_model(model, training).num_layers}"
            f" layers above the {training.frozen_layers} frozen ones (model.frozen)"
        )
        notes = [n for n in base.notes if not n.startswith("provisional answer")] + [composed]
        if base.path == PROVISIONAL:
            notes.append(
                f"provisional answer (learned phase coefficients of the base, composed per phase): {base.reason}"
            )
        return Draft(
            path=base.path,
            raw=raw,
            phases=phases,
            phase_bytes=dev,
            states=model_state_bytes(model, training),
            terms_key=base.terms_key,
            reason=base.reason,
            notes=notes,
            learned=base.learned_coefficients,
            composed_from="frozen",
            margin_sharding=training.sharding,
            report_group=False,
            gradients_live=training.accumulates_gradients,
        )
