"""Time to trace a never-seen architecture's phase terms, and to answer a cached one.

    python -m benchmarks.trace_time

Traces 8B-class configurations that are not in the shipped terms (catalog shapes with a changed
vocabulary or FFN width, so no cache entry can answer them), once each, as the service's background
tracer would (:func:`training.phases.trace_terms`), and prints the wall time of each trace. Then times
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
    from training.phases import trace_terms

    cache = TermsCache()
    print(f"{len(cache)} shipped term sets; this machine: 10^7 Python additions in {machine_speed_s():.2f} s")
    slowest = 0.0
    for name, change, precision in CASES:
        cfg = {**catalog.get(name)["hf_config"], **change}
        training = TrainingConfig(micro_batch_size=1, seq_len=4096, precision=precision)
        assert cache.get(terms_key(cfg, training)) is None, "not a never-seen configuration"
        t0 = time.perf_counter()
        terms = trace_terms(cfg, training)
        dt = time.perf_counter() - t0
        slowest = max(slowest, dt)
        print(f"  trace {name} {change} {precision.value}: {dt:.2f} s (period {terms.period})")
    print(f"slowest never-seen 8B-class trace: {slowest:.2f} s (target <= 10 s)")

    p = MemoryPredictor(None, cache)
    spec = catalog.spec("llama-3-8b")
    cfg = catalog.get("llama-3-8b")["hf_config"]
    training = TrainingConfig(micro_batch_size=2, seq_len=8192, precision=Precision.AMP_BF16)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        c = p.curve(spec, training, cfg)
        times.append(time.perf_counter() - t0)
    print(f"cached curve (llama-3-8b, {len(c.points)} points, path {c.path}): median "
          f"{1e3 * statistics.median(times):.3f} ms, p99 {1e3 * sorted(times)[int(0.99 * len(times))]:.3f} ms; "
          "nothing traced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
