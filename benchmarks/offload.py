"""Agreement of the composed offload curve and host-memory rule with measured offload rows.

    python -m benchmarks.offload [FILE]   # default: the shipped telemetry's offload rows

For every measured offload row of FILE (.parquet/.csv/.jsonl; default ``data/telemetry/telemetry.parquet``) (``python -m training.sweep --grid offload --jsonl ...``: the collector ran the
step with the optimizer on the host, :class:`tracer.collect.HostOffloadOptimizer`), the device peak at
its k is predicted by :meth:`model.curve.MemoryPredictor.curve` on the traced path — the base terms
(the configuration without offload, :func:`model.offload.traced_base`) are taken from the shipped cache
or traced once here — and compared. The measured host peak is compared with
:func:`model.offload.host_bytes_per_rank` (no buffer factor), per optimizer. Prints MAPE, the worst
error and the share within ±0.1 %.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path


def offloaded(record) -> bool:
    """The shipped rows this benchmark scores: optimizer or parameter offload (``training.sweep --grid offload``)."""
    t = record.training
    return t.offload_optimizer.value != "none" or t.offload_parameters.value != "none"


def main(argv: list[str] | None = None) -> int:
    from data import catalog
    from data.store import SHIPPED_TELEMETRY, read_records
    from model.curve import TRACED, MemoryPredictor
    from model.offload import host_bytes_per_rank, traced_base
    from model.terms import TermsCache, terms_key
    from tracer.phases import trace_terms

    path = Path((argv or sys.argv[1:] or [str(SHIPPED_TELEMETRY)])[0])
    rows = read_records(path, offloaded)
    predictor = MemoryPredictor(None, TermsCache())
    errors: list[float] = []
    host: dict[str, list[float]] = collections.defaultdict(list)
    t0 = time.perf_counter()
    for r in rows:
        cfg = catalog.get(r.model.model_name)["hf_config"]
        base = traced_base(r.training)
        key = terms_key(cfg, base)
        if predictor.terms.get(key) is None:
            predictor.terms.put(key, trace_terms(cfg, base).to_json())
        curve = predictor.curve(r.model, r.training, cfg)
        assert curve.path == TRACED
        measured = r.measurement.peak_allocated_bytes
        errors.append((curve.points[r.training.num_checkpointed_layers].predicted_bytes - measured) / measured)
        if r.measurement.host_peak_bytes is not None:
            formula = host_bytes_per_rank(r.model, r.training)
            host[r.training.optimizer.value].append(r.measurement.host_peak_bytes / formula - 1)
    n = len(errors)
    print(f"offload rows: {n} from {path} ({time.perf_counter() - t0:.0f} s, base terms traced where missing)")
    print(
        f"device peak, composed vs measured: MAPE {100 * sum(map(abs, errors)) / n:.3f} %, "
        f"worst {100 * max(errors, key=abs):+.3f} %, within ±0.1 %: {sum(abs(e) <= 1e-3 for e in errors)}/{n}"
    )
    for opt, v in sorted(host.items()):
        print(f"host peak / formula - 1, {opt:14s}: {100 * min(v):+.2f} % .. {100 * max(v):+.2f} % ({len(v)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
