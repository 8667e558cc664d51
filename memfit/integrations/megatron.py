"""Megatron-LM command-line flags for a recommendation.

Megatron's ``--recompute-method block`` checkpoints the first ``--recompute-num-layers`` layers of
each pipeline stage — memfit's ``block`` layout — with ``--recompute-granularity full`` (whole layers).
With pipeline parallelism the count is per stage: pass the per-stage k.
"""

from __future__ import annotations

from typing import Any


def megatron_flags(rec: Any, *, pipeline_parallel_size: int = 1, num_layers: int | None = None) -> list[str]:
    """Flags that recompute the recommended layers: ``["--recompute-granularity", "full",
    "--recompute-method", "block", "--recompute-num-layers", str(k)]``; ``[]`` when k == 0.

    Args:
        rec: a :class:`memfit.api.Recommendation` (or anything with ``k``), or k itself. The client's
            fallback means every layer: its ``num_layers``, or ``num_layers`` given here.
        pipeline_parallel_size: stages; the per-stage count is ``ceil(k / stages)``.

    Raises:
        ValueError: k is None (nothing fits) or negative; the layers are not the block layout; a
            fallback without a layer count.
    """
    if getattr(rec, "model_version", None) == "fallback":
        L = getattr(rec, "num_layers", 0) or num_layers
        if not L:
            raise ValueError("fallback recommendation (checkpoint every layer) without a layer count: pass num_layers=")
        rec = L
    k = rec if isinstance(rec, int) else getattr(rec, "k", None)
    if k is None:
        raise ValueError("recommendation has k=None (nothing fits): see its alternatives")
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    layers = getattr(rec, "layers", None)
    if layers and pipeline_parallel_size == 1 and list(layers) != list(range(k)):
        raise ValueError(f"layers {list(layers)} are not the first k={k} (layout 'even'?): Megatron's block method "
                         "checkpoints the first layers; ask for layout='block'")
    if k == 0:
        return []
    per_stage = -(-k // max(1, pipeline_parallel_size))
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(per_stage)]
