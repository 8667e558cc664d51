"""Apply activation checkpointing to exactly the chosen decoder layers, and count what recomputed.

A recommendation is read once, into a :class:`CheckpointPlan` (which layers, for how many, from
which model version, and why it was adjusted); :func:`apply`, the DeepSpeed patch
(:mod:`memfit.integrations.deepspeed`) and the Megatron-Core settings (:mod:`memfit.integrations.megatron`)
all take that plan. :func:`checkpoint_layers` is the one mechanism both the collector and the client use,
so the telemetry measures the checkpointing that users get.

* HF transformers with ``GradientCheckpointingLayer`` (>= 4.52, all of 5.x): every decoder layer has
  its own ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``; we set them per layer.
* HF transformers 4.x before that: the model's single ``_gradient_checkpointing_func`` is replaced by
  one that checkpoints only calls whose bound module is a chosen layer.
* Any other ``nn.ModuleList`` / ``nn.Sequential`` of blocks: the chosen blocks are wrapped with
  ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper`` in place (apply
  this before FSDP2 ``fully_shard``).

:func:`apply` is the user-facing entry (``memfit.apply``): it applies a service recommendation and
guards against known traps — reentrant checkpointing behind frozen embeddings (no gradients, silently),
frozen (LoRA) parameters + ZeRO-3 + non-reentrant checkpointing on DeepSpeed without the recompute fix,
whole-model ``torch.compile`` around non-reentrant checkpointing (can erase or invert the savings; per-block
compile applied after :func:`apply`, the torchtitan way, is fine).
:func:`verify` checks after the first backward that exactly the planned layers recomputed.
"""

from __future__ import annotations

import functools
import logging
import numbers
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger("memfit")


class MemfitWarning(UserWarning):
    """A memfit plan was adjusted, or may not do what it promises."""


FALLBACK_VERSION = "fallback"


