"""``python -m service``: run the API with uvicorn on MEMFIT_HOST:MEMFIT_PORT."""

import uvicorn

from service.settings import Settings

if __name__ == "__main__":
    s = Settings()
    uvicorn.run("service.app:create_app", factory=True, host=s.host, port=s.port)
