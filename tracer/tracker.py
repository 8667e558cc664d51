"""Live-storage memory tracker: peak bytes of tensor storage alive during a training step.

:class:`LiveStorageTracker` is a ``TorchDispatchMode``. Every tensor an operator returns is looked
up by its untyped storage; a storage seen for the first time adds its size, rounded up to the CUDA
caching allocator's 512-byte blocks (``kMinBlockSize`` in PyTorch ``c10/cuda/CUDACachingAllocator.cpp``),
to the live total, and a weak-reference callback subtracts it when the storage is freed. Storage
``resize_`` (how FSDP2 frees and re-allocates unsharded parameters) is not a dispatched op, so it is
patched while the tracker is active. This is the idea of PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` without its per-module bookkeeping, which makes it
about an order of magnitude faster.

Used under ``FakeTensorMode`` nothing is allocated, so 70B-class steps trace on a laptop. The figure
is *allocated* bytes: no allocator fragmentation (reserved − allocated) and no memory outside
PyTorch (CUDA context, cuBLAS workspace, NCCL buffers).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.schema import Phase

BLOCK_BYTES = 512
_PRIM_DEVICE = torch.ops.prim.device.default


def round_block(nbytes: int) -> int:
    """Round a size up to the CUDA caching allocator's 512-byte block."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def _active_fake_mode() -> FakeTensorMode | None:
    """The innermost active FakeTensorMode on the dispatch-mode stack (cheap: called per op)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


class LiveStorageTracker(TorchDispatchMode):
    """Track live and peak tensor-storage bytes.

    Attributes:
        live_bytes: bytes of storages alive now.
        peak_bytes: max of ``live_bytes`` since construction or :meth:`reset_peak`.
        peak_phase: the :class:`~memfit.schema.Phase` that was set when the peak was reached.
        phase: set by the caller (forward, backward, optimizer) to attribute the peak.

    Usage::

        tracker = LiveStorageTracker()
        with FakeTensorMode(), tracker:
            ...                      # build model, run steps
        tracker.peak_bytes
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase: Phase | str = Phase.INIT
        self.peak_phase: Phase | str = Phase.INIT
        self.phase_peaks: dict[str, int] = {}  # phase name -> peak live bytes inside that phase (see enter_phase)
        self._phase_peak = 0
        #: when a list, every allocation appends (phase, live bytes after it): the step's memory timeline
        self.timeline: list[tuple[str, int]] | None = None
        self._bytes: dict[int, int] = {}  # id(storage) -> counted bytes
        self._refs: dict[int, weakref.ref] = {}
        self._orig_resize = None
        self._orig_prop = None
        self._in_sharding_prop = 0
        self._fake_mode_on_entry: FakeTensorMode | None = None
        self._untracked: set[int] = set()  # storages that exist but are not PyTorch-allocator memory
        #: storages made inside :meth:`on_host` (offloaded states): counted here, not in ``live_bytes``
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self._host_depth = 0
        self._host_refs: dict[int, weakref.ref] = {}
        self._host_sizes: dict[int, int] = {}

    # -- bookkeeping -------------------------------------------------------------------------
    def _bump(self, delta: int) -> None:
        self.live_bytes += delta
        if self.timeline is not None and delta > 0:
            self.timeline.append((self.phase, self.live_bytes))
        if self.live_bytes > self._phase_peak:
            self._phase_peak = self.live_bytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                self.peak_phase = self.phase

    def enter_phase(self, name: str) -> None:
        """Close the current phase's peak into :attr:`phase_peaks` and open phase ``name``.

        A phase's peak starts at the live bytes on entry, so a phase in which nothing is allocated
        still reports what was alive in it. Re-entering a phase keeps the larger peak.
        """
        key = str(self.phase)
        self.phase_peaks[key] = max(self.phase_peaks.get(key, 0), self._phase_peak)
        self.phase = name
        self._phase_peak = self.live_bytes
        if self.timeline is not None:
            self.timeline.append((name, self.live_bytes))

    def track_storage(self, st: torch.UntypedStorage) -> None:
        """Count a storage (idempotent); re-count it if its size changed since last seen."""
        new = round_block(st.nbytes())
        key = id(st)
        ref = self._refs.get(key)
        if key in self._untracked and ref is not None and ref() is st:
            return
        if ref is None or ref() is not st:
            self._bytes[key] = new
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._freed(k))
            self._bump(new)
        elif self._bytes[key] != new:
            self._bump(new - self._bytes[key])
            self._bytes[key] = new

    def _freed(self, key: int) -> None:
        self._refs.pop(key, None)
        self._untracked.discard(key)
        self.live_bytes -= self._bytes.pop(key, 0)

    def untrack(self, t: torch.Tensor) -> None:
        """Stop counting ``t``'s storage from now on: memory the step holds outside PyTorch's allocator
        (bitsandbytes' paged optimizer states live in CUDA unified memory, ``cudaMallocManaged``)."""
        st = t.untyped_storage()
        self.track_storage(st)
        key = id(st)
        self.live_bytes -= self._bytes[key]
        self._bytes[key] = 0
        self._untracked.add(key)

    @contextlib.contextmanager
    def on_host(self):
        """Storages first seen inside this block live in host memory (CPU offload): they count towards
        :attr:`host_live_bytes` / :attr:`host_peak_bytes` and never towards the device's ``live_bytes``."""
        self._host_depth += 1
        try:
            yield self
        finally:
            self._host_depth -= 1

    def _track_host(self, t: torch.Tensor) -> None:
        if t.is_meta or t.layout is not torch.strided:
            return
        st = t.untyped_storage()
        key = id(st)
        if self.is_tracked(st):
            return  # a device tensor written in place from the host
        ref = self._host_refs.get(key)
        if ref is not None and ref() is st:
            return
        size = st.nbytes()
        self._host_sizes[key] = size
        self._host_refs[key] = weakref.ref(st, lambda _r, k=key: self._host_freed(k))
        self.host_live_bytes += size
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)

    def _host_freed(self, key: int) -> None:
        self._host_refs.pop(key, None)
        self.host_live_bytes -= self._host_sizes.pop(key, 0)

    def is_tracked(self, st: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(st))
        return ref is not None and ref() is st

    def track_tensors(self, *objs: Any) -> None:
        """Count the storages of all tensors in (nested) ``objs`` — e.g. tensors made before entering."""
        for t in tree_flatten(objs)[0]:
            if isinstance(t, torch.Tensor):
                self._track_tensor(t)

    def _track_tensor(self, t: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.is_meta or t.layout is not torch.strided:
            return
        self.track_storage(t.untyped_storage())

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (phase peaks included)."""
        self.peak_bytes = self.live_bytes
        self.peak_phase = self.phase
        self.phase_peaks = {}
        self._phase_peak = self.live_bytes
        self.host_peak_bytes = self.host_live_bytes

    # -- mode ----------------------------------------------------------------------------------
    def __enter__(self):
        self._fake_mode_on_entry = _active_fake_mode()
        self._orig_resize = torch.UntypedStorage.resize_
        orig, tracker = self._orig_resize, self

        def resize_(st: torch.UntypedStorage, size: int):
            out = orig(st, size)
            if tracker.is_tracked(st):
                tracker.track_storage(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._patch_sharding_prop()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._orig_prop is not None:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_prop
            self._orig_prop = None
        return super().__exit__(*exc)

    def _patch_sharding_prop(self) -> None:
        """Skip DTensor's shape propagation: it runs ops on global-shape fake tensors under the
        active fake mode (so the fake-mode identity test cannot tell them apart) and allocates nothing."""
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:
            return
        orig = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
        if orig is None:
            return
        tracker = self

        def propagate(*args, **kwargs):
            tracker._in_sharding_prop += 1
            try:
                return orig(*args, **kwargs)
            finally:
                tracker._in_sharding_prop -= 1

        self._orig_prop = orig
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE:  # ``tensor.device`` of a fake tensor (two thirds of all calls): allocates nothing
            return func(*args)
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into ops on its local shards first
        fake = _active_fake_mode() is not None
        if func is torch.ops._c10d_functional.wait_tensor.default and fake:
            out = args[0]  # the fake kernel returns a copy; eager returns the input itself
        elif func is torch.ops.aten._local_scalar_dense.default and fake:
            # ``.item()`` has no value under fake tensors (Adafactor reads norms this way). Values never
            # change which tensors are allocated in a training step, so a stand-in scalar is exact for memory.
            dtype = args[0].dtype
            return True if dtype is torch.bool else (1.0 if dtype.is_floating_point else 1)
        else:
            out = func(*args, **(kwargs or {}))
        # DTensor sharding propagation runs ops under a nested fake mode: those allocate nothing real.
        if self._host_depth and not self._in_sharding_prop:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track_host(t)
        elif not self._in_sharding_prop and _active_fake_mode() is self._fake_mode_on_entry:
            if type(out) is torch.Tensor or isinstance(out, torch.Tensor):
                self._track_tensor(out)
            elif isinstance(out, (tuple, list)):  # most multi-output ops return a flat tuple
                for t in out:
                    if isinstance(t, torch.Tensor):
                        self._track_tensor(t)
                    elif isinstance(t, (tuple, list, dict)):
                        self.track_tensors(t)
        return out
