# memfit service image.  Build: docker build -t memfit .   Run: docker run -p 8000:8000 memfit
# Stage 1 installs memfit and its service dependencies into a virtual environment (CPU torch: the
# service predicts, it never trains on a GPU); stage 2 copies only that environment into a slim
# runtime with no compiler and runs as an unprivileged user. The telemetry store and the model
# registry live under /var/lib/memfit (mount a volume there to keep them).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md constraints-dev.txt ./
COPY memfit ./memfit
COPY service ./service
COPY model ./model
COPY training ./training
COPY data ./data
RUN /opt/venv/bin/pip install --extra-index-url https://download.pytorch.org/whl/cpu \
        -c constraints-dev.txt ".[service]"

FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    MEMFIT_HOST=0.0.0.0 MEMFIT_PORT=8000 \
    MEMFIT_DB_URL=sqlite:////var/lib/memfit/telemetry.db MEMFIT_REGISTRY_DIR=/var/lib/memfit/models
RUN groupadd --system memfit && useradd --system --gid memfit --home-dir /var/lib/memfit memfit \
    && mkdir -p /var/lib/memfit && chown memfit:memfit /var/lib/memfit
COPY --from=build /opt/venv /opt/venv
USER memfit
WORKDIR /var/lib/memfit
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('MEMFIT_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/v2/health/ready', timeout=2).status == 200 else 1)"]
# Seeds the registry from the model shipped in the package (or trains one from the shipped
# telemetry), then serves.
CMD ["python", "-m", "training.main", "--registry", "/var/lib/memfit/models"]
