"""Collection sweep: measure a grid of configuration families over k and write them to the store.

A *family* is one (model, micro-batch, sequence length, precision, optimizer, sharding, attention,
fine-tune, further training fields) combination; each family is measured at several k (first-k "block"
checkpointing) with one model build (:func:`measure_family_records`, the one path both engines run).
Record ids are derived from the family and k, so a rerun skips what the store already holds (resumable)
and never duplicates rows.

Engines: ``local`` (default, a ``multiprocessing`` pool of ``--workers`` processes) and ``dask``
(``distributed``: a running scheduler at ``--scheduler ADDR``, else a ``LocalCluster`` of ``--workers``
single-threaded worker processes). Either way the driver writes each family's records to the store as
the family completes, and ``--jsonl PATH`` mirrors them to a JSON-lines file; ``--budget-s`` stops
cleanly (families still running are dropped, to be measured by the next run).

    python -m training.sweep --grid small --workers 2          # the test-suite sweep, < 1 min
    python -m training.sweep --grid default --workers 2        # the shipped dataset
    python -m training.sweep --models gpt2,llama-3.2-1b --seq-lens 512,2048 --micro-batches 1,4
    python -m training.sweep --spec training/sweeps/grow-15k.toml --plan     # what a spec would run
    python -m training.sweep --spec training/sweeps/grow-15k.toml --engine dask --workers 15 \
        --budget-s 420 --jsonl out/records.jsonl --db sqlite:///out/telemetry.db
    python -m training.sweep --grid offload --jsonl data/telemetry/incoming/offload.jsonl   # CPU offload rows

Exit codes: 0 all families measured (or the budget ran out with no failure), 1 some families failed
(listed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from memfit.schema import Attention, FineTune, Optimizer, Precision, Sharding, TrainingConfig
from model.job import resolve_architecture

SCHEMA_TAG = "v3"
ENGINES = ("local", "dask")


@dataclass(frozen=True)
class Family:
    """One configuration family: everything but k.

    ``extra`` holds further :class:`TrainingConfig` fields as sorted ``(name, value)`` pairs (the axes
    added after the first dataset: quantization, offload, parallel sizes, MoE settings). A family
    without extras keeps the record ids it always had.
    """

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
    optimizer_in_backward: bool = False
    quantization: str = "none"
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    offload_optimizer: str = "none"
    gradient_accumulation_steps: int = 1
    extra: tuple[tuple[str, Any], ...] = ()

    def training(self) -> TrainingConfig:
        """The family's :class:`TrainingConfig` (k = 0).

        Raises:
            pydantic.ValidationError: a field or value the schema does not accept.
        """
        d = asdict(self)
        d.pop("model")
        d.pop("extra")
        return TrainingConfig(**{**d, **dict(self.extra)})

    def record_id(self, k: int, device: str) -> str:
        # fields added after records were shipped join the id only when set, so existing ids stay valid
        d = {k_: v for k_, v in asdict(self).items() if _ADDED_FIELDS.get(k_, object()) != v}
        if not self.extra:
            d.pop("extra")  # ids of families without extras are those of the first dataset
        key = json.dumps([SCHEMA_TAG, device, d, k], sort_keys=True)
        return "c" + hashlib.sha256(key.encode()).hexdigest()[:31]


#: Family fields added later, with their defaults
_ADDED_FIELDS: dict[str, Any] = {
    "optimizer_in_backward": False,
    "quantization": "none",
    "tensor_parallel_size": 1,
    "sequence_parallel": False,
    "offload_optimizer": "none",
    "gradient_accumulation_steps": 1,
}


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
        extras: further :class:`TrainingConfig` fields, each a list of values drawn uniformly per family
            (a value equal to the schema's default is left out of the family, so ids stay canonical).
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
    shardings: list[tuple[str, list[int]]] = field(
        default_factory=lambda: [
            ("none", [1]),
            ("fsdp_full_shard", [2, 4, 8, 16, 32, 64]),
            ("zero3", [8, 64]),
            ("fsdp_shard_grad_op", [2, 8, 32]),
            ("zero2", [4, 16]),
            ("zero1", [2, 8, 64]),
        ]
    )
    sharding_weights: list[float] = field(default_factory=lambda: [8, 3, 1, 1, 1, 1])
    attentions: list[str] = field(default_factory=lambda: ["sdpa", "eager"])
    attention_weights: list[float] = field(default_factory=lambda: [4, 1])
    lora_ranks: list[int] = field(default_factory=lambda: [8, 16, 64])
    finetune_weights: list[float] = field(default_factory=lambda: [7, 2, 1])
    extras: dict[str, list[Any]] = field(default_factory=dict)
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
        from memfit.hf import max_seq_len

        rng = random.Random(self.seed)
        defaults = {name: info.default for name, info in TrainingConfig.model_fields.items()}
        out: list[Family] = list(self.fixed)
        for name in self.models:
            layers = resolve_architecture(name).num_layers
            n = (
                self.families_per_model
                if layers <= self.small_model_layers
                else self.mid_families_per_model
                if layers <= self.big_model_layers
                else self.big_families_per_model
            )
            for _ in range(n):
                sharding, dps = rng.choices(self.shardings, self.sharding_weights)[0]
                finetune = rng.choices(["full", "lora", "frozen"], self.finetune_weights)[0]
                seq = rng.choice(self.seq_lens)
                limit = max_seq_len(catalog.get(name)["hf_config"])
                if limit is not None and seq > limit:  # learned position embeddings end there
                    seq = max([x for x in self.seq_lens if x <= limit], default=limit)
                # eager attention materialises b*a*s^2 scores: keep it to the sequence lengths people use it at
                attention = rng.choices(self.attentions, self.attention_weights)[0] if seq <= 4096 else "sdpa"
                drawn = {k: rng.choice(v) for k, v in sorted(self.extras.items())}
                out.append(
                    Family(
                        model=name,
                        micro_batch_size=rng.choice(self.micro_batches),
                        seq_len=seq,
                        precision=rng.choices(self.precisions, self.precision_weights)[0],
                        optimizer=rng.choices(self.optimizers, self.optimizer_weights)[0],
                        sharding=sharding,
                        data_parallel_size=rng.choice(dps),
                        attention=attention,
                        finetune=finetune,
                        lora_rank=rng.choice(self.lora_ranks) if finetune == "lora" else None,
                        frozen_layers=max(1, layers // 4) if finetune == "frozen" else 0,
                        extra=tuple((k, v) for k, v in drawn.items() if k not in defaults or v != defaults[k]),
                        # drawn only when there is a choice, so the grids without offload sample as before
                        offload_optimizer=(
                            rng.choice(self.offload_optimizers)
                            if len(self.offload_optimizers) > 1
                            else self.offload_optimizers[0]
                        ),
                    )
                )
                if out[-1].optimizer == "adafactor" and sharding not in ("none", "zero1"):
                    # torch's Adafactor cannot step FSDP2 DTensors (see tracer/collect.py)
                    out[-1] = replace(out[-1], optimizer="adamw_foreach")
        seen: set[Family] = set()
        unique = [f for f in out if not (f in seen or seen.add(f))]
        return self._order(unique, rng)

    def _order(self, fams: list[Family], rng: random.Random) -> list[Family]:
        """Order so that a sweep stopped early is still useful: the fixed families, then two rounds
        of one family per model (cheapest model first), then the rest by tracing cost (layers)."""
        return order_for_early_stop(fams, set(self.fixed), rng)


def order_for_early_stop(
    fams: list[Family], fixed: set[Family], rng: random.Random, coverage_rounds: int = 2
) -> list[Family]:
    """``fixed`` families first, then ``coverage_rounds`` rounds of one family per model (cheapest model first), then
    the rest by tracing cost (layers; shuffled within equal cost), so a sweep stopped on a budget has
    covered every model and measured as many rows as the time allowed."""

    layers = {m: resolve_architecture(m).num_layers for m in {f.model for f in fams}}
    first_fixed = [f for f in fams if f in fixed]
    rest = [f for f in fams if f not in fixed]
    rng.shuffle(rest)
    first: list[Family] = []
    for _round in range(coverage_rounds):
        for m in sorted(layers, key=lambda m: (layers[m], m)):
            pick = next((f for f in rest if f.model == m and f not in first), None)
            if pick is not None:
                first.append(pick)
    taken = set(first)
    tail = sorted((f for f in rest if f not in taken), key=lambda f: layers[f.model])  # stable: keeps shuffle
    return first_fixed + first + tail


def _acceptance_families() -> list[Family]:
    """Families the dataset tests rely on (k = 0..L on each)."""
    fams = [Family("opt-1.3b", 4, 64, precision="amp_fp16")]
    for seq in (512, 1024, 2048, 4096):
        for mb in (1, 2, 4):
            fams.append(Family("llama-3.2-1b", mb, seq))
    return fams


def optim_qlora_families() -> list[Family]:
    """Issue 9 items 1-2 on small catalog models: bitsandbytes AdamW8bit / PagedAdamW8bit / Lion, the step in
    backward, and QLoRA bases (nf4, nf4 + double quantization, int8) under LoRA, in bf16 and amp_bf16."""
    out = []
    for model in ("pythia-160m", "gpt2"):
        for i, (opt, fused) in enumerate(
            [
                ("adamw_8bit", False),
                ("paged_adamw_8bit", False),
                ("lion", False),
                ("adamw_8bit", True),
                ("adamw_foreach", True),
                ("paged_adamw_8bit", True),
            ]
        ):
            precision = ("bf16", "amp_bf16")[i % 2]
            out.append(
                Family(
                    model=model,
                    micro_batch_size=2,
                    seq_len=512,
                    precision=precision,
                    optimizer=opt,
                    optimizer_in_backward=fused,
                )
            )
    # GPT-2's attention and MLP are Conv1D, which bitsandbytes does not quantize
    for model, settings in (("pythia-160m", (("bf16", 8), ("amp_bf16", 16))), ("qwen2.5-0.5b", (("bf16", 8),))):
        for i, q in enumerate(("nf4", "nf4_double_quant", "int8")):
            for precision, rank in settings:
                out.append(
                    Family(
                        model=model,
                        micro_batch_size=1 + i % 2,
                        seq_len=512,
                        precision=precision,
                        finetune="lora",
                        lora_rank=rank,
                        quantization=q,
                    )
                )
    return out


def _parallel_families() -> list[Family]:
    """Tensor-parallel families (+ sequence parallel) on the small Llama-style catalog models: the
    ``parallel`` grid, measured with DTensor over a fake process group."""
    fams = []
    for model, tps in (
        ("llama-3.2-1b", (2, 4, 8)),
        ("tinyllama-1.1b", (2, 4)),
        ("qwen2.5-0.5b", (2,)),
        ("smollm2-135m", (3,)),
    ):
        for tp in tps:
            for sp in (False, True):
                for mb, seq in ((1, 2048), (2, 512)):
                    fams.append(Family(model, mb, seq, tensor_parallel_size=tp, sequence_parallel=sp))
    # one family of each model first, so that a run stopped early still covers every model
    firsts = [next(f for f in fams if f.model == m) for m in dict.fromkeys(f.model for f in fams)]
    return firsts + [f for f in fams if f not in firsts]


GRIDS: dict[str, Any] = {
    "optim_qlora": lambda: SweepGrid(models=[], fixed=optim_qlora_families(), k_points=3),
    "parallel": lambda: SweepGrid(models=[], fixed=_parallel_families(), k_points=5),
    "smoke": lambda: SweepGrid(
        models=["gpt2"],
        families_per_model=2,
        seq_lens=[128, 256],
        micro_batches=[1, 2],
        k_points=3,
        shardings=[("none", [1]), ("fsdp_full_shard", [2])],
        sharding_weights=[1, 1],
    ),
    "small": lambda: SweepGrid(
        models=["gpt2", "qwen2.5-0.5b"], families_per_model=3, seq_lens=[128, 512], micro_batches=[1, 2], k_points=4
    ),
    "default": lambda: SweepGrid(models=_catalog_names(), fixed=_acceptance_families()),
    # optimizer CPU offload (ZeRO-Offload through tracer.collect.HostOffloadOptimizer): device and host bytes
    "offload": lambda: SweepGrid(
        models=["gpt2", "qwen2.5-0.5b", "llama-3.2-1b"],
        families_per_model=4,
        mid_families_per_model=4,
        seq_lens=[128, 512, 1024],
        micro_batches=[1, 2],
        k_points=4,
        offload_optimizers=["cpu"],
        shardings=[("none", [1]), ("zero2", [2, 4]), ("fsdp_full_shard", [2, 8])],
        sharding_weights=[3, 1, 1],
        finetune_weights=[3, 1, 0],
    ),
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

    return [n for n in catalog.names() if resolve_architecture(n).spec.num_experts is None]  # MoE: see README


# -- sweep specifications (TOML) ------------------------------------------------------------------
_GRID_KEYS = {f for f in SweepGrid.__dataclass_fields__ if f not in ("models", "fixed", "k_points", "seed")}


@dataclass
class SweepPlan:
    """Families of a specification file, and what its parts left out.

    Attributes:
        families: ordered for an early stop (:func:`order_for_early_stop`).
        k_points: max k values per family.
        parts: per part ``{"name", "families", "rows", "skipped": reason or None, "dropped": n, "why": reason}``.
        row_s_base / row_s_per_layer: the spec's per-row time estimate, seconds on one worker
            (``row_s_base + row_s_per_layer * layers``).
    """

    families: list[Family]
    k_points: int
    parts: list[dict[str, Any]]
    row_s_base: float = 0.0
    row_s_per_layer: float = 0.0

    def rows(self) -> int:

        return sum(len(k_values(resolve_architecture(f.model).num_layers, self.k_points)) for f in self.families)

    def rows_within(self, worker_s: float) -> int:
        """Rows measured, in order, before ``worker_s`` seconds of worker time are spent (the estimate)."""

        rows, spent = 0, 0.0
        for f in self.families:
            layers = resolve_architecture(f.model).num_layers
            n = len(k_values(layers, self.k_points))
            spent += n * (self.row_s_base + self.row_s_per_layer * layers)
            if spent > worker_s:
                break
            rows += n
        return rows

    def worker_seconds(self) -> float:
        """Estimated measuring time on one worker (sum over families of rows x per-row time)."""

        total = 0.0
        for f in self.families:
            layers = resolve_architecture(f.model).num_layers
            total += len(k_values(layers, self.k_points)) * (self.row_s_base + self.row_s_per_layer * layers)
        return total


def _expand_models(names: list[str]) -> list[str]:
    """Catalog names; ``@dense`` and ``@moe`` stand for every dense / MoE catalog model.

    Raises:
        memfit.errors.UnknownModel: a name the catalog does not hold.
    """
    from data import catalog

    out: list[str] = []
    for n in names:
        if n in ("@dense", "@moe"):
            moe = n == "@moe"
            out += [m for m in catalog.names() if (resolve_architecture(m).spec.num_experts is not None) == moe]
        else:
            out.append(catalog.get(n)["name"])
    return list(dict.fromkeys(out))


def load_spec(path: str | Path) -> SweepPlan:
    """Read a sweep specification (TOML; see ``training/sweeps/grow-15k.toml``).

    ``[sweep]`` holds ``seed``, ``k_points``, ``coverage_rounds`` (see :func:`order_for_early_stop`) and the
    per-row time estimate; each ``[[part]]`` is a
    :class:`SweepGrid` (its field names; ``shardings`` as ``[[name, [dp sizes]], ...]``) with a ``name``,
    ``models`` (catalog names, ``@dense``, ``@moe``), optional ``extras`` (further TrainingConfig
    fields) and optional ``requires_fields``. A part runs only where the schema supports it: a part
    whose ``requires_fields`` or ``extras`` name a field :class:`TrainingConfig` lacks is skipped, and a
    family the schema refuses (an optimizer value it does not know) is dropped; both are reported.

    Raises:
        ValueError: unknown keys, or a bad TOML file (the message names the part and key).
        memfit.errors.UnknownModel: a model the catalog does not hold.
    """
    import tomllib

    from pydantic import ValidationError

    spec = tomllib.loads(Path(path).read_text())
    head = spec.get("sweep", {})
    unknown = set(head) - {
        "seed",
        "k_points",
        "coverage_rounds",
        "row_s_base",
        "row_s_per_layer",
        "description",
        "target_rows",
        "target_architectures",
    }
    if unknown:
        raise ValueError(f"[sweep]: unknown keys {sorted(unknown)}")
    seed, k_points = int(head.get("seed", 0)), int(head.get("k_points", 13))
    fields = set(TrainingConfig.model_fields)
    fams: list[Family] = []
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(spec.get("part", [])):
        name = part.get("name", f"part {i}")
        extra_keys = set(part) - _GRID_KEYS - {"name", "models", "requires_fields", "description"}
        if extra_keys:
            raise ValueError(
                f"part {name!r}: unknown keys {sorted(extra_keys)}; allowed: "
                f"{sorted(_GRID_KEYS | {'name', 'models', 'requires_fields', 'description'})}"
            )
        report: dict[str, Any] = {"name": name, "families": 0, "rows": 0, "skipped": None, "dropped": 0, "why": None}
        parts.append(report)
        missing = sorted((set(part.get("requires_fields", [])) | set(part.get("extras", {}))) - fields)
        if missing:
            report["skipped"] = f"the schema has no field {missing} yet"
            continue
        kw = {k: v for k, v in part.items() if k in _GRID_KEYS}
        if "shardings" in kw:
            kw["shardings"] = [(s, list(dps)) for s, dps in kw["shardings"]]
        grid = SweepGrid(models=_expand_models(part["models"]), seed=seed + i, k_points=k_points, **kw)
        for fam in grid.families():
            try:
                fam.training()
            except ValidationError as err:
                report["dropped"] += 1
                report["why"] = (
                    report["why"]
                    or "; ".join(
                        ": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"]))) for e in err.errors()
                    )[:300]
                )
                continue
            fams.append(fam)
            report["families"] += 1
            report["rows"] += len(k_values(resolve_architecture(fam.model).num_layers, k_points))
        if report["families"] == 0 and report["dropped"]:
            report["skipped"] = f"the schema refuses every family: {report['why']}"
    unique = list(dict.fromkeys(fams))
    ordered = order_for_early_stop(unique, set(), random.Random(seed), int(head.get("coverage_rounds", 2)))
    return SweepPlan(
        ordered, k_points, parts, float(head.get("row_s_base", 0.0)), float(head.get("row_s_per_layer", 0.0))
    )


# -- execution ------------------------------------------------------------------------------------
@dataclass
class FamilyResult:
    """Outcome of measuring one family: its records (JSON dicts), or the error; wall seconds."""

    family: Family
    records: list[dict[str, Any]]
    error: str | None
    seconds: float


def measure_family_records(fam: Family, ks: list[int], device: str = "fake") -> FamilyResult:
    """Measure ``fam`` at each k in ``ks`` (first-k checkpointing) with one model build.

    The one "measure a family" path: the local pool and the Dask workers both run it. Records carry
    :meth:`Family.record_id` ids. A failure is returned as ``error`` (type and message), never raised,
    so one family cannot stop a sweep and nothing fails silently.
    """
    from data import catalog
    from tracer.collect import measure_family

    t0 = time.perf_counter()
    try:
        plans = [list(range(k)) for k in ks]
        recs = []
        for k, rec in zip(
            ks,
            measure_family(
                catalog.get(fam.model)["hf_config"],
                fam.training(),
                plans,
                model_name=fam.model,
                device=device,
                steps=1,
                prime=True,
            ),
        ):
            recs.append(rec.model_copy(update={"record_id": fam.record_id(k, device)}).model_dump(mode="json"))
        return FamilyResult(fam, recs, None, time.perf_counter() - t0)
    except Exception as err:  # noqa: BLE001 - a failed family is reported, never silently dropped
        return FamilyResult(fam, [], f"{type(err).__name__}: {err}"[:500], time.perf_counter() - t0)


def _measure_packed(args: tuple[Family, list[int], str]) -> FamilyResult:
    return measure_family_records(*args)


def _local_results(
    todo: list[tuple[Family, list[int], str]], workers: int, deadline: float | None
) -> Iterator[FamilyResult]:
    """Results from a spawn-context process pool (or in-process with one worker), as they complete."""
    if workers <= 1:
        for args in todo:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            yield _measure_packed(args)
        return
    pool = mp.get_context("spawn").Pool(workers, maxtasksperchild=20)
    try:
        it = pool.imap_unordered(_measure_packed, todo)
        for _ in todo:
            timeout = None if deadline is None else deadline - time.perf_counter()
            if timeout is not None and timeout <= 0:
                return
            try:
                yield it.next(timeout)
            except mp.TimeoutError:
                return
    finally:
        pool.terminate()


_DASK_BATCH = 32


def _dask_results(
    todo: list[tuple[Family, list[int], str]],
    workers: int,
    scheduler: str | None,
    deadline: float | None,
    drain_s: float = 0.0,
) -> Iterator[FamilyResult]:
    """Results from Dask ``distributed`` workers, as they complete.

    With ``scheduler`` (``tcp://host:8786``) the sweep uses that cluster's workers; without it a
    ``LocalCluster`` of ``workers`` processes with one thread each (the collector patches process-wide
    state: the default dtype, SDPA, the fake process group, so two measurements must never share a
    process). Tasks keep the sweep's order as their priority, batch by batch. At ``deadline`` the families
    not yet on a worker are cancelled and those on a worker get ``drain_s`` more seconds to finish. Leaving
    (budget, Ctrl-C) cancels what has not completed and closes the client and any cluster this function
    started.
    """
    from distributed import Client, LocalCluster, wait

    cluster = None
    if scheduler:
        client = Client(scheduler)
    else:
        # memory_limit=0: no nanny memory management (fake-tensor traces allocate no tensor memory, and a
        # paused or restarted worker would only lose families)
        cluster = LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, memory_limit=0, dashboard_address=None
        )
        client = Client(cluster)
    pending: set = set()
    try:
        # one graph per batch (a submit per family costs the scheduler one graph update each); earlier
        # batches get the higher priority, so the sweep's order holds batch by batch
        futures = []
        for start in range(0, len(todo), _DASK_BATCH):
            batch = todo[start : start + _DASK_BATCH]
            futures += client.map(
                measure_family_records,
                [t[0] for t in batch],
                [t[1] for t in batch],
                [t[2] for t in batch],
                pure=False,
                priority=len(todo) - start,
            )
        family_of = {fut.key: fam for fut, (fam, _ks, _dev) in zip(futures, todo)}
        pending = set(futures)
        draining = False
        while pending:
            timeout = None if deadline is None else deadline - time.perf_counter()
            if timeout is not None and timeout <= 0:
                if draining or drain_s <= 0:
                    return
                on_workers = {key for keys in client.processing().values() for key in keys}
                queued = [f for f in pending if f.key not in on_workers]
                client.cancel(queued)
                pending -= set(queued)
                print(
                    f"budget spent: {len(queued)} families cancelled, {len(pending)} running get {drain_s:g} s",
                    file=sys.stderr,
                )
                draining, deadline = True, time.perf_counter() + drain_s
                continue
            try:
                done, pending = wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")
            except TimeoutError:
                continue  # the deadline: cancel or drain at the top of the loop
            for fut in done:
                if fut.status == "finished":
                    yield fut.result()
                else:  # the task itself never raises: this is a lost worker (KilledWorker) or a cancellation
                    err = fut.exception()
                    yield FamilyResult(family_of[fut.key], [], f"{type(err).__name__}: {err}"[:500], 0.0)
                fut.release()
    finally:
        if pending:
            client.cancel(list(pending))
        client.close()
        if cluster is not None:
            cluster.close()


def record_ids_in(path: str | Path) -> set[str]:
    """Record ids of a telemetry file: ``.parquet`` / ``.csv`` (column ``record_id``) or ``.jsonl``.

    Raises:
        ValueError: another suffix. OSError: the file cannot be read.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        return {json.loads(line)["record_id"] for line in _complete_lines(path.read_text()) if line.strip()}
    import pandas as pd

    if path.suffix == ".parquet":
        return set(pd.read_parquet(path, columns=["record_id"])["record_id"])
    if path.suffix == ".csv":
        return set(pd.read_csv(path, usecols=["record_id"])["record_id"])
    raise ValueError(f"--skip-ids-in: {path.name!r} must end in .parquet, .csv or .jsonl")


class JsonlSink:
    """Append-only JSON-lines copy of the sweep's records (one :class:`TelemetryRecord` JSON per line).

    The ids already in the file count as done, so a sweep that writes here resumes where it stopped even
    with a fresh store; a record is appended once. Each family's lines go out in one write as it completes.
    A last line cut short (a run killed while writing) is cut off when the file is opened: its family is
    not complete in the file, so it is measured again.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.ids: set[str] = set()
        if self.path.exists():
            text = self.path.read_text()
            lines = _complete_lines(text)
            kept = "".join(line + "\n" for line in lines)
            if len(kept) != len(text):
                print(f"{self.path}: cut off an incomplete last line ({len(text) - len(kept)} bytes)", file=sys.stderr)
                self.path.write_text(kept)
            self.ids = {json.loads(line)["record_id"] for line in lines if line.strip()}

    def write(self, records: list[dict[str, Any]]) -> int:
        new = [r for r in records if r["record_id"] not in self.ids]
        with self.path.open("a") as fh:
            fh.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in new))
        self.ids.update(r["record_id"] for r in new)
        return len(new)


def _complete_lines(text: str) -> list[str]:
    """Lines of a JSON-lines text, without a last line that has no newline yet (being written, or cut)."""
    return text.split("\n")[:-1]


def run_sweep(
    families: list[Family],
    *,
    store,
    device: str = "fake",
    workers: int = 1,
    k_points: int = 13,
    progress: bool = True,
    engine: str = "local",
    scheduler: str | None = None,
    budget_s: float | None = None,
    drain_s: float = 0.0,
    jsonl: JsonlSink | None = None,
    skip_ids: set[str] | None = None,
) -> dict[str, Any]:
    """Measure all families not yet in ``store`` (nor in ``jsonl``); returns counts and failures.

    Args:
        engine: ``local`` (process pool) or ``dask`` (see :func:`_dask_results`).
        scheduler: Dask scheduler address; None starts a LocalCluster of ``workers``.
        budget_s: stop after this many seconds (families not finished by then are left for a rerun).
        drain_s: after the budget, families already running get this long to finish (Dask: nothing new
            starts; the local pool simply runs ``budget_s + drain_s``).
        jsonl: also append every stored (or already stored) record there.
        skip_ids: record ids measured elsewhere (the shipped dataset): families holding all of them are skipped.

    Returns:
        ``{"families", "to_run", "done", "stored", "duplicates", "rejected", "quarantined", "failed",
        "stopped_on_budget", "seconds", "family_seconds"}``.

    Raises:
        ValueError: unknown engine.
    """
    from tqdm import tqdm

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    have = store.record_ids() | (jsonl.ids if jsonl else set()) | (skip_ids or set())
    todo = []
    for fam in families:
        ks = k_values(resolve_architecture(fam.model).num_layers, k_points)
        if any(fam.record_id(k, device) not in have for k in ks):
            todo.append((fam, ks, device))
    summary: dict[str, Any] = {
        "families": len(families),
        "to_run": len(todo),
        "done": 0,
        "stored": 0,
        "duplicates": 0,
        "rejected": [],
        "quarantined": [],
        "failed": [],
        "stopped_on_budget": False,
        "family_seconds": 0.0,
    }
    t0 = time.perf_counter()
    deadline = None if budget_s is None else t0 + budget_s
    if drain_s < 0:
        raise ValueError(f"drain_s must be >= 0, got {drain_s}")
    bar = tqdm(total=len(todo), unit="family", disable=not progress, file=sys.stderr)
    results = (
        iter(())
        if not todo  # nothing to do: start no pool or cluster
        else _dask_results(todo, workers, scheduler, deadline, drain_s)
        if engine == "dask"
        else _local_results(todo, workers, None if deadline is None else deadline + drain_s)
    )
    try:
        for res in results:
            summary["done"] += 1
            summary["family_seconds"] += res.seconds
            if res.error:
                summary["failed"].append({"family": asdict(res.family), "error": res.error})
                bar.write(f"failed: {res.family} -> {res.error[:300]}")
            else:
                rep = store.add(res.records)
                summary["stored"] += len(rep.stored)
                summary["duplicates"] += len(rep.duplicates)
                summary["rejected"] += rep.rejected
                summary["quarantined"] += rep.quarantined
                if jsonl is not None:
                    kept = set(rep.stored) | set(rep.duplicates)
                    jsonl.write([r for r in res.records if r["record_id"] in kept])
            bar.update(1)
            bar.set_postfix(rows=summary["stored"], failed=len(summary["failed"]))
    finally:
        if hasattr(results, "close"):
            results.close()  # a generator: terminates the pool / cancels the futures and closes the cluster
        bar.close()
    summary["stopped_on_budget"] = summary["done"] < len(todo)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["family_seconds"] = round(summary["family_seconds"], 1)
    return summary


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _print_plan(plan: SweepPlan, workers: int, skip_ids: set[str], budget_s: float | None) -> None:

    for p in plan.parts:
        state = f"skipped: {p['skipped']}" if p["skipped"] else f"{p['families']} families, {p['rows']} rows"
        dropped = f" ({p['dropped']} dropped: {p['why']})" if p["dropped"] and not p["skipped"] else ""
        print(f"part {p['name']}: {state}{dropped}")
    models = {f.model for f in plan.families}
    moe = sum(resolve_architecture(m).spec.num_experts is not None for m in models)
    left = SweepPlan(
        [
            f
            for f in plan.families
            if any(
                f.record_id(k, "fake") not in skip_ids
                for k in k_values(resolve_architecture(f.model).num_layers, plan.k_points)
            )
        ],
        plan.k_points,
        plan.parts,
        plan.row_s_base,
        plan.row_s_per_layer,
    )
    secs = left.worker_seconds()
    print(
        json.dumps(
            {
                "families": len(plan.families),
                "rows": plan.rows(),
                "architectures": len(models),
                "moe_architectures": moe,
                "families_to_run": len(left.families),
                "rows_to_run": left.rows(),
                "estimated_worker_s": round(secs),
                f"estimated_wall_s_on_{workers}_workers": round(secs / max(workers, 1)),
                **({"estimated_rows_in_budget": left.rows_within(budget_s * workers)} if budget_s else {}),
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="small", help="embedded grid (default: small)")
    p.add_argument("--spec", type=Path, help="sweep specification file (TOML, see training/sweeps/); replaces --grid")
    p.add_argument("--plan", action="store_true", help="print the families' counts and time estimate, run nothing")
    p.add_argument("--models", help="comma-separated catalog names (overrides the grid's models)")
    p.add_argument("--micro-batches", type=_ints)
    p.add_argument("--seq-lens", type=_ints)
    p.add_argument("--families-per-model", type=int)
    p.add_argument("--k-points", type=int, help="max k values per family (0..L evenly spaced)")
    p.add_argument("--max-families", type=int, help="stop after this many families")
    p.add_argument("--engine", choices=ENGINES, default="local", help="local process pool (default) or Dask")
    p.add_argument("--scheduler", help="Dask scheduler address (tcp://host:8786); default: a LocalCluster")
    p.add_argument("--workers", type=int, default=1, help="pool processes, or LocalCluster workers")
    p.add_argument("--budget-s", type=float, help="stop cleanly after this many seconds (resumable)")
    p.add_argument(
        "--drain-s",
        type=float,
        default=0.0,
        help="after --budget-s, give the families already running this many seconds to finish",
    )
    p.add_argument("--device", choices=["fake", "cpu", "cuda"], default="fake")
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default sqlite:///data/telemetry.db)")
    p.add_argument("--jsonl", type=Path, help="also append the records to this JSON-lines file (resumes from it)")
    p.add_argument(
        "--skip-ids-in",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="families whose record ids are all in this .parquet/.csv/.jsonl are not measured "
        "(repeatable; e.g. the shipped dataset on a fresh machine)",
    )
    p.add_argument("--export", help="write the whole store to this .parquet/.csv afterwards")
    p.add_argument("--seed", type=int)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)

    from data import catalog
    from model.plausibility import telemetry_store

    if a.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    if a.scheduler and a.engine != "dask":
        print("error: --scheduler needs --engine dask", file=sys.stderr)
        return 2
    if a.budget_s is not None and a.budget_s <= 0:
        print("error: --budget-s must be > 0", file=sys.stderr)
        return 2
    if a.drain_s < 0 or (a.drain_s and a.budget_s is None):
        print("error: --drain-s must be >= 0 and needs --budget-s", file=sys.stderr)
        return 2
    try:
        if a.spec:
            plan = load_spec(a.spec)
            families, k_points = plan.families, plan.k_points
            if a.k_points is not None:
                print("error: --k-points is set in the spec's [sweep] table", file=sys.stderr)
                return 2
        else:
            grid = GRIDS[a.grid]()
            for attr in ("micro_batches", "seq_lens", "families_per_model", "k_points", "seed"):
                if getattr(a, attr) is not None:
                    setattr(grid, attr, getattr(a, attr))
            if a.models:
                grid.models = [m.strip() for m in a.models.split(",") if m.strip()]
                grid.fixed = []
            for m in grid.models:
                catalog.get(m)
            families, k_points = grid.families(), grid.k_points
            plan = SweepPlan(families, k_points, [])
    except (KeyError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if a.max_families:
        families = families[: a.max_families]
        plan.families = families
    try:
        skip = set().union(*(record_ids_in(path) for path in a.skip_ids_in))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if a.plan:
        _print_plan(plan, a.workers, skip, a.budget_s)
        return 0
    store = telemetry_store(a.db)
    sink = JsonlSink(a.jsonl) if a.jsonl else None
    summary = run_sweep(
        families,
        store=store,
        device=a.device,
        workers=a.workers,
        k_points=k_points,
        progress=not a.quiet,
        engine=a.engine,
        scheduler=a.scheduler,
        budget_s=a.budget_s,
        drain_s=a.drain_s,
        jsonl=sink,
        skip_ids=skip,
    )
    summary["rows_in_store"] = store.count()
    if sink is not None:
        summary["rows_in_jsonl"] = len(sink.ids)
    if a.export:
        summary["exported"] = store.export(a.export)
    counts = {k: len(summary[k]) for k in ("failed", "rejected", "quarantined")}
    print(json.dumps({**summary, **counts}))
    for f in summary["failed"]:
        print(f"failed: {f['family']['model']} {f['error']}", file=sys.stderr)
    for r in summary["rejected"] + summary["quarantined"]:
        print(f"not stored: {r}", file=sys.stderr)
    return 1 if summary["failed"] or summary["rejected"] or summary["quarantined"] else 0


if __name__ == "__main__":
    sys.exit(main())
