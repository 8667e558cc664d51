"""Apply activation checkpointing to exactly the chosen decoder layers, and count what recomputed.

This is the one function both the collector and the client use, so the telemetry measures the
checkpointing that users get.

* HF transformers with ``GradientCheckpointingLayer`` (>= 4.52, all of 5.x): every decoder layer has
  its own ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``; we set them per layer.
* HF transformers 4.x before that: the model's single ``_gradient_checkpointing_func`` is replaced by
  one that checkpoints only calls whose bound module is a chosen layer.
* Any other ``nn.ModuleList`` / ``nn.Sequential`` of blocks: the chosen blocks are wrapped with
  ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper`` in place (apply
  this before FSDP2 ``fully_shard``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AppliedCheckpointing:
    """What :func:`apply_activation_checkpointing` did.

    Attributes:
        layer_indices: indices (into the decoder-layer list) that are checkpointed, sorted.
        num_layers: length of the decoder-layer list.
        mechanism: ``hf_per_layer``, ``hf_shared_func`` or ``checkpoint_wrapper``.
        recomputed: layer indices seen recomputing during a backward pass (filled at run time).
    """

    layer_indices: list[int]
    num_layers: int
    mechanism: str
    use_reentrant: bool = False
    recomputed: set[int] = field(default_factory=set)

    @property
    def k(self) -> int:
        return len(self.layer_indices)

    def verify(self) -> bool:
        """True when exactly the planned layers recomputed (call after the first backward)."""
        return self.recomputed == set(self.layer_indices)


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1


def _counting(fn, plan: AppliedCheckpointing, index: int):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _in_backward():
            plan.recomputed.add(index)
        return fn(*args, **kwargs)

    return run


def _checkpoint_func(plan: AppliedCheckpointing, index: int):
    import torch.utils.checkpoint as cp

    def checkpointed(function, *args, **kwargs):
        return cp.checkpoint(_counting(function, plan, index), *args, use_reentrant=plan.use_reentrant, **kwargs)

    return checkpointed


def apply_activation_checkpointing(
    model, layer_indices: Sequence[int], *, layers=None, use_reentrant: bool = False
) -> AppliedCheckpointing:
    """Checkpoint exactly ``layer_indices`` of the model's decoder layers; un-checkpoint the others.

    Args:
        model: a HF ``PreTrainedModel`` (PEFT-wrapped is fine) or any ``nn.Module``.
        layer_indices: indices into the decoder-layer list, each in ``[0, L)``.
        layers: the ``nn.ModuleList``/``nn.Sequential`` of blocks; found automatically when None.
        use_reentrant: ``torch.utils.checkpoint`` flavour; non-reentrant is the default and the
            only one that keeps gradients flowing when the layer inputs do not require grad.

    Returns:
        :class:`AppliedCheckpointing`; its ``recomputed`` set fills during backward.

    Raises:
        ValueError: no decoder-layer list found, or an index outside ``[0, L)``.
    """
    from torch import nn

    from memfit.hf import decoder_layers

    layers = layers if layers is not None else decoder_layers(model)
    if layers is None:
        raise ValueError("model has no nn.ModuleList of decoder layers; pass layers=...")
    L = len(layers)
    chosen = sorted(set(int(i) for i in layer_indices))
    bad = [i for i in chosen if not 0 <= i < L]
    if bad:
        raise ValueError(f"layer_indices {bad} out of range: allowed [0, {L - 1}]")
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        GradientCheckpointingLayer = None

    if GradientCheckpointingLayer is not None and isinstance(layers[0], GradientCheckpointingLayer):
        plan = AppliedCheckpointing(chosen, L, "hf_per_layer", use_reentrant)
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i in chosen
            layer._gradient_checkpointing_func = _checkpoint_func(plan, i)
        _disable_cache(model)
        return plan

    hf_owner = next((m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")
                     or hasattr(m, "gradient_checkpointing")), None)
    if hf_owner is not None and hasattr(model, "gradient_checkpointing_enable"):
        plan = AppliedCheckpointing(chosen, L, "hf_shared_func", use_reentrant)
        index_of = {id(layer): i for i, layer in enumerate(layers)}
        funcs = {i: _checkpoint_func(plan, i) for i in chosen}

        def selective(function, *args, **kwargs):
            i = index_of.get(id(getattr(function, "__self__", None)))
            if i in funcs:
                return funcs[i](function, *args, **kwargs)
            return function(*args, **kwargs)

        for m in model.modules():
            if hasattr(m, "gradient_checkpointing"):
                m.gradient_checkpointing = bool(chosen)
                m._gradient_checkpointing_func = selective
        _disable_cache(model)
        return plan

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    plan = AppliedCheckpointing(chosen, L, "checkpoint_wrapper", use_reentrant)
    impl = CheckpointImpl.REENTRANT if use_reentrant else CheckpointImpl.NO_REENTRANT
    for i in range(L):
        inner = getattr(layers[i], "_checkpoint_wrapped_module", layers[i])
        if i in chosen:
            wrapped = checkpoint_wrapper(inner, checkpoint_impl=impl)
            inner_forward = inner.forward
            inner.forward = _counting(inner_forward, plan, i)
            layers[i] = wrapped
        elif isinstance(layers[i], nn.Module) and inner is not layers[i]:
            layers[i] = inner
    return plan


def _disable_cache(model) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
