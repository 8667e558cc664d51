"""Issue 26's prepared GPU command: measure the step on the GPU and trace it with that GPU's CUDA semantics.

On a machine with one CUDA GPU, in one call of under five minutes on an H200::

    python -m training.cuda_validate --out "$OUT"

On a CPU-only machine, the plan and the traced side only (no measurement)::

    python -m training.cuda_validate --out DIR --dry-run [--generation sm90] [--limit 2]

For each configuration of :data:`CONFIGS` (the catalog families of issue 26 plus GQA/MQA, dropout and fp32 cases)
one model build on the GPU measures every k in order, as ``data/telemetry/gpu_validation/*/catalog_records.jsonl``
were made (:func:`tracer.collect.measure_family` with ``device="cuda"``, one warm-up step, the peak reset, one
measured step: ``torch.cuda.max_memory_allocated``). Then the fake-tensor tracker traces the same steps on the CPU
inside :func:`tracer.cuda_policy.cuda_step_semantics` for the GPU's generation
(:func:`model.cuda_semantics.generation_of`). Outputs in ``--out``:

* ``gpu_records.jsonl``: the CUDA :class:`~memfit.schema.TelemetryRecord` rows (method ``cuda``), to commit under
  ``data/telemetry/gpu_validation/<gpu>-<date>/``, where ``benchmarks.cuda_rows`` and ``tests/test_cuda_rows.py``
  score them and ``python -m training.gpu_validate --ingest DIR`` stores them;
* ``traced_records.jsonl``: the traced rows (method ``fake_tracker``);
* ``cuda_validation.json``: per row the measured and traced bytes, traced + the step's cuBLAS workspaces
  (:func:`model.cuda_semantics.step_workspace_bytes`) and the error, the worst error per case, versions, seconds.

Configurations left when ``--budget-s`` has passed are skipped (listed in the summary), so the call ends in time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from training.sweep import Family

#: (family, checkpointed-layer counts k, what it checks); every one fits the H200's 139.8 GiB at these k
CONFIGS: list[tuple[Family, list[int], str]] = [
    (Family("gpt2", 4, 1024), [0, 12], "attention dropout 0.1: flash on sm80+, math fallback on CPU"),
    (Family("gpt2-large", 4, 1024), [0, 36], "dropout + CUDA autocast fp32 layer_norm/pow"),
    (Family("gpt2", 8, 1024, attention="eager"), [0, 12], "eager: CUDA softmax backward temporary"),
    (Family("falcon-7b", 2, 2048, precision="bf16"), [16, 32], "MQA without enable_gqa: math backend"),
    (Family("phi-3-mini-4k", 2, 4096), [0, 32], "masked SDPA, head dim 96: cuDNN on sm90"),
    (Family("gemma-3-1b", 4, 4096), [0, 26], "MQA (1 key head), head dim 256: memory-efficient"),
    (Family("llama-3.2-1b", 2, 4096), [0, 16], "GQA 32/8, no dropout: CPU and CUDA agree (control)"),
    (Family("qwen2.5-0.5b", 2, 2048, precision="fp32"), [0, 24], "fp32: flash refuses, memory-efficient runs"),
    (Family("opt-1.3b", 4, 2048), [0, 24], "dropout 0.1 + LayerNorm under autocast"),
    (Family("llama-3.2-1b", 1, 2048, precision="fp32", attention="eager"), [0, 16], "fp32 eager softmax"),
]

#: ``(hf_config, training, plans, model_name, device) -> records``; default :func:`_measure`
Measure = Callable[[dict[str, Any], Any, list[list[int]], str, str], Iterable[Any]]


def _measure(hf_config, training, plans, model_name, device):
    from tracer.collect import measure_family

    if device == "fake":
        return list(
            measure_family(hf_config, training, plans, model_name=model_name, device="fake", steps=1, prime=True)
        )
    return list(measure_family(hf_config, training, plans, model_name=model_name, device=device, steps=1, warmup=1))


def plan(limit: int | None = None) -> list[dict[str, Any]]:
    """The configurations a call measures, in order, as JSON-able dicts (``model``, ``training`` fields, ``ks``,
    ``why``); the first ``limit`` only when given.

    Raises:
        ValueError: ``limit`` below 1."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    chosen = CONFIGS[:limit] if limit else CONFIGS
    return [{"model": f.model, **f.training().model_dump(mode="json"), "ks": ks, "why": why} for f, ks, why in chosen]


def score_rows(gpu_records: list[Any], traced_records: list[Any], generation: str) -> list[dict[str, Any]]:
    """Pair measured and traced records (same order): bytes and (traced + workspaces - measured) / measured."""
    from model.cuda_semantics import GpuGeneration, step_workspace_bytes

    ws = step_workspace_bytes(GpuGeneration(generation))
    out = []
    for real, fake in zip(gpu_records, traced_records, strict=True):
        m, f = real.measurement, fake.measurement
        row = {
            "model": real.model.model_name,
            "precision": real.training.precision.value,
            "attention": real.training.attention.value,
            "micro_batch_size": real.training.micro_batch_size,
            "seq_len": real.training.seq_len,
            "k": len(real.training.checkpoint_layers),
            "allocated_bytes": m.peak_allocated_bytes,
            "traced_bytes": f.peak_allocated_bytes,
            "workspace_bytes": ws,
            "oom": m.oom,
        }
        if not m.oom:
            row["error"] = (f.peak_allocated_bytes + ws - m.peak_allocated_bytes) / m.peak_allocated_bytes
        out.append(row)
    return out


