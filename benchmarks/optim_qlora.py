"""Accuracy of the one curve on the optimizer and QLoRA slices, against measured full-model rows.

    python -m benchmarks.optim_qlora                     # the slices' rows of data/telemetry/telemetry.parquet
    python -m benchmarks.optim_qlora --trace             # first trace and ship the rows' missing phase terms

The rows are full-depth models measured by the collector (``python -m training.sweep --grid optim_qlora``).
Each row is answered by :meth:`model.curve.MemoryPredictor.curve` with the shipped terms
(``data/terms/*.jsonl``; ``--trace`` adds the missing ones to ``data/terms/optim_qlora.jsonl`` with
:func:`training.terms.run`), at the row's k. The traced path sees no other architecture's rows: its terms
come from one- and two-layer models of the row's own configuration, so every figure here is
leave-architecture-out by construction. Printed per slice: rows, MAPE, max error (%), the path, and the
analytic estimate's MAPE (:func:`model.analytic.analytic_estimate`, the provisional path's main feature).

Exit codes: 0 done, 2 no rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

TERMS_OUT = Path("data/terms/optim_qlora.jsonl")
#: bitsandbytes optimizers (tracer/bnb.py)
BITSANDBYTES_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "lion")


def in_slices(record) -> bool:
    """Whether a row belongs to the benchmark's slices: a bitsandbytes optimizer, a quantized base or the optimizer
    step in backward (``python -m training.sweep --grid optim_qlora``)."""
    t = record.training
    return t.optimizer.value in BITSANDBYTES_OPTIMIZERS or t.quantization.value != "none" or t.optimizer_in_backward


def load_records(path: Path | None = None):
    """The slices' rows of a telemetry file (default: the shipped telemetry, :data:`data.store.SHIPPED_TELEMETRY`)."""
    from data.store import SHIPPED_TELEMETRY, read_records

    return read_records(path or SHIPPED_TELEMETRY, in_slices)


def slice_of(training) -> str:
    """The slice a row belongs to: quantization under LoRA, else the optimizer (+ ``in-backward``)."""
    if training.quantization.value != "none":
        return f"qlora {training.quantization.value}"
    return training.optimizer.value + (" in-backward" if training.optimizer_in_backward else "")


def trace_missing(records) -> dict:
    from model.terms import training_key_fields
    from training.terms import run

    jobs, seen = [], set()
    for rec in records:
        sig = (rec.model.model_name, json.dumps(training_key_fields(rec.training), sort_keys=True))
        if sig not in seen:
            seen.add(sig)
            jobs.append((rec.model.model_name, rec.training))
    return run(jobs, TERMS_OUT)


def evaluate(records) -> dict[str, dict]:
    from data import catalog
    from model.analytic import analytic_estimate
    from model.curve import MemoryPredictor
    from model.terms import TermsCache

    predictor = MemoryPredictor(terms=TermsCache())
    rows = defaultdict(list)
    for rec in records:
        hf = catalog.get(rec.model.model_name)["hf_config"]
        curve = predictor.curve(rec.model, rec.training, hf)
        k = rec.training.num_checkpointed_layers
        y = rec.measurement.peak_allocated_bytes
        rows[slice_of(rec.training)].append(
            (
                curve.points[k].predicted_bytes / y - 1,
                curve.path,
                analytic_estimate(rec.model, rec.training).peak_bytes / y - 1,
            )
        )
    out = {}
    for name, vals in sorted(rows.items()):
        err = np.array([v[0] for v in vals])
        ana = np.array([v[2] for v in vals])
        out[name] = {
            "n": len(vals),
            "mape_pct": 100 * float(np.mean(np.abs(err))),
            "max_err_pct": 100 * float(np.max(np.abs(err))),
            "paths": sorted({v[1] for v in vals}),
            "analytic_mape_pct": 100 * float(np.mean(np.abs(ana))),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.optim_qlora", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=Path, default=None, help="telemetry file (default: the shipped telemetry)")
    p.add_argument("--trace", action="store_true", help="trace and ship the rows' missing phase terms first")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    if a.rows is not None and not a.rows.is_file():
        print(f"error: no rows at {a.rows}", file=sys.stderr)
        return 2
    records = load_records(a.rows)
    if not records:
        print(f"error: {a.rows or 'the shipped telemetry'} holds no rows of the slices", file=sys.stderr)
        return 2
    if a.trace:
        print(json.dumps(trace_missing(records)))
    res = evaluate(records)
    print(f"{'slice':<28} {'rows':>5} {'MAPE %':>8} {'max %':>8} {'analytic MAPE %':>16}  path")
    for name, m in res.items():
        print(
            f"{name:<28} {m['n']:>5} {m['mape_pct']:>8.3f} {m['max_err_pct']:>8.3f} {m['analytic_mape_pct']:>16.1f}"
            f"  {','.join(m['paths'])}"
        )
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
