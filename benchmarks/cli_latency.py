"""Wall time of a local ``memfit recommend`` (no ``--url``): the first answer, a repeated answer from the on-disk answer
cache (:mod:`service.answer_cache`), and a repeated answer with the cache off; each run is a fresh process, as a user
runs it. Also checks what the command line promises: stdout of ``--json`` is exactly one JSON document, and nothing
reaches stderr at the default log level.

    python -m benchmarks.cli_latency [--repeats 3] [--out benchmarks/results/cli_latency.txt]

Prints the figures (seconds, median of the repeats) and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["recommend", "--model", "llama-3-8b", "--gpu", "H100-80GB", "--micro-batch", "1", "--seq-len", "4096", "--json"]


def command() -> list[str]:
    """The ``memfit`` console script when installed, else ``python -m service.cli`` (the same code)."""
    found = shutil.which("memfit")
    return [found] if found else [sys.executable, "-m", "service.cli"]


def run_once(cache: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "MEMFIT_ANSWER_CACHE": cache, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*command(), *ARGS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False
    )
    elapsed = time.perf_counter() - t0
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"memfit exited {proc.returncode}: {proc.stderr[-2000:]}")
    json.loads(proc.stdout)  # exactly one JSON document, or this raises
    if proc.stderr.strip():
        raise RuntimeError(f"stderr was not empty: {proc.stderr[:2000]}")
    return elapsed, proc


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cli_latency.txt")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        first, _ = run_once(tmp)
        cached = [run_once(tmp)[0] for _ in range(a.repeats)]
        uncached = [run_once("off")[0] for _ in range(a.repeats)]
    out = {
        "command": " ".join(["memfit", *ARGS]),
        "first_answer_s": round(first, 2),
        "cached_answer_median_s": round(statistics.median(cached), 2),
        "cached_answer_max_s": round(max(cached), 2),
        "uncached_answer_median_s": round(statistics.median(uncached), 2),
        "repeats": a.repeats,
        "stdout_one_json_document": True,
        "stderr_empty": True,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}",
    }
    text = json.dumps(out, indent=1)
    print(text)
    a.out.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
