"""The traced answer against every shipped real-CUDA row, per family.

    python -m benchmarks.cuda_rows            # prints the table; writes benchmarks/results/cuda_rows.txt
    python -m benchmarks.cuda_rows --trace    # + traces the gap families' rows with and without CUDA semantics
    python -m benchmarks.cuda_rows --trace-terms   # traces the rows' sm90-keyed terms -> data/terms/cuda_sm90.jsonl

Rows: the ``method=cuda`` records under ``data/telemetry/gpu_validation/*/`` (``gpu_records.jsonl`` and
``catalog_records.jsonl``: ``torch.cuda.max_memory_allocated`` of one step after a warm-up step, on an H200).
Each row is sent to ``POST /predict`` (the service's router over a :class:`service.recommender.Recommender`
without a learned model, so only the traced path answers) with the row's model, training, k and its GPU as the
cluster, so the terms traced with that GPU generation's CUDA semantics answer where they differ from the CPU's
(:mod:`model.cuda_terms`). The predicted allocated bytes are the answer's ``predicted_peak_bytes`` plus the
step's cuBLAS workspaces (:func:`model.cuda_semantics.step_workspace_bytes`: 2 x 32 MiB on sm90) and the
parameters' unsplit blocks (:func:`model.recommend.parameter_block_bytes`), which the caching allocator counts and
no trace sees. ``gpu=False`` scores as before issue 26: no cluster (CPU-semantics
terms), no workspaces. Out-of-memory rows (their peak is the device capacity) are left out.

Error is ``(predicted - measured) / measured``. :data:`KNOWN_GAPS` names the rows where CUDA runs kernels or
dtypes the CPU trace does not; every other row is a same-kernel row.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ROWS_DIR = ROOT / "data" / "telemetry" / "gpu_validation"
RESULTS = ROOT / "benchmarks" / "results" / "cuda_rows.txt"
TRACE_RESULTS = ROOT / "benchmarks" / "results" / "cuda_rows_traced.txt"
ROW_FILES = ("gpu_records.jsonl", "catalog_records.jsonl")

#: (model_name, precision, attention) of families whose CUDA kernels or autocast dtypes differ from the CPU trace
KNOWN_GAPS = {
    ("falcon-7b", "bf16", "sdpa"): "falcon",
    ("gpt2", "amp_bf16", "sdpa"): "gpt2-sdpa-amp",
    ("gpt2-medium", "amp_fp16", "sdpa"): "gpt2-sdpa-amp",
    ("gpt2-large", "amp_bf16", "sdpa"): "gpt2-sdpa-amp",
    ("gpt2", "amp_bf16", "eager"): "gpt2-eager-amp",
    ("gpt2-large", "amp_bf16", "eager"): "gpt2-eager-amp",
    ("opt-1.3b", "amp_bf16", "sdpa"): "opt-amp",
    ("phi-3-mini-4k", "amp_bf16", "sdpa"): "phi-3",
    ("gemma-3-1b", "amp_bf16", "sdpa"): "gemma-3",
}


@dataclass(frozen=True)
class Scored:
    """One CUDA row and the traced answer for it (bytes)."""

    source: str
    model: str
    precision: str
    attention: str
    finetune: str
    micro_batch_size: int
    seq_len: int
    k: int
    num_layers: int
    measured_bytes: int
    predicted_bytes: int
    upper_bytes: int
    path: str
    notes: tuple[str, ...] = ()

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    @property
    def gap(self) -> str | None:
        """The :data:`KNOWN_GAPS` family of this row, or None for a same-kernel row."""
        return KNOWN_GAPS.get((self.model, self.precision, self.attention))


def cuda_rows(rows_dir: Path = ROWS_DIR) -> list[tuple[str, dict[str, Any]]]:
    """Every shipped ``method=cuda`` row that did not run out of memory, as (``folder/file``, record dict)."""
    out = []
    for folder in sorted(p for p in rows_dir.iterdir() if p.is_dir()):
        for name in ROW_FILES:
            path = folder / name
            if not path.is_file():
                continue
            for line in path.read_text().splitlines():
                r = json.loads(line) if line.strip() else None
                if r and r["measurement"]["method"] == "cuda" and not r["measurement"]["oom"]:
                    out.append((f"{folder.name}/{name}", r))
    return out


_TRAINING_IN = (
    "micro_batch_size",
    "seq_len",
    "precision",
    "optimizer",
    "attention",
    "finetune",
    "lora_rank",
    "lora_target_modules",
    "frozen_layers",
    "checkpoint_impl",
    "gradient_accumulation_steps",
)


def row_gpu(record: dict[str, Any]) -> str:
    """The :data:`memfit.api.GPUS` name of a record's device (``"NVIDIA H200"`` -> ``"H200"``).

    Raises:
        LookupError: no known GPU name is part of the device name."""
    from memfit.api import GPUS

    device = record["cluster"]["device_name"].lower()
    for name in sorted(GPUS, key=len, reverse=True):
        if name.split("-")[0].lower() in device:
            return name
    raise LookupError(f"cluster.device_name {record['cluster']['device_name']!r}: no known GPU")


def predict_item(record: dict[str, Any], gpu: bool = True) -> dict[str, Any]:
    """The ``/predict`` item of a record: catalog model, its training, k = checkpointed layers, and (``gpu``) its
    GPU as a one-GPU cluster."""
    t = record["training"]
    training = {f: t[f] for f in _TRAINING_IN if f in t and t[f] is not None}
    item = {"model": record["model"]["model_name"], "training": training, "k": len(t["checkpoint_layers"])}
    if gpu:
        item["cluster"] = {"gpu": row_gpu(record), "gpu_count": 1}
    return item


def workspace_bytes(record: dict[str, Any]) -> int:
    """cuBLAS workspace bytes of a record's step on its GPU (:func:`model.cuda_semantics.step_workspace_bytes`)."""
    from model.cuda_semantics import generation_of, step_workspace_bytes

    return step_workspace_bytes(generation_of(record["cluster"]["device_name"]))


