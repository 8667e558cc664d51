"""Megatron-Core ``TransformerConfig`` recompute fields (and Megatron-LM flags) for a recommendation.

Megatron's ``recompute_method="block"`` with ``recompute_granularity="full"`` checkpoints whole layers:
the first ``recompute_num_layers`` layers *of each pipeline stage* — memfit's ``block`` layout
(``megatron.core.transformer.transformer_config.TransformerConfig``, field docs). A stage may need a
different count (k not divisible by the stages: the first stages take one more), so the settings are
given per stage; each pipeline rank builds its ``TransformerConfig`` with its own stage's fields (under the
interleaved schedule a rank's layers are several model chunks, and the count is per chunk)::

    fields = megatron_recompute_config(rec, pipeline_parallel_size=pp)[pp_rank]
    config = TransformerConfig(num_layers=..., hidden_size=..., ..., **fields)

An every-layer plan (the client's fallback, or nothing fits) whose layer count is unknown is
``recompute_method="uniform", recompute_num_layers=1``: each layer its own recompute unit, i.e. every
layer checkpointed, without knowing how many there are. Nothing here imports megatron.
"""

from __future__ import annotations

from typing import Any

from memfit.checkpointing import CheckpointPlan
from memfit.schema import PipelineSchedule, TrainingConfig

NO_RECOMPUTE: dict[str, Any] = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
EVERY_LAYER: dict[str, Any] = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


def _training(rec: Any) -> dict[str, Any]:
    """The answer's resolved training configuration (a saved ``--json`` answer is a dict), else {}."""
    training = (rec.get("training") if isinstance(rec, dict) else getattr(rec, "training", None)) or {}
    return training if isinstance(training, dict) else {}


def _stages(rec: Any, pipeline_parallel_size: int | None) -> int:
    if pipeline_parallel_size is not None:
        return pipeline_parallel_size
    return int(_training(rec).get("pipeline_parallel_size", 1))


def _chunks(rec: Any, pipeline_chunks_per_rank: int | None) -> int:
    """Model chunks per pipeline rank: given, else the recommendation's (``interleaved_1f1b``), else 1."""
    if pipeline_chunks_per_rank is not None:
        return pipeline_chunks_per_rank
    t = _training(rec)
    if t.get("pipeline_schedule") != PipelineSchedule.INTERLEAVED_1F1B.value:
        return 1
    return int(t.get("pipeline_chunks_per_rank") or TrainingConfig.model_fields["pipeline_chunks_per_rank"].default)


def megatron_recompute_config(
    rec: Any,
    *,
    pipeline_parallel_size: int | None = None,
    num_layers: int | None = None,
    strict: bool = False,
    pipeline_chunks_per_rank: int | None = None,
) -> list[dict[str, Any]]:
    """``TransformerConfig`` recompute fields for each pipeline stage (index = pipeline rank).

    Args:
        rec: :class:`memfit.api.Recommendation`, :class:`memfit.CheckpointPlan` or layer indices
            (read by :meth:`CheckpointPlan.from_recommendation`; fallback / nothing fits = every layer).
        pipeline_parallel_size: stages (default: the recommendation's resolved training, else 1).
        num_layers: the model's layer count, when the recommendation does not carry it.
        strict: raise instead of adjusting the plan (nothing fits, layer-count mismatch).
        pipeline_chunks_per_rank: virtual-pipeline model chunks per rank (default: the recommendation's under
            ``interleaved_1f1b``, else 1). Megatron-Core builds one ``TransformerBlock`` per chunk, and the block
            method recomputes the first ``recompute_num_layers`` layers of each block
            (``megatron/core/transformer/transformer_block.py``, ``_checkpointed_forward``): a stage that plans
            k_s layers gets ``ceil(k_s / chunks)`` per chunk, at least the k_s layers memfit's stage model counts
            (it weighs a stage's layers alike: :func:`model.parallel.micro_batches_in_flight`).

    Returns:
        One dict per stage with ``recompute_granularity``, ``recompute_method`` and
        ``recompute_num_layers``: ``full``/``block``/k_s where the stage checkpoints k_s >= 1 layers,
        all None where it checkpoints none, ``full``/``uniform``/1 for an every-layer plan of
        unknown size.

    Raises:
        ValueError: stages < 1 or not dividing the layers; a stage whose chosen layers are not its
            first ones (layout ``even``: ask for ``layout='block'``); a plan of chosen layers with no
            layer count.
    """
    stages = _stages(rec, pipeline_parallel_size)
    if stages < 1:
        raise ValueError(f"pipeline_parallel_size={stages} must be >= 1")
    plan = CheckpointPlan.from_recommendation(rec, num_layers=num_layers, strict=strict)
    L = num_layers or plan.num_layers
    if plan.every_layer and not L:
        return [dict(EVERY_LAYER) for _ in range(stages)]
    if not L:
        raise ValueError("num_layers is required: the model's layer count (the plan does not carry it)")
    if L % stages:
        raise ValueError(
            f"num_layers={L} must be divisible by pipeline_parallel_size={stages}: Megatron-Core gives each stage "
            "num_layers / pipeline_parallel_size layers (the answer's stages split the remainder over the last ones, "
            "which Megatron's layer settings do not express); ask for a pipeline size that divides the layers"
        )
    chunks = _chunks(rec, pipeline_chunks_per_rank)
    if chunks < 1 or (L // stages) % chunks:
        raise ValueError(
            f"pipeline_chunks_per_rank={chunks} must be >= 1 and divide the {L // stages} layers of each stage"
        )
    chosen = set(plan.indices(L))
    per_stage = L // stages
    out = []
    for s in range(stages):
        mine = sorted(i - s * per_stage for i in chosen if s * per_stage <= i < (s + 1) * per_stage)
        if chunks > 1:  # the stage's layers sit in `chunks` blocks spread over the model: a count per block
            per_chunk = -(-len(mine) // chunks)
            out.append(
                {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": per_chunk}
                if per_chunk
                else dict(NO_RECOMPUTE)
            )
            continue
        if mine != list(range(len(mine))):
            raise ValueError(
                f"stage {s} checkpoints layers {[i + s * per_stage for i in mine]}, not its first "
                f"{len(mine)} (layout 'even'?): Megatron's block method checkpoints the first layers "
                "of each stage; ask for layout='block'"
            )
        out.append(
            {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": len(mine)}
            if mine
            else dict(NO_RECOMPUTE)
        )
    return out


def megatron_flags(
    rec: Any,
    *,
    pipeline_parallel_size: int | None = None,
    num_layers: int | None = None,
    pipeline_chunks_per_rank: int | None = None,
) -> list[str]:
    """Megatron-LM command-line flags for the same plan: ``["--recompute-granularity", "full",
    "--recompute-method", "block", "--recompute-num-layers", str(k)]``; ``[]`` when nothing recomputes.

    The command line sets one count for every stage, so stages that differ (k not divisible by the
    stages) get the largest per-stage count: at least the planned layers recompute.

    Raises:
        ValueError: as :func:`megatron_recompute_config`.
    """
    stages = megatron_recompute_config(
        rec,
        pipeline_parallel_size=pipeline_parallel_size,
        num_layers=num_layers,
        pipeline_chunks_per_rank=pipeline_chunks_per_rank,
    )
    active = [s for s in stages if s["recompute_granularity"] is not None]
    if not active:
        return []
    widest = max(active, key=lambda s: s["recompute_num_layers"])
    return [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        widest["recompute_method"],
        "--recompute-num-layers",
        str(widest["recompute_num_layers"]),
    ]
