#!/usr/bin/env bash
# Create .venv and install memfit with every extra, pinned by constraints-dev.txt (torch 2.13.0 CPU wheel,
# deepspeed, peft, megatron-core). Needs only python3 (>= 3.11) and pip. Idempotent: re-running re-checks
# the install quickly. Prints what it is doing; the first install takes a few minutes (pip's lines show
# each package as it is collected and installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { printf 'memfit setup: %s\n' "$*"; }
if [ ! -x .venv/bin/python ]; then
  say "[1/3] creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
else
  say "[1/3] .venv exists"
fi
. .venv/bin/activate
stamp=.venv/.memfit-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints-dev.txt -nt "$stamp" ]; then
  say "[2/3] upgrading pip"
  python -m pip install --quiet --upgrade pip
  # deepspeed builds from source: DS_BUILD_OPS=0 skips its CUDA/C++ ops (they are JIT-built only when used).
  say "[3/3] installing memfit[dev] (torch CPU, transformers, deepspeed, peft, megatron-core, lightgbm, ...);"
  say "      a first install takes a few minutes"
  log=.venv/setup.log
  set +e
  DS_BUILD_OPS=0 python -m pip install --progress-bar off -c constraints-dev.txt -e ".[dev]" 2>&1 | tee "$log" \
    | grep --line-buffered -E '^(Collecting|Building wheel|Installing collected|Successfully|ERROR)'
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    say "pip failed (exit $rc); the last lines of $log:"
    tail -n 30 "$log"
    exit "$rc"
  fi
  python -c "import torch, transformers, deepspeed, peft; print('memfit setup: torch', torch.__version__, \
'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'peft', peft.__version__)" 2>>"$log"
  touch "$stamp"
  say "done"
else
  say "[2/3] install is up to date (pyproject.toml and constraints-dev.txt unchanged)"
  say "done"
fi
# The editable install maps only the memfit package; the server parts (data, model, service, tracer, training)
# run from this checkout, which this .pth file puts on the venv's path.
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$(cat "$site/memfit-checkout.pth" 2>/dev/null)" != "$PWD" ]; then
  echo "$PWD" > "$site/memfit-checkout.pth"
fi
