"""``python -m service``: run the API with uvicorn on MEMFIT_HOST:MEMFIT_PORT (settings read once)."""

import sys

from pydantic import ValidationError

from service.app import create_app, serve
from service.settings import Settings

if __name__ == "__main__":
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
    app = create_app(s)
    # uvicorn logs at MEMFIT_LOG_LEVEL (warning by default): say once where the service answers (stderr, like the logs)
    print(f"memfit: serving on http://{s.host}:{s.port} (docs at /docs; stop with Ctrl-C)", file=sys.stderr, flush=True)
    serve(s, app)
