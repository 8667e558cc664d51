"""``python -m service``: run the API with uvicorn on MEMFIT_HOST:MEMFIT_PORT (settings read once)."""

import sys

import uvicorn
from pydantic import ValidationError

from service.app import create_app
from service.settings import Settings

if __name__ == "__main__":
    try:
        s = Settings()
    except ValidationError as err:
        sys.exit(f"memfit: refusing to start: {'; '.join(e['msg'].removeprefix('Value error, ') for e in err.errors())}")
    uvicorn.run(create_app(s), host=s.host, port=s.port, log_level="warning")
