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
a ``torch.utils.checkpoint``-based stand-in with the same convention, used by the examples and tests).
"""

from __future__ import annotations

import importlib
import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from memfit.checkpointing import AppliedCheckpointing, MemfitWarning, _counting

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
    """``deepspeed.checkpointing``.

    Raises:
        ImportError: deepspeed is not installed (the message says what to do instead).
    """
    try:
        return importlib.import_module("deepspeed.checkpointing")
    except ImportError as err:
        raise ImportError("deepspeed is not installed: pip install deepspeed, or pass module=... (e.g. "
                          "memfit.integrations.deepspeed.standin_checkpointing() for a CPU test)") from err


class DeepSpeedCheckpointPatch:
    """The installed patch: ``plan`` counts recomputed layers; :meth:`undo` restores the original.

    Usable as a context manager (undo on exit).
    """

    def __init__(self, module: Any, plan: AppliedCheckpointing, layer_index: Callable[..., int | None] | None,
                 layers: Sequence[Any] | None) -> None:
        self.module, self.plan = module, plan
        self.original = module.checkpoint
        self.calls = 0
        self._layer_index = layer_index
        self._index_of = {id(m): i for i, m in enumerate(layers)} if layers is not None else {}
        self._chosen = set(plan.layer_indices)
        self._funcs: dict[int, Any] = {}
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
        i = self.calls % self.plan.num_layers
        self.calls += 1
        return i

    def _checkpoint(self, function, *args, **kwargs):
        i = self._index(function, args)
        if i in self._chosen:
            return self.original(_counting(function, self.plan, i), *args, **kwargs)
        return function(*args)

    def undo(self) -> None:
        """Put the original ``checkpoint`` back."""
        if self.module.checkpoint == self._checkpoint:  # bound methods compare equal, never identical
            self.module.checkpoint = self.original

    def __enter__(self) -> DeepSpeedCheckpointPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def patch_deepspeed_checkpointing(rec: Any, *, num_layers: int | None = None, module: Any = None,
                                  layers: Sequence[Any] | None = None,
                                  layer_index: Callable[..., int | None] | None = None) -> DeepSpeedCheckpointPatch:
    """Make ``module.checkpoint`` (default ``deepspeed.checkpointing.checkpoint``) recompute only the
    recommended layers; see the module docstring for the call convention.

    Args:
        rec: :class:`memfit.api.Recommendation` (its ``layers``; the client fallback or ``k=None``
            means every layer) or a list of layer indices.
        num_layers: decoder layers per forward (default ``rec.num_layers``; required for a list or a
            fallback without a layer count).
        module: the object whose ``checkpoint`` is patched (default ``deepspeed.checkpointing``).
        layers: the layer modules, to index calls by ``function.__self__``.
        layer_index: ``f(function, *args) -> index or None`` for other conventions.

    Raises:
        ImportError: deepspeed is not installed and no ``module`` was given.
        ValueError: the layer count is unknown, or an index is outside ``[0, num_layers)``.
    """
    module = module if module is not None else checkpointing_module()
    L = num_layers or getattr(rec, "num_layers", 0) or (len(layers) if layers is not None else 0)
    if not L:
        raise ValueError("num_layers is required (the recommendation does not say how many layers the model has)")
    if not hasattr(rec, "layers"):
        chosen = sorted({int(i) for i in rec})
    elif getattr(rec, "model_version", None) == "fallback" or rec.k is None:
        chosen = list(range(L))
    else:
        chosen = list(rec.layers)
    bad = [i for i in chosen if not 0 <= i < L]
    if bad:
        raise ValueError(f"layer indices {bad} out of range: allowed [0, {L - 1}]")
    plan = AppliedCheckpointing(chosen, L, "deepspeed_patch", use_reentrant=True,
                                source=getattr(rec, "model_version", None))
    log.info("memfit: deepspeed checkpoint patched: %d of %d layers %s recompute", plan.k, L, chosen)
    return DeepSpeedCheckpointPatch(module, plan, layer_index, layers)


def deepspeed_activation_checkpointing_config(rec: Any) -> dict[str, Any]:
    """The DeepSpeed JSON ``activation_checkpointing`` block matching a recommendation.

    ``number_checkpoints`` is k: DeepSpeed uses it to size the contiguous buffer of checkpointed
    activations; *which* layers recompute is decided by the model's calls (see
    :func:`patch_deepspeed_checkpointing`, or Megatron's ``--recompute-num-layers``). Merge it with
    ``ds_config.update(...)``.

    Raises:
        ValueError: k is None (nothing fits).
    """
    k = getattr(rec, "k", rec)
    if k is None:
        raise ValueError("recommendation has k=None (nothing fits): see its alternatives")
    return {"activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "number_checkpoints": int(k), "synchronize_checkpoint_boundary": False, "profile": False}}


def _is_hf_model(model: Any) -> bool:
    from memfit.describe import unwrap

    base = unwrap(model)
    try:
        from transformers import PreTrainedModel

        if isinstance(base, PreTrainedModel):
            return True
    except ImportError:
        pass
    return hasattr(base, "config") and (hasattr(base, "gradient_checkpointing_enable")
                                        or hasattr(base, "activation_checkpointing_enable"))


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
        out.append(f"DeepSpeed activation_checkpointing ({keys}) has no effect on a HF transformers model: it "
                   "never calls deepspeed.checkpointing.checkpoint. Use memfit.apply(model, recommendation) "
                   "(or MemfitTrainerCallback with the HF Trainer) to choose the checkpointed layers.")
    for msg in out:
        warnings.warn(msg, MemfitWarning, stacklevel=2)
    return out