def write_rows(out_dir: Path, gpu_records: list[Any], traced_records: list[Any], summary: dict[str, Any]) -> None:
    """Write ``gpu_records.jsonl``, ``traced_records.jsonl`` (one record a line) and ``cuda_validation.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_records.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in gpu_records))
    (out_dir / "traced_records.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in traced_records))
    (out_dir / "cuda_validation.json").write_text(json.dumps(summary, indent=1) + "\n")


def run(
    out_dir: Path,
    device: str = "cuda",
    generation: str | None = None,
    limit: int | None = None,
    budget_s: float = 270.0,
    dry_run: bool = False,
    measure: Measure = _measure,
) -> dict[str, Any]:
    """Measure (unless ``dry_run``) and trace every configuration of :func:`plan`; write the outputs (see the
    module docstring) and return the summary. ``generation``: default the GPU's (``"sm90"`` on a dry run).

    Raises:
        ValueError: ``generation`` is not a known generation, or no GPU name gives one.
    """
    from data import catalog
    from model.cuda_semantics import GpuGeneration, generation_of
    from tracer.cuda_policy import cuda_step_semantics

    device_name = None
    if not dry_run and device == "cuda":
        import torch

        device_name = torch.cuda.get_device_name(0)
    gen = GpuGeneration(generation) if generation else (generation_of(device_name) if device_name else None)
    gen = gen or GpuGeneration.SM90
    t0 = time.perf_counter()
    gpu_records: list[Any] = []
    traced_records: list[Any] = []
    skipped, errors = [], []
    for (fam, ks, why), entry in zip(CONFIGS, plan(limit)):
        if time.perf_counter() - t0 > budget_s:
            skipped.append(entry)
            continue
        cfg = catalog.get(fam.model)["hf_config"]
        plans = [list(range(k)) for k in ks]
        try:
            real = [] if dry_run else list(measure(cfg, fam.training(), plans, fam.model, device))
            with cuda_step_semantics(gen):
                fake = list(measure(cfg, fam.training(), plans, fam.model, "fake"))
        except Exception as err:  # noqa: BLE001 - one failed configuration must not cost the whole call
            errors.append({**entry, "error": f"{type(err).__name__}: {err}"[:400]})
            continue
        finally:
            if not dry_run and device == "cuda":
                import torch

                torch.cuda.empty_cache()
        if device_name:
            fake = [
                r.model_copy(update={"cluster": r.cluster.model_copy(update={"device_name": device_name})})
                for r in fake
            ]
        traced_records += fake
        gpu_records += real
        print(f"{fam.model} {fam.precision} {fam.attention} ks={ks}: {why}", file=sys.stderr, flush=True)
    rows = score_rows(gpu_records, traced_records, gen.value) if gpu_records else []
    measured = [r for r in rows if "error" in r]
    summary = {
        "device": device_name or ("dry run" if dry_run else device),
        "generation": gen.value,
        "plan": plan(limit),
        "rows": rows,
        "traced_bytes": [r.measurement.peak_allocated_bytes for r in traced_records],
        "within_0_5_percent": sum(abs(r["error"]) <= 0.005 for r in measured),
        "within_1_percent": sum(abs(r["error"]) <= 0.01 for r in measured),
        "worst_error": max((r["error"] for r in measured), key=abs, default=None),
        "skipped": skipped,
        "errors": errors,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    try:
        import torch
        import transformers

        summary["torch"], summary["transformers"] = torch.__version__, transformers.__version__
    except ImportError:  # pragma: no cover - both are dependencies
        pass
    write_rows(out_dir, gpu_records, traced_records, summary)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); argparse exits 2 naming a bad option."""
    p = argparse.ArgumentParser(prog="python -m training.cuda_validate", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the three output files")
    p.add_argument("--device", default="cuda", choices=["cuda"], help="the measuring device")
    p.add_argument("--generation", choices=["sm80", "sm86", "sm89", "sm90"], help="default: the GPU's")
    p.add_argument("--limit", type=int, help="only the first N configurations (>= 1)")
    p.add_argument("--budget-s", type=float, default=270.0, help="start no configuration after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="no GPU: trace only, write the plan and traced rows")
    a = p.parse_args(argv)
    if a.limit is not None and a.limit < 1:
        p.error(f"--limit must be >= 1, got {a.limit}")
    if a.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {a.budget_s}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not a.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or use --dry-run", file=sys.stderr)
            return 2
    s = run(a.out, a.device, a.generation, a.limit, a.budget_s, a.dry_run)
    print(json.dumps({k: s[k] for k in ("device", "generation", "within_0_5_percent", "worst_error", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