def parameter_blocks(record: dict[str, Any]) -> int:
    """The unsplit parameter blocks a record's model holds on its GPU (:func:`model.recommend.parameter_block_bytes`,
    default allocator settings, as the rows were measured)."""
    from memfit.schema import TrainingConfig
    from model.job import resolve_architecture
    from model.recommend import parameter_block_bytes

    arch = resolve_architecture(record["model"]["model_name"])
    t = record["training"]
    training = TrainingConfig.model_validate({f: v for f, v in t.items() if f != "checkpoint_layers"})
    return parameter_block_bytes(arch.spec, training, arch.hf_config)


def score(rows: list[tuple[str, dict[str, Any]]] | None = None, client: Any = None, gpu: bool = True) -> list[Scored]:
    """Send every row to ``POST /predict`` (one batch) and pair the answers with the measurements (see the module
    docstring for ``gpu``).

    Raises:
        RuntimeError: the service refused the batch (status and body in the message), or a row was not answered
            by the traced path (its terms are not shipped).
    """
    rows = cuda_rows() if rows is None else rows
    client = client or traced_only_client()
    resp = client.post("/predict", json={"items": [predict_item(r, gpu) for _, r in rows]})
    if resp.status_code != 200:
        raise RuntimeError(f"/predict answered {resp.status_code}: {resp.text[:2000]}")
    out = []
    for (source, r), p in zip(rows, resp.json()["predictions"]):
        t = r["training"]
        out.append(
            Scored(
                source,
                r["model"]["model_name"],
                t["precision"],
                t["attention"],
                t["finetune"],
                t["micro_batch_size"],
                t["seq_len"],
                len(t["checkpoint_layers"]),
                r["model"]["num_layers"],
                r["measurement"]["peak_allocated_bytes"],
                p["predicted_peak_bytes"] + (workspace_bytes(r) + parameter_blocks(r) if gpu else 0),
                p["upper_bound_bytes"] + (workspace_bytes(r) + parameter_blocks(r) if gpu else 0),
                p["path"],
                tuple(p["notes"]),
            )
        )
    untraced = [s for s in out if s.path != "traced"]
    if untraced:
        raise RuntimeError(f"not answered from traced terms: {[(s.model, s.precision, s.k) for s in untraced]}")
    return out


