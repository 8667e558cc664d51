#!/usr/bin/env bash
# Create .venv and install memfit with every extra, torch pinned to the 2.13.0 CPU wheel (constraints-dev.txt).
# Needs only python3 (>= 3.11) and pip. Idempotent: re-running re-checks the install quickly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.memfit-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints-dev.txt -nt "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -c constraints-dev.txt -e ".[dev]"
  touch "$stamp"
fi
# The editable install maps only the memfit package; the server parts (data, model, service, training)
# run from this checkout, which this .pth file puts on the venv's path.
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$(cat "$site/memfit-checkout.pth" 2>/dev/null)" != "$PWD" ]; then
  echo "$PWD" > "$site/memfit-checkout.pth"
fi