@dataclass(frozen=True)
class CheckpointPlan:
    """Which decoder layers to activation-checkpoint, read once from a recommendation.

    The one reader of a recommendation: :func:`apply`, :func:`memfit.integrations.deepspeed.patch_deepspeed_checkpointing`
    and :func:`memfit.integrations.megatron.megatron_recompute_config` all take a plan (or build one
    with :meth:`from_recommendation`).

    Attributes:
        layer_indices: sorted indices into the decoder-layer list, or None for **every layer** (the
            safe plan: the client's fallback, nothing fits, or an answer for another layer count),
            which every reader can carry out without knowing the layer count.
        num_layers: L the plan was made for, or None when unknown.
        source: the recommendation's ``model_version`` (``"fallback"`` for the client's safe plan),
            None for a plain list of indices.
        adjusted: why the plan differs from the recommendation's ``layers`` (fallback, nothing fits,
            layer-count mismatch), else None.
        pipeline_parallel_size: the recommendation's pipeline-parallel size (1 for a plan not read from one).
    """

    layer_indices: tuple[int, ...] | None
    num_layers: int | None = None
    source: str | None = None
    adjusted: str | None = None
    pipeline_parallel_size: int = 1

    @property
    def every_layer(self) -> bool:
        return self.layer_indices is None

    def indices(self, num_layers: int) -> list[int]:
        """The checkpointed indices for a model with ``num_layers`` decoder layers.

        Raises:
            ValueError: an index outside ``[0, num_layers)``.
        """
        if self.layer_indices is None:
            return list(range(num_layers))
        bad = [i for i in self.layer_indices if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"layer_indices {bad} out of range: allowed [0, {num_layers - 1}]")
        return list(self.layer_indices)

    def k(self, num_layers: int | None = None) -> int | None:
        """Checkpointed layers; None for an every-layer plan whose layer count is unknown."""
        if self.layer_indices is not None:
            return len(self.layer_indices)
        return num_layers if num_layers is not None else self.num_layers

    @classmethod
    def from_recommendation(
        cls,
        rec: Any,
        *,
        num_layers: int | None = None,
        strict: bool = False,
        stacklevel: int = 3,
        pipeline_stage: int | None = None,
    ) -> CheckpointPlan:
        """Read a :class:`memfit.api.Recommendation`, a plan, a list of layer indices or a k (the first k layers).

        Args:
            rec: the service's answer (a :class:`memfit.api.Recommendation` or its JSON as a dict), the client's
                fallback, a :class:`CheckpointPlan`, layer indices (integers), or an integer k.
            num_layers: decoder layers of the live model when known (checked against the answer's, or against
                the stage's with ``pipeline_stage``).
            strict: raise instead of adjusting the plan with a :class:`MemfitWarning`.
            pipeline_stage: for an answer with ``pipeline_parallel_size > 1``, the stage this process runs
                (0-based): the plan is then that stage's layers, indexed from 0 within the stage (the answer's
                ``stages``: its ``first_layer`` and ``num_layers``).

        The client's fallback (``model_version == "fallback"``) is every layer, silently (the client
        already warned). A ``k=None`` answer (nothing fits) and an answer made for another layer count
        become every layer, with a warning.

        Raises:
            ValueError: with ``strict``, for nothing fits, a layer-count mismatch (a pipeline-parallel answer met
                by one stage's layers without ``pipeline_stage``) or ``pipeline_stage`` given for an answer without
                stages (without ``strict``: every layer, with a warning); an index < 0 or not an integer; a k outside
                [0, num_layers]; ``pipeline_stage`` outside the answer's stages.
            pydantic.ValidationError: a dict that is not a recommendation (the fields named).
        """
        if isinstance(rec, dict):  # a saved answer (``memfit recommend --json``, the service's JSON)
            from memfit.api import Recommendation

            rec = Recommendation.model_validate(rec)
        k_given = isinstance(rec, numbers.Integral)
        if isinstance(rec, bool) or (k_given and not 0 <= rec <= (num_layers or max(rec, 0))):
            allowed = "an integer >= 0" if num_layers is None else f"an integer in [0, {num_layers}]"
            raise ValueError(f"k={rec!r} must be {allowed}")
        if k_given:
            rec = range(int(rec))
        if isinstance(rec, CheckpointPlan):
            plan = rec
            if plan.num_layers is not None and num_layers is not None and plan.num_layers != num_layers:
                return cls._mismatch(plan.num_layers, num_layers, plan.source, strict, stacklevel + 1)
        elif not hasattr(rec, "layers"):
            iterable = hasattr(rec, "__iter__") and not isinstance(rec, (str, bytes)) and getattr(rec, "ndim", 1) != 0
            items = list(rec) if iterable else []
            if not iterable or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items):
                raise ValueError(
                    "recommendation: a Recommendation (or its JSON dict), a CheckpointPlan, a k (an int) or a list "
                    f"of layer indices (ints >= 0), got {type(rec).__name__} {rec!r:.80}"
                )
            chosen = tuple(sorted({int(i) for i in items}))
            if any(i < 0 for i in chosen):
                raise ValueError(f"layer indices {[i for i in chosen if i < 0]} must be >= 0")
            plan = cls(chosen, num_layers)
        else:
            stages = int((getattr(rec, "training", None) or {}).get("pipeline_parallel_size") or 1)
            plan = replace(
                cls._answer_plan(rec, num_layers, strict, stacklevel + 1, pipeline_stage),
                pipeline_parallel_size=stages,
            )
        if num_layers is not None and plan.num_layers is None:
            plan = replace(plan, num_layers=num_layers)
        return plan

    @classmethod
    def _answer_plan(
        cls, rec: Any, num_layers: int | None, strict: bool, stacklevel: int, pipeline_stage: int | None
    ) -> CheckpointPlan:
        """The plan of a :class:`memfit.api.Recommendation` (:meth:`from_recommendation`, same arguments)."""
        version = getattr(rec, "model_version", None)
        n = getattr(rec, "num_layers", 0) or None
        stages = int((getattr(rec, "training", None) or {}).get("pipeline_parallel_size") or 1)
        if version == FALLBACK_VERSION:  # every layer; of a stage, the live model's count (the answer's is the model's)
            count = num_layers if pipeline_stage is not None else num_layers or n
            return cls(None, count, version, "memfit service gave no answer (client fallback)")
        if pipeline_stage is not None:
            return cls._stage_plan(rec, pipeline_stage, num_layers, strict, stacklevel + 1)
        if n is not None and num_layers is not None and n != num_layers:
            hint = (
                f"; for one stage of its {stages}-stage pipeline pass pipeline_stage= (this rank's stage)"
                if stages > 1
                else ""
            )
            return cls._mismatch(n, num_layers, version, strict, stacklevel + 1, hint)
        if rec.k is None:
            msg = "recommendation says no k fits (see its alternatives)"
            if strict:
                raise ValueError(msg)
            _warn(f"memfit: {msg}; checkpointing every layer, the most memory it can save", stacklevel=stacklevel)
            return cls(None, num_layers or n, version, msg)
        return cls(tuple(sorted(int(i) for i in rec.layers)), n, version)

    @classmethod
    def _mismatch(
        cls, planned: int, num_layers: int, source: str | None, strict: bool, stacklevel: int, hint: str = ""
    ) -> CheckpointPlan:
        """Every layer of the live model, for a plan made for another layer count (or raise with ``strict``)."""
        msg = f"recommendation is for {planned} layers but the model has {num_layers}: it was made for another model"
        if strict:
            raise ValueError(msg + hint)
        _warn(f"memfit: {msg}{hint}; checkpointing every layer instead", stacklevel=stacklevel)
        return cls(None, num_layers, source, msg)

    @classmethod
    def _stage_plan(
        cls, rec: Any, pipeline_stage: int, num_layers: int | None, strict: bool, stacklevel: int
    ) -> CheckpointPlan:
        """One pipeline stage's plan from the answer's ``stages`` (indices within the stage)."""
        stages = list(getattr(rec, "stages", None) or [])
        version = getattr(rec, "model_version", None)
        if not stages:
            msg = (
                "pipeline_stage: the recommendation carries no pipeline stages (pipeline_parallel_size 1, or a "
                "provisional answer without a per-stage split)"
            )
            if strict:
                raise ValueError(msg)
            _warn(f"memfit: {msg}; checkpointing every layer of the stage", stacklevel=stacklevel)
            return cls(None, num_layers, version, msg)
        if isinstance(pipeline_stage, bool) or not 0 <= pipeline_stage < len(stages):
            raise ValueError(f"pipeline_stage={pipeline_stage!r} must be an integer in [0, {len(stages) - 1}]")
        st = stages[pipeline_stage]
        if num_layers is not None and num_layers != st.num_layers:
            return cls._mismatch(st.num_layers, num_layers, version, strict, stacklevel + 1, f" (stage {st.stage})")
        if rec.k is None:
            msg = "recommendation says no k fits (see its alternatives)"
            if strict:
                raise ValueError(msg)
            _warn(f"memfit: {msg}; checkpointing every layer of the stage", stacklevel=stacklevel)
            return cls(None, st.num_layers, version, msg)
        first, last = st.first_layer, st.first_layer + st.num_layers
        return cls(tuple(sorted(i - first for i in rec.layers if first <= i < last)), st.num_layers, version)


