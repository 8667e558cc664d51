"""Collection sweep: measure a grid of configuration families over k and write them to the store.

A *family* is one (model, micro-batch, sequence length, precision, optimizer, sharding, attention,
fine-tune) combination; each family is measured at several k (first-k "block" checkpointing) with
one model build (:func:`training.collect.measure_family`). Record ids are derived from the family
and k, so a rerun skips what the store already holds (resumable) and never duplicates rows.

    python -m training.sweep --grid small --workers 2          # the test-suite sweep, < 1 min
    python -m training.sweep --grid default --workers 2        # the shipped dataset
    python -m training.sweep --models gpt2,llama-3.2-1b --seq-lens 512,2048 --micro-batches 1,4
    python -m training.sweep --grid offload --jsonl data/telemetry/incoming/offload.jsonl   # CPU offload rows

Exit codes: 0 all families measured, 1 some families failed (listed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from memfit.schema import Attention, FineTune, Optimizer, Precision, Sharding, TrainingConfig

SCHEMA_TAG = "v3"


@dataclass(frozen=True)
class Family:
    """One configuration family: everything but k."""

    model: str
    micro_batch_size: int
    seq_len: int
    precision: str = Precision.AMP_BF16.value
    optimizer: str = Optimizer.ADAMW_FOREACH.value
    sharding: str = Sharding.NONE.value
    data_parallel_size: int = 1
    attention: str = Attention.SDPA.value
    finetune: str = FineTune.FULL.value
    lora_rank: int | None = None
    frozen_layers: int = 0
    offload_optimizer: str = "none"

    def training(self) -> TrainingConfig:
        d = asdict(self)
        d.pop("model")
        return TrainingConfig(**d)

    def record_id(self, k: int, device: str) -> str:
        d = asdict(self)
        if d["offload_optimizer"] == "none":
            del d["offload_optimizer"]  # families from before offload keep their ids
        key = json.dumps([SCHEMA_TAG, device, d, k], sort_keys=True)
        return "c" + hashlib.sha256(key.encode()).hexdigest()[:31]


def k_values(num_layers: int, max_points: int) -> list[int]:
    """Up to ``max_points`` evenly spaced k in [0, L], always 0 and L."""
    n = min(num_layers + 1, max_points)
    return sorted({round(i * num_layers / (n - 1)) for i in range(n)}) if n > 1 else [0]


@dataclass
class SweepGrid:
    """A sampled grid of families.

    Attributes:
        models: catalog names.
        micro_batches / seq_lens: values drawn per family.
        precisions, optimizers, attentions: drawn with the given weights (first value most often).
        shardings: (sharding, data-parallel sizes) options; ``none`` uses dp=1.
        lora_ranks: ranks drawn for LoRA families; ``finetune_weights`` = (full, lora, frozen).
        families_per_model: families sampled per model with at most ``small_model_layers`` layers; models
            up to ``big_model_layers`` get ``mid_families_per_model``, bigger ones ``big_families_per_model``
            (a record's tracing time grows with the layer count).
        k_points: max k values per family (k = 0..L evenly spaced).
        seed: sampling seed (the grid is deterministic).
        fixed: families always included (acceptance checks rely on them).
    """

    models: list[str]
    micro_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    seq_lens: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192, 16384, 32768])
    precisions: list[str] = field(default_factory=lambda: ["amp_bf16", "bf16", "fp32", "amp_fp16", "bf16_fp32_master"])
    precision_weights: list[float] = field(default_factory=lambda: [4, 2, 1, 1, 1])
    optimizers: list[str] = field(default_factory=lambda: ["adamw_foreach", "adamw_fused", "sgd_momentum", "adafactor"])
    optimizer_weights: list[float] = field(default_factory=lambda: [5, 2, 1, 1])
    shardings: list[tuple[str, list[int]]] = field(default_factory=lambda: [
        ("none", [1]), ("fsdp_full_shard", [2, 4, 8, 16, 32, 64]), ("zero3", [8, 64]),
        ("fsdp_shard_grad_op", [2, 8, 32]), ("zero2", [4, 16]), ("zero1", [2, 8, 64])])
    sharding_weights: list[float] = field(default_factory=lambda: [8, 3, 1, 1, 1, 1])
    attentions: list[str] = field(default_factory=lambda: ["sdpa", "eager"])
    attention_weights: list[float] = field(default_factory=lambda: [4, 1])
    lora_ranks: list[int] = field(default_factory=lambda: [8, 16, 64])
    finetune_weights: list[float] = field(default_factory=lambda: [7, 2, 1])
    families_per_model: int = 24
    small_model_layers: int = 24
    mid_families_per_model: int = 8
    big_model_layers: int = 40
    big_families_per_model: int = 3
    k_points: int = 13
    seed: int = 0
    fixed: list[Family] = field(default_factory=list)
    offload_optimizers: list[str] = field(default_factory=lambda: ["none"])

    def families(self) -> list[Family]:
        from data import catalog
        from training.collect import max_seq_len

        rng = random.Random(self.seed)
        out: list[Family] = list(self.fixed)
        for name in self.models:
            layers = catalog.spec(name).num_layers
            n = (self.families_per_model if layers <= self.small_model_layers
                 else self.mid_families_per_model if layers <= self.big_model_layers else self.big_families_per_model)
            for _ in range(n):
                sharding, dps = rng.choices(self.shardings, self.sharding_weights)[0]
                finetune = rng.choices(["full", "lora", "frozen"], self.finetune_weights)[0]
                seq = rng.choice(self.seq_lens)
                limit = max_seq_len(catalog.get(name)["hf_config"])
                if limit is not None and seq > limit:  # learned position embeddings end there
                    seq = max([x for x in self.seq_lens if x <= limit], default=limit)
                # eager attention materialises b*a*s^2 scores: keep it to the sequence lengths people use it at
                attention = rng.choices(self.attentions, self.attention_weights)[0] if seq <= 4096 else "sdpa"
                out.append(Family(
                    model=name, micro_batch_size=rng.choice(self.micro_batches), seq_len=seq,
                    precision=rng.choices(self.precisions, self.precision_weights)[0],
                    optimizer=rng.choices(self.optimizers, self.optimizer_weights)[0],
                    sharding=sharding, data_parallel_size=rng.choice(dps), attention=attention, finetune=finetune,
                    lora_rank=rng.choice(self.lora_ranks) if finetune == "lora" else None,
                    frozen_layers=max(1, layers // 4) if finetune == "frozen" else 0,
                    # drawn only when there is a choice, so the grids without offload sample as before
                    offload_optimizer=(rng.choice(self.offload_optimizers) if len(self.offload_optimizers) > 1
                                       else self.offload_optimizers[0]),
                ))
                if out[-1].optimizer == "adafactor" and sharding not in ("none", "zero1"):
                    # torch's Adafactor cannot step FSDP2 DTensors (see training/collect.py)
                    out[-1] = replace(out[-1], optimizer="adamw_foreach")
        seen: set[Family] = set()
        unique = [f for f in out if not (f in seen or seen.add(f))]
        return self._order(unique, rng)

    def _order(self, fams: list[Family], rng: random.Random) -> list[Family]:
        """Order so that a sweep stopped early is still useful: the fixed families, then two rounds
        of one family per model (cheapest model first), then the rest by tracing cost (layers)."""
        from data import catalog

        layers = {m: catalog.spec(m).num_layers for m in {f.model for f in fams}}
        fixed = [f for f in fams if f in set(self.fixed)]
        rest = [f for f in fams if f not in set(self.fixed)]
        rng.shuffle(rest)
        first: list[Family] = []
        for _round in range(2):
            for m in sorted(layers, key=lambda m: (layers[m], m)):
                pick = next((f for f in rest if f.model == m and f not in first), None)
                if pick is not None:
                    first.append(pick)
        taken = set(first)
        tail = sorted((f for f in rest if f not in taken), key=lambda f: layers[f.model])  # stable: keeps shuffle
        return fixed + first + tail


def _acceptance_families() -> list[Family]:
    """Families the dataset tests rely on (k = 0..L on each)."""
    fams = [Family("opt-1.3b", 4, 64, precision="amp_fp16")]
    for seq in (512, 1024, 2048, 4096):
        for mb in (1, 2, 4):
            fams.append(Family("llama-3.2-1b", mb, seq))
    return fams


GRIDS: dict[str, Any] = {
    "smoke": lambda: SweepGrid(models=["gpt2"], families_per_model=2, seq_lens=[128, 256], micro_batches=[1, 2],
                               k_points=3, shardings=[("none", [1]), ("fsdp_full_shard", [2])],
                               sharding_weights=[1, 1]),
    "small": lambda: SweepGrid(models=["gpt2", "qwen2.5-0.5b"], families_per_model=3, seq_lens=[128, 512],
                               micro_batches=[1, 2], k_points=4),
    "default": lambda: SweepGrid(models=_catalog_names(), fixed=_acceptance_families()),
    # optimizer CPU offload (ZeRO-Offload through training.collect.HostOffloadOptimizer): device and host bytes
    "offload": lambda: SweepGrid(models=["gpt2", "qwen2.5-0.5b", "llama-3.2-1b"], families_per_model=4,
                                 mid_families_per_model=4, seq_lens=[128, 512, 1024], micro_batches=[1, 2],
                                 k_points=4, offload_optimizers=["cpu"],
                                 shardings=[("none", [1]), ("zero2", [2, 4]), ("fsdp_full_shard", [2, 8])],
                                 sharding_weights=[3, 1, 1], finetune_weights=[3, 1, 0]),
}


class JsonlStore:
    """An append-only JSON-lines file of :class:`memfit.schema.TelemetryRecord` (one per line), with the two
    methods :func:`run_sweep` uses: the lead merges such files (``data/telemetry/incoming/*.jsonl``) into the
    shipped dataset. A record whose id is in the file already is a duplicate and is not written again."""

    def __init__(self, path) -> None:
        from pathlib import Path

        self.path = Path(path)

    def record_ids(self) -> set[str]:
        if not self.path.exists():
            return set()
        return {json.loads(line)["record_id"] for line in self.path.read_text().splitlines() if line.strip()}

    def add(self, records):
        from data.store import IngestReport
        from memfit.schema import TelemetryRecord

        have, report = self.record_ids(), IngestReport()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            for i, r in enumerate(records):
                try:
                    rec = r if isinstance(r, TelemetryRecord) else TelemetryRecord.model_validate(r)
                except ValueError as err:
                    report.rejected.append({"index": i, "record_id": (r or {}).get("record_id"), "reason": str(err)})
                    continue
                if rec.record_id in have:
                    report.duplicates.append(rec.record_id)
                    continue
                fh.write(rec.model_dump_json() + "\n")
                have.add(rec.record_id)
                report.stored.append(rec.record_id)
        return report

    def count(self) -> int:
        return len(self.record_ids())


def _catalog_names() -> list[str]:
    from data import catalog

    return [n for n in catalog.names() if catalog.spec(n).num_experts is None]  # MoE: see README


# -- execution ------------------------------------------------------------------------------------
def _run_family(args: tuple[Family, list[int], str]) -> tuple[Family, list[dict[str, Any]], str | None, float]:
    fam, ks, device = args
    from data import catalog
    from training.collect import measure_family

    t0 = time.perf_counter()
    try:
        plans = [list(range(k)) for k in ks]
        recs = []
        for k, rec in zip(ks, measure_family(catalog.get(fam.model)["hf_config"], fam.training(), plans,
                                             model_name=fam.model, device=device, steps=1, prime=True)):
            recs.append(rec.model_copy(update={"record_id": fam.record_id(k, device)}).model_dump(mode="json"))
        return fam, recs, None, time.perf_counter() - t0
    except Exception as err:  # a failed family is reported, never silently dropped
        return fam, [], f"{type(err).__name__}: {err}"[:500], time.perf_counter() - t0


def run_sweep(families: list[Family], *, store, device: str = "fake", workers: int = 1, k_points: int = 13,
              progress: bool = True) -> dict[str, Any]:
    """Measure all families not yet in ``store``; returns counts and failures."""
    from tqdm import tqdm

    from data import catalog

    have = store.record_ids()
    todo = []
    for fam in families:
        ks = k_values(catalog.spec(fam.model).num_layers, k_points)
        if any(fam.record_id(k, device) not in have for k in ks):
            todo.append((fam, ks, device))
    summary: dict[str, Any] = {"families": len(families), "to_run": len(todo), "stored": 0, "duplicates": 0,
                               "rejected": [], "failed": []}
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), unit="family", disable=not progress, file=sys.stderr)
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(workers, maxtasksperchild=20) if workers > 1 else None
    results = pool.imap_unordered(_run_family, todo) if pool else map(_run_family, todo)
    try:
        for fam, recs, err, _secs in results:
            if err:
                summary["failed"].append({"family": asdict(fam), "error": err})
                bar.write(f"failed: {fam} -> {err[:300]}")
            else:
                rep = store.add(recs)
                summary["stored"] += len(rep.stored)
                summary["duplicates"] += len(rep.duplicates)
                summary["rejected"] += rep.rejected
            bar.update(1)
            bar.set_postfix(rows=summary["stored"], failed=len(summary["failed"]))
    finally:
        bar.close()
        if pool:
            pool.terminate()
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="small", help="embedded grid (default: small)")
    p.add_argument("--models", help="comma-separated catalog names (overrides the grid's models)")
    p.add_argument("--micro-batches", type=_ints)
    p.add_argument("--seq-lens", type=_ints)
    p.add_argument("--families-per-model", type=int)
    p.add_argument("--k-points", type=int, help="max k values per family (0..L evenly spaced)")
    p.add_argument("--max-families", type=int, help="stop after this many families")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", choices=["fake", "cpu", "cuda"], default="fake")
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default sqlite:///data/telemetry.db)")
    p.add_argument("--jsonl", help="append the records to this JSON-lines file instead of a database (resumable)")
    p.add_argument("--export", help="write the whole store to this .parquet/.csv afterwards")
    p.add_argument("--seed", type=int)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)

    from data import catalog
    from data.store import TelemetryStore

    grid = GRIDS[a.grid]()
    for attr in ("micro_batches", "seq_lens", "families_per_model", "k_points", "seed"):
        if getattr(a, attr) is not None:
            setattr(grid, attr, getattr(a, attr))
    if a.models:
        grid.models = [m.strip() for m in a.models.split(",") if m.strip()]
        grid.fixed = []
    try:
        for m in grid.models:
            catalog.get(m)
        families = grid.families()
    except (KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if a.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    if a.jsonl and (a.export or a.db):
        print("error: --jsonl writes its own file: give it without --db/--export", file=sys.stderr)
        return 2
    if a.max_families:
        families = families[: a.max_families]
    store = JsonlStore(a.jsonl) if a.jsonl else TelemetryStore(a.db)
    summary = run_sweep(families, store=store, device=a.device, workers=a.workers, k_points=grid.k_points,
                        progress=not a.quiet)
    summary["rows_in_store"] = store.count()
    if a.export:
        summary["exported"] = store.export(a.export)
    print(json.dumps({**summary, "failed": len(summary["failed"]), "rejected": len(summary["rejected"])}))
    for f in summary["failed"]:
        print(f"failed: {f['family']['model']} {f['error']}", file=sys.stderr)
    for r in summary["rejected"]:
        print(f"rejected: {r}", file=sys.stderr)
    return 1 if summary["failed"] or summary["rejected"] else 0


if __name__ == "__main__":
    sys.exit(main())
