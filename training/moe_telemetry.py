"""Collect MoE telemetry on reduced-width MoE architectures: ``python -m training.moe_telemetry``.

Each architecture keeps its family's layout (router, top-k, shared experts, MLA attention for the
DeepSeek-style one) at a reduced width and depth, so a family measures in seconds under fake tensors.
Every configuration is measured at k = 0, L/2 and L through :func:`tracer.collect.measure_family`
(with :func:`tracer.moe.balanced_routing`, as the tracer) and appended, one
:class:`memfit.schema.TelemetryRecord` JSON per line, to ``data/telemetry/incoming/moe.jsonl``. Record ids
are derived from (architecture, configuration, k, device), so a rerun skips what the file holds
(resumable) and never writes a row twice.

    python -m training.moe_telemetry                       # the grid below, fake tensors
    python -m training.moe_telemetry --check               # the curve's error on the collected rows
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from data.reduced_moe import REDUCED_MOE
from memfit.hf import num_routed_experts
from memfit.schema import TelemetryRecord, TrainingConfig

OUT = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "incoming" / "moe.jsonl"
SCHEMA_TAG = "moe-v1"

#: (training settings, token shapes) per architecture: two traced keys each, three (b, s) per key
SETTINGS: list[tuple[dict[str, Any], list[tuple[int, int]]]] = [
    ({"precision": "bf16", "optimizer": "adamw_foreach"}, [(1, 512), (2, 1024), (4, 2048)]),
    ({"precision": "amp_bf16", "optimizer": "adamw_fused"}, [(1, 1024), (2, 2048), (8, 512)]),
    (
        {
            "precision": "bf16",
            "finetune": "lora",
            "lora_rank": 16,
            "lora_target_modules": ["o_proj"],  # every family has it (MLA too)
            "sharding": "fsdp_full_shard",
            "data_parallel_size": 2,
        },
        [(2, 1024), (4, 4096)],
    ),
    (
        {"precision": "bf16", "data_parallel_size": 4, "expert_parallel_size": 4, "moe_imbalance_factor": 1.5},
        [(2, 1024), (4, 2048)],
    ),
]


def configurations() -> list[tuple[str, TrainingConfig]]:
    """Every (architecture, configuration) of the grid, in collection order (k is added per row)."""
    out = []
    for name, cfg in REDUCED_MOE.items():
        E = num_routed_experts(cfg)
        for fields, shapes in SETTINGS:
            ep = fields.get("expert_parallel_size", 1)
            if E % ep or E // ep < cfg["num_experts_per_tok"]:
                continue
            for b, s in shapes:
                out.append((name, TrainingConfig(micro_batch_size=b, seq_len=s, **fields)))
    return out


def record_id(name: str, training: TrainingConfig, k: int, device: str) -> str:
    body = json.dumps(
        [SCHEMA_TAG, device, name, training.model_dump(mode="json", exclude={"checkpoint_layers"}), k], sort_keys=True
    )
    return "m" + hashlib.sha256(body.encode()).hexdigest()[:31]


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect(out: Path = OUT, device: str = "fake") -> dict[str, Any]:
    """Measure every configuration not yet in ``out`` (k = 0, L/2, L); returns counts and failures."""
    from memfit.hf import spec_fields_from_hf_config
    from tracer.collect import measure_family

    have = {r["record_id"] for r in _read(out)}
    out.parent.mkdir(parents=True, exist_ok=True)
    stats: dict[str, Any] = {"stored": 0, "skipped": 0, "failed": [], "seconds": 0.0}
    t0 = time.perf_counter()
    with out.open("a") as fh:
        for name, training in configurations():
            L = spec_fields_from_hf_config(REDUCED_MOE[name])["num_layers"]
            ks = [0, L // 2, L]
            ids = [record_id(name, training, k, device) for k in ks]
            if all(i in have for i in ids):
                stats["skipped"] += 1
                continue
            try:
                recs = list(
                    measure_family(
                        REDUCED_MOE[name],
                        training,
                        [list(range(k)) for k in ks],
                        model_name=name,
                        device=device,
                        steps=1,
                        prime=True,
                    )
                )
            except Exception as err:  # noqa: BLE001 - one configuration's failure is reported, not fatal
                stats["failed"].append(f"{name} {training.model_dump(exclude_defaults=True)}: {err}"[:400])
                continue
            for rid, rec in zip(ids, recs):
                if rid not in have:
                    fh.write(rec.model_copy(update={"record_id": rid}).model_dump_json() + "\n")
                    have.add(rid)
                    stats["stored"] += 1
            fh.flush()
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    return stats


def check(path: Path = OUT) -> dict[str, Any]:
    """The one curve (:meth:`model.curve.MemoryPredictor.curve`, traced path, terms traced here once per
    key) against every collected row: MAPE, worst error and the path, per architecture.

    The traced path has no learned component, so no architecture is held out.
    """
    import numpy as np

    from model.curve import MemoryPredictor
    from model.terms import TermsCache, terms_key
    from tracer.phases import trace_terms

    rows = [TelemetryRecord.model_validate(r) for r in _read(path)]
    cache = TermsCache(shipped_dir=None)
    predictor = MemoryPredictor(None, cache)
    errs: dict[str, list[float]] = {}
    paths: set[str] = set()
    for rec in rows:
        name = rec.model.model_name
        cfg = REDUCED_MOE[name]
        key = terms_key(cfg, rec.training)
        if cache.get(key) is None:
            cache.put(key, trace_terms(cfg, rec.training).to_json())
        c = predictor.curve(rec.model, rec.training, cfg)
        paths.add(c.path)
        got = c.points[rec.training.num_checkpointed_layers].predicted_bytes
        m = rec.measurement.peak_allocated_bytes
        errs.setdefault(name, []).append((got - m) / m)
    allerr = np.array([e for v in errs.values() for e in v])
    return {
        "rows": len(allerr),
        "paths": sorted(paths),
        "mape_pct": round(float(np.mean(np.abs(allerr))) * 100, 3),
        "worst_pct": round(float(allerr[np.argmax(np.abs(allerr))]) * 100, 3),
        "per_architecture_mape_pct": {k: round(float(np.mean(np.abs(v))) * 100, 3) for k, v in errs.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.moe_telemetry", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--device", choices=["fake", "cpu"], default="fake")
    p.add_argument("--check", action="store_true", help="report the curve's error on the rows instead of collecting")
    a = p.parse_args(argv)
    stats = check(a.out) if a.check else collect(a.out, a.device)
    print(json.dumps(stats, indent=1))
    return 1 if stats.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
