"""The run-time tracer: the part of the product that traces a training step under fake tensors.

The service spawns it to trace the phase terms of a configuration it has not seen (:mod:`tracer.phases`), and
the collectors and offline jobs in ``training/`` call it to measure steps (:mod:`tracer.collect`). Modules:
:mod:`tracer.tracker` (live-storage peak tracker), :mod:`tracer.phases` (per-phase terms of 1-/2-layer models),
:mod:`tracer.collect` (one measured step), :mod:`tracer.moe`, :mod:`tracer.bnb`, :mod:`tracer.parallel`
(mixture-of-experts, bitsandbytes and parallel-layout pieces of a step), :mod:`tracer.cuda_policy` (CUDA kernel
and autocast semantics on a CPU trace), :mod:`tracer.allocation` and :mod:`tracer.stream_source` (the caching
allocator's input stream). It imports ``memfit``, ``data`` and ``model``, never ``training`` or ``service``.
"""
