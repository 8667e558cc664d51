# memfit service image. Build: docker build -t memfit .   Run: docker run -p 8000:8000 memfit
# Stage 1 builds wheels for memfit and its service dependencies; stage 2 installs them into a slim
# runtime with no compiler, and runs as an unprivileged user.

FROM python:3.11-slim AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md constraints-dev.txt ./
COPY memfit ./memfit
COPY service ./service
COPY model ./model
COPY training ./training
COPY data ./data
# CPU torch keeps the image small: the service predicts, it never trains on a GPU.
RUN pip wheel --wheel-dir /wheels --extra-index-url https://download.pytorch.org/whl/cpu \
        -c constraints-dev.txt ".[service]"

FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    MEMFIT_HOST=0.0.0.0 MEMFIT_PORT=8000 MEMFIT_DB_URL=sqlite:////var/lib/memfit/telemetry.db
RUN groupadd --system memfit && useradd --system --gid memfit --home-dir /var/lib/memfit memfit \
    && mkdir -p /var/lib/memfit && chown memfit:memfit /var/lib/memfit
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links /wheels /wheels/*.whl && rm -rf /wheels
USER memfit
WORKDIR /var/lib/memfit
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/v2/health/live', timeout=2).status == 200 else 1)"]
CMD ["python", "-m", "service"]