def traced_only_client():
    """A test client of the ``/predict`` router over a Recommender with the shipped terms and no learned model."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from model.terms import TermsCache
    from service.deps import get_recommender
    from service.recommender import Recommender
    from service.routers.recommend import router

    app = FastAPI()
    app.include_router(router)
    rec = Recommender(None, "traced-only", terms=TermsCache())
    app.dependency_overrides[get_recommender] = lambda: rec
    return TestClient(app)


def table(scored: list[Scored]) -> str:
    """Per row and per family: measured and predicted GiB, error in %."""
    lines = [
        (
            f"{'family':<15} {'model':<16} {'precision':<16} {'attn':<6} {'ft':<5} {'mb':>3} {'seq':>5} {'k':>3}/"
            f"{'L':<3} {'CUDA GiB':>9} {'traced':>9} {'err %':>8}  source"
        )
    ]
    for s in sorted(scored, key=lambda s: (s.gap or "", s.model, s.precision, s.attention, s.finetune, s.k)):
        lines.append(
            f"{s.gap or 'same-kernel':<15} {s.model:<16} {s.precision:<16} {s.attention:<6} {s.finetune:<5} "
            f"{s.micro_batch_size:>3} {s.seq_len:>5} {s.k:>3}/{s.num_layers:<3} "
            f"{s.measured_bytes / 2**30:>9.3f} {s.predicted_bytes / 2**30:>9.3f} {100 * s.error:>+8.2f}  "
            f"{s.source}"
        )
    lines.append("")
    lines.append(f"{'family':<15} {'rows':>4} {'median |err| %':>15} {'worst %':>9} {'within 0.5 %':>13}")
    groups: dict[str, list[Scored]] = {}
    for s in scored:
        groups.setdefault(s.gap or "same-kernel", []).append(s)
    for name in ["same-kernel", *sorted(g for g in groups if g != "same-kernel")]:
        g = groups.get(name, [])
        if not g:
            continue
        worst = max(g, key=lambda s: abs(s.error)).error
        lines.append(
            f"{name:<15} {len(g):>4} {100 * statistics.median(abs(s.error) for s in g):>15.2f} "
            f"{100 * worst:>+9.2f} {sum(abs(s.error) <= 0.005 for s in g):>8}/{len(g)}"
        )
    within = sum(abs(s.error) <= 0.005 for s in scored)
    lines.append(
        f"{'all':<15} {len(scored):>4} {100 * statistics.median(abs(s.error) for s in scored):>15.2f} "
        f"{100 * max((s.error for s in scored), key=abs):>+9.2f} {within:>8}/{len(scored)}"
    )
    return "\n".join(lines)


#: same-kernel families traced next to the gap families, to show the CUDA semantics leave them where they are
CONTROL_FAMILIES = {
    ("llama-3.2-1b", "amp_bf16", "sdpa"),
    ("qwen2.5-3b", "amp_fp16", "sdpa"),
    ("pythia-410m", "amp_fp16", "sdpa"),
    ("bloom-560m", "amp_bf16", "eager"),
}


def trace_rows(generation: str = "sm90", families: set[tuple[str, str, str]] | None = None) -> list[dict[str, Any]]:
    """Trace every catalog-run configuration of the gap families (and :data:`CONTROL_FAMILIES`) with the fake
    tracer, as shipped (CPU semantics) and inside :func:`tracer.cuda_policy.cuda_step_semantics`; one model
    build per configuration and mode, all its k in one go. Returns one dict per row: the row's key, CUDA bytes,
    traced bytes before and after."""
    import contextlib

    from data.catalog import hf_config_of
    from memfit.schema import TrainingConfig
    from tracer.collect import measure_family
    from tracer.cuda_policy import cuda_step_semantics

    families = families if families is not None else set(KNOWN_GAPS) | CONTROL_FAMILIES
    groups: dict[str, list[dict[str, Any]]] = {}
    for _source, r in cuda_rows():
        t = r["training"]
        if (r["model"]["model_name"], t["precision"], t["attention"]) not in families:
            continue
        key = json.dumps([r["model"]["model_name"], *(t[f] for f in _TRAINING_IN if f in t)])  # both dates: once
        if all(len(x["training"]["checkpoint_layers"]) != len(t["checkpoint_layers"]) for x in groups.get(key, [])):
            groups.setdefault(key, []).append(r)
    out = []
    for rows in groups.values():
        rows.sort(key=lambda r: len(r["training"]["checkpoint_layers"]))
        name = rows[0]["model"]["model_name"]
        training = TrainingConfig.model_validate(rows[0]["training"])
        plans = [r["training"]["checkpoint_layers"] for r in rows]
        traced = {}
        for mode in ("cpu", "cuda"):
            ctx = cuda_step_semantics(generation) if mode == "cuda" else contextlib.nullcontext()
            with ctx:
                traced[mode] = [
                    rec.measurement.peak_allocated_bytes
                    for rec in measure_family(
                        hf_config_of(name), training, plans, model_name=name, device="fake", steps=1, prime=True
                    )
                ]
        for i, r in enumerate(rows):
            t = r["training"]
            out.append(
                {
                    "model": name,
                    "precision": t["precision"],
                    "attention": t["attention"],
                    "micro_batch_size": t["micro_batch_size"],
                    "seq_len": t["seq_len"],
                    "k": len(t["checkpoint_layers"]),
                    "cuda_bytes": r["measurement"]["peak_allocated_bytes"],
                    "before_bytes": traced["cpu"][i],
                    "after_bytes": traced["cuda"][i],
                    "gap": KNOWN_GAPS.get((name, t["precision"], t["attention"]), "same-kernel"),
                }
            )
        print(f"traced {name} {training.precision.value} {training.attention.value}", file=sys.stderr, flush=True)
    return out


def trace_table(rows: list[dict[str, Any]], generation: str = "sm90") -> str:
    """Before (CPU semantics) -> after (CUDA ``generation`` semantics) per traced row and per family."""
    lines = [
        f"fake tracer vs CUDA (H200); after = tracer.cuda_policy.cuda_step_semantics({generation!r})",
        (
            f"{'family':<15} {'model':<15} {'precision':<9} {'attn':<6} {'k':>3} {'CUDA GiB':>9} {'before':>8} "
            f"{'after':>8} {'before %':>9} {'after %':>8}"
        ),
    ]
    for r in sorted(rows, key=lambda r: (r["gap"], r["model"], r["precision"], r["attention"], r["k"])):
        b = (r["before_bytes"] - r["cuda_bytes"]) / r["cuda_bytes"]
        a = (r["after_bytes"] - r["cuda_bytes"]) / r["cuda_bytes"]
        lines.append(
            f"{r['gap']:<15} {r['model']:<15} {r['precision']:<9} {r['attention']:<6} {r['k']:>3} "
            f"{r['cuda_bytes'] / 2**30:>9.3f} {r['before_bytes'] / 2**30:>8.3f} {r['after_bytes'] / 2**30:>8.3f} "
            f"{100 * b:>+9.2f} {100 * a:>+8.2f}"
        )
    lines.append("")
    lines.append(f"{'family':<15} {'rows':>4} {'worst before %':>15} {'worst after %':>14}")
    fams: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        fams.setdefault(r["gap"], []).append(r)
    for name, g in sorted(fams.items()):
        wb = max(((r["before_bytes"] - r["cuda_bytes"]) / r["cuda_bytes"] for r in g), key=abs)
        wa = max(((r["after_bytes"] - r["cuda_bytes"]) / r["cuda_bytes"] for r in g), key=abs)
        lines.append(f"{name:<15} {len(g):>4} {100 * wb:>+15.2f} {100 * wa:>+14.2f}")
    return "\n".join(lines)


GENERATION_TERMS = ROOT / "data" / "terms" / "cuda_sm90.jsonl"


def generation_configs(generation: str = "sm90") -> list[tuple[str, Any]]:
    """(model name, TrainingConfig) of every shipped CUDA row's configuration whose terms key holds ``generation``
    (:func:`model.terms.key_generation`: CUDA and CPU traces differ), one per key."""
    from data.catalog import hf_config_of
    from memfit.schema import TrainingConfig
    from model.terms import key_generation, terms_key

    out: dict[str, tuple[str, Any]] = {}
    for _source, r in cuda_rows():
        name = r["model"]["model_name"]
        t = TrainingConfig.model_validate(r["training"])
        cfg = hf_config_of(name)
        if key_generation(cfg, t, generation) is not None:
            out.setdefault(terms_key(cfg, t, generation), (name, t))
    return list(out.values())


def trace_generation_terms(generation: str = "sm90", path: Path = GENERATION_TERMS) -> int:
    """Trace :func:`generation_configs` with ``generation``'s CUDA semantics (:func:`tracer.phases.trace_terms`)
    and append the lines missing from ``path`` (``key``, ``model_name``, ``training`` with ``cuda_generation``,
    ``terms``); returns the lines written. Run ``python scripts/rekey_canonical.py`` afterwards."""
    from data.catalog import hf_config_of
    from model.terms import TermsCache, terms_key, training_key_fields
    from tracer.phases import trace_terms

    cache = TermsCache()
    written = 0
    for name, t in generation_configs(generation):
        cfg = hf_config_of(name)
        key = terms_key(cfg, t, generation)
        if cache.get(key) is not None:
            continue
        terms = trace_terms(cfg, t, generation=generation).to_json()
        line = {
            "key": key,
            "model_name": name,
            "training": {**training_key_fields(t), "cuda_generation": generation},
            "terms": terms,
        }
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        written += 1
        print(f"traced {name} {t.precision.value} {t.attention.value} with {generation}", file=sys.stderr, flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "--cpu" in argv:  # as before issue 26: no cluster, CPU-semantics terms, no workspaces
        print(table(score(gpu=False)))
        return 0
    if "--trace-terms" in argv:
        print(f"{trace_generation_terms()} lines -> {GENERATION_TERMS}")
        return 0
    text = table(score())
    print(text)
    RESULTS.write_text(text + "\n")
    if "--trace" in argv:
        traced = trace_table(trace_rows())
        print(traced)
        TRACE_RESULTS.write_text(traced + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