def checkpointed_layers(model: Any) -> list[int] | None:
    """The decoder layers (indices into :func:`memfit.hf.decoder_layers`) the live ``model`` checkpoints, read from
    the layers themselves: wrapped by ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (:func:`apply`
    on plain PyTorch), else each layer's ``gradient_checkpointing`` flag (transformers' ``GradientCheckpointingLayer``,
    set per layer by :func:`apply` and for every layer by ``activation_checkpointing_enable`` /
    ``gradient_checkpointing_enable`` / ``TrainingArguments``).

    Returns:
        Sorted indices (empty: no layer is checkpointed), or None where the layers show neither (no decoder-layer
        list, a model that checkpoints inside its own forward, transformers' older model-wide function).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from memfit.hf import decoder_layers

    layers = decoder_layers(model)
    if layers is None:
        return None
    wrapped = [i for i, layer in enumerate(layers) if isinstance(layer, CheckpointWrapper)]
    if wrapped:
        return wrapped
    flags = [getattr(layer, "gradient_checkpointing", None) for layer in layers]
    if all(isinstance(f, bool) for f in flags):
        return [i for i, f in enumerate(flags) if f]
    return None


#: plans whose recomputation the compiled marker op reports to, by id (weak: a dropped plan is forgotten)
_PLANS: weakref.WeakValueDictionary[int, AppliedCheckpointing] = weakref.WeakValueDictionary()


@dataclass
class AppliedCheckpointing:
    """What :func:`checkpoint_layers` did.

    Attributes:
        layer_indices: indices (into the decoder-layer list) that are checkpointed, sorted.
        num_layers: length of the decoder-layer list.
        mechanism: ``hf_per_layer``, ``hf_shared_func``, ``checkpoint_wrapper`` or ``deepspeed_patch``.
        use_reentrant: ``torch.utils.checkpoint`` flavour in use.
        recomputed: layer indices seen recomputing during a backward pass (filled at run time).
        source: the recommendation's ``model_version`` when applied by :func:`apply`.
    """

    layer_indices: list[int]
    num_layers: int
    mechanism: str
    use_reentrant: bool = False
    recomputed: set[int] = field(default_factory=set)
    source: str | None = None

    def __post_init__(self) -> None:
        _PLANS[id(self)] = self  # found again by the compiled recompute marker,
        _recompute_marker()  # which is defined here, outside any torch.compile tracing

    @property
    def k(self) -> int:
        return len(self.layer_indices)

    @property
    def missing(self) -> list[int]:
        """Planned layers that did not recompute (so far)."""
        return sorted(set(self.layer_indices) - self.recomputed)

    @property
    def unexpected(self) -> list[int]:
        """Layers that recomputed without being planned."""
        return sorted(self.recomputed - set(self.layer_indices))

    def verify(self) -> bool:
        """True when exactly the planned layers recomputed (call after the first backward)."""
        return self.recomputed == set(self.layer_indices)


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1


@functools.cache
def _recompute_marker():
    """``memfit::recompute_marker(x, plan_id, layer) -> copy of x``: an op opaque to ``torch.compile``.

    Inside a compiled, checkpointed block the Python counter below would be traced away (or break the
    graph, sending the block back to eager). This op instead stays a call in the compiled graphs; the
    partitioner recomputes it with the rest of the checkpointed region, so when it runs inside a backward
    pass the layer is recorded as recomputed. Used only while compiling; eager runs count in Python.
    """
    import torch

    @torch.library.custom_op(
        "memfit::recompute_marker", mutates_args=(), schema="(Tensor x, int plan_id, int layer) -> Tensor"
    )
    def marker(x, plan_id, layer):
        if _in_backward() and (plan := _PLANS.get(plan_id)) is not None:
            plan.recomputed.add(layer)
        return x.clone()

    @marker.register_fake
    def _(x, plan_id, layer):
        return torch.empty_like(x)

    marker.register_autograd(lambda ctx, grad: (grad, None, None))
    return marker


def _counting(fn, plan: AppliedCheckpointing, index: int):
    """``fn`` that records ``index`` in ``plan.recomputed`` when it runs inside a backward pass (the
    recompute of a checkpointed layer), in eager mode and inside ``torch.compile``'d blocks."""
    import torch

    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            if args and isinstance(args[0], torch.Tensor):
                args = (torch.ops.memfit.recompute_marker(args[0], id(plan), index), *args[1:])
        elif _in_backward():
            plan.recomputed.add(index)
        return fn(*args, **kwargs)

    return run


