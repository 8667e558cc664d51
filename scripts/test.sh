#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite on every core (pytest-xdist).
# Extra arguments go to pytest: `bash scripts/test.sh tests/test_cli.py -n 0` runs one file in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "memfit test: ruff check"
ruff check .
echo "memfit test: ruff format --check"
ruff format --check .
echo "memfit test: pytest on $(nproc) cores"
exec python -m pytest -q -n auto "$@"
