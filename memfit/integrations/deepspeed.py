"""DeepSpeed: recompute only the chosen layers in models that call ``deepspeed.checkpointing.checkpoint``.

Megatron-DeepSpeed style models call ``deepspeed.checkpointing.checkpoint(function, *args)`` for every
layer when activation checkpointing is on. :func:`patch_deepspeed_checkpointing` replaces that
attribute with a dispatcher that checkpoints only the recommended layers and runs the others
directly (keeping their activations).

Call convention (what the patch relies on):

* ``checkpoint(function, *args)``: ``function(*args)`` is one decoder layer's forward and returns its
  outputs; DeepSpeed's own implementation recomputes ``function`` during backward.
* Layer index of a call: ``layer_index(function, *args)`` when given; else the position of
  ``function.__self__`` in ``layers`` when given; else the call's position in the forward pass —
  calls are counted modulo ``num_layers`` (every forward must call it once per layer, in order;
  :meth:`DeepSpeedCheckpointPatch.reset` re-synchronises, e.g. at the start of each step).
* The attribute is looked up at call time (``deepspeed.checkpointing.checkpoint(...)``); code that
  bound ``from deepspeed.checkpointing import checkpoint`` before patching keeps the original.

deepspeed is never required: without it, pass ``module=`` (for instance :func:`standin_checkpointing`,
a ``torch.utils.checkpoint``-based stand-in with the same convention). The tests run the patch against
the real ``deepspeed.checkpointing`` on CPU (``pip install memfit[frameworks]``).
"""

from __future__ import annotations

import importlib
import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Self

from memfit.checkpointing import AppliedCheckpointing, CheckpointPlan, MemfitWarning, _counting

log = logging.getLogger("memfit")


def standin_checkpointing() -> types.ModuleType:
    """A module object with ``checkpoint(function, *args)`` = ``torch.utils.checkpoint.checkpoint``
    (non-reentrant): stands in for ``deepspeed.checkpointing`` where deepspeed is not installed."""
    mod = types.ModuleType("memfit_standin.checkpointing", "Stand-in for deepspeed.checkpointing")

    def checkpoint(function, *args):
        import torch.utils.checkpoint as cp

        return cp.checkpoint(function, *args, use_reentrant=False)

    mod.checkpoint = checkpoint
    return mod


def checkpointing_module() -> types.ModuleType:
    """``deepspeed.checkpointing`` (an attribute of the ``deepspeed`` package, not an importable submodule:
    it is ``deepspeed.runtime.activation_checkpointing.checkpointing``).

    Raises:
        ImportError: deepspeed is not installed (the message says what to do instead).
    """
    try:
        deepspeed = importlib.import_module("deepspeed")
        return deepspeed.checkpointing
    except (ImportError, AttributeError) as err:
        raise ImportError(
            "deepspeed is not installed: pip install deepspeed, or pass module=... (e.g. "
            "memfit.integrations.deepspeed.standin_checkpointing() for a CPU test)"
        ) from err


