"""Trace and ship phase terms for catalog architectures: ``python -m training.terms``.

For every distinct (architecture, training key) in the telemetry dataset, and for each catalog
architecture under the default request settings, trace :func:`tracer.phases.trace_terms` once and
append a line ``{"key", "model_name", "training", "terms"}`` to ``data/terms/<file>.jsonl``. Keys already
in any ``*.jsonl`` of that folder are skipped, so the job resumes where it stopped; lines are flushed one
by one. ``--shard I/N`` splits the jobs over parallel workers writing their own files.

    python -m training.terms --telemetry data/telemetry/telemetry.parquet --out data/terms/catalog.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from data import catalog
from data.catalog import hf_config_of
from memfit.schema import FineTune, ModelSpec, Optimizer, Precision, Sharding, TrainingConfig
from model.terms import base_terms_key, entry_key, not_traceable_reason, shipped_keys, terms_key, training_key_fields

#: the settings a request gets when it says nothing (memfit.api defaults), traced for every catalog model
DEFAULT_SETTINGS = [
    {"precision": Precision.AMP_BF16, "optimizer": Optimizer.ADAMW_FOREACH},
    {"precision": Precision.BF16, "optimizer": Optimizer.ADAMW_FOREACH},
    {"precision": Precision.AMP_BF16, "optimizer": Optimizer.ADAMW_FUSED},
]


def jobs_from_telemetry(path: str | Path) -> list[tuple[str, TrainingConfig]]:
    """(model_name, training) for each distinct traced key in a telemetry Parquet file."""
    import pandas as pd

    from memfit.schema import TelemetryRecord

    df = pd.read_parquet(path)
    out, seen = [], set()
    for _, row in df.iterrows():
        rec = TelemetryRecord.from_row(row.to_dict())
        name = rec.model.model_name
        cfg = hf_config_of(name)  # None for rows of models neither in the catalog nor reduced MoE: skipped
        training = None if cfg is None else traced_training(rec.model, rec.training, cfg)
        if training is None:
            continue
        sig = (rec.model.model_name, json.dumps(training_key_fields(training), sort_keys=True))
        if sig not in seen:
            seen.add(sig)
            out.append((rec.model.model_name, training))
    return out


def traced_training(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any]) -> TrainingConfig | None:
    """The configuration whose traced terms answer ``training``: itself where it is traced, else the base its
    curve is composed from (a frozen fine-tune: the full fine-tune, :mod:`model.frozen`; ZeRO-1: the same
    without sharding, :mod:`model.zero1`), else None (the provisional path answers it)."""
    from model import frozen, zero1

    if not_traceable_reason(model, training, hf_config) is None:
        return training
    if base_terms_key(model, training, hf_config) is not None:
        return frozen.base_training(training)
    if training.sharding is Sharding.ZERO1 and zero1.not_composable_reason(training) is None:
        base = zero1.base_training(training)
        return base if not_traceable_reason(model, base, hf_config) is None else None
    return None


#: configurations of the public reports the tests pose (tests/test_cases.py), traced ahead like the catalog
PUBLIC_CASE_JOBS = [
    # the README's and the main job's example request (llama-3-8b, ZeRO-3 over 8 GPUs, seq 8192, mb 2)
    ("llama-3-8b", TrainingConfig(micro_batch_size=2, seq_len=8192, sharding="zero3", data_parallel_size=8)),
    (
        "llama-2-7b",
        TrainingConfig(
            micro_batch_size=2, seq_len=512, precision=Precision.BF16, sharding="fsdp_full_shard", data_parallel_size=4
        ),
    ),
    # Qwen2.5-72B, tensor parallel 8 inside each of 8 ZeRO-3 data-parallel replicas (2-D mesh)
    (
        "qwen2.5-72b",
        TrainingConfig(
            micro_batch_size=1, seq_len=4096, sharding="zero3", data_parallel_size=8, tensor_parallel_size=8
        ),
    ),
]

#: MoE public cases (tests/test_cases_moe.py); traced with balanced routing, written to data/terms/moe.jsonl
MOE_CASE_JOBS = [
    # Mixtral-8x7B, LoRA r16 on q,k,v,o, FSDP full shard over 2 GPUs, pure bf16, AdamW
    (
        "mixtral-8x7b",
        TrainingConfig(
            micro_batch_size=4,
            seq_len=4096,
            precision=Precision.BF16,
            finetune=FineTune.LORA,
            lora_rank=16,
            lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            sharding="fsdp_full_shard",
            data_parallel_size=2,
        ),
    ),
]


def default_jobs() -> list[tuple[str, TrainingConfig]]:
    """Every catalog architecture (MoE ones included, traced with balanced routing) under
    :data:`DEFAULT_SETTINGS`, full fine-tune, :data:`PUBLIC_CASE_JOBS` and :data:`MOE_CASE_JOBS`."""
    out = list(PUBLIC_CASE_JOBS) + list(MOE_CASE_JOBS)
    for name in catalog.names():
        for s in DEFAULT_SETTINGS:
            out.append((name, TrainingConfig(micro_batch_size=1, seq_len=1024, finetune=FineTune.FULL, **s)))
    return out


def run(jobs: list[tuple[str, TrainingConfig]], out: Path) -> dict[str, Any]:
    """Trace each job not yet in ``out``; returns counts and the slowest trace."""
    from tracer.phases import trace_terms

    done = set()
    keys = shipped_keys(out.parent)
    for path in out.parent.glob("*.jsonl"):  # other shards' files count as done too
        done |= {entry_key(json.loads(line), keys) for line in path.read_text().splitlines() if line.strip()}
    out.parent.mkdir(parents=True, exist_ok=True)
    stats: dict[str, Any] = {"traced": 0, "skipped": 0, "failed": [], "slowest_s": 0.0, "slowest": None}
    with out.open("a") as fh:
        for name, training in jobs:
            cfg = hf_config_of(name)
            key = terms_key(cfg, training)
            if key in done:
                stats["skipped"] += 1
                continue
            t0 = time.perf_counter()
            try:
                terms = trace_terms(cfg, training)
            except Exception as err:  # noqa: BLE001 - one architecture's failure must not stop the job
                stats["failed"].append(f"{name} {training_key_fields(training)}: {err}")
                print(f"FAILED {name}: {err}", flush=True)
                continue
            dt = time.perf_counter() - t0
            fh.write(
                json.dumps(
                    {
                        "key": key,
                        "model_name": name,
                        "training": training_key_fields(training),
                        "terms": terms.to_json(),
                    }
                )
                + "\n"
            )
            fh.flush()
            done.add(key)
            stats["traced"] += 1
            if dt > stats["slowest_s"]:
                stats["slowest_s"], stats["slowest"] = round(dt, 2), name
            print(f"{stats['traced']:4d} {name:24s} {dt:5.1f}s {training_key_fields(training)}", flush=True)
    return stats


def shard_spec(text: str) -> tuple[int, int]:
    """``--shard I/N`` as an argparse ``type``: (I, N) with 0 <= I < N.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse reports it naming the flag).
    """
    try:
        i, n = (int(x) for x in text.split("/"))
        if 0 <= i < n:
            return i, n
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"must be I/N with 0 <= I < N, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.terms", description=__doc__.split("\n\n")[0])
    p.add_argument("--telemetry", type=Path, help="trace every key of this telemetry Parquet file")
    p.add_argument("--defaults", action="store_true", help="trace every catalog model under the default settings")
    p.add_argument("--out", type=Path, default=Path("data/terms/catalog.jsonl"))
    p.add_argument(
        "--shard",
        type=shard_spec,
        default=(0, 1),
        help="I/N: trace every N-th job from the I-th (parallel workers, each with its own --out in the same folder)",
    )
    args = p.parse_args(argv)
    i, n = args.shard
    jobs = (default_jobs() if args.defaults else []) + (jobs_from_telemetry(args.telemetry) if args.telemetry else [])
    jobs = jobs[i::n]
    if not jobs:
        p.error("give --telemetry PATH and/or --defaults")
    stats = run(jobs, args.out)
    print(json.dumps(stats, indent=1))
    return 1 if stats["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
