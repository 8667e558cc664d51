"""memfit's main job on embedded defaults (``bash scripts/main.sh``).

1. Load the shipped telemetry (``data/telemetry/telemetry.parquet``) into the store (idempotent).
2. If the registry has no current model: copy the model shipped with memfit (``data/models``) into
   it, or when there is none, run the retraining job on the store (evaluates, writes a report,
   registers and promotes a version).
3. Start the service on 127.0.0.1 (``MEMFIT_PORT``, default 8000) with the embedded SQLite store and
   print a ready-to-paste ``curl`` for Llama-3-8B on 8 × H100-80GB.

``--sweep GRID`` also runs a collection sweep first (e.g. ``small``); ``--no-serve`` stops after 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "telemetry.parquet"
CURL_BODY = {"model": "llama-3-8b", "training": {"micro_batch_size": 2, "seq_len": 8192, "sharding": "zero3"},
             "cluster": {"gpu": "H100-80GB", "gpu_count": 8}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default sqlite:///data/telemetry.db)")
    p.add_argument("--registry", help="model registry folder (default data/models)")
    p.add_argument("--sweep", help="run this collection grid first (smoke, small, default)")
    p.add_argument("--retrain", action="store_true", help="retrain even when a model is registered")
    p.add_argument("--no-serve", action="store_true", help="prepare the model, do not start the service")
    a = p.parse_args(argv)

    from data.store import TelemetryStore
    from model.registry import Registry

    store = TelemetryStore(a.db)
    if SHIPPED.exists():
        rep = store.import_file(SHIPPED)
        print(f"[1/3] shipped telemetry: {len(rep.stored)} new, {len(rep.duplicates)} already stored, "
              f"{len(rep.rejected)} rejected; store holds {store.count()} records", flush=True)
        for r in rep.rejected[:10]:
            print(f"  rejected: {r}", file=sys.stderr)
    if a.sweep:
        from training.sweep import main as sweep_main

        sweep_main(["--grid", a.sweep, "--workers", str(min(2, os.cpu_count() or 1))] + (["--db", a.db] if a.db else []))
    registry = Registry(a.registry)
    shipped = Registry()
    if not a.retrain and registry.current() is None and shipped.current() and shipped.root != registry.root:
        import shutil

        registry.root.mkdir(parents=True, exist_ok=True)
        shutil.copytree(shipped.root / shipped.current(), registry.root / shipped.current(), dirs_exist_ok=True)
        registry.promote(shipped.current())
        print(f"[2/3] seeded the registry with the shipped model {shipped.current()}", flush=True)
    if a.retrain or registry.current() is None:
        from training.retrain import main as retrain_main

        print("[2/3] training a model from the telemetry (first start only)", flush=True)
        args = ["--registry", str(registry.root)] + (["--db", a.db] if a.db else [])
        rc = retrain_main(args)
        if registry.current() is None:
            print(f"error: retraining registered no current model (exit {rc})", file=sys.stderr)
            return 1
    print(f"      model {registry.current()} is current", flush=True)
    if a.no_serve:
        return 0
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    settings = Settings(db_url=a.db, registry_dir=str(registry.root))
    import socket

    with socket.socket() as probe:  # say so plainly instead of printing a banner for a port we cannot bind
        try:
            probe.bind((settings.host, settings.port))
        except OSError as err:
            print(f"error: cannot listen on {settings.host}:{settings.port} ({err}); set MEMFIT_PORT", file=sys.stderr)
            return 3
    url = f"http://{settings.host}:{settings.port}"
    print(f"[3/3] serving on {url}  (docs: {url}/docs)\n\nTry:\n"
          f"curl -s -X POST {url}/recommend -H 'content-type: application/json' \\\n"
          f"     -d '{json.dumps(CURL_BODY)}'\n", flush=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