class DeepSpeedCheckpointPatch:
    """The installed patch: ``plan`` counts recomputed layers; :meth:`undo` restores the original.

    Usable as a context manager (undo on exit). For an every-layer plan whose layer count is unknown
    (the client's fallback for a catalog name) every call is checkpointed and ``plan.layer_indices``
    fills with the call positions seen in the first forward.
    """

    def __init__(
        self,
        module: Any,
        plan: AppliedCheckpointing,
        layer_index: Callable[..., int | None] | None,
        layers: Sequence[Any] | None,
        every_layer: bool = False,
    ) -> None:
        self.module, self.plan = module, plan
        self.original = module.checkpoint
        self.calls = 0
        self._layer_index = layer_index
        self._index_of = {id(m): i for i, m in enumerate(layers)} if layers is not None else {}
        self._chosen = set(plan.layer_indices)
        self._every_layer = every_layer
        self._undone = False
        module.checkpoint = self._checkpoint

    def reset(self) -> None:
        """The next positional call is layer 0."""
        self.calls = 0

    def _index(self, function, args) -> int:
        if self._layer_index is not None:
            i = self._layer_index(function, *args)
            if i is not None:
                return int(i)
        owner = getattr(function, "__self__", None)
        if owner is not None and id(owner) in self._index_of:
            return self._index_of[id(owner)]
        if not self.plan.num_layers and self.plan.recomputed:  # every-layer plan: the first backward ran,
            self.plan.num_layers, self.calls = len(self.plan.layer_indices), 0  # so the first forward gave L
        i = self.calls % self.plan.num_layers if self.plan.num_layers else self.calls
        self.calls += 1
        return i

    def _checkpoint(self, function, *args, **kwargs):
        if self._undone:  # undone under a later patch: pass through to what was there before this one
            return self.original(function, *args, **kwargs)
        import torch

        if not torch.is_grad_enabled():  # an evaluation forward: nothing to recompute, and not a counted step
            return function(*args, **kwargs)
        i = self._index(function, args)
        if self._every_layer:
            if i not in self._chosen:
                self._chosen.add(i)
                self.plan.layer_indices.append(i)
            return self.original(_counting(function, self.plan, i), *args, **kwargs)
        if i in self._chosen:
            return self.original(_counting(function, self.plan, i), *args, **kwargs)
        return function(*args)

    def undo(self) -> None:
        """Put the original ``checkpoint`` back. Patches may be undone in any order: one undone under a later
        patch passes its calls through until that one is undone, which then restores what was there before both."""
        self._undone = True
        if self.module.checkpoint == self._checkpoint:  # bound methods compare equal, never identical
            original = self.original
            while (
                isinstance(getattr(original, "__self__", None), DeepSpeedCheckpointPatch) and original.__self__._undone
            ):
                original = original.__self__.original
            self.module.checkpoint = original

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def patch_deepspeed_checkpointing(
    rec: Any,
    *,
    num_layers: int | None = None,
    module: Any = None,
    layers: Sequence[Any] | None = None,
    layer_index: Callable[..., int | None] | None = None,
    strict: bool = False,
    pipeline_stage: int | None = None,
) -> DeepSpeedCheckpointPatch:
    """Make ``module.checkpoint`` (default ``deepspeed.checkpointing.checkpoint``) recompute only the
    recommended layers; see the module docstring for the call convention.

    Args:
        rec: :class:`memfit.api.Recommendation`, :class:`memfit.CheckpointPlan` or a list of layer
            indices, read by :meth:`CheckpointPlan.from_recommendation` (the client's fallback and a
            ``k=None`` answer mean every layer).
        num_layers: decoder layers per forward (default: the recommendation's, else ``len(layers)``).
            Not needed for an every-layer plan: then every call is checkpointed.
        module: the object whose ``checkpoint`` is patched (default ``deepspeed.checkpointing``).
        layers: the layer modules, to index calls by ``function.__self__``.
        layer_index: ``f(function, *args) -> index or None`` for other conventions.
        strict: raise instead of adjusting the plan (nothing fits, layer-count mismatch).
        pipeline_stage: for a pipeline-parallel answer, this process's stage: the calls are then that stage's
            layers (:meth:`CheckpointPlan.from_recommendation`).

    Calls under ``torch.no_grad()`` (evaluation forwards) run the layer directly and are not counted.

    Raises:
        ImportError: deepspeed is not installed and no ``module`` was given.
        ValueError: the layer count is unknown for a plan of chosen layers, or an index is outside
            ``[0, num_layers)``; a pipeline-parallel answer without ``pipeline_stage`` and without the
            stage's ``num_layers`` (counting the calls of one stage modulo the whole model's layers would stop
            checkpointing after the first step).
    """
    module = module if module is not None else checkpointing_module()
    given = num_layers or (len(layers) if layers is not None else None)
    plan = CheckpointPlan.from_recommendation(rec, num_layers=given, strict=strict, pipeline_stage=pipeline_stage)
    stages = plan.pipeline_parallel_size
    if stages > 1 and pipeline_stage is None and given is None and not plan.every_layer:
        raise ValueError(
            f"pipeline_stage: the recommendation is for pipeline_parallel_size={stages}; pass pipeline_stage= "
            f"(this rank's stage, 0..{stages - 1}) so the calls count the stage's layers"
        )
    # An every-layer plan needs no count (every call is checkpointed); the recommendation's count is
    # only trusted for a plan of chosen layers.
    L = given or (None if plan.every_layer else plan.num_layers)
    if plan.every_layer:
        chosen = list(range(L)) if L else []
    elif not L:
        raise ValueError("num_layers is required: the model's decoder-layer count (to index the checkpoint calls)")
    else:
        chosen = plan.indices(L)
    applied = AppliedCheckpointing(chosen, L or 0, "deepspeed_patch", use_reentrant=True, source=plan.source)
    log.info(
        "memfit: deepspeed checkpoint patched: %s of %s layers %s recompute",
        applied.k if L else "every",
        L or "?",
        chosen if L else "(all)",
    )
    return DeepSpeedCheckpointPatch(module, applied, layer_index, layers, every_layer=plan.every_layer and not L)


