"""The traced answer against every shipped real-CUDA row, per family.

    python -m benchmarks.cuda_rows            # prints the table; writes benchmarks/results/cuda_rows.txt

Rows: the ``method=cuda`` records under ``data/telemetry/gpu_validation/*/`` (``gpu_records.jsonl`` and
``catalog_records.jsonl``: ``torch.cuda.max_memory_allocated`` of one step after a warm-up step, on an H200).
Each row is sent to ``POST /predict`` (the service's router over a :class:`service.recommender.Recommender`
without a learned model, so only the traced path answers; no cluster, so the answer is allocated bytes) with
the row's model, training and k. Out-of-memory rows (their peak is the device capacity) are left out.

Error is ``(predicted - measured) / measured``. :data:`KNOWN_GAPS` names the rows where CUDA runs kernels or
dtypes the CPU trace does not (issue 26); every other row is a same-kernel row.
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


_TRAINING_IN = ("micro_batch_size", "seq_len", "precision", "optimizer", "attention", "finetune", "lora_rank",
                "lora_target_modules", "frozen_layers", "checkpoint_impl", "gradient_accumulation_steps")


def predict_item(record: dict[str, Any]) -> dict[str, Any]:
    """The ``/predict`` item of a record: catalog model, its training, k = checkpointed layers, no cluster."""
    t = record["training"]
    training = {f: t[f] for f in _TRAINING_IN if f in t and t[f] is not None}
    return {"model": record["model"]["model_name"], "training": training, "k": len(t["checkpoint_layers"])}


def score(rows: list[tuple[str, dict[str, Any]]] | None = None, client: Any = None) -> list[Scored]:
    """Send every row to ``POST /predict`` (one batch) and pair the answers with the measurements.

    Raises:
        RuntimeError: the service refused the batch (status and body in the message), or a row was not answered
            by the traced path (its terms are not shipped).
    """
    rows = cuda_rows() if rows is None else rows
    client = client or traced_only_client()
    resp = client.post("/predict", json={"items": [predict_item(r) for _, r in rows]})
    if resp.status_code != 200:
        raise RuntimeError(f"/predict answered {resp.status_code}: {resp.text[:2000]}")
    out = []
    for (source, r), p in zip(rows, resp.json()["predictions"]):
        t = r["training"]
        out.append(Scored(source, r["model"]["model_name"], t["precision"], t["attention"], t["finetune"],
                          t["micro_batch_size"], t["seq_len"], len(t["checkpoint_layers"]), r["model"]["num_layers"],
                          r["measurement"]["peak_allocated_bytes"], p["predicted_peak_bytes"], p["upper_bound_bytes"],
                          p["path"]))
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
    lines = [(f"{'family':<15} {'model':<16} {'precision':<16} {'attn':<6} {'ft':<5} {'mb':>3} {'seq':>5} {'k':>3}/"
              f"{'L':<3} {'CUDA GiB':>9} {'traced':>9} {'err %':>8}  source")]
    for s in sorted(scored, key=lambda s: (s.gap or "", s.model, s.precision, s.attention, s.finetune, s.k)):
        lines.append(f"{s.gap or 'same-kernel':<15} {s.model:<16} {s.precision:<16} {s.attention:<6} {s.finetune:<5} "
                     f"{s.micro_batch_size:>3} {s.seq_len:>5} {s.k:>3}/{s.num_layers:<3} "
                     f"{s.measured_bytes / 2**30:>9.3f} {s.predicted_bytes / 2**30:>9.3f} {100 * s.error:>+8.2f}  "
                     f"{s.source}")
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
        lines.append(f"{name:<15} {len(g):>4} {100 * statistics.median(abs(s.error) for s in g):>15.2f} "
                     f"{100 * worst:>+9.2f} {sum(abs(s.error) <= 0.005 for s in g):>8}/{len(g)}")
    within = sum(abs(s.error) <= 0.005 for s in scored)
    lines.append(f"{'all':<15} {len(scored):>4} {100 * statistics.median(abs(s.error) for s in scored):>15.2f} "
                 f"{100 * max((s.error for s in scored), key=abs):>+9.2f} {within:>8}/{len(scored)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    text = table(score())
    print(text)
    RESULTS.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
