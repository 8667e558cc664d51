"""Accuracy of the one curve on model-parallel telemetry: per-slice MAPE against measured rows.

Reads the tensor-parallel rows of the shipped telemetry (``data/telemetry/telemetry.parquet``, or ``--jsonl PATH``; rows measured with DTensor over a fake
process group: ``python -m training.sweep --grid parallel --jsonl ...``), answers each row's k with
:meth:`model.curve.MemoryPredictor.curve` (terms traced once per configuration key, in a subprocess)
and prints MAPE, worst error and the share answered on the traced path per slice
(tensor-parallel size × sequence parallel, and per model).

    python -m benchmarks.parallel_accuracy [--jsonl PATH]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from data.store import SHIPPED_TELEMETRY, read_records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parallel_accuracy")
    p.add_argument("--jsonl", type=Path, default=None, help="telemetry file (default: the shipped telemetry)")
    a = p.parse_args(argv)

    from data import catalog
    from model.curve import MemoryPredictor
    from model.terms import TermsCache
    from service.tracing import InlineTracer

    rows = read_records(a.jsonl or SHIPPED_TELEMETRY, lambda r: r.training.tensor_parallel_size > 1)
    cache = TermsCache()
    predictor = MemoryPredictor(terms=cache, tracer=InlineTracer(cache))
    errs: dict[str, list[float]] = defaultdict(list)
    paths: dict[str, list[str]] = defaultdict(list)
    curves = {}
    for r in rows:
        t = r.training
        cfg = catalog.get(r.model.model_name)["hf_config"]
        key = (r.model.model_name, t.model_copy(update={"checkpoint_layers": []}).model_dump_json())
        if key not in curves:
            curves[key] = predictor.curve(r.model, t, cfg)
        c = curves[key]
        pred = c.points[t.num_checkpointed_layers].predicted_bytes
        e = pred / r.measurement.peak_allocated_bytes - 1
        for s in (f"tp={t.tensor_parallel_size} sp={t.sequence_parallel}", f"model={r.model.model_name}", "all"):
            errs[s].append(e)
            paths[s].append(c.path)
    print(f"{'slice':32s} {'rows':>5s} {'MAPE':>8s} {'worst':>8s} {'traced':>7s}")
    for s in sorted(errs):
        v = errs[s]
        worst = max(v, key=abs)
        traced = sum(x == "traced" for x in paths[s]) / len(v)
        print(f"{s:32s} {len(v):5d} {100 * sum(map(abs, v)) / len(v):7.3f}% {100 * worst:+7.3f}% {traced:7.0%}")
    print(json.dumps({"rows": len(rows), "mape_pct": round(100 * sum(map(abs, errs["all"])) / len(errs["all"]), 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
