#!/usr/bin/env bash
# Set up (if needed) and start memfit's main job on its embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m training.main "$@"
