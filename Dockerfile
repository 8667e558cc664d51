# memfit service image.  Build: docker build -t memfit .
# Run:   docker run -e MEMFIT_TOKEN=<secret> -p 8000:8000 -v memfit-data:/var/lib/memfit memfit
# Stage 1 installs the memfit package and the service's dependencies into a virtual environment (CPU
# torch: the service predicts, it never trains on a GPU); stage 2 copies that environment and the
# server parts (data/, model/, service/, tracer/, training/: run from /opt/memfit/app, never installed into
# site-packages) into a slim runtime with no compiler, running as an unprivileged user.
# Everything the service writes (telemetry store, model registry) lives under MEMFIT_DATA_DIR
# (/var/lib/memfit); /opt/memfit/app stays read-only. The container listens on 0.0.0.0, so it
# refuses to start without MEMFIT_TOKEN (writes and reloads need it). If /var/lib/memfit is not
# writable the service starts read-only: it recommends from the shipped model, writes answer 503.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md constraints-dev.txt ./
COPY memfit ./memfit
RUN /opt/venv/bin/pip install --extra-index-url https://download.pytorch.org/whl/cpu \
        -c constraints-dev.txt ".[service]"
# The packages' own test suites and C/C++ headers are never imported at run time (about 190 MiB of the 1.8 GiB
# environment, counted from the installed files' RECORD with scripts/image_size.py); "testing" packages stay
# (numpy.testing, torch.testing are imported by their packages).
RUN find /opt/venv/lib/python3.11/site-packages -depth -type d \( -name tests -o -name test -o -name include \) \
        -exec rm -rf {} +

FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/memfit/app \
    MEMFIT_HOST=0.0.0.0 MEMFIT_PORT=8000 MEMFIT_DATA_DIR=/var/lib/memfit
RUN groupadd --system memfit && useradd --system --gid memfit --home-dir /var/lib/memfit memfit \
    && mkdir -p /var/lib/memfit && chown memfit:memfit /var/lib/memfit
COPY --from=build /opt/venv /opt/venv
COPY data /opt/memfit/app/data
COPY model /opt/memfit/app/model
COPY service /opt/memfit/app/service
COPY tracer /opt/memfit/app/tracer
COPY training /opt/memfit/app/training
USER memfit
WORKDIR /var/lib/memfit
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('MEMFIT_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/v2/health/ready', timeout=2).status == 200 else 1)"]
# Imports the shipped telemetry into /var/lib/memfit/telemetry.db, seeds /var/lib/memfit/models from
# the shipped model (or trains one), then serves.
CMD ["python", "-m", "training.main"]
