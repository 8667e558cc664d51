"""memfit's main job on embedded defaults (``bash scripts/main.sh``).

1. Load the shipped telemetry (``data/telemetry/telemetry.parquet``) into the store (idempotent).
2. If the registry has no current model: copy the model shipped with memfit (``data/models``) into
   it, or when there is none, run the retraining job on the store (evaluates, writes a report,
   registers and promotes a version).
3. Start the service (``MEMFIT_HOST``:``MEMFIT_PORT``, default 127.0.0.1:8000) and print a
   ready-to-paste ``curl`` for Llama-3-8B on 8 × H100-80GB.

Configuration is one :class:`service.settings.Settings`, read once: the environment (``MEMFIT_*``)
first, then the flags given here. Every writable path lies under its ``data_dir``. When that
directory cannot be written, steps 1-2 are skipped and the service runs read-only on the shipped
model (it recommends; writes answer 503).

``--sweep GRID`` also runs a collection sweep first (e.g. ``small``); ``--no-serve`` stops after 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from data.store import SHIPPED_TELEMETRY as SHIPPED

CURL_BODY = {
    "model": "llama-3-8b",
    "training": {"micro_batch_size": 2, "seq_len": 8192, "sharding": "zero3"},
    "cluster": {"gpu": "H100-80GB", "gpu_count": 8},
}


def _settings(a: argparse.Namespace):
    """One Settings: environment first, then only the flags actually given."""
    from pydantic import ValidationError

    from service.settings import Settings

    flags = {"data_dir": a.data_dir, "db_url": a.db, "registry_dir": a.registry}
    try:
        return Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as err:
        raise SystemExit("error: " + "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors()))


def _seed_registry(settings, retrain: bool) -> str | None:
    """Make the registry hold a current model; returns why it could not (None when it does)."""
    from model.registry import DEFAULT_ROOT, Registry

    registry, shipped = Registry(settings.registry_dir), Registry(DEFAULT_ROOT)
    if not retrain and registry.current() is None and shipped.current() and shipped.root != registry.root:
        try:
            registry.root.mkdir(parents=True, exist_ok=True)
            shutil.copytree(shipped.root / shipped.current(), registry.root / shipped.current(), dirs_exist_ok=True)
            registry.promote(shipped.current())
        except OSError as err:
            return f"cannot write the registry {registry.root} ({err.strerror or type(err).__name__})"
        print(f"      seeded the registry with the shipped model {shipped.current()}", flush=True)
    if retrain or registry.current() is None:
        from training.retrain import main as retrain_main

        print("      training a model from the telemetry (first start only)", flush=True)
        rc = retrain_main(["--registry", str(registry.root), "--db", settings.db_url])
        if registry.current() is None:
            return f"retraining registered no current model (exit {rc})"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="the directory memfit writes under (env MEMFIT_DATA_DIR; default data/)")
    p.add_argument(
        "--db",
        help="SQLAlchemy URL of the telemetry store (env MEMFIT_DB_URL; default sqlite:///<data-dir>/telemetry.db)",
    )
    p.add_argument("--registry", help="model registry folder (env MEMFIT_REGISTRY_DIR; default <data-dir>/models)")
    p.add_argument("--sweep", help="run this collection grid first (smoke, small, default)")
    p.add_argument("--retrain", action="store_true", help="retrain even when a model is registered")
    p.add_argument("--no-serve", action="store_true", help="prepare the model, do not start the service")
    a = p.parse_args(argv)
    settings = _settings(a)

    from model.registry import Registry
    from service.app import open_store

    Registry(settings.registry_dir).start_check()  # the model's canary parses in a child while we import below
    store, read_only = open_store(settings)
    marker = Path(settings.data_dir) / ".shipped_telemetry_sha256"  # the shipped file already imported here
    digest = hashlib.sha256(SHIPPED.read_bytes()).hexdigest() if SHIPPED.exists() else None
    stored = marker.read_text().strip() if marker.exists() else None
    if store is not None and digest and stored == f"{digest} {settings.db_url}" and store.count():
        print(f"[1/3] shipped telemetry already imported; store holds {store.count()} records", flush=True)
    elif store is not None and digest:
        rep = store.import_file(SHIPPED)
        try:
            marker.write_text(f"{digest} {settings.db_url}")
        except OSError:
            pass
        print(
            f"[1/3] shipped telemetry: {len(rep.stored)} new, {len(rep.duplicates)} already stored, "
            f"{len(rep.rejected)} rejected, {len(rep.quarantined)} quarantined; store holds {store.count()} "
            f"records",
            flush=True,
        )
        for r in rep.rejected[:10]:
            print(f"  rejected: {r}", file=sys.stderr)
    if store is not None and a.sweep:
        from training.sweep import main as sweep_main

        sweep_main(["--grid", a.sweep, "--workers", str(min(2, os.cpu_count() or 1)), "--db", settings.db_url])
    if store is None:
        print(f"[1/3] read-only: {read_only}; serving recommendations only", flush=True)
        from model.registry import DEFAULT_ROOT, Registry

        if Registry(settings.registry_dir).current() is None:
            settings = settings.model_copy(update={"registry_dir": DEFAULT_ROOT, "read_only": True})
    elif a.retrain:
        why = _seed_registry(settings, a.retrain)
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return 1
    from service.startup import NothingToServe, ensure_servable

    try:  # the model the service will load, checked the way it loads it; seeded from the shipped one if broken
        _, note = ensure_servable(settings.registry_dir)
    except NothingToServe as err:
        if store is None or _seed_registry(settings, True) is not None:  # last resort: train one
            print(f"error: refusing to start: {err}", file=sys.stderr)
            return 1
        note = f"model {_current(settings)} trained from the telemetry ({err})"
    print(f"[2/3] {note}", flush=True)
    if a.no_serve:
        return 0

    from service.app import serve

    err = bind_refusal(settings.host, settings.port)  # say so plainly instead of a banner for a port we cannot bind
    if err is not None:
        print(f"error: cannot listen on {settings.host}:{settings.port} ({err}); set MEMFIT_PORT", file=sys.stderr)
        return 3
    url = f"http://{settings.host}:{settings.port}"
    print(
        f"[3/3] serving on {url}  (docs: {url}/docs)\n\nTry:\n"
        f"curl -s -X POST {url}/recommend -H 'content-type: application/json' \\\n"
        f"     -d '{json.dumps(CURL_BODY)}'\n",
        flush=True,
    )
    if store is not None:
        store.engine.dispose()
    serve(settings)
    return 0


def bind_refusal(host: str, port: int) -> OSError | None:
    """Why the server could not bind host:port, or None when it can.

    Binds as uvicorn does (uvicorn/config.py ``Config.bind_socket`` sets SO_REUSEADDR), so the TIME-WAIT
    connections a killed server leaves do not keep a restart off its port.
    """
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            return err
    return None


def _current(settings) -> str | None:
    from model.registry import Registry

    return Registry(settings.registry_dir).current()


if __name__ == "__main__":
    sys.exit(main())
