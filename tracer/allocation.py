"""The allocation stream of a training step, recorded with the fake-tensor tracker.

:func:`step_allocations` runs exactly what the GPU validation runs on CUDA
(:func:`tracer.collect.measure_family` with one warm-up step and one measured step), under
``FakeTensorMode`` on the CPU, and records every storage allocation and free in order: the model build,
the warm-up step, ``reset_peak_memory_stats`` (the stream's ``measured_from``) and the measured step.
:mod:`model.allocator` replays the stream through a model of PyTorch's caching allocator.

The fake device path of the collector is used unchanged, so SDPA takes the kernels CUDA takes and
transformers 5 builds no ``(b, 1, s, s)`` packed-sequence mask (``tracer.collect._cuda_sdpa_kernels``).

CUDA allocates through the caching allocator what a CPU trace never sees: cuBLAS keeps one workspace per
(handle, stream) (``aten/src/ATen/cuda/CublasHandlePool.cpp``), and the autograd engine runs the backward
on its own thread with its own handle, so a step holds two. Their size on Hopper is 32 MiB (cuBLAS docs,
``cublasSetWorkspace``: 32 MiB recommended for sm90; PyTorch's default for sm90). The stream gets them at
the first forward and the first backward, never freed: :data:`SM90_WORKSPACES`.

Kernels also allocate scratch memory through the caching allocator that no traced op returns. The one that
matters at training sizes is the attention backward: FlashAttention-2's ``mha_bwd`` (PyTorch
``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``) allocates, after the gradients it
returns, an fp32 ``softmax_d`` (B, H, S_q rounded to 128), an fp32 ``dq_accum`` (B, S_q rounded, H, D rounded
to 32) and, for grouped-query attention, ``dk_expanded``/``dv_expanded`` (B, S_k, H, D) in the inputs' dtype,
all freed when it returns. :func:`model.cuda_semantics.flash_backward_scratch` gives those sizes; the recorder allocates and frees
them right after each fused attention backward of the trace (``kernel_scratch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from memfit.schema import CheckpointImpl, TrainingConfig
from model.allocator import AllocationStream
from model.cuda_semantics import GpuGeneration, flash_backward_scratch, step_workspaces
from tracer.stream_source import STREAM_FORMAT, stream_cache_dir, stream_path, trace_policy_name  # noqa: F401 - re-exported
from tracer.tracker import LiveStorageTracker

#: cuBLAS workspaces allocated at the first entry of a phase (bytes): one per autograd thread, on sm90
#: (:func:`model.cuda_semantics.step_workspaces`).
SM90_WORKSPACES: Mapping[str, int] = step_workspaces(GpuGeneration.SM90)


_CREATED: list[RecordingTracker] = []


def _attention_backward_ops() -> tuple:
    import torch

    ops = torch.ops.aten
    return (
        ops._scaled_dot_product_flash_attention_for_cpu_backward.default,
        ops._scaled_dot_product_flash_attention_backward.default,
    )


class RecordingTracker(LiveStorageTracker):
    """:class:`~tracer.tracker.LiveStorageTracker` that also records each allocation and free in order.

    Attributes:
        handles / sizes: the events (see :class:`model.allocator.AllocationStream`); sizes are the storages'
            bytes before rounding.
        measured_from: the event index at the last :meth:`reset_peak`.
        marks: ``(event index, phase)`` at each phase change.
        workspaces: bytes allocated (never freed) the first time a phase is entered.
        kernel_scratch: whether fused attention backwards get FlashAttention-2's scratch allocations.
        labels: per event, the decoder layer it belongs to (-1: none), once :meth:`attach_layers` was called
            (:attr:`model.allocator.AllocationStream.layer_labels` says what a label means).
    """

    def __init__(
        self, workspaces: Mapping[str, int] | None = None, kernel_scratch: bool = True, layered: bool = False
    ) -> None:
        self.kernel_scratch = kernel_scratch
        self._will_layer = layered  # attach_layers will be called: the build keeps each tensor's sources
        self._attn_bwd = _attention_backward_ops() if kernel_scratch else ()
        self.handles: list[int] = []
        self.sizes: list[int] = []
        self.marks: list[tuple[int, str]] = []
        self.measured_from = 0
        self.workspaces = dict(SM90_WORKSPACES if workspaces is None else workspaces)
        self._entered: set[str] = set()
        self._handle: dict[int, int] = {}  # id(storage) -> handle of its current allocation
        self._next = 1
        self.labels: list[int] = []
        self._label = -1  # the forward/backward context: the decoder layer running now
        self._label_of: dict[int, int] = {}  # handle -> label of its allocation
        self._owner: list[int] | int | None = None  # init/optimizer: label(s) of the tensors the current op reads
        self._layered = False
        self._loose: list[bool] = []  # per event: a free outside any layer's forward or backward
        self._made_from: dict[int, list[int]] = {}  # build: handle -> handles of the op's inputs (a cast's source)
        super().__init__()
        _CREATED.append(self)

    @property
    def phase(self):
        return self._phase_value

    @phase.setter
    def phase(self, value) -> None:
        self._phase_value = value
        name = str(value)
        if self.marks and self.marks[-1][1] == name:
            return
        self.marks.append((len(self.sizes), name))
        self._label = -1  # a forward or backward starts outside any layer
        if name not in self._entered:
            self._entered.add(name)
            extra = self.workspaces.get(name, 0)
            if extra:
                self._alloc(extra)

    def _by_owner(self) -> bool:
        """Init and optimizer events are labelled by the tensors they belong to, forward and backward ones by
        the layer running."""
        return str(self._phase_value) not in ("forward", "backward")

    def _alloc(self, nbytes: int) -> int:
        h = self._next
        self._next += 1
        self.handles.append(h)
        self.sizes.append(nbytes)
        if self._by_owner():
            owner = self._owner.pop(0) if isinstance(self._owner, list) and self._owner else self._owner
            label = owner if isinstance(owner, int) else (self.labels[-1] if self.labels else -1)
        else:
            label = self._label
        self.labels.append(label)
        self._loose.append(False)
        self._label_of[h] = label
        return h

    def _free(self, h: int) -> None:
        self.handles.append(h)
        self.sizes.append(0)
        loose = self._by_owner() or self._label == -1
        self.labels.append(self._label_of.get(h, -1) if loose else self._label)
        self._loose.append(loose)

    def attach_layers(self, layers, model=None) -> None:
        """Label events by decoder layer from now on (module hooks on ``layers``; tensor hooks on the
        hidden states between layers mark where each layer's backward starts) and label the parameters
        already built (``model``'s outside ``layers``: -1). Reentrant checkpointing is not supported (its layer
        outputs carry no gradient hooks).
        """
        import torch

        n = len(layers)
        self._layered = True

        def in_backward() -> bool:
            return torch._C._current_graph_task_id() != -1

        def first_tensor(obj):
            if isinstance(obj, torch.Tensor):
                return obj
            if isinstance(obj, (tuple, list)):
                return next((t for t in obj if isinstance(t, torch.Tensor)), None)
            return None

        def set_label(i):
            def hook(_grad):
                self._label = i

            return hook

        def pre(i):
            def hook(_module, args, kwargs):
                if in_backward():
                    return
                self._label = i
                x = first_tensor(args) if args else kwargs.get("hidden_states")
                if i == 0 and isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(set_label(-1))

            return hook

        def post(i):
            def hook(_module, _args, output):
                if in_backward():
                    return
                y = first_tensor(output)
                if isinstance(y, torch.Tensor) and y.requires_grad:
                    y.register_hook(set_label(i))
                if i == n - 1:
                    self._label = -1

            return hook

        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(pre(i), with_kwargs=True)
            layer.register_forward_hook(post(i))
        # the build so far: a parameter's or buffer's allocation gets its layer (-1 outside the layers), any
        # other allocation the label of the allocation before it, a free its allocation's
        event_of = {h: j for j, (h, size) in enumerate(zip(self.handles, self.sizes)) if size}
        fixed: dict[int, int] = {}
        for label, module in [(-1, model)] + list(enumerate(layers)):
            if module is None:
                continue
            for t in (*module.parameters(), *module.buffers()):
                h = self._handle.get(id(t.untyped_storage()))
                if h in event_of:
                    fixed[event_of[h]] = label
        # a built tensor copied into a parameter (a cast, PEFT's adapters moved to the base's dtype) is that layer's
        made = {self.handles[j]: label for j, label in fixed.items()}
        todo = list(made.items())
        while todo:
            h, label = todo.pop()
            for src in self._made_from.get(h, ()):
                if src not in made and src in event_of:
                    made[src] = label
                    fixed.setdefault(event_of[src], label)
                    todo.append((src, label))
        label = -1
        for j, (h, size) in enumerate(zip(self.handles, self.sizes)):
            if size:
                label = fixed.get(j, label)
                self.labels[j] = label
                self._label_of[h] = label
            else:
                self.labels[j] = self._label_of.get(h, -1)

    def track_storage(self, st) -> None:
        key = id(st)
        ref = self._refs.get(key)
        known = ref is not None and ref() is st
        old = self._bytes.get(key, 0) if known else 0
        super().track_storage(st)
        if key in self._untracked:
            return
        new = self._bytes.get(key, 0)
        if known and old == new:
            return
        before = self._handle.pop(key, None) if known else None
        if new:
            self._handle[key] = self._alloc(st.nbytes())  # a resize allocates the new buffer first
        if before is not None:
            self._free(before)

    def _freed(self, key: int) -> None:
        super()._freed(key)
        h = self._handle.pop(key, None)
        if h is not None:
            self._free(h)

    def untrack(self, t) -> None:
        super().untrack(t)
        h = self._handle.pop(id(t.untyped_storage()), None)
        if h is not None:
            self._free(h)

    def _owner_label(self, t) -> int | None:
        import torch

        if not isinstance(t, torch.Tensor) or t.is_meta:
            return None
        return self._label_of.get(self._handle.get(id(t.untyped_storage()), 0))

    def _set_owner(self, func, args) -> None:
        """The label(s) an optimizer op's allocations get: per element of a foreach op's first list, else the
        first tensor argument's with a label (None: the allocation before's)."""
        if args and isinstance(args[0], (list, tuple)) and func.__name__.startswith(("_foreach_", "_fused_")):
            self._owner = [self._owner_label(t) for t in args[0]]
            return
        self._owner = None
        for a in args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                label = self._owner_label(t)
                if label is not None:
                    self._owner = label
                    return

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._layered and self._by_owner():
            self._set_owner(func, args)
        building = self._will_layer and not self._layered and str(self._phase_value) == "init"
        if building:
            import torch

            before = self._next
            inputs = [
                h
                for a in args
                for t in (a if isinstance(a, (list, tuple)) else (a,))
                if isinstance(t, torch.Tensor)
                and not t.is_meta
                and (h := self._handle.get(id(t.untyped_storage()))) is not None
            ]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._owner = None
        if building and inputs:
            for h in range(before, self._next):
                self._made_from[h] = inputs
        if func in self._attn_bwd and not self._in_sharding_prop and not self._host_depth:
            q, k = args[1], args[2]
            handles = [self._alloc(n) for n in flash_backward_scratch(q.shape, k.shape, q.element_size())]
            for h in handles:
                self._free(h)
        return out

    def reset_peak(self) -> None:
        super().reset_peak()
        self.measured_from = len(self.sizes)

    def stream(self, meta: dict[str, Any] | None = None) -> AllocationStream:
        """The events recorded so far."""
        if not self._layered:
            return AllocationStream(
                list(self.handles), list(self.sizes), self.measured_from, list(self.marks), dict(meta or {})
            )
        handles, labels = list(self.handles), list(self.labels)
        # frees in a row leave the allocator in the same state in any order, and their order is Python's (an
        # autocast cache cleared in hash order, a list of foreach temporaries released last to first, saved
        # tensors released as references drop): put each run of them (inside one layer, or outside any layer)
        # in allocation order, so that a deeper model's stream is the template's layer by layer
        cuts = {at for at, _ in self.marks} | {self.measured_from}
        key = ["loose" if loose else lab for loose, lab in zip(self._loose, labels)]
        j, end = 0, len(handles)
        while j < end:
            if self.sizes[j]:
                j += 1
                continue
            e = j + 1
            while e < end and not self.sizes[e] and key[e] == key[j] and e not in cuts:
                e += 1
            batch = sorted(zip(handles[j:e], labels[j:e]))
            handles[j:e], labels[j:e] = [h for h, _ in batch], [lab for _, lab in batch]
            j = e
        return AllocationStream(
            handles, list(self.sizes), self.measured_from, list(self.marks), dict(meta or {}), labels
        )


@contextlib.contextmanager
def _recording_tracker(workspaces: Mapping[str, int] | None, kernel_scratch: bool = True, layered: bool = False):
    """Make the collector build a :class:`RecordingTracker` (with ``layered``, labelling events by decoder layer
    once the model is built: :meth:`RecordingTracker.attach_layers`); yields the list it is appended to."""
    from tracer import collect

    original, apply = collect.LiveStorageTracker, collect.checkpoint_as_applied
    collect.LiveStorageTracker = lambda: RecordingTracker(workspaces, kernel_scratch, layered)

    def checkpoint_and_attach(model, layers, chosen, use_reentrant):
        plan = apply(model, layers, chosen, use_reentrant)
        if _CREATED and not _CREATED[-1]._layered:
            _CREATED[-1].attach_layers(layers, model)
        return plan

    if layered:
        collect.checkpoint_as_applied = checkpoint_and_attach
    _CREATED.clear()
    try:
        yield _CREATED
    finally:
        collect.LiveStorageTracker, collect.checkpoint_as_applied = original, apply


def step_allocations(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    *,
    model_name: str | None = None,
    warmup: int = 1,
    workspaces: Mapping[str, int] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    kernel_scratch: bool = True,
    layered: bool = False,
) -> AllocationStream:
    """Record the allocation stream of one measured training step, as the GPU validation runs it.

    Builds the model of ``hf_config`` for ``training`` (checkpointing ``training.checkpoint_layers``) under
    fake tensors, runs ``warmup`` steps, resets the peak and runs one step.

    Args:
        hf_config: the HF ``config.json`` dict.
        training: the configuration (as :func:`tracer.collect.measure_family` accepts it).
        warmup: steps before the measured one (>= 0).
        workspaces: bytes allocated at a phase's first entry (default :data:`SM90_WORKSPACES`; ``{}`` for none).
        step_context: a factory of a context the trace runs in (e.g. a CUDA-semantics policy), or None.
        kernel_scratch: add the attention backward's scratch allocations (:func:`model.cuda_semantics.flash_backward_scratch`).
        layered: label each event with its decoder layer (:attr:`AllocationStream.layer_labels`); needs
            non-reentrant checkpointing.

    Returns:
        The stream; ``meta`` holds the model name, the training configuration and the tracker's peak bytes.

    Raises:
        ValueError: what :func:`tracer.collect.measure_family` raises for an unsupported configuration,
            or ``warmup`` < 0.
    """
    from tracer.collect import measure_family

    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if layered and training.checkpoint_impl is not CheckpointImpl.NON_REENTRANT:
        raise ValueError("layered recording needs checkpoint_impl non_reentrant")
    with (
        _recording_tracker(workspaces, kernel_scratch, layered) as created,
        (step_context or contextlib.nullcontext)(),
    ):
        records = measure_family(
            hf_config,
            training,
            [list(training.checkpoint_layers)],
            model_name=model_name,
            device="fake",
            steps=1,
            warmup=warmup,
        )
        record = next(iter(records))
        tracker = created[-1]
        meta = {
            "model": model_name,
            "training": training.model_dump(mode="json"),
            "tracker_peak_bytes": record.measurement.peak_allocated_bytes,
            "workspaces": {k: int(v) for k, v in tracker.workspaces.items()},
            "kernel_scratch": kernel_scratch,
        }
        stream = tracker.stream(meta)
        records.close()
    return stream


def cuda_trace_policy(generation: str = "sm90"):
    """(name, factory) of the CUDA-semantics trace policy (``tracer.cuda_policy.cuda_step_semantics``: CUDA's
    autocast lists, fused dropout, SDPA backend); the name is :func:`tracer.stream_source.trace_policy_name`'s."""
    from tracer.cuda_policy import cuda_step_semantics

    return trace_policy_name(generation), lambda: cuda_step_semantics(generation)


def cached_step_allocations(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    *,
    model_name: str | None = None,
    warmup: int = 1,
    workspaces: Mapping[str, int] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    context_name: str = "",
    kernel_scratch: bool = True,
    layered: bool = False,
    config_id: str | None = None,
) -> AllocationStream:
    """:func:`step_allocations`, kept in :func:`stream_cache_dir` under a key of everything that shapes the
    stream (:func:`tracer.stream_source.stream_path`: the model's ``config_id``, by default
    :func:`tracer.stream_source.stream_config_id` of ``hf_config``; the training configuration, the warm-up, the
    workspaces, ``context_name`` (name the ``step_context``), the torch and transformers versions and
    :data:`STREAM_FORMAT`)."""
    path = stream_path(
        hf_config,
        training,
        warmup=warmup,
        workspaces=workspaces,
        context_name=context_name,
        kernel_scratch=kernel_scratch,
        config_id=config_id,
    )
    if path.exists():
        return AllocationStream.load(path)
    stream = step_allocations(
        hf_config,
        training,
        model_name=model_name,
        warmup=warmup,
        workspaces=workspaces,
        step_context=step_context,
        kernel_scratch=kernel_scratch,
        layered=layered,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    stream.save(tmp)
    tmp.replace(path)
    return stream
