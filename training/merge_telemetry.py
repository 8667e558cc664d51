"""Merge collected telemetry files into the shipped dataset, through the store's validation.

    python -m training.merge_telemetry OUT_DIR/records.jsonl          # a sweep's --jsonl file, into the shipped parquet
    python -m training.merge_telemetry --into out.parquet a.jsonl b.parquet --dry-run

The target (default ``data/telemetry/telemetry.parquet``) and every input go into a temporary
:class:`data.store.TelemetryStore`, so each row is validated, checked for plausibility and deduplicated
on ``record_id`` exactly as ``POST /telemetry`` would. A row already in the target with different
content is a conflict: nothing is overwritten. The target is rewritten only when no input row was
rejected or quarantined (``--allow-held`` writes the rest anyway and lists what was held back; the
input files are never modified, so nothing is lost).

Exit codes: 0 merged (or would merge, ``--dry-run``), 1 rows rejected or quarantined (target unchanged
unless ``--allow-held``), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from data.store import SHIPPED_TELEMETRY as SHIPPED


def merge(into: Path, inputs: list[Path], *, write: bool = True, allow_held: bool = False) -> dict:
    """Merge ``inputs`` into the telemetry file ``into``; returns per-file counts.

    Returns:
        ``{"before": int, "after": int, "files": {name: {"stored", "duplicates", "rejected", "quarantined",
        "held": [{"record_id", "reason"}]}}, "written": bool}``.

    Raises:
        ValueError: an input with an unsupported suffix or a malformed JSON line (from
            :func:`data.store.read_rows`).
    """
    from model.plausibility import telemetry_store

    with tempfile.TemporaryDirectory() as tmp:
        store = telemetry_store(f"sqlite:///{Path(tmp) / 'merge.db'}")
        base = store.import_file(into) if into.exists() else None
        if base is not None and (base.rejected or base.quarantined):
            raise ValueError(
                f"{into}: {len(base.rejected)} rejected / {len(base.quarantined)} quarantined rows in "
                "the target itself; fix it first"
            )
        before = store.count()
        files, held_any = {}, False
        for path in inputs:
            rep = store.import_file(path)
            held = [{"record_id": h["record_id"], "reason": h["reason"]} for h in rep.rejected + rep.quarantined]
            held_any |= bool(held)
            files[str(path)] = {
                "stored": len(rep.stored),
                "duplicates": len(rep.duplicates),
                "rejected": len(rep.rejected),
                "quarantined": len(rep.quarantined),
                "held": held,
            }
        after = store.count()
        written = write and after > before and (allow_held or not held_any)
        if written:
            store.export(into)
    return {"before": before, "after": after, "files": files, "written": written, "held": held_any}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.merge_telemetry", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path, help=".jsonl / .parquet / .csv telemetry files")
    p.add_argument("--into", type=Path, default=SHIPPED, help=f"target .parquet (default {SHIPPED})")
    p.add_argument("--dry-run", action="store_true", help="report only; write nothing")
    p.add_argument(
        "--allow-held",
        action="store_true",
        help="write the valid rows even when some were rejected or quarantined (listed)",
    )
    a = p.parse_args(argv)
    missing = [str(x) for x in a.inputs if not x.exists()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    if a.into.suffix != ".parquet":
        print(f"error: --into must be a .parquet file, got {a.into.name!r}", file=sys.stderr)
        return 2
    try:
        out = merge(a.into, a.inputs, write=not a.dry_run, allow_held=a.allow_held)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, f in out["files"].items():
        for h in f["held"]:
            print(f"held back from {name}: {h['record_id']}: {h['reason']}", file=sys.stderr)
    print(
        json.dumps(
            {k: v for k, v in out.items() if k != "files"}
            | {"files": {n: {k: v for k, v in f.items() if k != "held"} for n, f in out["files"].items()}}
        )
    )
    return 1 if out["held"] else 0


if __name__ == "__main__":
    sys.exit(main())