def deepspeed_activation_checkpointing_config(rec: Any, *, num_layers: int | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON ``activation_checkpointing`` block matching a recommendation.

    ``number_checkpoints`` is k: DeepSpeed uses it to size the contiguous buffer of checkpointed
    activations; *which* layers recompute is decided by the model's calls (see
    :func:`patch_deepspeed_checkpointing`, or Megatron's ``--recompute-num-layers``). For an
    every-layer plan (the client's fallback, or nothing fits) it is the layer count, or DeepSpeed's
    default ``None`` (no buffer sizing) when the count is unknown. Merge it with ``ds_config.update(...)``;
    DeepSpeed's ``DeepSpeedActivationCheckpointingConfig`` parses it to the same values.

    Raises:
        ValueError: ``rec`` a bool, or a k or layer index outside the model's layers (``[0, num_layers]``; k >= 0
            when the count is unknown).
    """
    plan = CheckpointPlan.from_recommendation(rec, num_layers=num_layers)
    n = num_layers if num_layers is not None else plan.num_layers
    k = len(plan.indices(n)) if n is not None else plan.k()
    return {
        "activation_checkpointing": {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": k,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    }


def _is_hf_model(model: Any) -> bool:
    from memfit.describe import unwrap

    base = unwrap(model)
    try:
        from transformers import PreTrainedModel

        if isinstance(base, PreTrainedModel):
            return True
    except ImportError:
        pass
    return hasattr(base, "config") and (
        hasattr(base, "activation_checkpointing_enable") or hasattr(base, "gradient_checkpointing_enable")
    )


def check_deepspeed_config(ds_config: dict[str, Any], model: Any) -> list[str]:
    """Warn about DeepSpeed settings that do nothing for this model; returns the warnings given.

    HF transformers models checkpoint through ``torch.utils.checkpoint`` and never call
    ``deepspeed.checkpointing.checkpoint``, so an ``activation_checkpointing`` block (e.g.
    ``number_checkpoints``, ``partition_activations``) in the DeepSpeed JSON has no effect on them.
    """
    out = []
    block = (ds_config or {}).get("activation_checkpointing")
    if isinstance(block, dict) and block and _is_hf_model(model):
        keys = ", ".join(sorted(block))
        out.append(
            f"DeepSpeed activation_checkpointing ({keys}) has no effect on a HF transformers model: it "
            "never calls deepspeed.checkpointing.checkpoint. Use memfit.apply(model, recommendation) "
            "(or MemfitTrainerCallback with the HF Trainer) to choose the checkpointed layers."
        )
    for msg in out:
        warnings.warn(msg, MemfitWarning, stacklevel=2)
    return out
