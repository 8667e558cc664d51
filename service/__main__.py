"""``python -m service``: run the API with uvicorn on MEMFIT_HOST:MEMFIT_PORT (settings read once, from the
environment only; ``--help`` lists the variables and their defaults, any other argument is refused)."""

import argparse
import os
import sys

from pydantic import ValidationError

from service.settings import Settings


def _parser() -> argparse.ArgumentParser:
    """The command line: no options besides ``--help``, whose text lists each ``MEMFIT_*`` variable the server
    reads (its :class:`~service.settings.Settings` and the fit decision's allocation-stream source), with its
    default and the value set in this environment (the token's only as set)."""
    from service.app import STREAMS_DEFAULT
    from tracer.stream_source import STREAM_CACHE_DEFAULT, STREAM_CACHE_ENV, STREAMS_ENV

    def line(name: str, default: object) -> str:
        value = os.environ.get(name)
        now = "" if value is None else " (set: ***)" if name == "MEMFIT_TOKEN" else f" (set: {value})"
        return f"  {name:<40} {default}{now}"

    names = [
        line(f"MEMFIT_{name.upper()}", "unset" if field.default is None else field.default)
        for name, field in Settings.model_fields.items()
    ]
    names += [
        line(STREAM_CACHE_ENV, STREAM_CACHE_DEFAULT),
        line(STREAMS_ENV, f"{STREAMS_DEFAULT} (record | cache | off)"),
    ]
    return argparse.ArgumentParser(
        prog="python -m service",
        description="Serve memfit's API (POST /recommend, /predict, telemetry, models) with uvicorn, configured by "
        "environment variables only (README.md, section 'Service').",
        epilog="environment variables, their defaults and what this environment sets (unset MEMFIT_DB_URL and "
        "MEMFIT_REGISTRY_DIR lie under MEMFIT_DATA_DIR: telemetry.db, models/):\n" + "\n".join(names),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


if __name__ == "__main__":
    _parser().parse_args()  # --help, or an error naming the unexpected argument (exit status 2)
    try:
        s = Settings()
    except ValidationError as err:
        sys.exit(
            f"memfit: refusing to start: {'; '.join(e['msg'].removeprefix('Value error, ') for e in err.errors())}"
        )
    from service.startup import NothingToServe, ensure_servable

    try:  # an empty or broken registry is seeded from the shipped model; nothing servable: refuse, say why
        _, note = ensure_servable(s.registry_dir)
    except NothingToServe as err:
        sys.exit(f"memfit: refusing to start: {err}")
    print(f"memfit: {note}", file=sys.stderr, flush=True)
    from service.app import create_app, serve

    app = create_app(s)
    # uvicorn logs at MEMFIT_LOG_LEVEL (warning by default): say once where the service answers (stderr, like the logs)
    print(f"memfit: serving on http://{s.host}:{s.port} (docs at /docs; stop with Ctrl-C)", file=sys.stderr, flush=True)
    serve(s, app)
