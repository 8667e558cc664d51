"""Which traced terms answer a request that names a GPU: that generation's, or the CPU-semantics ones meanwhile.

A request with a cluster is answered inside :func:`model.cuda_semantics.target_generation` (the service sets it
from ``cluster.gpu``). There :func:`model.terms.terms_key` keys a configuration by the GPU generation exactly where
a CUDA run of that generation executes the step differently from the CPU trace
(:func:`model.cuda_semantics.cuda_trace_reasons`: math attention for Falcon's one key head, eager softmax backward,
fused dropout masks, CUDA autocast lists); elsewhere the key is the CPU one and every shipped line answers.

How the shipped CPU-semantics terms are used (:func:`generation_curve`):

* where CPU and CUDA agree (Llama, Qwen, Mistral, Gemma, OLMo-2, Granite, SmolLM3 with SDPA and no dropout, any
  precision), they are the answer for every generation: the key is the same;
* where they differ and the generation's terms are traced (shipped in ``data/terms/cuda_sm90.jsonl``, or traced
  by the service's background tracer with that generation's semantics), the generation's terms answer, and the
  answer's notes name the CUDA choices assumed (:func:`model.cuda_semantics.cuda_notes`);
* where they differ and the generation's terms are not traced yet, the tracer is asked for them, and meanwhile the
  CPU-semantics terms answer on the traced path when they exist (better than the provisional estimate), with a note
  saying so and why CUDA differs; the service recomputes the curve once the generation's terms arrive.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.schema import ModelSpec, TrainingConfig
from model.cuda_semantics import TARGET_GENERATION, cuda_notes, cuda_trace_reasons, target_generation
from model.curve import TRACED, Curve, MemoryPredictor


def generation_curve(
    predictor: MemoryPredictor,
    untraced: MemoryPredictor,
    model: ModelSpec,
    training: TrainingConfig,
    hf_config: dict[str, Any] | None,
) -> tuple[Curve, str | None]:
    """The curve for the request's GPU generation (:data:`model.cuda_semantics.TARGET_GENERATION`) and the terms key
    it still waits for (None when it is final).

    ``predictor`` answers with the generation's key (its tracer is asked for missing terms); ``untraced`` (the same
    terms and estimators, no tracer) answers the CPU-semantics fallback described in the module docstring.
    """
    gen = TARGET_GENERATION.get()
    reasons: tuple[str, ...] = ()
    if gen is not None and hf_config is not None:
        try:
            reasons = cuda_trace_reasons(hf_config, training, gen)
        except Exception:  # noqa: BLE001 - a config that can't be read: the curve's own path says why
            reasons = ()
    if not reasons:
        return predictor.curve(model, training, hf_config), None
    try:
        c: Curve | None = predictor.curve(model, training, hf_config)
    except ValueError:  # no provisional estimator either: the CPU-semantics terms may still answer
        c = None
    if c is not None and c.path == TRACED:
        return dataclasses.replace(c, notes=[*c.notes, *cuda_notes(hf_config, training, gen)]), None
    with target_generation(None):
        try:
            cpu = untraced.curve(model, training, hf_config)
        except ValueError:
            if c is None:
                raise
            return c, None
    if cpu.path != TRACED:
        return (c if c is not None else cpu), None
    from model.terms import terms_key

    waiting = c.reason if c is not None and c.reason else "not traced yet"
    note = (
        f"answered from terms traced with the CPU's kernels while this configuration is traced with {gen.value} "
        f"CUDA semantics ({waiting}); CUDA differs here: {'; '.join(reasons)}"
    )
    return dataclasses.replace(cpu, notes=[*cpu.notes, note]), terms_key(hf_config, training)
