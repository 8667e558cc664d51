"""Measure one training step's peak memory by running it — the collector's core.

:func:`measure` builds a model from a HF config dict with random weights, applies fine-tuning mode,
activation checkpointing (through :func:`memfit.checkpointing.apply_activation_checkpointing`, the
function the client uses), sharding and the optimizer, then runs two real steps (forward, loss,
backward, optimizer step) and returns a validated :class:`memfit.schema.TelemetryRecord`.

Devices:

* ``fake``: ``FakeTensorMode`` on device cpu + :class:`tracer.tracker.LiveStorageTracker`
  (nothing is allocated; method ``fake_tracker``);
* ``cpu``: real CPU tensors + the same tracker (method ``cpu_tracker``; gives a real step time);
* ``cuda``: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after a reset (method ``cuda``).

Sharding is measured by running FSDP2 ``fully_shard`` over a fake process group of world size
``data_parallel_size`` (rank 0 is measured):

* ``zero3`` and ``fsdp_full_shard`` -> ``fully_shard(reshard_after_forward=True)``: parameters,
  gradients and optimizer states sharded; each layer's parameters are all-gathered just in time.
* ``zero2`` and ``fsdp_shard_grad_op`` -> ``fully_shard(reshard_after_forward=False)``: parameters stay
  gathered from forward to backward. DeepSpeed ZeRO-2 keeps the full parameters all the time; at the
  backward peak both hold every layer's parameters, so the peak matches, while FSDP2's resting
  state between steps is lower.
* ``zero1`` -> ``torch.distributed.optim.ZeroRedundancyOptimizer`` (optimizer states sharded only).

MoE models are routed deterministically while measured (:func:`tracer.moe.balanced_routing`: every
expert gets its balanced share of tokens, or the hottest ``moe_imbalance_factor`` times it), so the
step's shapes are known under fake tensors and a real CPU run routes identically. Expert parallelism
(``expert_parallel_size`` > 1, with ``sharding=none``) is measured on one rank's shard of the experts.

Mixed precision with sharding uses FSDP2's ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=fp32)``
instead of autocast, which is how FSDP2 users train.

Tensor parallelism (optionally with sequence parallelism) is measured by running DTensor
``parallelize_module`` with the Megatron/torchtitan plan of :func:`tracer.parallel.apply_tensor_parallel`
over a fake process group of ``tensor_parallel_size`` ranks (rank 0 is measured). With ZeRO-2/3 or FSDP
sharding too, the process group spans data × tensor parallel ranks and FSDP2 shards the tensor-parallel
DTensor parameters over the data-parallel dimension of a 2-D ``(dp, tp)`` device mesh, as torchtitan
does. Pipeline and context parallelism are not run: the collector requires both sizes to be 1, and
:mod:`model.parallel` composes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from memfit.checkpointing import apply_activation_checkpointing
from memfit.hf import (
    apply_finetune,
    build_causal_lm,
    decoder_layers,
    local_expert_config,
    max_seq_len,
    model_spec,
    num_routed_experts,
    param_dtype,
    quiet_transformers,
)
from memfit.schema import (
    Attention,
    CheckpointImpl,
    ClusterSpec,
    FineTune,
    Measurement,
    Method,
    Offload,
    Optimizer,
    Phase,
    Precision,
    Quantization,
    Sharding,
    TelemetryRecord,
    TrainingConfig,
    check_moe_settings,
    check_quantized_base,
)
from tracer.tracker import LiveStorageTracker

_HALF = {Precision.AMP_FP16: torch.float16, Precision.AMP_BF16: torch.bfloat16}
_FSDP_RESHARD = {
    Sharding.ZERO3: True,
    Sharding.FSDP_FULL_SHARD: True,
    Sharding.ZERO2: False,
    Sharding.FSDP_SHARD_GRAD_OP: False,
}


def flat_partition_placement(world_size: int) -> Callable[[torch.nn.Parameter], Any]:
    """FSDP2 ``shard_placement_fn`` for DeepSpeed's ZeRO-3 (``zero3``): a gathered parameter is its own size.

    DeepSpeed partitions each parameter flat (``deepspeed/runtime/zero/partition_parameters.py``: every rank holds
    ``ceil(numel / world_size)`` elements, so the gathered buffer pads under ``world_size`` elements). FSDP2 shards
    dim 0 and pads it to a multiple of the world size (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``
    ``_init_sharded_param``: the padded shard is chunk 0's size), so a fused (8, 2F, H) expert tensor over 64 ranks
    gathers 64 rows, 8 times its size, in forward and again in backward's reduce-scatter; LoRA's (r, in) A matrix
    with r below the world size likewise. Returned: ``Shard(0)`` where dim 0 has at least ``world_size`` rows (FSDP2
    pads under one row per rank: GPT-2's 50,257-row embedding over 64 ranks by 47 rows, 0.09 %), else the first
    other dimension that splits evenly (FSDP2 shards those only evenly), else ``Shard(0)``. ``fsdp_*`` shardings keep
    FSDP2's own dim-0 placement, and ``zero2`` too: it shares ``fsdp_shard_grad_op``'s trace
    (:func:`model.terms.training_key_fields`).
    """
    from torch.distributed.tensor import Shard

    def placement(param: torch.nn.Parameter) -> Any:
        shape = tuple(param.shape)
        if not shape or shape[0] >= world_size:
            return Shard(0)
        return Shard(next((d for d in range(1, len(shape)) if shape[d] % world_size == 0), 0))

    return placement


class MasterWeightsOptimizer:
    """bf16 parameters with an fp32 master copy (DeepSpeed/Megatron ``bf16`` optimizer style).

    Holds fp32 copies of the trainable parameters; ``step`` casts each bf16 gradient to fp32 on
    the master, steps the inner optimizer on the masters and copies them back into the bf16 weights.
    """

    def __init__(self, params, make_inner) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().requires_grad_(True) for p in self.params]
        self.inner = make_inner(self.masters)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                m.grad = p.grad.float()
                p.grad = None
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


class HostOffloadOptimizer:
    """ZeRO-Offload's step (Ren et al. 2021, arXiv 2101.06840, Sec. 4.1): the optimizer lives on the host.

    The weight copy the optimizer updates (fp32 master; bf16 in pure bf16 training), its states and a
    gradient copy in that dtype are made inside ``tracker.on_host()`` (counted as host memory, not
    device); ``step`` copies each device gradient to the host and frees it, steps the inner optimizer
    there and copies the updated weights back into the device parameters in place. The device keeps the
    training-dtype parameters and gradients only.
    """

    def __init__(self, params, make_inner, tracker, dtype) -> None:
        self._host = tracker.on_host if tracker is not None else contextlib.nullcontext
        self.params = [p for p in params if p.requires_grad]
        with self._host(), torch.no_grad():
            self.masters = [p.detach().to(dtype, copy=True).requires_grad_(True) for p in self.params]
            self.inner = make_inner(self.masters)

    @torch.no_grad()
    def step(self) -> None:
        with self._host():
            for p, m in zip(self.params, self.masters):
                if p.grad is not None:
                    m.grad = p.grad.to(m.dtype, copy=True)
                    p.grad = None
            self.inner.step()
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def make_optimizer(kind: Optimizer, params, *, lr: float = 1e-4, process_group=None, tracker=None):
    """A ``torch.optim`` or bitsandbytes optimizer of the given kind (wrapped in ZeroRedundancyOptimizer for
    ZeRO-1; bitsandbytes ones through :func:`tracer.bnb.make_bnb_optimizer`, ``tracker`` for paged states)."""
    from tracer.bnb import BNB_OPTIMIZERS, make_bnb_optimizer

    if kind in BNB_OPTIMIZERS:
        if process_group is not None:
            raise ValueError(
                f"optimizer={kind.value} cannot run with sharding=zero1 in the collector "
                "(ZeroRedundancyOptimizer over a bitsandbytes optimizer)"
            )
        return make_bnb_optimizer(kind, [p for p in params if p.requires_grad], lr=lr, tracker=tracker)
    table: dict[Optimizer, tuple[type, dict[str, Any]]] = {
        Optimizer.ADAMW_FOREACH: (torch.optim.AdamW, {"lr": lr, "foreach": True}),
        Optimizer.ADAMW_FUSED: (torch.optim.AdamW, {"lr": lr, "fused": True}),
        Optimizer.SGD_MOMENTUM: (torch.optim.SGD, {"lr": lr, "momentum": 0.9, "foreach": True}),
        Optimizer.ADAFACTOR: (torch.optim.Adafactor, {"lr": lr, "foreach": True}),
    }
    cls, kwargs = table[kind]
    params = [p for p in params if p.requires_grad]
    if process_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=process_group, **kwargs)
    return cls(params, **kwargs)


def _fake_process_group(world_size: int):
    """Initialise (or re-initialise) the default process group as a fake one of ``world_size``.

    Raises:
        RuntimeError: the process already has a real default group (backend other than ``fake``, e.g. a
            training job's ``gloo``/``nccl`` group): a trace would have to destroy it. Trace in another process
            (the service's tracing process, ``memfit recommend``) instead.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            raise RuntimeError(
                f"tracing a sharded or tensor-parallel step needs a fake default process group, but this process "
                f"has a real '{backend}' group of world size {dist.get_world_size()}; trace in another process"
            )
        if dist.get_world_size() == world_size:
            return dist.group.WORLD
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return dist.group.WORLD


@contextlib.contextmanager
def _mesh_bookkeeping_outside_modes():
    """Let FSDP2 build its (dp, tp) device mesh outside the fake mode and the tracker.

    Sharding already tensor-parallel DTensor parameters, FSDP2 concatenates the data- and tensor-parallel
    sub-meshes (``DeviceMesh._concatenate``), which computes rank coordinates with ops on the mesh's real
    integer tensor (``nonzero``): a data-dependent shape a fake mode refuses. That is mesh bookkeeping,
    not training memory, so it runs with the dispatch modes switched off.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    original = DeviceMesh._concatenate

    def concatenate(device_mesh_list):
        with _disable_current_modes():
            return original(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)


def checkpoint_as_applied(model, layers, chosen: list[int], use_reentrant: bool):
    """Checkpoint the ``chosen`` layers as :func:`memfit.checkpointing.apply` does: reentrant checkpointing of a layer
    whose inputs do not require grad (frozen embeddings: LoRA, QLoRA) gets ``model.enable_input_require_grads()``,
    apply's fix, without which the checkpointed layers get no gradients and a step whose head is frozen too fails
    ("element 0 of tensors does not require grad"). Returns the :class:`memfit.checkpointing.AppliedCheckpointing`."""
    from memfit.checkpointing import frozen_input_trap

    plan = apply_activation_checkpointing(model, chosen, layers=layers, use_reentrant=use_reentrant)
    if use_reentrant and frozen_input_trap(model, layers, chosen) is not None:
        model.enable_input_require_grads()
    return plan


@contextlib.contextmanager
def _cuda_sdpa_kernels():
    """Make SDPA under fake tensors pick the kernels CUDA picks, and HF build the masks real runs build.

    * On CPU, ``F.scaled_dot_product_attention`` with an explicit ``attn_mask`` or with dropout
      (GPT-2's ``attn_pdrop``) falls back to the math path, which saves the ``b·a·s²`` probabilities;
      on CUDA the same call runs the memory-efficient kernel
      (``aten._scaled_dot_product_efficient_attention``), which saves only the output and an fp32
      log-sum-exp. Calls with neither already take the flash kernel on both. A boolean mask becomes an
      additive bias of the query's dtype, as PyTorch does.
    * transformers treats every fake tensor as "tracing" (``utils.import_utils.is_tracing``), so
      ``masking_utils.find_packed_sequence_indices`` never answers "no packed sequences" and a
      ``(b, 1, s, s)`` mask is built that real runs without padding never build. The collector never
      packs sequences, so that function answers None here.
    * Inside :func:`tracer.cuda_policy.cuda_step_semantics`, a call the GPU generation would run on the math
      backend (:func:`model.cuda_semantics.select_backend`) runs :func:`tracer.cuda_policy.math_sdpa` (PyTorch's math
      composite as CUDA runs it), which saves the
      fp32 probabilities; one it would run on cuDNN returns its output (B, H, S, D)-contiguous, as cuDNN does.
    """
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        from model.cuda_semantics import SdpaBackend
        from tracer.cuda_policy import autocast_sdpa_args, math_sdpa, sdpa_backend

        query, key, value, attn_mask = autocast_sdpa_args(query, key, value, attn_mask)
        backend = sdpa_backend(query, key, attn_mask, dropout_p, is_causal, enable_gqa)
        if backend is SdpaBackend.MATH:
            mask = attn_mask
            if mask is not None and mask.dtype == torch.bool:  # convert_boolean_attn_mask, as the public op does
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                    ~mask, float("-inf")
                )
            return math_sdpa(query, key, value, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is None and dropout_p == 0.0:
            return orig(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
        bias = attn_mask
        if bias is not None:
            if bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill_(
                    ~bias, float("-inf")
                )
            elif bias.dtype != query.dtype:
                bias = bias.to(query.dtype)
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if backend is SdpaBackend.FLASH and need_lse and key.shape[-3] == query.shape[-3]:
            from tracer.cuda_policy import FlashAttentionScratch

            return FlashAttentionScratch.apply(query, key, value, bias, dropout_p, is_causal, scale)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale
        )[0]
        # cuDNN returns (B, H, S, D)-contiguous output, so the caller's transpose(1, 2).contiguous() copies
        return out.contiguous() if backend is SdpaBackend.CUDNN else out

    from transformers import masking_utils

    orig_packed = masking_utils.find_packed_sequence_indices
    F.scaled_dot_product_attention = sdpa
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig
        masking_utils.find_packed_sequence_indices = orig_packed


def accumulation_micro_batches(training: TrainingConfig) -> int:
    """Forward/backward passes a measured step runs: 2 under gradient accumulation, else 1.

    The third and later micro-batches start from the same live set as the second (parameters, optimizer
    states and the summed gradients; autograd adds each new gradient into ``.grad`` in place), so they repeat
    its memory timeline and the step's peak is reached by the second micro-batch or the optimizer step.
    """
    return 2 if training.accumulates_gradients else 1


def _check_supported(training: TrainingConfig) -> None:
    if training.gradient_accumulation_steps > 1 and training.offload_optimizer is not Offload.NONE:
        raise ValueError(
            "gradient_accumulation_steps > 1 with an offloaded optimizer is not simulated by the "
            "collector: the gradients accumulate in host memory, so the device holds one micro-batch's "
            "peak (model.offload composes it)"
        )
    if training.offload_parameters is Offload.CPU:
        raise ValueError(
            "offload_parameters='cpu' is not simulated by the collector: it is composed from the "
            "FSDP full-shard trace (model.offload)"
        )
    if training.pipeline_parallel_size != 1 or training.context_parallel_size != 1:
        raise ValueError(
            "the collector runs pipeline_parallel_size=1 and context_parallel_size=1 only "
            "(model.parallel composes pipeline and context parallelism)"
        )
    if training.tensor_parallel_size > 1 and training.sharding not in (Sharding.NONE, *_FSDP_RESHARD):
        raise ValueError(
            f"tensor_parallel_size={training.tensor_parallel_size} is measured with sharding none, "
            f"zero2/zero3 or FSDP (FSDP2 over the data-parallel dimension); got {training.sharding.value}"
        )
    if training.tensor_parallel_size > 1 and (
        training.optimizer_in_backward or training.quantization is not Quantization.NONE
    ):
        raise ValueError(
            f"tensor_parallel_size={training.tensor_parallel_size} is measured without "
            "optimizer_in_backward and quantization only"
        )
    if training.optimizer_in_backward and training.sharding is not Sharding.NONE:
        raise ValueError(
            f"optimizer_in_backward=True is collected with sharding='none' only "
            f"(got sharding={training.sharding.value!r})"
        )
    if training.quantization is not Quantization.NONE and training.sharding is not Sharding.NONE:
        raise ValueError(
            f"quantization={training.quantization.value} is collected with sharding='none' only "
            f"(got sharding={training.sharding.value!r})"
        )
    if training.expert_parallel_size > 1 and training.sharding is not Sharding.NONE:
        # FSDP would shard the local experts over all data-parallel ranks instead of the expert-data-parallel
        # group (data_parallel_size / expert_parallel_size), which the fake process group does not model
        raise ValueError(
            f"expert_parallel_size={training.expert_parallel_size} is simulated with sharding=none "
            f"only; got sharding={training.sharding.value}"
        )
    if training.optimizer is Optimizer.ADAFACTOR and training.sharding in _FSDP_RESHARD:
        # torch.optim.Adafactor squares its row/column means in place; on FSDP2's DTensor parameters those
        # are _NormPartial placements, and DTensor refuses in-place ops that change placement (torch 2.13).
        raise ValueError(
            f"optimizer=adafactor cannot run with sharding={training.sharding.value} "
            "(FSDP2 DTensor parameters); use zero1 or an AdamW/SGD optimizer"
        )


def _device_context(device: str):
    if device == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        return FakeTensorMode(allow_non_fake_inputs=False), Method.FAKE_TRACKER
    if device == "cpu":
        return contextlib.nullcontext(), Method.CPU_TRACKER
    if device == "cuda":
        return torch.device("cuda"), Method.CUDA
    raise ValueError(f"device must be one of fake, cpu, cuda; got {device!r}")


def _cluster(device: str, training: TrainingConfig) -> ClusterSpec:
    import transformers

    world = training.data_parallel_size * training.tensor_parallel_size * training.pipeline_parallel_size
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, mem = props.name, props.total_memory
    else:
        name = "fake-cpu" if device == "fake" else "cpu"
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    from importlib import metadata

    try:  # the installed version, without importing DeepSpeed: its import logs a warning to stdout on CPU
        ds_version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds_version = None
    return ClusterSpec(
        device_name=name,
        device_memory_bytes=mem,
        gpu_count=world,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        deepspeed_version=ds_version,
    )


@dataclasses.dataclass
class PreparedModel:
    """A model built, fine-tuned and sharded for measurement, with what a step needs (see :func:`prepared_model`)."""

    model: Any
    layers: Any
    spec: Any
    training: TrainingConfig
    tracker: LiveStorageTracker | None
    cluster: ClusterSpec
    use_autocast: bool
    amp_dtype: Any
    on: str
    zero1_group: Any
    method: Method
    vocab_parallel: bool = False

    def loss_context(self):
        """The context forward and backward run in: vocab-parallel cross-entropy under tensor parallelism."""
        from tracer.parallel import vocab_parallel_loss

        return vocab_parallel_loss(self.vocab_parallel)

    def live(self) -> int:
        """Live bytes now: the tracker's count, or CUDA's allocated bytes."""
        return self.tracker.live_bytes if self.tracker else torch.cuda.memory_allocated()

    def input_ids(self, micro_batch_size: int, seq_len: int):
        """Random token ids of shape ``(micro_batch_size, seq_len)``."""
        return torch.randint(0, self.spec.vocab_size, (micro_batch_size, seq_len), device=self.on)

    def make_optimizer(self):
        """A fresh optimizer over the trainable parameters (bf16 + fp32 master wrapper where set; on the host
        with ``offload_optimizer='cpu'``; one per parameter stepped in backward with ``optimizer_in_backward``:
        close it with :func:`close_optimizer`)."""
        kind, group, tracker = self.training.optimizer, self.zero1_group, self.tracker

        def make(params):
            if self.training.offload_optimizer is Offload.CPU:
                dtype = torch.bfloat16 if self.training.precision is Precision.BF16 else torch.float32
                return HostOffloadOptimizer(
                    params, lambda ps: make_optimizer(kind, ps, process_group=group, tracker=tracker), tracker, dtype
                )
            if self.training.precision is Precision.BF16_FP32_MASTER:
                return MasterWeightsOptimizer(
                    params, lambda ps: make_optimizer(kind, ps, process_group=group, tracker=tracker)
                )
            return make_optimizer(kind, params, process_group=group, tracker=tracker)

        if self.training.optimizer_in_backward:
            from tracer.bnb import OptimizerInBackward

            return OptimizerInBackward(self.model.parameters(), make)
        return make(self.model.parameters())


def close_optimizer(opt) -> None:
    """Remove what an optimizer registered on the parameters (the hooks of an optimizer in backward)."""
    close = getattr(opt, "close", None)
    if close is not None:
        close()


@contextlib.contextmanager
def _default_group_restored():
    """Destroy, on exit, a default process group initialised inside (a trace's fake group, :func:`_fake_process_group`)
    when none was initialised before: ``memfit.describe`` reads the world size of an initialised group, so a process
    that traced a sharded step would describe later jobs as distributed."""
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if not had_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def prepared_model(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    *,
    model_name: str | None = None,
    device: str = "fake",
    seed: int = 0,
):
    """Build the model of ``hf_config`` for ``training`` inside the measuring context and yield a
    :class:`PreparedModel`: random weights, fine-tuning applied, no layer checkpointed yet, FSDP2
    applied for ``zero2``/``zero3``/FSDP sharding over a fake process group of ``data_parallel_size``. A fake
    default process group made for the trace is destroyed on exit (:func:`_default_group_restored`).

    Raises:
        ValueError: unsupported configuration (tensor/pipeline parallel > 1, Adafactor under FSDP2) or a
            sequence longer than a learned position table.
    """
    _check_supported(training)
    limit = max_seq_len(hf_config)
    if limit is not None and training.seq_len > limit:
        raise ValueError(
            f"seq_len={training.seq_len} exceeds this model's learned position embeddings: allowed 1..{limit}"
        )
    from tracer.moe import balanced_routing

    if training.finetune is FineTune.LORA:
        # outside the measuring context: importing PEFT makes tensors (default arguments such as
        # ``torch.tensor(1)`` in its LoHa layer) that the first traced step of a process would count
        import peft  # noqa: F401

    num_experts = num_routed_experts(hf_config)
    ep = training.expert_parallel_size
    built_config = local_expert_config(hf_config, ep) if ep > 1 else hf_config
    torch.manual_seed(seed)
    ctx, method = _device_context(device)
    world = training.data_parallel_size
    tp = training.tensor_parallel_size
    mesh_device = "cuda" if device == "cuda" else "cpu"
    with _default_group_restored():  # the fake group made below goes when the trace ends
        group = _fake_process_group(world) if training.sharding is not Sharding.NONE and tp == 1 else None
        tp_mesh = mesh = None
        if tp > 1 and training.sharding in _FSDP_RESHARD:
            # 2-D (data, tensor) mesh as torchtitan builds it: TP inside each data-parallel replica, FSDP2 over
            # the data-parallel dimension of the already tensor-parallel DTensor parameters
            from torch.distributed.device_mesh import init_device_mesh

            _fake_process_group(world * tp)
            mesh2d = init_device_mesh(mesh_device, (world, tp), mesh_dim_names=("dp", "tp"))  # outside the fake mode
            tp_mesh, mesh = mesh2d["tp"], mesh2d["dp"]
        elif tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            _fake_process_group(tp)
            tp_mesh = init_device_mesh(mesh_device, (tp,))  # outside the fake mode
        elif training.sharding in _FSDP_RESHARD:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(mesh_device, (world,))  # outside the fake mode
        tracker = LiveStorageTracker() if method is not Method.CUDA else None
        amp_dtype = _HALF.get(training.precision)
        on = "cuda" if device == "cuda" else "cpu"
        cluster = _cluster(device, training)
        sdpa_ctx = _cuda_sdpa_kernels() if device == "fake" else contextlib.nullcontext()
        quantized = training.quantization is not Quantization.NONE
        if quantized and device != "cuda":
            from tracer.bnb import cuda_kernel_choices

            kernel_ctx = cuda_kernel_choices()
        else:
            kernel_ctx = contextlib.nullcontext()
        with quiet_transformers(), sdpa_ctx, ctx, tracker or contextlib.nullcontext(), kernel_ctx:
            model = build_causal_lm(
                built_config, dtype=param_dtype(training.precision), attention=training.attention.value
            )
            if model.config._attn_implementation == "eager" and training.attention is not Attention.EAGER:
                training = training.model_copy(update={"attention": Attention.EAGER})  # family lacks SDPA
            if quantized:
                from tracer.bnb import quantize_base_linears

                half = _HALF.get(training.precision, param_dtype(training.precision))
                quantize_base_linears(model, training.quantization, storage_dtype=half, compute_dtype=half)
            layers = decoder_layers(model)
            model = apply_finetune(model, training, layers)
            spec = model_spec(built_config, model, name=model_name)  # counts include LoRA adapters
            if ep > 1:  # the record describes the whole model (all experts), as a user would give it
                from memfit.hf import count_params_from_config

                extra = spec.total_params - count_params_from_config(built_config)  # LoRA adapters
                total = count_params_from_config(hf_config) + extra
                trainable = total if spec.trainable_params == spec.total_params else spec.trainable_params
                spec = spec.model_copy(
                    update={"num_experts": num_experts, "total_params": total, "trainable_params": trainable}
                )
            check_moe_settings(spec, training)
            check_quantized_base(spec, training)
            reentrant = training.checkpoint_impl is CheckpointImpl.REENTRANT
            apply_activation_checkpointing(model, [], layers=layers, use_reentrant=reentrant)
            if tp_mesh is not None:
                from tracer.parallel import apply_tensor_parallel

                apply_tensor_parallel(model, layers, tp_mesh, sequence_parallel=training.sequence_parallel)
            if mesh is not None:
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": _FSDP_RESHARD[training.sharding]}
                if training.sharding is Sharding.ZERO3 and tp_mesh is None:  # zero2 shares fsdp_shard_grad_op's key
                    kw["shard_placement_fn"] = flat_partition_placement(world)
                if amp_dtype is not None:
                    kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
                with _mesh_bookkeeping_outside_modes() if tp_mesh is not None else contextlib.nullcontext():
                    for layer in layers:
                        fully_shard(layer, **kw)
                    fully_shard(model, **kw)
            routing = (
                balanced_routing(
                    model,
                    imbalance_factor=training.moe_imbalance_factor,
                    expert_parallel_size=ep,
                    num_experts=num_experts,
                )
                if num_experts
                else contextlib.nullcontext()
            )
            with routing:
                yield PreparedModel(
                    model=model,
                    layers=layers,
                    spec=spec,
                    training=training,
                    tracker=tracker,
                    cluster=cluster,
                    use_autocast=amp_dtype is not None and mesh is None,
                    amp_dtype=amp_dtype,
                    on=on,
                    zero1_group=group if training.sharding is Sharding.ZERO1 else None,
                    method=method,
                    vocab_parallel=tp_mesh is not None,
                )


def measure(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    *,
    model_name: str | None = None,
    device: str = "fake",
    steps: int = 2,
    seed: int = 0,
) -> TelemetryRecord:
    """Run ``steps`` training steps and return the measured record (peak = max over the steps).

    Args:
        hf_config: HF ``config.json`` dict of the model.
        training: configuration; ``checkpoint_layers`` says which decoder layers recompute.
        model_name: catalog name stored with the record.
        device: ``fake`` | ``cpu`` | ``cuda`` (see module docstring).
        steps: training steps (>= 2 so that the optimizer states created in step 1 are present in step 2).

    Raises:
        ValueError: unsupported configuration (tensor/pipeline parallel > 1) or bad arguments.
        pydantic.ValidationError: the resulting record is invalid (e.g. k > layers).
    """
    plans = [training.checkpoint_layers]
    return next(
        iter(measure_family(hf_config, training, plans, model_name=model_name, device=device, steps=steps, seed=seed))
    )


def measure_family(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    checkpoint_plans: list[list[int]],
    *,
    model_name: str | None = None,
    device: str = "fake",
    steps: int = 2,
    seed: int = 0,
    prime: bool = False,
    warmup: int = 0,
):
    """Measure one configuration family at several checkpoint plans, building the model once.

    For each plan the checkpointing is re-applied, a fresh optimizer is made and ``steps`` steps run;
    ``training.checkpoint_layers`` is replaced by the plan. Yields one :class:`TelemetryRecord` per plan.

    ``prime=True`` (the sweep's setting) creates the optimizer states first with one optimizer step on
    zero gradients, outside the peak window, and then measures ``steps`` steps. Step 1 of an unprimed
    run holds a subset of what step 2 holds (no optimizer states until its optimizer phase, which
    allocates the same states and temporaries as step 2's), so the max over two unprimed steps equals
    one primed step's peak; ``tests/test_collect.py`` checks this equality to the byte. It halves the
    sweep's time. ``warmup`` full steps run before the peak window opens (the GPU validation uses 1).
    On CUDA an out-of-memory step yields a record with ``oom=True`` and the device capacity as peak.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with prepared_model(hf_config, training, model_name=model_name, device=device, seed=seed) as run:
        model, layers, spec, tracker, training = run.model, run.layers, run.spec, run.tracker, run.training
        reentrant = training.checkpoint_impl is CheckpointImpl.REENTRANT
        ids = run.input_ids(training.micro_batch_size, training.seq_len)
        use_autocast, on, amp_dtype, cluster, live = run.use_autocast, run.on, run.amp_dtype, run.cluster, run.live
        method = run.method

        for plan_layers in checkpoint_plans:
            plan = checkpoint_as_applied(model, layers, plan_layers, reentrant)
            opt = run.make_optimizer()
            if prime:
                _prime_optimizer(model, opt)
            oom = False
            try:
                # warm-up steps run outside the peak window (CUDA: allocator segments, cuBLAS workspace)
                _run_steps(model, opt, ids, warmup, tracker, use_autocast, on, amp_dtype, live, run.loss_context)
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                after_init = live()
                if tracker:
                    tracker.reset_peak()
                after_forward, step_times = _run_steps(
                    model,
                    opt,
                    ids,
                    steps,
                    tracker,
                    use_autocast,
                    on,
                    amp_dtype,
                    live,
                    run.loss_context,
                    accumulation_micro_batches(training),
                )
            except torch.OutOfMemoryError:
                oom, after_init, after_forward, step_times = True, None, None, []
                model.zero_grad(set_to_none=True)
            close_optimizer(opt)
            del opt
            extra: dict[str, Any] = {}
            if tracker:
                peak, phase = tracker.peak_bytes, tracker.peak_phase
            else:
                peak = cluster.device_memory_bytes if oom else torch.cuda.max_memory_allocated()
                phase = None
                extra = _cuda_extras()
            measurement = Measurement(
                peak_allocated_bytes=peak,
                memory_after_init_bytes=after_init,
                memory_after_forward_bytes=after_forward,
                peak_phase=phase,
                oom=oom,
                step_time_s=None if device == "fake" or oom else min(step_times),
                method=method,
                recomputed_layers=len(plan.recomputed),
                host_peak_bytes=tracker.host_peak_bytes
                if tracker and training.offload_optimizer is Offload.CPU
                else None,
                **extra,
            )
            yield TelemetryRecord(
                model=spec,
                training=training.model_copy(update={"checkpoint_layers": plan_layers}),
                cluster=cluster,
                measurement=measurement,
            )


def _run_steps(
    model,
    opt,
    ids,
    n,
    tracker,
    use_autocast,
    on,
    amp_dtype,
    live,
    loss_context=contextlib.nullcontext,
    micro_batches: int = 1,
):
    """Run ``n`` training steps of ``micro_batches`` forward/backward passes each (gradient accumulation);
    returns (live bytes after the first forward, step times in s)."""
    after_forward, times = None, []
    for step in range(n):
        t0 = time.perf_counter()
        for micro in range(micro_batches):
            _set_phase(tracker, Phase.FORWARD)
            with loss_context():
                with torch.autocast(on, dtype=amp_dtype) if use_autocast else contextlib.nullcontext():
                    loss = model(input_ids=ids, labels=ids).loss
                if step == 0 and micro == 0:
                    after_forward = live()
                _set_phase(tracker, Phase.BACKWARD)
                loss.backward()
                del loss
        _set_phase(tracker, Phase.OPTIMIZER)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return after_forward, times


def _cuda_extras() -> dict[str, Any]:
    """CUDA allocator figures of the peak window, plus device memory used outside PyTorch."""
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "active_peak_bytes": stats.get("active_bytes.all.peak"),
        "num_alloc_retries": stats.get("num_alloc_retries"),
        # used on the device minus what PyTorch's caching allocator holds: CUDA context, cuBLAS workspace, NCCL
        "outside_torch_bytes": max(0, total - free - torch.cuda.memory_reserved()),
    }


def _prime_optimizer(model, opt) -> None:
    """Create optimizer states with one step on zero gradients (values are irrelevant to memory)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _set_phase(tracker: LiveStorageTracker | None, phase: Phase) -> None:
    if tracker is not None:
        tracker.phase = phase