def _checkpoint_func(plan: AppliedCheckpointing, index: int):
    import torch.utils.checkpoint as cp

    def checkpointed(function, *args, **kwargs):
        return cp.checkpoint(_counting(function, plan, index), *args, use_reentrant=plan.use_reentrant, **kwargs)

    return checkpointed


def checkpoint_layers(
    model, layer_indices: Sequence[int], *, layers=None, use_reentrant: bool = False
) -> AppliedCheckpointing:
    """Checkpoint exactly ``layer_indices`` of the model's decoder layers; un-checkpoint the others.

    The mechanism under :func:`apply` (which reads a recommendation and guards the traps). Not
    ``torch.distributed``'s ``apply_activation_checkpointing``, which wraps every module a predicate
    selects; here the indices say which of the blocks are checkpointed and the rest are un-wrapped.

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
    chosen = sorted({int(i) for i in layer_indices})
    bad = [i for i in chosen if not 0 <= i < L]
    if bad:
        raise ValueError(f"layer_indices {bad} out of range: allowed [0, {L - 1}]")
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        GradientCheckpointingLayer = None

    blocks = [getattr(layer, "_orig_mod", layer) for layer in layers]  # through per-block torch.compile
    if GradientCheckpointingLayer is not None and isinstance(blocks[0], GradientCheckpointingLayer):
        plan = AppliedCheckpointing(chosen, L, "hf_per_layer", use_reentrant)
        for i, layer in enumerate(blocks):
            layer.gradient_checkpointing = i in chosen
            layer._gradient_checkpointing_func = _checkpoint_func(plan, i)
        _disable_cache(model)
        return plan

    hf_owner = next(
        (
            m
            for m in model.modules()
            if hasattr(m, "_gradient_checkpointing_func") or hasattr(m, "gradient_checkpointing")
        ),
        None,
    )
    if hf_owner is not None and (
        hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")
    ):
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

    if not any(m is layers for m in model.modules()):  # entries are replaced: a copy would leave the model as it was
        raise ValueError(
            f"layers: a {type(layers).__name__} that is not one of the model's modules; pass the model's own "
            "nn.ModuleList or nn.Sequential of blocks (its entries are replaced by checkpoint wrappers)"
        )
    plan = AppliedCheckpointing(chosen, L, "checkpoint_wrapper", use_reentrant)
    impl = CheckpointImpl.REENTRANT if use_reentrant else CheckpointImpl.NO_REENTRANT
    for i in range(L):
        inner = getattr(layers[i], "_checkpoint_wrapped_module", layers[i])
        if "_memfit_orig_forward" in inner.__dict__:  # undo an earlier plan's counting wrapper
            orig = inner.__dict__.pop("_memfit_orig_forward")
            if orig is None:
                inner.__dict__.pop("forward", None)
            else:
                inner.forward = orig
        if i in chosen:
            wrapped = checkpoint_wrapper(inner, checkpoint_impl=impl)
            inner._memfit_orig_forward = inner.__dict__.get("forward")
            inner.forward = _counting(inner.forward, plan, i)
            layers[i] = wrapped
        elif isinstance(layers[i], nn.Module) and inner is not layers[i]:
            layers[i] = inner
    return plan


#: The earlier name of :func:`checkpoint_layers` (kept for existing callers such as tracer/collect.py).
#: It is not ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``.
apply_activation_checkpointing = checkpoint_layers


def _disable_cache(model) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


# -- user-facing: apply a recommendation, with the traps guarded --------------------------------------
def _warn(message: str, stacklevel: int = 3) -> None:
    """Warn at the caller of the public function (``stacklevel`` counts from here)."""
    warnings.warn(message, MemfitWarning, stacklevel=stacklevel)


def _is_compiled(model) -> bool:
    return hasattr(model, "_orig_mod") or type(model).__name__ == "OptimizedModule"


def _has_frozen_params(model) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def zero3_recompute_keeps_frozen_params() -> bool:
    """The installed DeepSpeed keeps frozen ZeRO-3 parameters gathered through a checkpoint recompute.

    Older DeepSpeed re-partitions a frozen parameter (``param.data = empty(0)``) when the recompute
    re-runs the forward hooks, so non-reentrant ``torch.utils.checkpoint`` finds a saved tensor of shape
    ``[0]`` and raises ``CheckpointError`` (transformers issue 47254, DeepSpeed PR 8130). Fixed versions
    attribute recompute parameters to the backward module (``update_recompute_parameters`` in
    ``deepspeed.runtime.zero.partitioned_param_coordinator``); that is what this checks. False without
    deepspeed.
    """
    try:
        from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator
    except ImportError:
        return False
    return hasattr(coordinator, "update_recompute_parameters")


def _zero3_active(model, deepspeed_config: dict[str, Any] | None) -> bool:
    """ZeRO-3: the given DeepSpeed config says stage 3, parameters are DeepSpeed-partitioned
    (``ds_id``), or HF's DeepSpeed integration reports ZeRO-3."""
    if deepspeed_config and ((deepspeed_config.get("zero_optimization") or {}).get("stage") == 3):
        return True
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return True
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    try:
        return bool(is_deepspeed_zero3_enabled())
    except Exception:  # noqa: BLE001 - an integration in an odd state must not stop training
        return False


