"""Time to trace a never-seen architecture's phase terms, and to answer a cached one.

    python -m benchmarks.trace_time

Traces 8B-class configurations that are not in the shipped terms (catalog shapes with a changed
vocabulary or FFN width, so no cache entry can answer them), first as the service's background tracer does
(:class:`service.tracing.TracingProcess`: one spawned process that imports the tracer once, its start timed
apart, then traces one configuration after another), timing each request as the service waits for it; then
each again in this process (:func:`tracer.phases.trace_terms`: the larger small model in a forked process
where two CPUs are free), and the same trace in one process, each with PyTorch's fake-tensor dispatch cache
cleared (a new process starts with it empty). The one-off imports of a fresh
process (transformers' config modules) are timed apart, before the first trace; the first trace still pays
the modeling code's and PyTorch's lazy imports. Then times
:meth:`model.curve.MemoryPredictor.curve` for a cached configuration (the whole curve over k, what
``/recommend`` computes per request) as a median over repeated calls.
"""

from __future__ import annotations

import statistics
import sys
import time

from data import catalog
from memfit.schema import Precision, TrainingConfig
from model.curve import MemoryPredictor
from model.job import resolve_architecture
from model.terms import TermsCache, terms_key

CASES = [
    ("llama-3-8b", {"vocab_size": 100_352}, Precision.BF16),
    ("qwen2.5-7b", {"intermediate_size": 20_480}, Precision.AMP_BF16),
    ("mistral-7b-v0.1", {"vocab_size": 65_536}, Precision.BF16_FP32_MASTER),
    ("gemma-7b", {"intermediate_size": 16_384}, Precision.AMP_BF16),
]


def machine_speed_s() -> float:
    """Seconds this machine takes for 10^7 Python integer additions: trace times are CPU-bound Python (fake-tensor
    dispatch), so figures from different machines compare only through this."""
    t0 = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - t0


def main() -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.hf import layer_period
    from tracer.phases import trace_terms

    cache = TermsCache()
    print(f"{len(cache)} shipped term sets; this machine: 10^7 Python additions in {machine_speed_s():.2f} s")
    t0 = time.perf_counter()
    for name, _change, _precision in CASES:
        layer_period(catalog.get(name)["hf_config"])  # builds the HF config: imports its modules
    print(f"one-off imports of a fresh process: {time.perf_counter() - t0:.2f} s")
    from service.tracing import TracingProcess

    process = TracingProcess()
    t0 = time.perf_counter()
    process.start()
    print(f"the service's tracing process: started and imported the tracer in {time.perf_counter() - t0:.2f} s")
    slowest_service = 0.0
    try:
        for name, change, precision in CASES:
            cfg = {**catalog.get(name)["hf_config"], **change}
            training = TrainingConfig(micro_batch_size=1, seq_len=4096, precision=precision)
            t0 = time.perf_counter()
            process.trace(cfg, training)
            dt = time.perf_counter() - t0
            slowest_service = max(slowest_service, dt)
            print(f"  service traces {name} {change} {precision.value}: {dt:.2f} s")
    finally:
        process.close()
    print(
        f"slowest never-seen 8B-class trace in the service's tracing process: {slowest_service:.2f} s (target <= 10 s)"
    )
    slowest = 0.0
    for name, change, precision in CASES:
        cfg = {**catalog.get(name)["hf_config"], **change}
        training = TrainingConfig(micro_batch_size=1, seq_len=4096, precision=precision)
        assert cache.get(terms_key(cfg, training)) is None, "not a never-seen configuration"
        dt = {}
        for parallel in (True, False):
            FakeTensorMode.cache_clear()  # each trace starts with PyTorch's fake-op cache as cold as a new process's
            t0 = time.perf_counter()
            terms = trace_terms(cfg, training, parallel=parallel)
            dt[parallel] = time.perf_counter() - t0
        slowest = max(slowest, dt[True])
        print(
            f"  trace {name} {change} {precision.value}: {dt[True]:.2f} s (one process: {dt[False]:.2f} s; "
            f"period {terms.period}, sliding window {terms.long_min_seq_len})"
        )
    print(f"slowest never-seen 8B-class trace here, from a cleared fake-op cache: {slowest:.2f} s")

    p = MemoryPredictor(None, cache)
    arch = resolve_architecture("llama-3-8b")
    spec, cfg = arch.spec, arch.hf_config
    training = TrainingConfig(micro_batch_size=2, seq_len=8192, precision=Precision.AMP_BF16)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        c = p.curve(spec, training, cfg)
        times.append(time.perf_counter() - t0)
    print(
        f"cached curve (llama-3-8b, {len(c.points)} points, path {c.path}): median "
        f"{1e3 * statistics.median(times):.3f} ms, p99 {1e3 * sorted(times)[int(0.99 * len(times))]:.3f} ms; "
        "nothing traced"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
