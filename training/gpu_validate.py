"""GPU validation: CUDA allocator figures next to the fake-tensor tracker's, on the same configs.

Run on a machine with one CUDA GPU, in a single call of well under ten minutes::

    python -m training.gpu_validate --out "$OUT"            # ~20 configs, writes 3 files

For each configuration it runs one warm-up step, ``torch.cuda.reset_peak_memory_stats()``, one
measured step, and logs ``max_memory_allocated``, ``max_memory_reserved``, ``active_bytes.all.peak``,
``num_alloc_retries`` and the device memory used outside PyTorch (``mem_get_info`` minus reserved:
CUDA context, cuBLAS workspace, NCCL), then measures the same configuration with the fake-tensor
tracker on the CPU. Outputs in ``--out``:

* ``gpu_records.jsonl`` — the CUDA :class:`~memfit.schema.TelemetryRecord` rows (method ``cuda``);
* ``fake_records.jsonl`` — the paired tracker rows;
* ``gpu_validation.json`` — per-config pairs, allocated/tracker ratios, reserved − allocated,
  outside-PyTorch bytes, the allocator environment variables and library versions.

Import the CUDA rows afterwards with ``python -m training.gpu_validate --ingest DIR`` (it also reads a
``catalog_records.jsonl`` there).
``--device cpu`` runs the same pipeline on real CPU tensors (the ``cpu_tracker``) for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from training.sweep import Family

ALLOC_ENV = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "CUDA_MODULE_LOADING",
    "CUBLAS_WORKSPACE_CONFIG",
    "NCCL_BUFFSIZE",
    "CUDA_VISIBLE_DEVICES",
)

# (family, k values): small enough that every config fits on an 80 GB card and runs in seconds.
CONFIGS: list[tuple[Family, list[int]]] = [
    (Family("gpt2", 4, 1024), [0, 6, 12]),
    (Family("gpt2", 8, 1024, attention="eager"), [0, 12]),
    (Family("gpt2-medium", 4, 1024, precision="amp_fp16"), [0, 24]),
    (Family("qwen2.5-0.5b", 4, 2048), [0, 12, 24]),
    (Family("qwen2.5-0.5b", 2, 4096, precision="bf16"), [0, 24]),
    (Family("llama-3.2-1b", 2, 4096), [0, 8, 16]),
    (Family("llama-3.2-1b", 1, 8192, precision="bf16_fp32_master"), [0, 16]),
    (Family("llama-3.2-1b", 4, 2048, optimizer="adamw_fused"), [0, 16]),
    (Family("llama-3.2-1b", 4, 2048, finetune="lora", lora_rank=16), [0, 16]),
    (Family("opt-1.3b", 4, 64, precision="amp_fp16"), [0, 24]),
    (Family("qwen2.5-1.5b", 2, 4096, optimizer="sgd_momentum"), [0, 28]),
    (Family("llama-3.2-3b", 1, 4096, precision="bf16", optimizer="adafactor"), [0, 14, 28]),
]


def _pairs(limit: int | None) -> list[tuple[Family, int]]:
    out = [(fam, k) for fam, ks in CONFIGS for k in ks]
    return out[:limit] if limit else out


def run(out_dir: Path, device: str = "cuda", limit: int | None = None, budget_s: float = 480.0) -> dict[str, Any]:
    """Measure every config on ``device`` and with the fake tracker; write the three output files."""
    import torch
    import transformers

    from data import catalog
    from tracer.collect import measure_family

    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    gpu_f = (out_dir / "gpu_records.jsonl").open("w")
    fake_f = (out_dir / "fake_records.jsonl").open("w")
    for fam, k in _pairs(limit):
        if time.perf_counter() - t_start > budget_s:
            rows.append({"family": fam.__dict__, "k": k, "skipped": "time budget"})
            continue
        cfg = catalog.get(fam.model)["hf_config"]
        plan = [list(range(k))]
        try:
            real = next(
                iter(measure_family(cfg, fam.training(), plan, model_name=fam.model, device=device, steps=1, warmup=1))
            )
            fake = next(
                iter(
                    measure_family(cfg, fam.training(), plan, model_name=fam.model, device="fake", steps=1, prime=True)
                )
            )
        except Exception as err:  # noqa: BLE001 - keep going: one failed config must not cost the whole call
            rows.append({"family": fam.__dict__, "k": k, "error": f"{type(err).__name__}: {err}"[:400]})
            continue
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        real = real.model_copy(update={"record_id": fam.record_id(k, device)})
        fake = fake.model_copy(update={"record_id": fam.record_id(k, "fake")})
        gpu_f.write(real.model_dump_json() + "\n")
        fake_f.write(fake.model_dump_json() + "\n")
        m, f = real.measurement, fake.measurement
        rows.append(
            {
                "family": fam.__dict__,
                "k": k,
                "allocated_bytes": m.peak_allocated_bytes,
                "tracker_bytes": f.peak_allocated_bytes,
                "allocated_over_tracker": m.peak_allocated_bytes / f.peak_allocated_bytes,
                "reserved_bytes": m.peak_reserved_bytes,
                "reserved_minus_allocated_bytes": (m.peak_reserved_bytes - m.peak_allocated_bytes)
                if m.peak_reserved_bytes is not None
                else None,
                "active_peak_bytes": m.active_peak_bytes,
                "num_alloc_retries": m.num_alloc_retries,
                "outside_torch_bytes": m.outside_torch_bytes,
                "step_time_s": m.step_time_s,
                "oom": m.oom,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    gpu_f.close()
    fake_f.close()
    ratios = [r["allocated_over_tracker"] for r in rows if "allocated_over_tracker" in r]
    summary = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "env": {k: os.environ.get(k) for k in ALLOC_ENV},
        "configs": len(rows),
        "measured": len(ratios),
        "ratio_min": min(ratios, default=None),
        "ratio_max": max(ratios, default=None),
        "ratio_mean": sum(ratios) / len(ratios) if ratios else None,
        "seconds": round(time.perf_counter() - t_start, 1),
        "rows": rows,
    }
    (out_dir / "gpu_validation.json").write_text(json.dumps(summary, indent=1))
    return summary


#: files of CUDA rows in a measurement folder: this module's configs, and the catalog families measured with
#: ``tracer.collect.measure_family(..., device="cuda")`` (see data/telemetry/gpu_validation/*/README.md)
CUDA_RECORD_FILES = ("gpu_records.jsonl", "catalog_records.jsonl")


def ingest(in_dir: Path, db: str | None = None) -> dict[str, int]:
    """Add the CUDA rows of a measurement folder (:data:`CUDA_RECORD_FILES`, those present) to the telemetry store.

    Returns counts of rows stored, duplicates, rejected and quarantined (a row whose record id is stored with
    other figures, e.g. the same built-in config measured on another day).

    Raises:
        FileNotFoundError: the folder holds none of :data:`CUDA_RECORD_FILES`.
    """
    from model.plausibility import telemetry_store

    paths = [in_dir / name for name in CUDA_RECORD_FILES if (in_dir / name).is_file()]
    if not paths:
        raise FileNotFoundError(f"{in_dir}: none of {', '.join(CUDA_RECORD_FILES)}")
    lines = [line for path in paths for line in path.read_text().splitlines()]
    rep = telemetry_store(db).add(json.loads(line) for line in lines if line.strip())
    for r in rep.rejected:
        print(f"rejected: {r}", file=sys.stderr)
    # a re-measurement of the same (family, k) has the same record id and other figures: quarantined as a conflict
    return {
        "stored": len(rep.stored),
        "duplicates": len(rep.duplicates),
        "rejected": len(rep.rejected),
        "quarantined": len(rep.quarantined),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.gpu_validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for the three output files")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--limit", type=int, help="measure only the first N (config, k) pairs")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new configs after this long")
    p.add_argument(
        "--ingest",
        type=Path,
        help="store this folder's CUDA rows (gpu_records.jsonl, catalog_records.jsonl) instead of measuring",
    )
    p.add_argument("--db", help="SQLAlchemy URL for --ingest")
    a = p.parse_args(argv)
    if a.ingest:
        print(json.dumps(ingest(a.ingest, a.db)))
        return 0
    if a.out is None:
        p.error("--out is required unless --ingest is given")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device; use --device cpu for a CPU smoke run", file=sys.stderr)
            return 2
    s = run(a.out, a.device, a.limit, a.budget_s)
    print(json.dumps({k: v for k, v in s.items() if k != "rows"}))
    return 0 if s["measured"] else 1


if __name__ == "__main__":
    sys.exit(main())