def _pre_layer_modules(model, layers) -> list:
    """Modules that run before the block list: its earlier siblings in the parent (embeddings,
    position embeddings, input norms), registration order being forward order in HF models."""
    for parent in model.modules():
        children = list(parent.children())
        if any(c is layers for c in children):
            return children[: next(i for i, c in enumerate(children) if c is layers)]
    return []


def _trainable(module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _input_grads_hooked(model) -> bool:
    """HF ``enable_input_require_grads`` already hooked the input embeddings."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        emb = None
    hooks = getattr(emb, "_forward_hooks", {}) or {}
    return any(getattr(h, "__name__", "") == "make_inputs_require_grads" for h in hooks.values())


def frozen_input_trap(model, layers, chosen: Sequence[int]) -> int | None:
    """The checkpointed layer whose inputs will not require grad although it has trainable
    parameters, or None.

    Under reentrant checkpointing such a layer (and every layer after it) gets no gradients: the
    inputs of layer ``j`` require grad only when something trainable runs before it. That is the
    first layer holding trainable parameters when the embeddings (and earlier layers) are frozen —
    LoRA with frozen embeddings, or frozen leading layers.
    """
    if _input_grads_hooked(model) or any(_trainable(m) for m in _pre_layer_modules(model, layers)):
        return None
    first = next((i for i, layer in enumerate(layers) if _trainable(layer)), None)
    return first if first is not None and first in set(chosen) else None


def apply(
    model,
    recommendation,
    *,
    strict: bool = False,
    use_reentrant: bool = False,
    layers=None,
    deepspeed_config: dict[str, Any] | None = None,
    pipeline_stage: int | None = None,
) -> AppliedCheckpointing:
    """Checkpoint exactly the recommended layers of ``model``; the others keep their activations.

    Args:
        model: HF model (PEFT-wrapped or ``torch.compile``'d is fine) or any module with a block list.
        recommendation: a :class:`memfit.api.Recommendation` (its ``layers``), a :class:`CheckpointPlan`
            or a list of indices, read by :meth:`CheckpointPlan.from_recommendation`: the client's
            fallback (``model_version == "fallback"``) checkpoints every layer; a ``k=None`` answer
            (nothing fits) and a layer-count mismatch do too, with a warning (raise if strict).
        strict: raise ``ValueError`` instead of adjusting the plan with a warning.
        use_reentrant: ``torch.utils.checkpoint`` flavour (non-reentrant recommended).
        layers: the block list, when it cannot be found automatically.
        deepspeed_config: the job's DeepSpeed config dict, used to detect ZeRO-3.
        pipeline_stage: with a pipeline-parallel answer, the stage ``model`` is (its layers are the stage's):
            :meth:`CheckpointPlan.from_recommendation`.

    Traps handled (each warns with :class:`MemfitWarning`):

    * reentrant checkpointing where the first checkpointed trainable layer gets inputs that do not
      require grad (frozen embeddings / leading layers, LoRA): gradients would silently be None.
      Fixed with ``model.enable_input_require_grads()`` when available, else by switching to
      non-reentrant; with ``strict`` it raises ``ValueError``.
    * whole-model ``torch.compile`` around non-reentrant checkpointing: compile traces the checkpointed
      regions and its partitioner decides what is saved, which can erase or invert the savings (and
      :func:`verify` sees no recomputation). Compile each block *after* :func:`apply` instead (the
      torchtitan order: ``layers[i] = torch.compile(layers[i])``).
    * frozen parameters (PEFT LoRA) + DeepSpeed ZeRO-3 + non-reentrant checkpointing, on a DeepSpeed
      without the recompute fix (:func:`zero3_recompute_keeps_frozen_params`): the backward fails with
      ``CheckpointError``; switched to reentrant (then the frozen-input trap below applies), or
      ``ValueError`` with ``strict``.

    Returns:
        :class:`AppliedCheckpointing`; call :func:`verify` after the first backward.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: see above, or no block list found / an index out of range / a ``recommendation`` of
            another type.
    """
    from memfit.hf import decoder_layers

    if not hasattr(model, "named_modules"):
        raise TypeError(f"model: apply() checkpoints a live torch.nn.Module, got {type(model).__name__} {model!r:.60}")
    target = getattr(model, "_orig_mod", model)
    layers = layers if layers is not None else decoder_layers(target)
    if layers is None:
        raise ValueError("model has no nn.ModuleList of decoder layers; pass layers=...")
    checkpoint_plan = CheckpointPlan.from_recommendation(
        recommendation, num_layers=len(layers), strict=strict, stacklevel=4, pipeline_stage=pipeline_stage
    )
    chosen = checkpoint_plan.indices(len(layers))
    if _is_compiled(model) and chosen and not use_reentrant:
        _warn(
            "memfit: the whole model is torch.compile'd around non-reentrant checkpointing: compile decides what "
            "the checkpointed layers save, which can erase or invert the savings the prediction assumes (and "
            "verify() sees no recompute). Compile each block after memfit.apply instead: "
            "layers[i] = torch.compile(layers[i])."
        )

    if (
        not use_reentrant
        and chosen
        and _has_frozen_params(target)
        and _zero3_active(target, deepspeed_config)
        and not zero3_recompute_keeps_frozen_params()
    ):
        why = (
            "frozen parameters (LoRA base weights) + DeepSpeed ZeRO-3 + non-reentrant checkpointing fails in the "
            "backward with torch's CheckpointError (ZeRO-3 re-partitions frozen parameters before the recompute "
            "is checked; fixed in newer DeepSpeed)"
        )
        if strict:
            raise ValueError(
                f"{why}; upgrade deepspeed, or use use_reentrant=True with model.enable_input_require_grads()"
            )
        use_reentrant = True
        _warn(f"memfit: {why}; switched to reentrant checkpointing")
    if use_reentrant and (j := frozen_input_trap(target, layers, chosen)) is not None:
        why = (
            f"reentrant checkpointing of layer {j}, whose inputs do not require grad (frozen embeddings/"
            "earlier layers), silently produces no gradients"
        )
        if strict:
            raise ValueError(f"{why}; use use_reentrant=False or call model.enable_input_require_grads()")
        if hasattr(target, "enable_input_require_grads"):
            target.enable_input_require_grads()
            _warn(f"memfit: {why}; called model.enable_input_require_grads() to fix it")
        else:
            use_reentrant = False
            _warn(f"memfit: {why}; switched to non-reentrant checkpointing")

    plan = checkpoint_layers(target, chosen, layers=layers, use_reentrant=use_reentrant)
    plan.source = checkpoint_plan.source
    log.info(
        "memfit: checkpointing %d of %d layers %s (%s, %s, recommendation %s)",
        plan.k,
        plan.num_layers,
        plan.layer_indices,
        plan.mechanism,
        "reentrant" if use_reentrant else "non-reentrant",
        checkpoint_plan.source,
    )
    return plan


def verify(plan: AppliedCheckpointing, *, strict: bool = False) -> bool:
    """After the first backward: did exactly the planned layers recompute?

    Logs the outcome; on a mismatch warns (:class:`MemfitWarning`) or, with ``strict``, raises
    ``RuntimeError``. Typical causes: no backward ran yet, HF's ``activation_checkpointing_enable()``
    (``gradient_checkpointing_enable()`` before transformers 5) was
    called after :func:`apply` (it overwrites the plan), or reentrant layers whose inputs do not
    require grad.

    Returns:
        True when the recomputed set equals the plan.

    Raises:
        TypeError: ``plan`` is not what :func:`apply` returned (a Recommendation, say).
        RuntimeError: with ``strict``, on a mismatch.
    """
    if not isinstance(plan, AppliedCheckpointing):
        raise TypeError(
            f"plan: verify() checks what memfit.apply returned (an AppliedCheckpointing), got {type(plan).__name__}; "
            "keep apply's return value: plan = memfit.apply(model, rec); ...; memfit.verify(plan)"
        )
    if plan.verify():
        log.info("memfit: verified: layers %s recomputed in backward, as planned", plan.layer_indices)
        return True
    msg = (
        f"memfit: planned to recompute {plan.k} layers {plan.layer_indices} but layers {sorted(plan.recomputed)} "
        f"recomputed (missing {plan.missing}, unexpected {plan.unexpected})"
    )
    if not plan.recomputed and plan.k:
        msg += (
            "; nothing recomputed: no backward yet, the model in eval mode (model.train() before the step: HF layers "
            "checkpoint only while training), checkpointing overwritten after memfit.apply "
            "(e.g. activation_checkpointing_enable / gradient_checkpointing_enable), or inputs that do not "
            "require grad"
        )
    if strict:
        raise RuntimeError(msg)
    _warn(msg)
    return False
