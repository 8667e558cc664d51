"""memfit's main job on embedded defaults (``bash scripts/main.sh``).

1. Load the shipped telemetry (``data/telemetry/telemetry.parquet``) into the store (idempotent).
2. Run the small collection sweep (fake tensors on CPU, both cores) so the store holds fresh
   measurements from this machine's torch/transformers.
3. Print what the store holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "telemetry.parquet"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default sqlite:///data/telemetry.db)")
    p.add_argument("--grid", default="small", help="sweep grid to run after loading (default: small)")
    p.add_argument("--no-sweep", action="store_true", help="only load the shipped telemetry")
    a = p.parse_args(argv)

    from data.store import TelemetryStore
    from training.sweep import main as sweep_main

    store = TelemetryStore(a.db)
    if SHIPPED.exists():
        rep = store.import_file(SHIPPED)
        print(f"shipped telemetry: {len(rep.stored)} new, {len(rep.duplicates)} already stored, "
              f"{len(rep.rejected)} rejected", flush=True)
        for r in rep.rejected[:10]:
            print(f"  rejected: {r}", file=sys.stderr)
    rc = 0
    if not a.no_sweep:
        args = ["--grid", a.grid, "--workers", str(min(2, os.cpu_count() or 1))]
        rc = sweep_main(args + (["--db", a.db] if a.db else []))
    df = store.dataframe()
    print(json.dumps({
        "store": store.url,
        "records": len(df),
        "architectures": int(df["model_name"].nunique()) if len(df) else 0,
        "methods": df["method"].value_counts().to_dict() if len(df) else {},
    }))
    return rc


if __name__ == "__main__":
    sys.exit(main())
