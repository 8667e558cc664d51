"""Re-trace shipped terms that predate the current tracer: ``python -m training.terms_mb1``.

An entry is stale (:func:`stale_reason`) when it was traced before :func:`tracer.phases.trace_terms`

* traced micro-batch 1 on its own (``mb1`` in the terms JSON): such terms compose b = 1 from the b >= 2
  fit, up to 3.3 % low (FSDP + LoRA on pythia-160m);
* measured the per-layer increment above the bottom layer (:func:`tracer.phases.traced_depths`: depths
  2 and 3 where they were 1 and 2): the 1 -> 2 layer difference charged every layer with what only the
  bottom layer lacks, up to +293 % at k = L (BLOOM, eager attention) and +126 % (GPT-J LoRA).

Old entries stay valid (they compose at the depths they carry). This job re-traces the stale entries of a
shipped terms file, the same key and training settings, with the current tracer: each shard appends its
lines to ``--out DIR/<file stem>.<I>.jsonl`` (resumable: keys already there are skipped); ``--merge`` then
replaces the entries of the shipped file by those lines, in place, keeping the file's order.

    python -m training.terms_mb1 data/terms/catalog.jsonl --out /tmp/retrace --shard 0/16   # one per core
    python -m training.terms_mb1 data/terms/catalog.jsonl --out /tmp/retrace --merge
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from data.catalog import hf_config_of
from memfit.schema import TrainingConfig
from model.terms import entry_key, key_training_fields, shipped_keys, terms_key
from training.terms import shard_spec


def entry_training(entry: dict[str, Any]) -> TrainingConfig:
    """The training configuration a shipped entry was traced for (micro-batch, sequence length and k are not
    part of the key; placeholders are used)."""
    fields = key_training_fields(entry["training"])
    if fields.get("sharding") == "none":
        fields.pop("data_parallel_size", None)
    return TrainingConfig(micro_batch_size=1, seq_len=512, **fields)


def stale_reason(entry: dict[str, Any]) -> str | None:
    """Why a shipped entry's terms are older than :func:`tracer.phases.trace_terms` (None: current)."""
    from memfit.schema import Sharding
    from tracer.phases import traced_depths

    terms = entry["terms"]
    if "mb1" not in terms:
        return "no micro-batch-1 terms"
    p = terms.get("period", 1)
    depths = tuple(terms.get("depths") or (p, 2 * p))
    now = traced_depths(p, Sharding(entry["training"].get("sharding") or "none"))
    if depths != now:
        return f"traced at depths {depths}, now {now}"
    return None


def retrace(
    path: Path, out_dir: Path, shard: tuple[int, int] = (0, 1), models: set[str] | None = None
) -> dict[str, Any]:
    """Re-trace every stale entry of ``path`` (:func:`stale_reason`; of ``models`` only, when given; this
    shard's share); returns counts.

    Raises:
        ValueError: an entry whose key does not match its recomputed key (the file is inconsistent).
    """
    from tracer.phases import trace_terms

    i, n = shard
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{path.stem}.{i}.jsonl"
    done = {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()} if out.exists() else set()
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = shipped_keys(path.parent)
    todo = [e for e in entries if stale_reason(e) and (models is None or e["model_name"] in models)][i::n]
    stats: dict[str, Any] = {"traced": 0, "skipped": 0, "failed": []}
    with out.open("a") as fh:
        for e in todo:
            if e["key"] in done:
                stats["skipped"] += 1
                continue
            cfg = hf_config_of(e["model_name"])
            training = entry_training(e)
            if terms_key(cfg, training) != entry_key(e, keys):
                raise ValueError(f"{path}: entry {e['key']} ({e['model_name']}) does not match its training fields")
            t0 = time.perf_counter()
            try:
                terms = trace_terms(cfg, training)
            except Exception as err:  # noqa: BLE001 - one entry's failure must not stop the job
                stats["failed"].append(f"{e['model_name']} {e['key']}: {err}")
                continue
            fh.write(json.dumps({**e, "terms": terms.to_json()}) + "\n")
            fh.flush()
            stats["traced"] += 1
            print(
                f"{stats['traced']:4d}/{len(todo)} {e['model_name']:24s} {time.perf_counter() - t0:5.1f}s", flush=True
            )
    return stats


def merge(path: Path, out_dir: Path) -> int:
    """Replace the entries of ``path`` by the re-traced lines in ``out_dir``; returns how many were replaced."""
    new = {}
    for f in sorted(out_dir.glob(f"{path.stem}.*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                new[e["key"]] = e
    lines, n = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        e = json.loads(line)
        if e["key"] in new and new[e["key"]]["training"] == e["training"]:
            e, n = {**e, "terms": new[e["key"]]["terms"]}, n + 1
            line = json.dumps(e)
        lines.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.terms_mb1", description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path, help="a shipped terms file, e.g. data/terms/catalog.jsonl")
    p.add_argument("--out", type=Path, required=True, help="folder for the re-traced lines")
    p.add_argument("--shard", type=shard_spec, default=(0, 1), help="I/N: re-trace every N-th entry from the I-th")
    p.add_argument("--merge", action="store_true", help="fold the re-traced lines into FILE")
    p.add_argument("--model", action="append", help="re-trace the entries of this model name only (repeatable)")
    a = p.parse_args(argv)
    if a.merge:
        print(f"replaced {merge(a.file, a.out)} entries of {a.file}")
        return 0
    stats = retrace(a.file, a.out, a.shard, set(a.model) if a.model else None)
    print(json.dumps(stats, indent=1))
    return 1 if stats["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
